"""When to raise the layer-safepoint preemption flag (pure decision).

The engine runs one step at a time. When a request arrives while a step is in
flight, the scheduler asks ``should_preempt``: abandoning the step at the next
layer boundary pays off only if

- the step holds nothing as important as the arrival (every request in it is
  of a strictly lower class), and
- waiting for the step to finish would break the arrival's next deadline,
  while starting it now (after about one layer) would still meet it.

Offline batch work (the pool's ``offline.className``, when offline co-serving is
enabled) is harvest: it has no deadline worth an online request's wait, so a step
that holds only offline work yields to any online arrival at the next layer
boundary, unless it would end within about a layer anyway. The price is the
abandoned part of one offline step; its earlier KV is kept.

Who calls it: the coserve scheduler adapter, from the engine core's
add-request path; the worker then sees the flag at its next safepoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from coserve.scheduling.cost_model import StepCostModel
from coserve.scheduling.requests import SchedRequest

__all__ = ["EXIT_SHARE_OF_TTFT", "PreemptionDecision", "RunningStep", "safepoint_min_step_s", "should_preempt"]

# An urgent first token may wait this share of its class's TTFT objective for a step to end on its own.
EXIT_SHARE_OF_TTFT = 0.02


@dataclass(frozen=True)
class RunningStep:
    """The step in flight: when it started, how long it was predicted to take, and its classes' ranks."""

    started_s: float
    predicted_s: float
    class_ranks: Sequence[int]
    num_layers: int


@dataclass(frozen=True)
class PreemptionDecision:
    preempt: bool
    reason: str


def should_preempt(
    step: RunningStep,
    arrival: SchedRequest,
    now_s: float,
    cost_model: StepCostModel,
    offline_rank: int | None = None,
) -> PreemptionDecision:
    """Decide for one arrival; ``reason`` is logged and exported as a metric label.

    ``offline_rank`` is the rank of the offline (harvest) class, or ``None`` when
    offline co-serving is off.
    """
    if not step.class_ranks:
        return PreemptionDecision(False, "idle")
    if min(step.class_ranks) <= arrival.cls.rank:
        return PreemptionDecision(False, "step-holds-equal-or-higher-class")
    remaining_step_s = max(step.started_s + step.predicted_s - now_s, 0.0)
    layer_s = step.predicted_s / max(step.num_layers, 1)
    if offline_rank is not None and min(step.class_ranks) >= offline_rank > arrival.cls.rank:
        if remaining_step_s <= layer_s:
            return PreemptionDecision(False, "step-ending")
        return PreemptionDecision(True, "offline-yields-to-online")
    own_s = cost_model.latency_s(arrival.remaining_prefill_tokens, arrival.num_computed_tokens)
    if now_s + remaining_step_s + own_s <= arrival.next_deadline_s:
        return PreemptionDecision(False, "deadline-met-without-preemption")
    if now_s + layer_s + own_s > arrival.next_deadline_s:
        return PreemptionDecision(False, "deadline-missed-either-way")
    return PreemptionDecision(True, "deadline-at-risk")


def safepoint_min_step_s(ttft_slos_s: Sequence[float]) -> float:
    """The steps that need no safepoint: those the cost model predicts to end within this many seconds.

    The exit-latency target is ``EXIT_SHARE_OF_TTFT`` of the tightest TTFT objective among the online classes
    (``ttft_slos_s``; the offline class has none worth a wait): a step predicted to end sooner delays an urgent
    first token by no more than that, so checking it buys nothing, while each check costs the step (on a GPU,
    the run-ahead bound waits for the device at every safepoint). The scheduler compares each step's
    prediction with it (``TDGScheduler._post_step``). Who calls it: the operator, which renders the value into
    coserve's connector settings (``safepoint_min_step_s``) for every engine. 0 without online classes.
    """
    tightest = min((slo for slo in ttft_slos_s if slo > 0), default=0.0)
    return round(EXIT_SHARE_OF_TTFT * tightest, 6)
