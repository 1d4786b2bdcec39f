"""The autoscaler re-plans with measured turns, appended tokens and the decoders' running time."""

from __future__ import annotations

import re

import pytest

from coserve.api.parse import parse_pool
from coserve.api.spec import SpecModel
from coserve.autoscaling.policy import Replicas, Signals, Thresholds, decide
from coserve.provisioning import plan_for
from pool_builders import sample_pool

SPEC: SpecModel = parse_pool(sample_pool()).spec
# the model at the spec's design rate (the autoscaler plans at the measured rate times its own margin, in place
# of the spec's headroom), to compare with plan_for
LIMITS = Thresholds(max_replicas=Replicas(64, 256), rate_headroom=SPEC.headroom)


def planned(rate: float, **workload: float) -> Replicas:
    spec = SPEC.model_copy(
        update={"workload": SPEC.workload.model_copy(update={"arrival_rate_per_s": rate, **workload})}
    )
    plan = plan_for(spec)
    return Replicas(plan.prefillers, plan.decoders)


def wanted(reason: str) -> Replicas:
    """What the proactive rule's model wanted, as its reason says (before the stability rules)."""
    found = re.search(r"wants (\d+) prefillers and (\d+) decoders", reason)
    assert found is not None, reason
    return Replicas(int(found[1]), int(found[2]))


def test_measured_turns_and_running_time_set_the_idle_time_the_model_plans_with() -> None:
    """g = (W - W_run) / (n - 1): a 300 s lifetime of 3 turns, 20 s of it running, idles 140 s per gap."""
    signals = Signals(arrival_rate_per_s=2.0, lifetime_s=300.0, turns=3.0, appended_tokens=400.0, decoder_run_s=20.0)
    decision = decide(SPEC, signals, Replicas(1, 1), 0.0, thresholds=LIMITS)
    expected = planned(2.0, lifetime_s=300.0, turns=3.0, appended_tokens=400, idle_s=140.0)
    assert wanted(decision.reason) == expected
    assert "n=3 turns, a=400, g=140s" in decision.reason
    # the same lifetime without the running time measured: the spec's idle time (0), all 300 s of KV counted
    kept = decide(SPEC, Signals(arrival_rate_per_s=2.0, lifetime_s=300.0, turns=3.0, appended_tokens=400.0),
                  Replicas(1, 1), 0.0, thresholds=LIMITS)  # fmt: skip
    assert wanted(kept.reason) == planned(2.0, lifetime_s=300.0, turns=3.0, appended_tokens=400)
    assert wanted(kept.reason).decoders > expected.decoders


@pytest.mark.parametrize("run_s", [0.0, -5.0])
def test_a_running_time_at_or_below_zero_keeps_the_idle_time_inside_the_lifetime(run_s: float) -> None:
    """Measurements that disagree (W_run <= 0) must not make an idle time the model refuses."""
    signals = Signals(arrival_rate_per_s=1.0, lifetime_s=100.0, turns=2.0, decoder_run_s=run_s)
    decision = decide(SPEC, signals, Replicas(1, 1), 0.0, thresholds=LIMITS)
    assert wanted(decision.reason) == planned(1.0, lifetime_s=100.0, turns=2.0, idle_s=99.0)
