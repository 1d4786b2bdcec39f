"""SlideBatching's ``decide`` as it was written before it became a pipeline of named steps: a frozen copy.

``test_slide_batching.py`` checks, by property, that the pipeline decides exactly as this function does. Do
not edit it to follow the policy: a deliberate change of the policy retires this copy and its test.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from coserve.scheduling.cost_model import StepCostModel
from coserve.scheduling.requests import SchedRequest
from coserve.scheduling.slide_batching import SlideConfig, StepDecision, _Scored

_MIN_WORK_S = 1e-6


class ReferenceSlideBatching:
    """SlideBatching as it was, whole."""

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
        """
        config = self.config
        if not requests:
            empty: frozenset[str] = frozenset()
            return StepDecision((), empty, {}, config.max_tokens_per_step, config.max_step_s, empty, empty, empty)
        scored = [self._score(r, now_s) for r in requests]
        # Load = predicted time to drain every runnable request's next piece of work (each request's tokens
        # attend to its own context: the cost model's attention term is per request).
        load_s = self.cost_model.step_latency_s(
            (s.request.remaining_prefill_tokens, s.request.num_computed_tokens) for s in scored
        )
        boundary_s = config.urgency_factor * load_s

        waited = [
            s
            for s in scored
            if not s.request.is_running
            and s.request.num_output_tokens == 0
            and now_s - s.request.arrival_s > config.max_wait_s
        ]
        waited.sort(key=lambda s: (s.request.arrival_s, s.request.request_id))
        # Only the oldest starving request jumps the queue each step; the others keep their place.
        promoted = waited[:1]
        promoted_ids = {s.request.request_id for s in promoted}
        rest = [s for s in scored if s.request.request_id not in promoted_ids]
        late = [s for s in rest if s.slack_s < 0]
        late_ids = {s.request.request_id for s in late}
        on_time = [s for s in rest if s.request.request_id not in late_ids]
        urgent = [s for s in on_time if s.slack_s < boundary_s]
        urgent_ids = {s.request.request_id for s in urgent}
        normal = [s for s in on_time if s.request.request_id not in urgent_ids]
        # NOTE: a late request whose later tokens can still catch up competes by density with the urgent
        # ones (behind everything it would starve under sustained load); one that can earn nothing more
        # goes last, where promotion still bounds its wait.
        recoverable = [s for s in late if s.value > 0]
        # A running request that can earn nothing more still finishes (its decodes are cheap, and held back it
        # would keep its KV and its client waiting); only waiting hopeless ones go last.
        hopeless = [s for s in late if s.value <= 0 and not s.request.is_running]
        normal += [s for s in late if s.value <= 0 and s.request.is_running]
        # Critical: urgent top-class requests that miss their next deadline unless they run in this step. They
        # go first, so the top class is served before its deadline whenever that is possible at all; density
        # orders everything else. NOTE: measured at 1.4x overload (benchmarks/priority_scheduling.py --rate 5):
        # density alone let 17% of the top class miss (a long top-class prompt earns less per second than short
        # low-class ones); making every class's critical requests go first, class by class, cut the gain by a
        # fifth (everyone served at the last moment, in small steps); this rule: top class 100%, most gain.
        step_s = self.cost_model.latency_s(config.max_tokens_per_step, 0)
        top_rank = min(s.request.cls.rank for s in scored)
        critical = [s for s in urgent if s.slack_s < step_s and s.request.cls.rank == top_rank]
        critical_ids = {s.request.request_id for s in critical}
        critical.sort(key=lambda s: (s.request.cls.rank, -s.density, s.request.next_deadline_s, s.request.request_id))
        by_density = sorted(
            [s for s in urgent if s.request.request_id not in critical_ids] + recoverable,
            key=lambda s: (-s.density, s.request.next_deadline_s, s.request.request_id),
        )
        by_deadline = sorted(
            normal, key=lambda s: (s.request.next_deadline_s, -s.request.cls.weight, s.request.request_id)
        )
        hopeless.sort(key=lambda s: (s.request.next_deadline_s, -s.request.cls.weight, s.request.request_id))
        # NOTE: an online request that missed its deadline by a whisker (a step that ran longer than predicted)
        # earns nothing more, but behind offline work it waited until promotion (max_wait_s, 30 s by default);
        # it goes before the offline class's work instead, and after every online request that can still earn.
        if self.offline_rank is not None:
            offline = self.offline_rank
            ordered = (
                promoted + critical + by_density
                + [s for s in by_deadline if s.request.cls.rank != offline]
                + [s for s in hopeless if s.request.cls.rank != offline]
                + [s for s in by_deadline if s.request.cls.rank == offline]
                + [s for s in hopeless if s.request.cls.rank == offline]
            )  # fmt: skip
        else:
            ordered = promoted + critical + by_density + by_deadline + hopeless

        slacks = [s.slack_s for s in urgent] + [s.slack_s for s in on_time if s.request.is_running]
        time_budget_s = min(max(min(slacks, default=config.max_step_s), config.min_step_s), config.max_step_s)
        promoted_cap = max(1, math.ceil(config.promoted_share * config.max_tokens_per_step))
        caps = {s.request.request_id: promoted_cap for s in promoted}
        token_budget = self._token_budget(ordered, time_budget_s, caps, free_slots)
        # Never starve the step: the first request's work, or every urgent decode, always fits.
        floor = max(
            min(ordered[0].work_tokens, config.max_tokens_per_step), sum(1 for s in urgent if not s.request.in_prefill)
        )
        token_budget = min(max(token_budget, floor), config.max_tokens_per_step)
        allowances = _fill(ordered, token_budget, caps, free_slots)
        return StepDecision(
            order=tuple(s.request.request_id for s in ordered),
            selected_ids=frozenset(allowances),
            allowances=allowances,
            token_budget=token_budget,
            time_budget_s=time_budget_s,
            urgent_ids=frozenset(urgent_ids),
            promoted_ids=frozenset(promoted_ids),
            late_ids=frozenset(late_ids),
        )

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
