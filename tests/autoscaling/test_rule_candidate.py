"""The queue-length rule as one of the autoscaler's candidates, judged by the model; and the rising-rate forecast.

Who this guards: ``coserve.autoscaling.policy.decide`` (the rule, ``rule_count``; the backlog judgement; the
forecast) and ``thresholds_for`` (the spec's knobs). The ``autoscaling`` benchmark judges the outcome against
the swept rule; these tests pin each step of the decision.
"""

from __future__ import annotations

import pytest

from coserve.api.parse import parse_pool
from coserve.autoscaling.policy import (
    DEFAULT_PREFILLER_TARGET,
    Replicas,
    Signals,
    Thresholds,
    decide,
    rate_lag_s,
    rule_count,
    thresholds_for,
)
from coserve.provisioning import plan_for
from pool_builders import sample_pool

POOL = sample_pool()  # L_in 2000, L_d 500, W 60 s; R* = 4.76/s per prefiller
SPEC = parse_pool(POOL).spec
# the model at the spec's design rate (the autoscaler's margin stands in for the spec's headroom), as plan_for
LIMITS = Thresholds(max_replicas=Replicas(64, 256), rate_headroom=SPEC.headroom, stabilization_window_s=300.0)


def planned(rate: float) -> Replicas:
    plan = plan_for(SPEC.model_copy(update={"workload": SPEC.workload.model_copy(update={"arrival_rate_per_s": rate})}))
    return Replicas(plan.prefillers, plan.decoders)


@pytest.mark.parametrize(
    ("current", "requests", "target", "count"),
    [
        (2, 8.0, 2.0, 4),  # 4 per replica, twice the target
        (3, 6.0, 2.0, 3),  # on target
        (3, 6.5, 2.0, 3),  # 8 % above: within the HPA's 10 % tolerance
        (3, 7.0, 2.0, 4),  # 17 % above: ceil(3 x 7/6)
        (4, 2.0, 2.0, 1),  # a quarter of the target: ceil(4 x 1/4)
        (0, 5.0, 2.0, None),  # no replicas (an aggregated pool's prefillers)
        (2, None, 2.0, None),  # no sample
        (2, 4.0, None, None),  # no target
    ],
)
def test_the_rule_is_the_hpa_s_formula(current: int, requests: float | None, target: float | None,
                                        count: int | None) -> None:  # fmt: skip
    assert rule_count(current, requests, target) == count


def test_the_rule_s_extra_replicas_are_added_when_the_backlog_outlasts_a_start_up() -> None:
    # two prefillers serve 9.52/s; at 4.5/s they have 5.02/s to spare, so 400 waiting take ~80 s to clear, longer
    # than the 60 s a new one takes to start: the rule's 205 are capped at the 3 that serve 4.5/s and clear them
    base = planned(4.5)
    signals = Signals(arrival_rate_per_s=4.5, prefiller_queue=200.0, prefiller_requests=410.0)
    decision = decide(SPEC, signals, base, 1000.0, thresholds=LIMITS)
    assert base.prefillers == 2
    assert decision.replicas.prefillers == 3
    assert (
        "the queue-length rule (410 running + waiting, target 2 each) asks for 205; at most 3 serve" in decision.reason
    )


def test_the_rule_s_extra_replicas_are_not_added_for_a_backlog_that_clears_before_they_would_serve() -> None:
    base = planned(2.0)
    signals = Signals(arrival_rate_per_s=2.0, prefiller_queue=9.0, prefiller_requests=10.0)
    decision = decide(SPEC, signals, base, 1000.0, thresholds=LIMITS)
    assert decision.replicas == base and decision.recommended == base
    assert "the queue-length rule (10 running + waiting, target 2 each): 5 prefillers, not added: " in decision.reason
    assert "before a new one serves (60s)" in decision.reason
    # the same backlog with a start-up of a second is worth a replica: the rule's 5, capped at what clears it
    quick = decide(SPEC, signals, base, 1000.0, thresholds=Thresholds(rate_headroom=SPEC.headroom, startup_s=1.0))
    assert quick.replicas.prefillers > base.prefillers


def test_a_growing_queue_confirms_the_model_s_need_within_its_tolerance() -> None:
    # at 5.5/s the model wants 3 prefillers and 4 decoders: held at (2, 3) within the 10 % tolerance. A small flat
    # queue clears on the two: the rule's 4 add nothing. A queue that grew past what two clear within a start-up
    # confirms the model's third prefiller (the rule's 135 capped at it); the decoders stay held.
    small = Signals(arrival_rate_per_s=5.5, prefiller_queue=3.0, prefiller_requests=8.0)
    flat = decide(SPEC, small, Replicas(2, 3), 1000.0, thresholds=LIMITS, last_prefiller_queue=3.0)
    assert planned(5.5) == Replicas(3, 4)
    assert flat.replicas == Replicas(2, 3) and ": 4 prefillers, not added: its 3 serve" in flat.reason
    large = Signals(arrival_rate_per_s=5.5, prefiller_queue=130.0, prefiller_requests=270.0)
    grew = decide(SPEC, large, Replicas(2, 3), 1000.0, thresholds=LIMITS, last_prefiller_queue=100.0)
    assert grew.replicas == Replicas(3, 3)
    assert "asks for 135; at most 3 serve 5.5/s" in grew.reason and "decoders held at 3" in grew.reason


def test_the_decoders_rule_targets_what_a_decoder_s_kv_cache_holds_by_default() -> None:
    plan = plan_for(SPEC)
    base = Replicas(plan.prefillers, plan.decoders)
    slots = plan.kv_slots_per_decoder
    signals = Signals(arrival_rate_per_s=SPEC.workload.arrival_rate_per_s, decoder_requests=3.0 * slots * base.decoders)
    decision = decide(SPEC, signals, base, 1000.0, thresholds=LIMITS)
    assert f"target {slots:g} each" in decision.reason


def test_a_rising_rate_is_planned_for_when_a_new_replica_will_serve() -> None:
    # 4.0/s 15 s ago, 4.5/s now: rising 1/30 per second; over the rate's 60 s lag and a 60 s start-up, 8.5/s
    rising = decide(SPEC, Signals(arrival_rate_per_s=4.5), Replicas(1, 1), 1000.0, thresholds=LIMITS,
                    last_arrival=(985.0, 4.0))  # fmt: skip
    # the forecast is the design rate itself, no margin on top (``planned`` is at the spec's headroom)
    assert rising.recommended == planned(8.5 / SPEC.headroom) != planned(4.5)
    assert "rising to 8.5/s" in rising.reason
    assert rising.arrival == (1000.0, 4.5)
    falling = decide(SPEC, Signals(arrival_rate_per_s=4.5), Replicas(1, 1), 1000.0, thresholds=LIMITS,
                     last_arrival=(985.0, 5.0))  # fmt: skip
    assert falling.recommended == planned(4.5) and "rising" not in falling.reason


def test_the_spec_sets_the_rule_s_targets_the_start_up_and_the_rate_s_lag() -> None:
    assert thresholds_for(SPEC).prefiller_target_requests == DEFAULT_PREFILLER_TARGET
    assert thresholds_for(SPEC).decoder_target_requests is None and thresholds_for(SPEC).rate_lag_s == 60.0
    scaling = {
        "prefillers": {"targetRequestsPerReplica": 6},
        "decoders": {"targetRequestsPerReplica": 48},
        "replicaStartupS": 240,
        "queries": {"arrivalRate": "sum(rate(conversations[30s]))"},
    }
    pool = {**POOL, "spec": {**POOL["spec"], "autoscaling": scaling}}
    limits = thresholds_for(parse_pool(pool).spec)
    assert (limits.prefiller_target_requests, limits.decoder_target_requests) == (6, 48)
    assert limits.startup_s == 240 and limits.rate_lag_s == 15.0
    assert rate_lag_s("sum(my_rate)") == 0.0  # no window to read: the forecast uses the start-up alone
