"""vLLM scheduler adapter: runs SlideBatching inside vLLM's own scheduler.

Start vLLM with ``--scheduler-cls coserve.engine.scheduler.TDGScheduler``
(the operator renders it). Each step, ``schedule``:

1. converts vLLM's running and waiting requests into ``SchedRequest`` values;
2. asks ``SlideBatching.decide`` for an order, a selection and a token budget;
3. reorders vLLM's running list and waiting queue accordingly, sets aside the
   running requests that were not selected and the waiting ones given no
   tokens, caps prefill chunks at the largest allowance a prefill got, lowers
   the step's token budget, and calls vLLM's ``Scheduler.schedule``, which does
   all block accounting, prefix caching, chunking and preemption exactly as it
   always does;
4. puts the set-aside requests back (running ones keep their KV and slots);
5. posts the step on the safepoint board (``coserve.engine.safepoint``), so an
   urgent arrival can preempt it at the next layer boundary; a step the cost
   model predicts to end within ``safepoint_min_step_s`` (coserve's connector
   setting, which the operator renders from the pool's profile) runs without
   safepoints, since an urgent arrival would wait no longer than that for it
   anyway; so does a step in which another connector of vLLM's MultiConnector
   (NIXL, vLLM's offloading connector, LMCache) moves KV, since coserve cannot
   roll their work back (``sibling_transfer_work``).

When the workers abandon a step, ``update_from_output`` rolls it back: every
scheduled request's computed-token count returns to where it was, the
prefix-cache entries registered for blocks the step was about to fill are
withdrawn (their KV was never written), and a request that hit such a block
in the same step is preempted and recomputed. KV computed in earlier steps is
kept; no token is emitted for the abandoned step. The step's output still
carries the connectors' transfer results (``coserve.engine.worker``), which
vLLM applies as for any step: a received request is promoted, sent blocks are
freed.

Nothing here decides anything: the policy is ``coserve.scheduling``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from coserve.engine.connector import CoServeConnector, find_connector, find_metadata, sibling_transfer_work
from coserve.engine.in_flight import require_supported_engine
from coserve.engine.safepoint import PostedStep, SafepointBoard
from coserve.kv.handoff import KV_LOAD_FAILURE_POLICY
from coserve.scheduling import InvalidRequestClass, SchedRequest, SlideBatching
from coserve.scheduling.config import CONFIG_ENV, EngineSchedulingConfig, load_engine_config
from coserve.scheduling.requests import RequestClass

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

__all__ = ["TDGScheduler"]

logger = logging.getLogger("coserve.engine.scheduler")

# A file to append one JSON line per step to (what ran, what the cost model predicted, how long it took);
# unset: no trace. The simulator's fidelity benchmark reads it to see where served steps depart from the profile.
STEP_TRACE_ENV = "COSERVE_STEP_TRACE"
# After an abandoned step, how long to hold the engine for the arrival that caused it: the abort is
# raised in the API server before the request is tokenized and sent to the engine core.
ARRIVAL_WAIT_S = 0.05


class TDGScheduler(Scheduler):
    """vLLM's ``Scheduler`` with SlideBatching choosing each step's batch (TDG gain, deadlines)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        require_supported_engine(self.vllm_config, "coserve's TDGScheduler")
        if self.policy != SchedulingPolicy.FCFS:
            raise ValueError(
                "--scheduling-policy: coserve's TDGScheduler orders requests itself; use the default 'fcfs' "
                f"(got {self.policy.value!r})"
            )
        self.coserve: EngineSchedulingConfig = load_engine_config(
            os.environ.get(CONFIG_ENV), self.max_num_scheduled_tokens
        )
        offline = self.coserve.offline_class
        offline_rank = self.coserve.classes.get(offline).rank if offline is not None else None
        self.policy_impl = SlideBatching(self.coserve.cost_model, self.coserve.slide, offline_rank)
        # request_id -> (class, TTFT SLO s, TPOT SLO s), resolved once when the request arrives
        self._request_classes: dict[str, tuple[RequestClass, float, float]] = {}
        self._num_arrivals = 0
        self._hold_until = 0.0
        self._arrivals_at_abandon = 0
        self._stalled = False  # the last policy-driven step scheduled nothing
        self.board: SafepointBoard | None = None
        coserve_connector = find_connector(self.connector)  # alone, or inside MultiConnector on GPUs
        self._safepoint_min_step_s = coserve_connector.safepoint_min_step_s if coserve_connector is not None else 0.0
        self.num_steps_unchecked = 0  # steps predicted too short to need a safepoint
        self.num_steps_transferring = 0  # steps run to their end because another connector moves KV in them
        self._coserve_connector = coserve_connector
        _require_recompute_on_load_failure(coserve_connector, self.recompute_kv_load_failures)
        if coserve_connector is not None:
            for child in getattr(self.connector, "_connectors", None) or ():  # inside vLLM's MultiConnector
                if isinstance(child, CoServeConnector):
                    child.in_multi_connector = True
            # Posted even with safepoints off, so the step stays observable (benchmarks' baseline).
            self.board = SafepointBoard.create(coserve_connector.board_name)
            coserve_connector.scheduler_board = self.board  # it reads the pause switch once per step
        self._num_layers = self.vllm_config.model_config.get_num_layers(self.vllm_config.parallel_config)
        trace = os.environ.get(STEP_TRACE_ENV)
        self._trace = open(trace, "a", buffering=1) if trace else None  # noqa: SIM115 - closed in shutdown
        self._step_started = 0.0
        logger.info(
            "coserve TDGScheduler: classes %s, max %d tokens/step",
            self.coserve.classes.names,
            self.coserve.slide.max_tokens_per_step,
        )

    # --- vLLM hooks -----------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Called by the engine core for every new request; resolves its class and SLOs."""
        if request.request_id not in self._request_classes:
            self._request_classes[request.request_id] = self._resolve(request)
            self._num_arrivals += 1
            if self._trace is not None:
                # when the engine core got it, and when the API server did (vLLM's arrival_time), wall clock
                line = {
                    "arrive": time.time(),
                    "server_arrival": request.arrival_time,
                    "prompt": request.num_prompt_tokens,
                }
                self._trace.write(json.dumps(line) + "\n")
        super().add_request(request)

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        """Called by the engine core once per step (one forward pass)."""
        self._step_started = time.perf_counter()
        self._forget_finished()
        if self._holding_for_arrival():
            return self._empty_step(throttle_prefills)
        candidates = [*self.running, *self.waiting]
        if not candidates:
            return super().schedule(throttle_prefills)
        now_s = time.time()
        running_ids = {r.request_id for r in self.running}
        free_slots = max(self.max_num_running_reqs - len(self.running), 0)
        policed = [self._to_policy(r, r.request_id in running_ids) for r in candidates]
        decision = self.policy_impl.decide(policed, now_s, free_slots)
        rank = {request_id: index for index, request_id in enumerate(decision.order)}

        self.running.sort(key=lambda r: rank.get(r.request_id, len(rank)))
        waiting = sorted(self.waiting, key=lambda r: rank.get(r.request_id, len(rank)))
        self.waiting.clear()  # type: ignore[attr-defined]  # FCFSRequestQueue is a deque
        self.waiting.extend(waiting)  # type: ignore[attr-defined]

        held = [r for r in self.running if r.request_id not in decision.selected_ids]
        # waiting requests the policy gave no tokens this step; only plain WAITING ones are set aside (a request
        # waiting for remote KV or a grammar is vLLM's to check every step)
        parked = [
            r for r in self.waiting if not decision.allowances.get(r.request_id) and r.status == RequestStatus.WAITING
        ]
        if self._stalled:
            # NOTE: the last step ran nothing although requests were runnable (vLLM could not start the waiting
            # ones the policy chose, e.g. for want of KV blocks, and the running ones were held); this step
            # holds nothing back, so the engine always makes progress.
            held, parked = [], []
        if held:
            self.running = [r for r in self.running if r.request_id in decision.selected_ids]
        if parked:
            # vLLM would start any waiting request the budget has room for, the policy's or not
            skip = {r.request_id for r in parked}
            kept = [r for r in self.waiting if r.request_id not in skip]
            self.waiting.clear()  # type: ignore[attr-defined]
            self.waiting.extend(kept)  # type: ignore[attr-defined]
        # vLLM caps every prefill chunk, running or waiting, at one threshold; it is set to the largest allowance
        # the policy gave a request that still prefills, so each gets up to what the policy gave it (a decode's
        # allowance of 1 must not cap a new request's first chunk at one token). After a stalled step the running
        # requests the policy did not select run too, with no allowance of their own.
        cap = max(
            (
                decision.allowances.get(r.request_id, 0)
                for r in (*self.running, *self.waiting)
                if r.num_tokens - r.num_computed_tokens > 1  # a prefill, or a preempted request's recompute
            ),
            default=0,
        )
        threshold = self.scheduler_config.long_prefill_token_threshold
        saved = (self.max_num_scheduled_tokens, self.max_num_running_reqs, self.max_num_active_reqs)
        # NOTE: held requests keep their model-runner slots, so the step may admit that many fewer.
        self.max_num_scheduled_tokens = min(decision.token_budget, saved[0])
        self.max_num_running_reqs = saved[1] - len(held)
        self.max_num_active_reqs = saved[2] - len(held)
        if cap and cap < decision.token_budget:
            self.scheduler_config.long_prefill_token_threshold = cap
        try:
            output = super().schedule(throttle_prefills)
        finally:
            self.max_num_scheduled_tokens, self.max_num_running_reqs, self.max_num_active_reqs = saved
            self.scheduler_config.long_prefill_token_threshold = threshold
            if held:
                self.running.extend(held)
            if parked:
                self.waiting.extend(parked)  # type: ignore[attr-defined]  # after the ones vLLM left waiting
        self._stalled = output.total_num_scheduled_tokens == 0
        if self._stalled and held:
            logger.warning("coserve: a step held %d running requests and ran nothing; holding none next", len(held))
        self._post_step(output, now_s)
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """Called by the engine core after each step; rolls an abandoned step back first."""
        metadata = find_metadata(scheduler_output.kv_connector_metadata)
        abandoned = self.board is not None and metadata is not None and self.board.take_abandoned(metadata.step_id)
        if self.board is not None:
            self.board.clear_step()
        if abandoned and metadata is not None and self._coserve_connector is not None:
            self._coserve_connector.step_abandoned(metadata.step_id)  # its output still carries transfer results
        # each request's new tokens over its own context (read before finished requests are freed)
        pieces = self._pieces(scheduler_output) if self._trace is not None else []
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if abandoned:
            self._roll_back(scheduler_output)
        if pieces:
            self._trace_step(pieces, abandoned)
        return outputs

    def _pieces(self, output: SchedulerOutput) -> list[tuple[int, int]]:
        """(new tokens, cached context) per scheduled request; a request's count already includes this step's."""
        return [
            (n, max(self.requests[r].num_computed_tokens - n, 0) if r in self.requests else 0)
            for r, n in output.num_scheduled_tokens.items()
        ]

    def _trace_step(self, pieces: list[tuple[int, int]], abandoned: bool) -> None:
        """One line of the step trace: start and end (perf_counter s), requests, P, C, Σp(p+c), prediction,
        and after the step the waiting and running requests and the KV blocks' usage."""
        if self._trace is None:
            return
        line = {
            "wall": time.time(),
            "start": self._step_started,
            "end": time.perf_counter(),
            "requests": len(pieces),
            "new": sum(p for p, _ in pieces),
            "context": sum(c for _, c in pieces),
            "attention": sum(p * (p + c) for p, c in pieces),
            "predicted_s": self.coserve.cost_model.step_latency_s(pieces),
            "waiting": len(self.waiting),
            "running": len(self.running),
            "kv_usage": round(self.kv_cache_manager.usage, 4),
            "abandoned": abandoned,
        }
        self._trace.write(json.dumps(line) + "\n")

    def shutdown(self) -> None:
        if self._trace is not None:
            self._trace.close()
            self._trace = None
        super().shutdown()
        if self.board is not None:
            self.board.close()
            self.board = None

    # --- safepoints ---------------------------------------------------------------------------------

    def _holding_for_arrival(self) -> bool:
        """True while a preempted step's cause has not reached the engine core yet (bounded wait)."""
        if not self._hold_until:
            return False
        if self._num_arrivals != self._arrivals_at_abandon or time.monotonic() >= self._hold_until:
            self._hold_until = 0.0
            return False
        time.sleep(0.001)
        return True

    def _empty_step(self, throttle_prefills: bool) -> SchedulerOutput:
        saved = self.max_num_scheduled_tokens
        self.max_num_scheduled_tokens = 0
        try:
            return super().schedule(throttle_prefills)
        finally:
            self.max_num_scheduled_tokens = saved

    def _post_step(self, output: SchedulerOutput, now_s: float) -> None:
        metadata = find_metadata(output.kv_connector_metadata)
        if self.board is None or metadata is None:
            return
        scheduled = output.num_scheduled_tokens
        if not scheduled:
            return
        ranks = [self._class_of(req_id).rank for req_id in scheduled]
        pieces = self._pieces(output)
        predicted_s = self.coserve.cost_model.step_latency_s(pieces)
        if metadata.safepoints and predicted_s <= self._safepoint_min_step_s:
            # NOTE: the same on every rank (it travels in the metadata), as the TP agreement needs
            metadata.safepoints = False
            self.num_steps_unchecked += 1
        elif metadata.safepoints and sibling_transfer_work(output.kv_connector_metadata):
            # another connector receives, sends or stores KV in this step: coserve cannot roll that back
            metadata.safepoints = False
            self.num_steps_transferring += 1
        self.board.post_step(PostedStep(metadata.step_id, now_s, predicted_s, min(ranks), self._num_layers))

    def _class_of(self, request_id: str) -> RequestClass:
        entry = self._request_classes.get(request_id)
        return entry[0] if entry else self.coserve.classes.default

    def _roll_back(self, scheduler_output: SchedulerOutput) -> None:
        """Undo an abandoned step's effect on vLLM's state (see the module docstring)."""
        self._hold_until = time.monotonic() + ARRIVAL_WAIT_S
        self._arrivals_at_abandon = self._num_arrivals
        scheduled = {
            req_id: n
            for req_id, n in scheduler_output.num_scheduled_tokens.items()
            if req_id in self.requests and not self.requests[req_id].is_finished()
        }
        before = {req_id: self.requests[req_id].num_computed_tokens - n for req_id, n in scheduled.items()}
        managers = self.kv_cache_manager.coordinator.single_type_managers
        stale_block_ids: set[int] = set()
        own_new: dict[str, set[int]] = {}
        for manager in managers:
            size = manager.block_size
            for req_id in scheduled:
                blocks = manager.req_to_blocks.get(req_id, [])
                first = before[req_id] // size
                cached = manager.num_cached_block.get(req_id, first)
                new_ids = {block.block_id for block in blocks[first:cached]}
                own_new.setdefault(req_id, set()).update(new_ids)
                stale_block_ids |= new_ids
        sharers = []
        for req_id in scheduled:
            for manager in managers:
                hits = manager.req_to_blocks.get(req_id, [])[: before[req_id] // manager.block_size]
                if any(block.block_id in stale_block_ids for block in hits):
                    sharers.append(req_id)
                    break
        self.kv_cache_manager.block_pool.evict_blocks(stale_block_ids)
        coserve_connector = self._coserve_connector
        if coserve_connector is not None and coserve_connector.planner is not None:
            coserve_connector.planner.roll_back(before)  # its blocks past `before` are copied out once recomputed
        for req_id in scheduled:
            if req_id in sharers:
                continue
            request = self.requests[req_id]
            request.num_computed_tokens = before[req_id]
            request.is_prefill_chunk = request.num_computed_tokens < request.num_tokens
            for manager in managers:
                if req_id in manager.num_cached_block:
                    manager.num_cached_block[req_id] = min(
                        manager.num_cached_block[req_id], before[req_id] // manager.block_size
                    )
        now = time.monotonic()
        for req_id in sharers:
            request = self.requests[req_id]
            if request in self.running:
                self.running.remove(request)
                self._preempt_request(request, now)
        logger.info(
            "rolled back abandoned step (%d requests, %d same-step sharers recomputed)", len(scheduled), len(sharers)
        )

    # --- conversion -------------------------------------------------------------------------------

    def _resolve(self, request: Request) -> tuple[RequestClass, float, float]:
        extra = request.sampling_params.extra_args if request.sampling_params is not None else None
        try:
            return self.coserve.classes.resolve(extra, request.priority)
        except InvalidRequestClass as error:
            # The API server's middleware rejects these with HTTP 400; a client that bypasses it gets the
            # default class rather than a dead engine.
            logger.warning(
                "request %s: %s; using class %r", request.request_id, error, self.coserve.classes.default.name
            )
            default = self.coserve.classes.default
            return default, default.ttft_slo_s, default.tpot_slo_s

    def _to_policy(self, request: Request, is_running: bool) -> SchedRequest:
        cls, ttft_s, tpot_s = self._request_classes.get(request.request_id) or self._resolve(request)
        return SchedRequest(
            request_id=request.request_id,
            cls=cls,
            arrival_s=request.arrival_time,
            ttft_slo_s=ttft_s,
            tpot_slo_s=tpot_s,
            num_prompt_tokens=request.num_prompt_tokens,
            num_computed_tokens=request.num_computed_tokens,
            num_output_tokens=request.num_output_tokens,
            max_output_tokens=request.max_tokens,
            is_running=is_running,
        )

    def _forget_finished(self) -> None:
        if len(self._request_classes) > len(self.requests):
            for request_id in [r for r in self._request_classes if r not in self.requests]:
                del self._request_classes[request_id]


def _require_recompute_on_load_failure(connector: CoServeConnector | None, recomputes: bool) -> None:
    """Raise ``ValueError`` when coserve's connector loads KV (host offload, the shm handoff) into an engine that
    fails a request whose load failed: a handoff block dropped before the decoder read it would end a turn with an
    error and no token, where recomputing the block costs only time."""
    if connector is None or recomputes or not (connector.kv_settings.offload or connector.kv_settings.handoff):
        return
    raise ValueError(
        f"--kv-transfer-config: kv_load_failure_policy is 'fail', but coserve's connector loads KV that may be gone "
        f'by the time it is read (a prefiller\'s handoff block, a host-pool block); set "kv_load_failure_policy": '
        f'"{KV_LOAD_FAILURE_POLICY}" at the top level, as the operator and coserve up render it'
    )
