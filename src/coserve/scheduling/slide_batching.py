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
3. Urgent requests go first, by density (gain of their next token per second
   of predicted work, greedily as a fractional knapsack); normal ones follow
   by earliest deadline, and requests whose next deadline has already passed
   (they can earn nothing now, but every later token is due sooner) join them
   in that order rather than starving at the back.
4. Requests that waited longer than ``max_wait_s`` for their first token are
   promoted to the front (no starvation).
5. The step's time budget η is the smallest slack among the urgent and
   running requests, clamped to [min_step_s, max_step_s], and becomes a token
   budget through the cost model.
"""

from __future__ import annotations

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

    def __post_init__(self) -> None:
        if self.max_tokens_per_step < 1:
            raise ValueError(f"scheduler.maxTokensPerStep: must be at least 1, got {self.max_tokens_per_step}")
        if self.urgency_factor < 0:
            raise ValueError(f"scheduler.urgencyFactor: must be >= 0, got {self.urgency_factor}")
        if self.max_wait_s <= 0:
            raise ValueError(f"scheduler.maxWaitS: must be > 0, got {self.max_wait_s}")
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
    density: float


class SlideBatching:
    """The policy object; stateless between steps, so the adapter may rebuild its inputs freely."""

    def __init__(self, cost_model: StepCostModel, config: SlideConfig | None = None) -> None:
        self.cost_model = cost_model
        self.config = config or SlideConfig()

    def decide(self, requests: Sequence[SchedRequest], now_s: float) -> StepDecision:
        """Order ``requests`` for the next step; called once per engine step."""
        config = self.config
        if not requests:
            empty: frozenset[str] = frozenset()
            return StepDecision((), empty, {}, config.max_tokens_per_step, config.max_step_s, empty, empty, empty)
        scored = [self._score(r, now_s) for r in requests]
        # Load = predicted time to drain every runnable request's next piece of work.
        load_s = self.cost_model.latency_s(
            sum(s.request.remaining_prefill_tokens for s in scored),
            sum(s.request.num_computed_tokens for s in scored),
        )
        boundary_s = config.urgency_factor * load_s

        promoted = [
            s
            for s in scored
            if not s.request.is_running
            and s.request.num_output_tokens == 0
            and now_s - s.request.arrival_s > config.max_wait_s
        ]
        promoted_ids = {s.request.request_id for s in promoted}
        rest = [s for s in scored if s.request.request_id not in promoted_ids]
        late = [s for s in rest if s.slack_s < 0]
        late_ids = {s.request.request_id for s in late}
        on_time = [s for s in rest if s.request.request_id not in late_ids]
        urgent = [s for s in on_time if s.slack_s < boundary_s]
        urgent_ids = {s.request.request_id for s in urgent}
        normal = [s for s in on_time if s.request.request_id not in urgent_ids]

        promoted.sort(key=lambda s: (s.request.arrival_s, s.request.request_id))
        urgent.sort(key=lambda s: (-s.density, s.request.next_deadline_s, s.request.request_id))
        # NOTE: late requests join the normal ones in deadline order, i.e. right after the urgent ones.
        # Behind everything they would starve under sustained load, and every further token of theirs
        # would be late too; their overdue deadline puts them first among the normal requests.
        normal = sorted(
            normal + late, key=lambda s: (s.request.next_deadline_s, -s.request.cls.weight, s.request.request_id)
        )
        ordered = promoted + urgent + normal

        slacks = [s.slack_s for s in urgent] + [s.slack_s for s in on_time if s.request.is_running]
        time_budget_s = min(max(min(slacks, default=config.max_step_s), config.min_step_s), config.max_step_s)
        context = sum(s.request.num_computed_tokens for s in ordered)
        token_budget = self.cost_model.max_new_tokens(time_budget_s, context, config.max_tokens_per_step)
        # Never starve the step: the first request's work, or every urgent decode, always fits.
        floor = max(
            min(ordered[0].work_tokens, config.max_tokens_per_step), sum(1 for s in urgent if not s.request.in_prefill)
        )
        token_budget = min(max(token_budget, floor), config.max_tokens_per_step)
        allowances = _fill(ordered, token_budget)
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

    def _score(self, request: SchedRequest, now_s: float) -> _Scored:
        work_tokens = min(request.remaining_prefill_tokens, self.config.max_tokens_per_step)
        base_s = self.cost_model.latency_s(0, 0)
        work_s = max(self.cost_model.latency_s(work_tokens, request.num_computed_tokens) - base_s, _MIN_WORK_S)
        # A prefill chunk that does not finish the prompt emits no token this step.
        finishes = work_tokens >= request.remaining_prefill_tokens
        gain = (
            request.next_token_weight()
            if finishes
            else request.next_token_weight() * (work_tokens / request.remaining_prefill_tokens)
        )
        # Slack counts all the work before the next token, even if it spans several steps.
        remaining_s = (
            work_s
            if finishes
            else max(
                self.cost_model.latency_s(request.remaining_prefill_tokens, request.num_computed_tokens) - base_s,
                _MIN_WORK_S,
            )
        )
        slack_s = request.next_deadline_s - now_s - remaining_s
        return _Scored(request, work_tokens, work_s, slack_s, gain / work_s)


def _fill(ordered: Sequence[_Scored], token_budget: int) -> dict[str, int]:
    """How many new tokens each request gets this step: walk ``ordered`` until the budget is spent.

    The last one may get only part of its prefill (a chunk); vLLM chunks it the same way.
    """
    allowances: dict[str, int] = {}
    left = token_budget
    for scored in ordered:
        if left <= 0:
            break
        allowances[scored.request.request_id] = min(scored.work_tokens, left)
        left -= scored.work_tokens
    return allowances
