"""SlideBatching: the per-step batch policy of the coserve engine scheduler.

Each engine step (one forward pass) the vLLM adapter hands ``decide`` every
waiting and running request; it returns the order in which the engine should
fill the step, which requests fit in it, and how many new tokens it may take.

1. Each request's next piece of work (its remaining prefill, or one decode
   token) gets a predicted time from the cost model and a slack: its next
   token's deadline minus now minus that time.
2. The urgency boundary slides with load: a request is urgent when its slack
   is below ``urgency_factor`` times the predicted time to drain all runnable
   work. Light load -> few urgent, EDF rules; overload -> most are urgent and
   gain density rules.
3. A request's density is the gain it can still earn per second of the work it
   still needs: its next token (if that can be on time) plus every later token
   that can still meet its deadline, over its remaining prefill and decode
   time. Counting the later tokens is what keeps a long interactive prompt
   ahead of short low-class ones: its first token alone is worth little per
   second of prefill, its whole answer is worth a lot.
4. Critical requests go first: urgent requests of the most important class
   present that miss their next deadline unless they run in this step. Then
   the other urgent requests by density (greedily, a fractional knapsack),
   joined by late requests whose later tokens can still catch up; normal ones
   follow by earliest deadline, and waiting requests that can earn nothing
   more come last (a running one keeps decoding: it is cheap, and held back it
   would keep its KV and its client waiting).
5. Requests that waited longer than ``max_wait_s`` for their first token are
   promoted (no starvation): the oldest goes first every step, with at most
   ``promoted_share`` of the step's tokens, so starving work always advances
   without taking the step from urgent work; the others wait their turn.
6. The step's time budget η is the smallest slack among the urgent and
   running requests, clamped to [min_step_s, max_step_s], and becomes a token
   budget through the cost model, with each request in the order charged for
   its own context (the attention term is per request).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from coserve.scheduling.cost_model import StepCostModel
from coserve.scheduling.requests import SchedRequest

__all__ = ["SlideBatching", "SlideConfig", "StepDecision"]

_MIN_WORK_S = 1e-6


@dataclass(frozen=True)
class SlideConfig:
    """SlideBatching's knobs; every one has a default that works on the CPU engine and on GPUs."""

    max_tokens_per_step: int = 2048
    urgency_factor: float = 2.0
    max_wait_s: float = 30.0
    min_step_s: float = 0.01
    max_step_s: float = 2.0
    promoted_share: float = 0.25

    def __post_init__(self) -> None:
        if self.max_tokens_per_step < 1:
            raise ValueError(f"scheduler.maxTokensPerStep: must be at least 1, got {self.max_tokens_per_step}")
        if self.urgency_factor < 0:
            raise ValueError(f"scheduler.urgencyFactor: must be >= 0, got {self.urgency_factor}")
        if self.max_wait_s <= 0:
            raise ValueError(f"scheduler.maxWaitS: must be > 0, got {self.max_wait_s}")
        if not 0 < self.promoted_share <= 1:
            raise ValueError(f"scheduler.promotedShare: must be in (0, 1], got {self.promoted_share}")
        if not 0 < self.min_step_s <= self.max_step_s:
            raise ValueError(
                f"scheduler.minStepS/maxStepS: need 0 < minStepS <= maxStepS, got {self.min_step_s}, {self.max_step_s}"
            )


@dataclass(frozen=True)
class StepDecision:
    """What one step should run: ``order`` of request ids and the step's budgets."""

    order: tuple[str, ...]
    selected_ids: frozenset[str]
    # request_id -> new tokens it may take this step (its work, or the rest of the budget for the last)
    allowances: dict[str, int]
    token_budget: int
    time_budget_s: float
    urgent_ids: frozenset[str]
    promoted_ids: frozenset[str]
    late_ids: frozenset[str]


@dataclass(frozen=True)
class _Scored:
    request: SchedRequest
    work_tokens: int
    work_s: float
    slack_s: float
    value: float
    density: float


class SlideBatching:
    """The policy object; stateless between steps, so the adapter may rebuild its inputs freely."""

    def __init__(
        self, cost_model: StepCostModel, config: SlideConfig | None = None, offline_rank: int | None = None
    ) -> None:
        self.cost_model = cost_model
        self.config = config or SlideConfig()
        # The offline (harvest) class's rank, when the engine has one: its work fills what online work leaves,
        # so even an online request that can earn nothing more goes before it.
        self.offline_rank = offline_rank

    def decide(self, requests: Sequence[SchedRequest], now_s: float, free_slots: int | None = None) -> StepDecision:
        """Order ``requests`` for the next step; called once per engine step.

        ``free_slots``: how many waiting requests the engine can start this step (its running-request cap
        minus the requests running); ``None`` means no limit. A waiting request beyond them is not selected,
        so the step is one the engine can run: with every slot taken, only running requests are.

        A pipeline of pure steps, each one decision (the module docstring's rules, in order): score every
        request (1), promote the oldest starving one (5), sort the rest by urgency against the sliding
        boundary (2), pick the critical top-class requests, order everything (3, 4), and size the step (6).
        """
        config = self.config
        if not requests:
            empty: frozenset[str] = frozenset()
            return StepDecision((), empty, {}, config.max_tokens_per_step, config.max_step_s, empty, empty, empty)
        scored = [self._score(r, now_s) for r in requests]
        promoted, rest = _promote_oldest_starving(scored, now_s, config.max_wait_s)
        groups = _by_urgency(rest, config.urgency_factor * self._drain_s(scored))
        critical, by_density = self._critical_first(groups, top_rank=min(s.request.cls.rank for s in scored))
        ordered = self._ordered(promoted, critical, by_density, groups)
        time_budget_s = _time_budget_s(groups, config)
        promoted_cap = max(1, math.ceil(config.promoted_share * config.max_tokens_per_step))
        caps = {s.request.request_id: promoted_cap for s in promoted}
        token_budget = self._step_tokens(ordered, groups, time_budget_s, caps, free_slots)
        allowances = _fill(ordered, token_budget, caps, free_slots)
        return StepDecision(
            order=tuple(s.request.request_id for s in ordered),
            selected_ids=frozenset(allowances),
            allowances=allowances,
            token_budget=token_budget,
            time_budget_s=time_budget_s,
            urgent_ids=frozenset(s.request.request_id for s in groups.urgent),
            promoted_ids=frozenset(s.request.request_id for s in promoted),
            late_ids=frozenset(s.request.request_id for s in groups.late),
        )

    def _drain_s(self, scored: Sequence[_Scored]) -> float:
        """The load: predicted time to drain every runnable request's next piece of work (each request's tokens
        attend to its own context: the cost model's attention term is per request)."""
        return self.cost_model.step_latency_s(
            (s.request.remaining_prefill_tokens, s.request.num_computed_tokens) for s in scored
        )

    def _critical_first(self, groups: _Urgency, top_rank: int) -> tuple[list[_Scored], list[_Scored]]:
        """(critical, by density): the urgent top-class requests that miss their next deadline unless they run in
        this step, then the other urgent requests and the recoverable late ones by density.

        NOTE: measured at 1.4x overload (benchmarks/priority_scheduling.py --rate 5): density alone let 17% of
        the top class miss (a long top-class prompt earns less per second than short low-class ones); making
        every class's critical requests go first, class by class, cut the gain by a fifth (everyone served at
        the last moment, in small steps); this rule: top class 100%, most gain.
        """
        step_s = self.cost_model.latency_s(self.config.max_tokens_per_step, 0)
        critical = [s for s in groups.urgent if s.slack_s < step_s and s.request.cls.rank == top_rank]
        critical_ids = {s.request.request_id for s in critical}
        critical.sort(key=lambda s: (s.request.cls.rank, -s.density, s.request.next_deadline_s, s.request.request_id))
        by_density = sorted(
            [s for s in groups.urgent if s.request.request_id not in critical_ids] + groups.recoverable,
            key=lambda s: (-s.density, s.request.next_deadline_s, s.request.request_id),
        )
        return critical, by_density

    def _ordered(
        self, promoted: list[_Scored], critical: list[_Scored], by_density: list[_Scored], groups: _Urgency
    ) -> list[_Scored]:
        """The step's order: promoted, critical, by density, then the normal ones by earliest deadline and the
        hopeless ones last.

        NOTE: an online request that missed its deadline by a whisker (a step that ran longer than predicted)
        earns nothing more, but behind offline work it waited until promotion (max_wait_s, 30 s by default);
        with an offline class it goes before that class's work instead, and after every online request that
        can still earn.
        """
        by_deadline = sorted(
            groups.normal, key=lambda s: (s.request.next_deadline_s, -s.request.cls.weight, s.request.request_id)
        )
        hopeless = sorted(
            groups.hopeless, key=lambda s: (s.request.next_deadline_s, -s.request.cls.weight, s.request.request_id)
        )
        if self.offline_rank is None:
            return promoted + critical + by_density + by_deadline + hopeless
        offline = self.offline_rank
        return (
            promoted + critical + by_density
            + [s for s in by_deadline if s.request.cls.rank != offline]
            + [s for s in hopeless if s.request.cls.rank != offline]
            + [s for s in by_deadline if s.request.cls.rank == offline]
            + [s for s in hopeless if s.request.cls.rank == offline]
        )  # fmt: skip

    def _step_tokens(
        self,
        ordered: Sequence[_Scored],
        groups: _Urgency,
        time_budget_s: float,
        caps: dict[str, int],
        free_slots: int | None,
    ) -> int:
        """The step's token budget: what fits in ``time_budget_s`` (``_token_budget``), never below the first
        request's work or every urgent decode (the step is never starved), never above the step's cap."""
        limit = self.config.max_tokens_per_step
        floor = max(min(ordered[0].work_tokens, limit), sum(1 for s in groups.urgent if not s.request.in_prefill))
        return min(max(self._token_budget(ordered, time_budget_s, caps, free_slots), floor), limit)

    def _token_budget(
        self, ordered: Sequence[_Scored], time_budget_s: float, caps: dict[str, int], free_slots: int | None
    ) -> int:
        """The most new tokens whose step, filled in ``ordered`` as ``_fill`` fills it, fits in ``time_budget_s``.

        Walks the order with the step's running sums (new tokens, context, Σ p·(p + c)): a request whose whole
        piece fits is taken; the first that does not gets the largest chunk that fits (a binary search, exact
        while latency grows with the chunk), and the walk stops there, as ``_fill`` stops when the budget is
        spent. Only the requests the step would run count their context.
        """
        model = self.cost_model
        limit = self.config.max_tokens_per_step
        new = context = 0
        attention = 0.0
        slots = free_slots
        for scored in ordered:
            left = limit - new
            if left <= 0:
                break
            request = scored.request
            if not request.is_running and slots is not None:
                if slots <= 0:
                    continue
                slots -= 1
            c = request.num_computed_tokens
            take = min(scored.work_tokens, left, caps.get(request.request_id, scored.work_tokens))
            if model.latency_from(new + take, context + c, attention + take * (take + c)) <= time_budget_s:
                new, context, attention = new + take, context + c, attention + take * (take + c)
                continue
            low, high = 0, take - 1  # the largest chunk that fits; 0 when not even one token does
            while low < high:
                middle = (low + high + 1) // 2
                if model.latency_from(new + middle, context + c, attention + middle * (middle + c)) <= time_budget_s:
                    low = middle
                else:
                    high = middle - 1
            return new + low
        return new

    def _score(self, request: SchedRequest, now_s: float) -> _Scored:
        model = self.cost_model
        context = request.num_computed_tokens
        work_tokens = min(request.remaining_prefill_tokens, self.config.max_tokens_per_step)
        base_s = model.latency_s(0, 0)
        work_s = max(model.latency_s(work_tokens, context) - base_s, _MIN_WORK_S)
        # Slack counts all the work before the next token, even if it spans several steps.
        finishes = work_tokens >= request.remaining_prefill_tokens
        remaining_s = (
            work_s
            if finishes
            else max(model.latency_s(request.remaining_prefill_tokens, context) - base_s, _MIN_WORK_S)
        )
        slack_s = request.next_deadline_s - now_s - remaining_s
        # Later tokens: a late request catches up if it decodes faster than its TPOT SLO; assume twice as fast.
        later = max(request.max_output_tokens - request.num_output_tokens - 1, 0)
        behind = math.ceil(-2.0 * slack_s / request.tpot_slo_s) if slack_s < 0 and request.tpot_slo_s > 0 else 0
        value = (request.next_token_weight() if slack_s >= 0 else 0.0) + request.cls.weight * max(later - behind, 0)
        per_token_s = max(model.latency_s(1, context) - base_s, _MIN_WORK_S)
        density = value / (remaining_s + later * per_token_s)
        return _Scored(request, work_tokens, work_s, slack_s, value, density)


@dataclass(frozen=True)
class _Urgency:
    """The requests not promoted, by urgency against the sliding boundary (``_by_urgency``)."""

    late: list[_Scored]  # past their next deadline's slack
    urgent: list[_Scored]  # on time, slack below the boundary
    normal: list[_Scored]  # on time above the boundary, and late running ones that can earn nothing more
    recoverable: list[_Scored]  # late, but their later tokens can still earn
    hopeless: list[_Scored]  # late waiting ones that can earn nothing more
    running_on_time: list[_Scored]  # on-time running requests (their slack bounds the step's time)


def _promote_oldest_starving(
    scored: Sequence[_Scored], now_s: float, max_wait_s: float
) -> tuple[list[_Scored], list[_Scored]]:
    """(promoted, rest): the oldest request that waited longer than ``max_wait_s`` for its first token jumps the
    queue; the other starving ones keep their place this step."""
    waited = [
        s
        for s in scored
        if not s.request.is_running and s.request.num_output_tokens == 0 and now_s - s.request.arrival_s > max_wait_s
    ]
    waited.sort(key=lambda s: (s.request.arrival_s, s.request.request_id))
    promoted = waited[:1]
    promoted_ids = {s.request.request_id for s in promoted}
    return promoted, [s for s in scored if s.request.request_id not in promoted_ids]


def _by_urgency(rest: Sequence[_Scored], boundary_s: float) -> _Urgency:
    """Late, urgent and normal requests against the sliding ``boundary_s``.

    NOTE: a late request whose later tokens can still catch up competes by density with the urgent ones (behind
    everything it would starve under sustained load); one that can earn nothing more goes last, where promotion
    still bounds its wait. A running request that can earn nothing more still finishes (its decodes are cheap,
    and held back it would keep its KV and its client waiting): it joins the normal ones.
    """
    late = [s for s in rest if s.slack_s < 0]
    on_time = [s for s in rest if not s.slack_s < 0]
    urgent = [s for s in on_time if s.slack_s < boundary_s]
    normal = [s for s in on_time if not s.slack_s < boundary_s]
    return _Urgency(
        late=late,
        urgent=urgent,
        normal=normal + [s for s in late if s.value <= 0 and s.request.is_running],
        recoverable=[s for s in late if s.value > 0],
        hopeless=[s for s in late if s.value <= 0 and not s.request.is_running],
        running_on_time=[s for s in on_time if s.request.is_running],
    )


def _time_budget_s(groups: _Urgency, config: SlideConfig) -> float:
    """η: the smallest slack among the urgent and the on-time running requests, within [min_step_s, max_step_s]."""
    slacks = [s.slack_s for s in groups.urgent] + [s.slack_s for s in groups.running_on_time]
    return min(max(min(slacks, default=config.max_step_s), config.min_step_s), config.max_step_s)


def _fill(
    ordered: Sequence[_Scored], token_budget: int, caps: dict[str, int], free_slots: int | None = None
) -> dict[str, int]:
    """How many new tokens each request gets this step: walk ``ordered`` until the budget is spent.

    The last one may get only part of its prefill (a chunk), and so may a capped
    (promoted) one; vLLM chunks them the same way. Waiting requests need one of
    ``free_slots`` each (``None``: unlimited); past them, waiting requests are skipped.
    """
    allowances: dict[str, int] = {}
    left = token_budget
    slots = free_slots
    for scored in ordered:
        if left <= 0:
            break
        if not scored.request.is_running and slots is not None:
            if slots <= 0:
                continue  # NOTE: selected but unstartable, it would hold the budget and run nothing
            slots -= 1
        take = min(scored.work_tokens, left, caps.get(scored.request.request_id, scored.work_tokens))
        allowances[scored.request.request_id] = take
        left -= take
    return allowances
