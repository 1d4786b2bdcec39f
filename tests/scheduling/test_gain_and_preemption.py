"""TDG gain accounting and the preemption decision."""

from __future__ import annotations

import pytest

from coserve.scheduling import RunningStep, request_gain, should_preempt, slo_attained
from sched_builders import COST, REGISTRY, make_request

INTERACTIVE = REGISTRY.get("interactive")  # weight 10, TTFT 1 s, TPOT 100 ms


@pytest.mark.parametrize(
    ("times", "earned", "on_time"),
    [
        ([0.5, 0.6, 0.7], 30.0, 3),
        ([1.5, 1.55, 1.6], 0.0, 0),  # first token late, and so is everything after it
        ([0.9, 1.05, 1.3], 20.0, 2),  # token 2 due at 1.2
        ([], 0.0, 0),
    ],
)
def test_tdg_counts_only_on_time_tokens(times: list[float], earned: float, on_time: int) -> None:
    report = request_gain(INTERACTIVE, 0.0, 1.0, 0.1, times)
    assert (report.earned, report.on_time_tokens, report.possible) == (earned, on_time, 10.0 * len(times))


def test_first_token_weight_is_separate() -> None:
    from coserve.scheduling import ClassRegistry

    registry = ClassRegistry([{"name": "a", "weight": 1, "ttftSloMs": 100, "tpotSloMs": 10}], first_token_factor=5)
    report = request_gain(registry.get("a"), 0.0, 0.1, 0.01, [0.05, 0.5])
    assert report.earned == 5.0 and report.possible == 6.0


def test_slo_attainment() -> None:
    assert slo_attained(0.0, 1.0, 0.1, [0.5, 0.55, 0.7])
    assert not slo_attained(0.0, 1.0, 0.1, [1.2])
    assert not slo_attained(0.0, 1.0, 0.1, [0.5, 1.0, 1.5])
    assert not slo_attained(0.0, 1.0, 0.1, [])


def test_all_on_time_judges_every_token_deadline_not_the_mean() -> None:
    # An early first token banks slack: token 2 is due at 1.0 + 2 * 0.1 = 1.2 s, so all three are on time
    # although the mean time per output token (0.45 s) is far above the 0.1 s SLO.
    early = request_gain(INTERACTIVE, 0.0, 1.0, 0.1, [0.1, 1.0, 1.0])
    assert early.all_on_time
    assert not slo_attained(0.0, 1.0, 0.1, [0.1, 1.0, 1.0])
    assert not request_gain(INTERACTIVE, 0.0, 1.0, 0.1, [0.1, 1.0, 1.25]).all_on_time
    assert not request_gain(INTERACTIVE, 0.0, 1.0, 0.1, []).all_on_time


OFFLINE_STEP = RunningStep(started_s=0.0, predicted_s=0.8, class_ranks=[2, 2], num_layers=16)


@pytest.mark.parametrize(
    ("step", "arrival", "now", "preempt", "reason"),
    [
        (OFFLINE_STEP, make_request("u", "interactive", arrival_s=-0.5, prompt=10), 0.1, True, "deadline-at-risk"),
        (
            OFFLINE_STEP,
            make_request("u", "interactive", arrival_s=0.0, prompt=10),
            0.1,
            False,
            "deadline-met-without-preemption",
        ),
        (
            OFFLINE_STEP,
            make_request("u", "interactive", arrival_s=-1.5, prompt=10),
            0.1,
            False,
            "deadline-missed-either-way",
        ),
        (
            RunningStep(0.0, 0.8, [0, 2], 16),
            make_request("u", "interactive", arrival_s=-0.5),
            0.1,
            False,
            "step-holds-equal-or-higher-class",
        ),
        (
            RunningStep(0.0, 0.8, [2], 16),
            make_request("u", "offline", arrival_s=-0.5),
            0.1,
            False,
            "step-holds-equal-or-higher-class",
        ),
        (RunningStep(0.0, 0.0, [], 16), make_request("u", "interactive"), 0.1, False, "idle"),
    ],
)
def test_preemption_decision(step: RunningStep, arrival: object, now: float, preempt: bool, reason: str) -> None:
    decision = should_preempt(step, arrival, now, COST)  # type: ignore[arg-type]
    assert (decision.preempt, decision.reason) == (preempt, reason)


@pytest.mark.parametrize(
    ("step", "arrival_class", "now", "preempt", "reason"),
    [
        # with offline co-serving on, an offline-only step yields to any online arrival, deadline or not
        (OFFLINE_STEP, "interactive", 0.1, True, "offline-yields-to-online"),
        (OFFLINE_STEP, "standard", 0.1, True, "offline-yields-to-online"),
        # ... unless it is about to end anyway (less than one layer, 50 ms here, left)
        (OFFLINE_STEP, "interactive", 0.76, False, "step-ending"),
        # another offline request waits; so does anything behind a step holding online work
        (OFFLINE_STEP, "offline", 0.1, False, "step-holds-equal-or-higher-class"),
        (RunningStep(0.0, 0.8, [1, 2], 16), "interactive", 0.1, False, "deadline-met-without-preemption"),
    ],
)
def test_offline_work_yields_to_online_arrivals(
    step: RunningStep, arrival_class: str, now: float, preempt: bool, reason: str
) -> None:
    arrival = make_request("u", arrival_class, arrival_s=now, prompt=10)
    decision = should_preempt(step, arrival, now, COST, offline_rank=REGISTRY.get("offline").rank)
    assert (decision.preempt, decision.reason) == (preempt, reason)


def test_without_offline_co_serving_the_deadline_rule_decides() -> None:
    arrival = make_request("u", "interactive", arrival_s=0.1, prompt=10)
    assert should_preempt(OFFLINE_STEP, arrival, 0.1, COST).reason == "deadline-met-without-preemption"
