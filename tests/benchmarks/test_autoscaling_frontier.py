"""The autoscaling benchmark's judgement: the rule's Pareto frontier over (replica-hours, SLO-violation minutes),
read between and beyond its points, and coserve's point against it."""

from __future__ import annotations

import itertools
from types import ModuleType
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

# (replica-hours, violation minutes) of five rule settings: (2.5, 6) and (3.0, 2) are beaten
SWEEP = [(2.0, 8.0), (2.5, 6.0), (2.2, 4.0), (3.0, 2.0), (2.8, 0.0), (3.5, 0.0)]
FRONTIER = [(2.0, 8.0), (2.2, 4.0), (2.8, 0.0)]


def test_the_frontier_keeps_the_points_nothing_beats_sorted_by_replica_hours(world: ModuleType) -> None:
    assert world.pareto_frontier(SWEEP) == FRONTIER
    # equal replica-hours: the fewer minutes; equal points once
    assert world.pareto_frontier([(1.0, 3.0), (1.0, 2.0), (1.0, 2.0)]) == [(1.0, 2.0)]
    assert world.pareto_frontier([(1.0, 0.0)]) == [(1.0, 0.0)]


@pytest.mark.parametrize(
    ("hours", "minutes"),
    [
        (2.0, 8.0),  # on a point
        (2.1, 6.0),  # linear between (2.0, 8) and (2.2, 4)
        (2.5, 2.0),  # linear between (2.2, 4) and (2.8, 0)
        (2.8, 0.0),
        (1.5, 8.0),  # below the cheapest point: its minutes
        (9.0, 0.0),  # above the most expensive point: its minutes
    ],
)
def test_the_frontiers_minutes_at_given_replica_hours(world: ModuleType, hours: float, minutes: float) -> None:
    assert world.frontier_minutes_at(FRONTIER, hours) == pytest.approx(minutes)


@pytest.mark.parametrize(
    ("minutes", "hours"),
    [
        (8.0, 2.0),
        (6.0, 2.1),
        (2.0, 2.5),
        (0.0, 2.8),  # the cheapest point with 0 minutes
        (12.0, 2.0),  # more minutes than the cheapest point: the cheapest point's replica-hours
    ],
)
def test_the_frontiers_replica_hours_at_given_minutes(world: ModuleType, minutes: float, hours: float) -> None:
    assert world.frontier_hours_at(FRONTIER, minutes) == pytest.approx(hours)


def test_fewer_minutes_than_any_setting_reached_is_beyond_the_frontier(world: ModuleType) -> None:
    assert world.frontier_hours_at([(2.0, 8.0), (3.0, 1.0)], 0.0) is None
    verdict = world.against_frontier([(2.0, 8.0), (3.0, 1.0)], 4.0, 0.0)
    assert verdict["beats_frontier"]  # 0 < 1 at 4 replica-hours, however much it spent
    assert verdict["frontier_replica_hours_at_coserve_minutes"] is None


@pytest.mark.parametrize(
    ("hours", "minutes", "beats", "on_or_below"),
    [
        (2.1, 5.0, True, True),  # the frontier has 6 there
        (2.1, 6.0, False, True),  # on it: not fewer
        (2.1, 7.0, False, False),
        (2.5, 2.0, False, True),
        (1.5, 7.0, True, True),  # cheaper than every setting, fewer minutes than the cheapest
        (2.7, 0.0, True, True),  # the frontier still has 0.67 minutes there
        (2.8, 0.0, True, True),  # a tie at 0, at the frontier's cost
        (2.9, 0.0, False, True),  # a tie at 0 that needs more replica-hours
        (4.0, 1.0, False, False),  # more replica-hours do not buy the frontier's 0 back
    ],
)
def test_coserve_beats_the_frontier_with_fewer_minutes_at_its_cost_and_a_tie_at_zero_on_cost(
    world: ModuleType, hours: float, minutes: float, beats: bool, on_or_below: bool
) -> None:
    verdict = world.against_frontier(FRONTIER, hours, minutes)
    assert verdict["beats_frontier"] is beats
    assert verdict["on_or_below_frontier"] is on_or_below
    assert verdict["tie_at_zero_minutes"] is (minutes == 0 and hours >= 2.8)


points = st.lists(st.tuples(st.floats(0.1, 10.0), st.integers(0, 15).map(float)), min_size=1, max_size=25)


@given(points)
def test_no_sweep_point_lies_below_the_frontier(world: ModuleType, sweep: list[tuple[float, float]]) -> None:
    frontier = world.pareto_frontier(sweep)
    assert set(frontier) <= set(sweep)
    assert [h for h, _ in frontier] == sorted({h for h, _ in frontier})
    assert all(m1 < m0 for (_, m0), (_, m1) in itertools.pairwise(frontier))
    for hours, minutes in sweep:
        assert world.frontier_minutes_at(frontier, hours) <= minutes
        assert not world.against_frontier(frontier, hours, minutes)["beats_frontier"] or minutes == 0


@given(points, st.floats(0.0, 15.0))
def test_hours_at_inverts_minutes_at_inside_the_frontier(
    world: ModuleType, sweep: list[tuple[float, float]], minutes: float
) -> None:
    frontier = world.pareto_frontier(sweep)
    # two points a few ulps apart in replica-hours: no hour between them can be told apart from its ends
    assume(all(later[0] - earlier[0] > 1e-9 for earlier, later in itertools.pairwise(frontier)))
    hours = world.frontier_hours_at(frontier, minutes)
    if frontier[-1][1] <= minutes <= frontier[0][1]:
        assert hours is not None
        assert world.frontier_minutes_at(frontier, hours) == pytest.approx(minutes)


def test_a_points_own_replica_hours_read_its_minutes_exactly(world: ModuleType) -> None:
    # float noise here would turn a tie at 0 into a win: 0 < 8.9e-16
    frontier = [(3.0, 7.0), (4.558180784095902, 0.0)]
    assert world.frontier_minutes_at(frontier, 4.558180784095902) == 0.0
    assert world.frontier_hours_at(frontier, 0.0) == 4.558180784095902
    verdict = world.against_frontier(frontier, 4.558180784095902, 0.0)
    assert verdict["tie_at_zero_minutes"]
    assert verdict["beats_frontier"]  # at the frontier's own cost


def decision(world: ModuleType, replicas: tuple[int, int], reasons: tuple[str, ...]) -> Any:
    chosen = world.Replicas(*replicas)
    return world.Decision(chosen, chosen, reasons, (), 0, None)


def test_each_step_of_coserve_is_put_down_to_what_its_decision_names(world: ModuleType) -> None:
    both_guards = ("the model", "decoder KV occupancy 90% stayed >= 85%", "prefiller queue 5.0 per replica >= 4",
                   "busy prefillers measure T_p = 8,000 tokens/s: 6 prefillers, not added: its 4 serve")  # fmt: skip
    decisions = [
        (120.0, decision(world, (3, 2), ("the model ... wants 3 prefillers and 2 decoders",))),
        (135.0, decision(world, (4, 3), ("the model", "busy prefillers measure T_p = 8,000 tokens/s", "x"))),
        (150.0, decision(world, (5, 4), both_guards)),
        (165.0, decision(world, (4, 4), ("the model", "prefillers 5 -> 4: low for 300s"))),
    ]
    seen = [world.Replicas(2, 2), world.Replicas(3, 2), world.Replicas(4, 3), world.Replicas(5, 4)]
    steps = world.scaling_steps(decisions, seen)
    assert [(s["at_s"], s["role"], s["from"], s["to"], s["drivers"]) for s in steps] == [
        (120.0, "prefillers", 2, 3, ["model re-plan"]),
        (135.0, "prefillers", 3, 4, ["measured T_p"]),
        (135.0, "decoders", 2, 3, ["model re-plan"]),
        (150.0, "prefillers", 4, 5, ["prefiller queue guard"]),
        (150.0, "decoders", 3, 4, ["KV guard"]),
        (165.0, "prefillers", 5, 4, ["stabilization window"]),
    ]
    run = world.Run("coserve", replicas=[(1, 1)], arrived=[1], missed=[0], span_s=1, steps=steps)
    assert world.summarize(run)["scaling_drivers"] == {
        "prefillers": {"model re-plan": 1, "measured T_p": 1, "prefiller queue guard": 1, "stabilization window": 1},
        "decoders": {"model re-plan": 1, "KV guard": 1},
    }


def _setting(decoder: float, prefiller: float, hours: float, minutes: float) -> dict[str, Any]:
    return {"decoder_target": decoder, "prefiller_target": prefiller, "replica_hours": hours,
            "slo_violation_minutes": minutes}  # fmt: skip


def test_a_setting_dominates_coserve_with_no_more_of_either_count(world: ModuleType) -> None:
    ours = {"replica_hours": 2.0, "slo_violation_minutes": 1}
    sweep = [
        _setting(16, 1, 2.0, 1),  # equal on both: at least as good
        _setting(16, 2, 1.9, 0),  # better on both
        _setting(32, 1, 1.5, 2),  # cheaper, more minutes: not
        _setting(32, 2, 2.1, 0),  # fewer minutes, dearer: not
    ]
    assert world.dominated_by(ours, sweep) == [(16, 1), (16, 2)]
    assert world.dominated_by({"replica_hours": 1.0, "slo_violation_minutes": 0}, sweep) == []


def test_only_a_setting_that_dominates_on_every_trace_counts_everywhere(world: ModuleType) -> None:
    """An operator deploys one setting: the one that matches coserve on one trace must match it on the other."""
    first = {
        "coserve": {"replica_hours": 2.0, "slo_violation_minutes": 0},
        "baseline_sweep": [_setting(16, 1, 1.9, 0), _setting(32, 1, 1.8, 0), _setting(64, 1, 3.0, 0)],
    }
    second = {
        "coserve": {"replica_hours": 1.0, "slo_violation_minutes": 0},
        "baseline_sweep": [_setting(16, 1, 1.2, 0), _setting(32, 1, 0.9, 0), _setting(64, 1, 0.8, 0)],
    }
    assert world.dominant_everywhere([first, second]) == [(32, 1)]
    assert world.dominant_everywhere([first]) == [(16, 1), (32, 1)]
