"""The plan's shape: P/D and aggregated engines, each sized for the objectives at the design rate, and the pool's
choice."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import sanity_document
from coserve.api import parse_pool
from coserve.api.spec import PoolShape
from coserve.api.status import Plan, ShapeComparison
from coserve.provisioning import plan_for
from coserve.provisioning.queueing import mgc_wait
from coserve.provisioning.shape import tpot_rate
from coserve.router.policy import EngineLoad, local_prefill_step_s
from coserve.scheduling.steps import STEP_TOKENS, chunked_step_s


def plan_with(shape: str | None = None, **spec: Any) -> Plan:
    """The paper's sanity case (one prefiller saturates while its decoders have room), ``shape`` as asked."""
    document = sanity_document()
    document["spec"].pop("shape", None)
    if shape is not None:
        document["spec"]["shape"] = shape
    document["spec"].update(copy.deepcopy(spec))
    return plan_for(parse_pool(document).spec)


LOOSE = [{"name": "batch", "weight": 1.0, "ttftSloMs": 3_600_000, "tpotSloMs": 60_000}]
SLOW = {"prefillLatency": {"constantS": 0.01, "perTokenS": 1e-4}, "decodeThroughputTokensPerS": 1000.0,
        "kvCapacityTokens": 300_000}  # fmt: skip


def test_auto_takes_p_d_when_it_meets_the_objectives_on_fewer_engines() -> None:
    """R = R* = 1.667/s, the default classes (TTFT 1 s): P/D needs three prefillers for the 0.6 s prefill's queue
    and two decoders; aggregated engines, whose turn 1 shares their steps with decoding, need many more."""
    plan = plan_with()
    shapes = plan.shapes
    assert shapes is not None and shapes.shape is PoolShape.DISAGGREGATED and not plan.aggregated
    split, aggregated = shapes.disaggregated, shapes.aggregated
    assert (split.prefillers, split.decoders) == (plan.prefillers, plan.decoders) == (3, 2)
    assert aggregated.engines > split.engines and aggregated.prefillers == 0
    assert shapes.reason.startswith(f"P/D needs fewer engines ({split.engines} against {aggregated.engines})")
    assert split.ttft_p95_s <= 1.0 and aggregated.ttft_p95_s <= 1.0  # each sized to the objective
    assert any(line.startswith("alternative (aggregated, not taken)") for line in plan.explanation)


def test_auto_takes_aggregated_engines_when_they_need_fewer() -> None:
    """With objectives that never bind: P/D needs 2 prefillers (1.667/s of 0.6 s prefills is one prefiller's
    whole time) and 2 decoders; 3 engines that each prefill (0.6 s) and decode (1 s) a conversation take 2.67."""
    plan = plan_with(priorityClasses=LOOSE)
    shapes = plan.shapes
    assert shapes is not None and shapes.shape is PoolShape.AGGREGATED and plan.aggregated
    assert (shapes.disaggregated.prefillers, shapes.disaggregated.decoders) == (2, 2)
    assert shapes.aggregated.engines == plan.decoders == 3 and plan.prefillers == 0
    assert shapes.aggregated.limit == "DecoderThroughput"
    assert shapes.aggregated.saturation_rate_per_s == pytest.approx(3 / 1.6)
    assert plan.utilization.prefiller == 0.0
    assert shapes.reason.startswith("aggregated engines need fewer engines (3 against 4)")
    assert any(line.startswith("shape Aggregated:") for line in plan.explanation)


def test_a_prefiller_is_never_planned_at_its_saturation_rate() -> None:
    """At 99 % of R* one prefiller's queue is stable, but its p95 wait is about 90 s: the 5 s objective takes two."""
    standard = [{"name": "standard", "weight": 1.0, "ttftSloMs": 5_000, "tpotSloMs": 200}]
    plan = plan_with("Disaggregated", priorityClasses=standard, workload={
        **sanity_document()["spec"]["workload"], "arrivalRatePerS": 0.99 * 25_000 / 15_000})  # fmt: skip
    assert plan.shapes is not None
    assert plan.prefillers == 2 and plan.shapes.disaggregated.prefillers_limit == "TTFT"
    one = mgc_wait(1, 0.99 / 0.6, 0.6, 0.0)
    assert one.quantile_s(0.95) > 60.0


def test_the_predicted_ttft_is_the_prefillers_queue_plus_the_prefill() -> None:
    """M/G/c at the design rate with deterministic prompts (σ = 0): p95 wait + latency(L_in) + a decoder step. The
    sanity profile's step has no constant: a stream's token costs 1 / T_d, stretched by the decoders' load
    (1.667/s of 1,000 tokens on 2 decoders: 83 % busy), 6 ms."""
    plan = plan_with("Disaggregated")
    assert plan.shapes is not None
    option = plan.shapes.disaggregated
    wait = mgc_wait(option.prefillers, 25_000 / 15_000, 0.6, 0.0)
    step = 0.001 / (1 - (25_000 / 15_000) / 2)
    assert option.tpot_s == pytest.approx(step)
    assert option.ttft_p95_s == pytest.approx(wait.quantile_s(0.95) + 0.6 + step)


def test_ttfet_adds_every_turn_before_the_last() -> None:
    """Each of the n - 1 turns before the last adds its idle time (and its answer and the next turn's TTFT)."""
    workload = {**sanity_document()["spec"]["workload"], "turns": 3.0, "appendedTokens": 200, "lifetimeS": 30.0}
    quick = plan_with("Disaggregated", workload={**workload, "idleS": 1.0}).shapes
    slow = plan_with("Disaggregated", workload={**workload, "idleS": 4.0}).shapes
    assert quick is not None and slow is not None
    assert quick.disaggregated.engines == slow.disaggregated.engines
    gained = slow.disaggregated.ttfet_p95_s - quick.disaggregated.ttfet_p95_s
    assert gained == pytest.approx(2 * 3.0)
    assert quick.disaggregated.ttfet_p95_s > quick.disaggregated.ttft_p95_s + 2 * 1.0


def test_a_pool_that_asks_for_p_d_keeps_it_and_still_sees_the_comparison() -> None:
    plan = plan_with("Disaggregated", priorityClasses=LOOSE)
    assert (plan.prefillers, plan.decoders) == (2, 2)
    assert plan.shapes is not None and plan.shapes.shape is PoolShape.DISAGGREGATED and not plan.aggregated
    assert plan.shapes.aggregated.engines < plan.shapes.disaggregated.engines
    assert plan.shapes.reason.startswith("spec.shape asks for Disaggregated")


def test_a_pool_may_ask_for_aggregated_engines_where_p_d_wins() -> None:
    assert plan_with(profile=SLOW).shapes.shape is PoolShape.DISAGGREGATED  # type: ignore[union-attr]
    plan = plan_with("Aggregated", profile=SLOW)
    assert plan.prefillers == 0 and plan.aggregated
    assert plan.shapes is not None and plan.shapes.reason.startswith("spec.shape asks for Aggregated")


def test_a_turn_1_chunk_that_alone_exceeds_the_tightest_tpot_rules_aggregated_out() -> None:
    """A 2,048-token chunk at 1e-4 s per token takes 0.2 s plus the step's 0.01 s: over the default interactive
    class's 100 ms, so every stream sharing an aggregated engine with a turn 1 misses its objective."""
    plan = plan_with(profile=SLOW)
    shapes = plan.shapes
    assert shapes is not None
    # and its 1.5 s prefill is past the 1 s TTFT in either shape
    assert shapes.aggregated.unmet == ["TPOT", "TTFT"] and shapes.disaggregated.unmet == ["TTFT"]
    assert shapes.shape is PoolShape.DISAGGREGATED
    assert shapes.reason.startswith("P/D misses fewer objectives (TTFT, against TPOT, TTFT)")
    # with a looser objective for every class, the chunk fits
    loose = [{"name": "batch", "weight": 1.0, "ttftSloMs": 60_000, "tpotSloMs": 1_000}]
    relaxed = plan_with(profile=SLOW, priorityClasses=loose).shapes
    assert relaxed is not None and relaxed.aggregated.unmet == []
    standard = [{"name": "standard", "weight": 1.0, "ttftSloMs": 5_000, "tpotSloMs": 100}]
    met = plan_with(profile=SLOW, priorityClasses=standard).shapes
    assert met is not None and met.aggregated.unmet == ["TPOT"] and met.disaggregated.unmet == []
    assert met.reason.startswith("P/D meets every objective and aggregated engines cannot (TPOT)")


def test_an_objective_no_size_meets_is_warned_and_the_pool_still_planned() -> None:
    """A 15k-token prompt takes 0.6 s to prefill: a 300 ms TTFT objective is out of reach for either shape."""
    tight = [{"name": "standard", "weight": 1.0, "ttftSloMs": 300, "tpotSloMs": 200}]
    plan = plan_with("Disaggregated", priorityClasses=tight)
    assert plan.shapes is not None and plan.shapes.disaggregated.unmet == ["TTFT"]
    assert plan.prefillers >= 2  # sized to wait no longer than a prefill, not left saturated
    assert any("cannot meet the TTFT objective (300 ms) at any size" in w for w in plan.warnings)


@settings(max_examples=60, deadline=None)
@given(rate=st.floats(min_value=0.0, max_value=30.0), extra=st.floats(min_value=0.0, max_value=10.0))
def test_more_traffic_never_needs_fewer_engines_and_a_met_objective_holds(rate: float, extra: float) -> None:
    def shapes(value: float) -> ShapeComparison:
        document = sanity_document(arrivalRatePerS=value)
        document["spec"].pop("shape")
        found = plan_for(parse_pool(document).spec).shapes
        assert found is not None
        return found

    low, high = shapes(rate), shapes(rate + extra)
    for name in ("disaggregated", "aggregated"):
        assert getattr(high, name).engines >= getattr(low, name).engines
        for found in (low, high):
            option = getattr(found, name)
            if "TTFT" not in option.unmet:
                assert option.ttft_p95_s <= found.ttft_objective_s * (1 + 1e-9)
            if "TPOT" not in option.unmet:
                assert option.tpot_s <= found.tpot_objective_s * (1 + 1e-9)


def test_the_tpot_limit_is_littles_law_at_the_objective() -> None:
    """(TPOT - step(chunk)) / (b·L_d·TPOT) conversations/s per engine."""
    curve = (0.01, 1e-5, 0.0)
    step = chunked_step_s(curve, 4_000, 0.0)
    assert step == pytest.approx(0.01 + 1e-5 * STEP_TOKENS)
    assert tpot_rate(2, curve, 4_000, 500, 0.1) == pytest.approx(2 * (0.1 - step) / (1e-5 * 500 * 0.1))
    assert tpot_rate(2, curve, 0, 500, 0.1) == math.inf  # no chunk rides in the steps
    assert tpot_rate(2, (0.2, 1e-5, 0.0), 10, 500, 0.1) == 0.0  # the step alone is over the objective


def test_the_router_and_the_plan_read_one_step_rule() -> None:
    decoder = EngineLoad("http://d")
    decoder.decoding = 30
    curve = (0.01, 1e-4, 1e-9)
    assert local_prefill_step_s(decoder, 5_000, curve) == chunked_step_s(curve, 5_000, 30)


def test_an_autoscaled_aggregated_pool_is_told_its_prefiller_bounds_do_not_apply() -> None:
    scaling = {"enabled": True, "prometheusUrl": "http://prometheus:9090",
               "prefillers": {"minReplicas": 1, "maxReplicas": 4},
               "decoders": {"minReplicas": 5, "maxReplicas": 8}}  # fmt: skip
    plan = plan_with("Aggregated", autoscaling=scaling, priorityClasses=LOOSE)
    assert plan.shapes is not None and plan.shapes.aggregated.engines == 3
    assert plan.prefillers == 0 and plan.decoders == 5  # lifted to the decoders' minReplicas
    assert any(w.startswith("spec.autoscaling.prefillers does not apply") for w in plan.warnings)


def test_the_reason_states_the_objectives_as_written_never_in_exponent_form() -> None:
    """ttftSloMs 10000 and 3600000 read back as the user wrote them (they once printed as "1e+04 ms")."""
    classes = [{"name": "interactive", "weight": 10, "ttftSloMs": 10_000, "tpotSloMs": 2000},
               {"name": "batch", "weight": 1, "ttftSloMs": 3_600_000, "tpotSloMs": 60_000}]  # fmt: skip
    shapes = plan_with(priorityClasses=classes).shapes
    assert shapes is not None
    assert "objectives: TTFT 10000 ms (interactive), TPOT 2000 ms (interactive)" in shapes.reason
    assert "e+0" not in shapes.reason
