"""coserve.autoscaling.policy: the autoscaler's decision, table-driven and by properties."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coserve.api.parse import parse_pool
from coserve.api.problems import InvalidInput
from coserve.api.spec import PoolShape, SpecModel
from coserve.autoscaling.policy import Decision, Recommendation, Replicas, Signals, Thresholds, decide
from coserve.provisioning import plan_for
from pool_builders import sample_pool

SPEC: SpecModel = parse_pool(sample_pool()).spec  # L_in 2000, L_d 500, W 60 s; R* = 4.76/s per prefiller
LIMITS = Thresholds(
    min_replicas=Replicas(1, 1),
    max_replicas=Replicas(8, 32),
    stabilization_window_s=300.0,
    kv_usage_high=0.85,
    # the model at the spec's design rate (the autoscaler plans at the measured rate times its own margin, in
    # place of the spec's headroom), to compare with plan_for
    rate_headroom=SPEC.headroom,
)


def planned(rate: float, **workload: float) -> Replicas:
    spec = SPEC.model_copy(update={"workload": SPEC.workload.model_copy(update={"arrival_rate_per_s": rate,
                                                                                 **workload})})  # fmt: skip
    plan = plan_for(spec)
    return Replicas(plan.prefillers, plan.decoders)


def run(signals: Signals, current: Replicas, now_s: float = 1000.0, **kwargs: object) -> Decision:
    return decide(SPEC, signals, current, now_s, thresholds=LIMITS, **kwargs)  # type: ignore[arg-type]


def test_no_arrivals_recommends_each_roles_minimum() -> None:
    decision = run(Signals(arrival_rate_per_s=0.0), Replicas(1, 1))
    assert decision.recommended == Replicas(1, 1) and decision.replicas == Replicas(1, 1)
    assert "minimum" in decision.reason


@pytest.mark.parametrize("rate", [0.5, 3.0, 6.0, 12.0])
def test_the_proactive_rule_is_the_provisioning_model_at_the_measured_workload(rate: float) -> None:
    signals = Signals(arrival_rate_per_s=rate, input_tokens=2000, output_tokens=500, lifetime_s=60)
    decision = run(signals, Replicas(1, 1))
    assert decision.recommended == planned(rate)
    assert decision.replicas == planned(rate)  # up at once


def test_rate_headroom_plans_for_more_than_the_measured_rate() -> None:
    # the autoscaler's margin stands in for the spec's headroom: 1.5 x 1.5 = 2.25 at 8/s is the plan at 12/s
    limits = Thresholds(rate_headroom=1.5 * SPEC.headroom)
    decision = decide(SPEC, Signals(arrival_rate_per_s=8.0), Replicas(1, 1), 0.0, thresholds=limits)
    assert decision.recommended == planned(12.0) and "x2.25 headroom" in decision.reason


@pytest.mark.parametrize(("decoders", "after"), [(18, 18), (20, 17)])
def test_a_small_drop_is_not_worth_a_scale_down(decoders: int, after: int) -> None:
    assert planned(30.0) == Replicas(10, 17)  # 10 prefillers: above the limits' 8, which cap them
    steady, current = Signals(arrival_rate_per_s=30.0), Replicas(8, decoders)
    first = run(steady, current, now_s=0.0)
    later = run(steady, current, now_s=400.0, history=first.history)  # the window has passed
    assert later.replicas.decoders == after  # 17 of 18 is within the 10 % tolerance; 17 of 20 is not


def test_measured_lengths_replace_the_specs_and_missing_ones_fall_back_to_it() -> None:
    longer = run(Signals(arrival_rate_per_s=4.0, input_tokens=8000, output_tokens=800, lifetime_s=90), Replicas(1, 1))
    assert longer.recommended == planned(4.0, input_tokens=8000, output_tokens=800, lifetime_s=90)
    assert longer.recommended.prefillers > planned(4.0).prefillers  # longer prompts: more prefillers
    fallback = run(Signals(arrival_rate_per_s=4.0), Replicas(1, 1))
    assert fallback.recommended == planned(4.0)


def test_the_kv_guard_needs_two_high_evaluations_in_a_row() -> None:
    signals = Signals(arrival_rate_per_s=0.5, decoder_kv_usage=0.9)
    base = planned(0.5)
    first = run(signals, base)
    assert first.replicas == base and first.kv_high_evaluations == 1
    second = run(signals, base, kv_high_evaluations=first.kv_high_evaluations)
    assert second.replicas.decoders == base.decoders + 1 and "KV occupancy 90%" in second.reason
    calm = run(replace(signals, decoder_kv_usage=0.5), base, kv_high_evaluations=1)
    assert calm.kv_high_evaluations == 0 and calm.replicas == base


@pytest.mark.parametrize(
    ("rate", "queue", "last", "extra"),
    [
        (4.5, 200.0, 150.0, 1),  # high and growing: two prefillers (5/s to spare) would take 80 s to clear 400
        (4.5, 30.0, 20.0, 0),  # high and growing, but two prefillers clear 60 in 12 s, before a third serves
        (4.5, 30.0, 30.0, 0),  # flat
        (4.5, 30.0, None, 0),  # the first evaluation
        (4.5, 2.0, 1.0, 0),  # low
        (0.5, 6.0, 4.0, 0),  # high and growing, but one prefiller serves 0.5/s and clears 6 in 1.4 s
    ],
)
def test_the_prefiller_guard_adds_one_when_the_queue_is_high_growing_and_the_model_needs_it(
    rate: float, queue: float, last: float | None, extra: int
) -> None:
    base = planned(rate)
    decision = run(Signals(arrival_rate_per_s=rate, prefiller_queue=queue), base, last_prefiller_queue=last)
    assert decision.replicas.prefillers == base.prefillers + extra
    assert decision.prefiller_queue == queue
    if queue >= LIMITS.queue_high and last is not None and queue > last and not extra:
        assert "not added" in decision.reason


def test_replicas_stay_within_the_bounds() -> None:
    huge = run(Signals(arrival_rate_per_s=10_000.0), Replicas(1, 1))
    assert huge.replicas == Replicas(8, 32)
    floor = decide(SPEC, Signals(arrival_rate_per_s=0.0), Replicas(3, 5), 0.0,
                   thresholds=replace(LIMITS, min_replicas=Replicas(2, 4), stabilization_window_s=0))  # fmt: skip
    assert floor.replicas == Replicas(2, 4)


def test_scale_down_waits_for_the_window_then_goes_in_bounded_steps() -> None:
    current = Replicas(4, 16)
    history: tuple[Recommendation, ...] = (Recommendation(0.0, 4, 16),)
    low = Signals(arrival_rate_per_s=0.0)
    held = run(low, current, now_s=100.0, history=history)  # the window (300 s) has not passed
    assert held.replicas == current and "waiting out the stabilization window" in held.reason
    step = run(low, current, now_s=400.0, history=held.history)  # low ever since the 4/16 recommendation aged out
    assert step.replicas == Replicas(3, 12)  # a quarter at most per evaluation
    nothing_yet = run(low, current, now_s=100.0)  # no history at all (just enabled): the window is not covered
    assert nothing_yet.replicas == current


def test_history_stays_small_whatever_the_interval() -> None:
    history: tuple[Recommendation, ...] = ()
    for second in range(0, 3000, 1):
        decision = run(Signals(arrival_rate_per_s=2.0 + (second % 7) / 10), Replicas(2, 6), now_s=second,
                       history=history)  # fmt: skip
        history = decision.history
    assert len(history) <= 10


def test_an_unplannable_measured_workload_is_an_error_for_the_caller_to_report() -> None:
    with pytest.raises(InvalidInput):
        run(Signals(arrival_rate_per_s=1.0, input_tokens=5_000_000), Replicas(1, 1))


rates = st.floats(min_value=0.0, max_value=200.0, allow_nan=False)


@given(low=rates, high=rates)
def test_recommendations_are_monotone_in_load(low: float, high: float) -> None:
    low, high = sorted((low, high))
    a = run(Signals(arrival_rate_per_s=low), Replicas(1, 1)).recommended
    b = run(Signals(arrival_rate_per_s=high), Replicas(1, 1)).recommended
    assert a.prefillers <= b.prefillers and a.decoders <= b.decoders


@given(
    rate=rates,
    kv=st.floats(0, 1),
    queue=st.floats(0, 100),
    current=st.tuples(st.integers(1, 20), st.integers(1, 60)),
    kv_high=st.integers(0, 3),
)
def test_replicas_are_always_within_bounds(
    rate: float, kv: float, queue: float, current: tuple[int, int], kv_high: int
) -> None:
    decision = run(Signals(arrival_rate_per_s=rate, decoder_kv_usage=kv, prefiller_queue=queue),
                   Replicas(*current), kv_high_evaluations=kv_high, last_prefiller_queue=queue / 2)  # fmt: skip
    assert 1 <= decision.replicas.prefillers <= 8 and 1 <= decision.replicas.decoders <= 32


@settings(max_examples=50, deadline=None)  # up to 120 evaluations, each planning twice
@given(boundary=st.floats(1.0, 100.0), wobble=st.floats(0.001, 0.2), evaluations=st.integers(10, 120))
def test_load_hovering_at_a_boundary_changes_direction_at_most_once(
    boundary: float, wobble: float, evaluations: int
) -> None:
    current, history, directions = Replicas(1, 1), (), []
    for index in range(evaluations):  # every 30 s, the rate alternates just below and just above
        rate = boundary * (1 + wobble if index % 2 else 1 - wobble)
        decision = run(Signals(arrival_rate_per_s=rate), current, now_s=30.0 * index, history=history)
        for role in ("prefillers", "decoders"):
            delta = getattr(decision.replicas, role) - getattr(current, role)
            if delta:
                directions.append((role, delta > 0))
        current, history = decision.replicas, decision.history
    for role in ("prefillers", "decoders"):
        moves = [up for r, up in directions if r == role]
        changes = sum(1 for a, b in itertools.pairwise(moves) if a != b)
        assert changes == 0, f"{role} went {moves}"


def test_a_steady_low_load_scales_down_once_the_window_has_passed() -> None:
    current, history = Replicas(2, 6), ()
    for second in range(0, 400, 10):  # 0.5/s throughout, evaluations every 10 s, a 300 s window
        decision = run(Signals(arrival_rate_per_s=0.5), current, now_s=float(second), history=history)
        if second < 300:
            assert decision.replicas == current, f"down at {second} s, before the window passed"
        current, history = decision.replicas, decision.history
    assert current == planned(0.5)


@pytest.mark.parametrize(
    ("tokens_per_s", "queue", "prefillers"),
    [
        # busy at 4,000 tokens/s each, not the profile's 9,524, asks for ceil(10/s x 2000 / 4000) = 5; 100 waiting
        # per prefiller outlast a start-up, and 4 serve 10/s and clear the 300 waiting within one: 4
        (4000.0, 100.0, 4),
        (4000.0, 5.0, None),  # 15 waiting clear in 3.5 s, long before a new prefiller would serve
        (9524.0, 100.0, None),  # busy at the profile's speed: the model's count stands
        (4000.0, 0.0, None),  # not busy: a low token rate is low load, not slow prefillers
    ],
)
def test_busy_prefillers_slower_than_the_profile_add_what_their_backlog_needs(
    tokens_per_s: float, queue: float, prefillers: int | None
) -> None:
    signals = Signals(arrival_rate_per_s=10.0, prefill_tokens_per_s=tokens_per_s, prefiller_queue=queue)
    decision = run(signals, Replicas(2, 6))
    expected = planned(10.0).prefillers if prefillers is None else prefillers
    assert decision.recommended.prefillers == expected


@pytest.mark.parametrize(
    ("rate", "current", "after"),
    [
        # "within 10 %": the model with its rate and its headroom each 10 % lower fits the current replicas
        (5.5, Replicas(2, 3), Replicas(2, 3)),  # 3 prefillers and 4 decoders wanted: both held
        (7.0, Replicas(2, 3), Replicas(3, 4)),  # the same wanted, past the tolerance: up at once
        (3.6, Replicas(1, 2), Replicas(2, 2)),  # 2 and 3 wanted: the prefiller is added, the decoder held
        (7.5, Replicas(2, 4), Replicas(3, 4)),  # 3 and 5 wanted: the prefiller added, the decoder held
        (11.0, Replicas(3, 5), Replicas(4, 7)),
    ],
)
def test_the_model_adds_a_replica_only_for_more_than_the_up_tolerance_of_its_need(
    rate: float, current: Replicas, after: Replicas
) -> None:
    decision = run(Signals(arrival_rate_per_s=rate), current)
    assert decision.recommended == planned(rate)  # the model's own number, as status shows it
    assert decision.replicas == after
    held = [role for role in ("prefillers", "decoders") if getattr(after, role) < getattr(planned(rate), role)]
    for role in held:
        assert f"{role} held at {getattr(current, role)}: " in decision.reason
        assert "within 10% of the need" in decision.reason


def test_the_guards_and_a_zero_up_tolerance_still_add_at_once() -> None:
    hovering = Signals(arrival_rate_per_s=5.5, prefiller_queue=6.0, decoder_kv_usage=0.9)
    guarded = run(hovering, Replicas(2, 3), last_prefiller_queue=2.0, kv_high_evaluations=1)
    assert guarded.replicas == Replicas(2, 4)  # the KV guard adds its decoder; the small queue clears
    eager = decide(
        SPEC, Signals(arrival_rate_per_s=5.5), Replicas(2, 3), 0.0, thresholds=replace(LIMITS, up_tolerance=0)
    )
    assert eager.replicas == Replicas(3, 4)


def test_an_aggregated_pool_scales_its_engines_and_never_adds_prefillers() -> None:
    """The pool keeps the shape its spec's plan takes while the model re-plans with measured numbers: a busy,
    growing prefiller queue (a stale signal: there are no prefillers) adds none."""
    spec = SPEC.model_copy(update={"shape": PoolShape.AGGREGATED})
    busy = Signals(arrival_rate_per_s=8.0, prefiller_queue=9.0)
    decision = decide(spec, busy, Replicas(0, 2), 1000.0, thresholds=LIMITS, last_prefiller_queue=5.0)
    assert decision.replicas.prefillers == 0 and decision.recommended.prefillers == 0
    assert decision.replicas.decoders > 2
    assert decision.replicas.decoders == plan_for(spec.model_copy(update={"workload": spec.workload.model_copy(
        update={"arrival_rate_per_s": 8.0})})).decoders  # fmt: skip


def test_the_spec_s_headroom_does_not_stack_on_the_autoscaler_s_margin() -> None:
    """The spec's headroom is the static plan's margin over a guessed rate; a measured rate gets the
    autoscaler's ``rate_headroom`` alone (both at once sized a pool for 1.8x what it measured)."""
    generous = SPEC.model_copy(update={"headroom": 3.0})
    signals = Signals(arrival_rate_per_s=6.0)
    assert (
        run(signals, Replicas(1, 1)).recommended
        == decide(generous, signals, Replicas(1, 1), 1000.0, thresholds=LIMITS).recommended
        == planned(6.0)
    )
    assert planned(6.0) != Replicas(plan_for(generous.model_copy(update={"workload": generous.workload.model_copy(
        update={"arrival_rate_per_s": 6.0})})).prefillers, plan_for(generous.model_copy(update={
            "workload": generous.workload.model_copy(update={"arrival_rate_per_s": 6.0})})).decoders)  # fmt: skip
