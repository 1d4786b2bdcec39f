"""The plan's shape: P/D against aggregated engines on the same engines, and the pool's choice."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest

from conftest import sanity_document
from coserve.api import parse_pool
from coserve.api.spec import PoolShape
from coserve.api.status import Plan
from coserve.provisioning import plan_for
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


def test_auto_takes_aggregated_engines_when_they_sustain_more_on_the_same_engines() -> None:
    """1 prefiller saturates at 1.667/s (T_p 25k over 15k tokens) while 2 decoders could take 2/s; 3 engines that
    each prefill (0.6 s) and decode (1 s) a conversation sustain 3 / 1.6 = 1.875/s."""
    plan = plan_with()
    shapes = plan.shapes
    assert shapes is not None and shapes.shape is PoolShape.AGGREGATED and plan.aggregated
    assert shapes.engines == 3
    assert shapes.disaggregated_rate_per_s == pytest.approx(25_000 / 15_000)
    assert shapes.disaggregated_limit == "Prefiller"
    assert shapes.aggregated_rate_per_s == pytest.approx(3 / 1.6)
    assert shapes.aggregated_limit == "DecoderThroughput"
    assert plan.prefillers == 0
    assert plan.decoders == math.ceil(1.0 * (25_000 / 15_000) / (1.875 / 3))  # headroom 1.0: 3 engines
    assert plan.utilization.prefiller == 0.0
    assert "aggregated sustains the higher rate" in shapes.reason and "1.875" in shapes.reason
    assert any(line.startswith("shape Aggregated:") for line in plan.explanation)


def test_a_pool_that_asks_for_p_d_keeps_it_and_still_sees_the_comparison() -> None:
    plan = plan_with("Disaggregated")
    assert (plan.prefillers, plan.decoders) == (1, 2)
    assert plan.shapes is not None and plan.shapes.shape is PoolShape.DISAGGREGATED and not plan.aggregated
    assert plan.shapes.aggregated_rate_per_s > plan.shapes.disaggregated_rate_per_s
    assert plan.shapes.reason.startswith("spec.shape asks for Disaggregated")


def test_a_pool_may_ask_for_aggregated_engines_where_p_d_sustains_more() -> None:
    slow = {"prefillLatency": {"constantS": 0.01, "perTokenS": 1e-4}, "decodeThroughputTokensPerS": 1000.0,
            "kvCapacityTokens": 300_000}  # fmt: skip
    assert plan_with(profile=slow).shapes.shape is PoolShape.DISAGGREGATED  # type: ignore[union-attr]
    plan = plan_with("Aggregated", profile=slow)
    assert plan.prefillers == 0 and plan.aggregated
    assert plan.shapes is not None and plan.shapes.reason.startswith("spec.shape asks for Aggregated")


def test_a_turn_1_chunk_that_alone_exceeds_the_tightest_tpot_rules_aggregated_out() -> None:
    """A 2,048-token chunk at 1e-4 s per token takes 0.2 s plus the step's 0.01 s: over the default interactive
    class's 100 ms, so every stream sharing an aggregated engine with a turn 1 misses its objective."""
    slow = {"prefillLatency": {"constantS": 0.01, "perTokenS": 1e-4}, "decodeThroughputTokensPerS": 1000.0,
            "kvCapacityTokens": 300_000}  # fmt: skip
    shapes = plan_with(profile=slow).shapes
    assert shapes is not None
    assert (shapes.aggregated_rate_per_s, shapes.aggregated_limit) == (0.0, "TPOT")
    assert shapes.shape is PoolShape.DISAGGREGATED
    # with a looser objective for every class, the chunk fits and the comparison is on throughput again
    loose = [{"name": "batch", "weight": 1.0, "ttftSloMs": 60_000, "tpotSloMs": 1_000}]
    relaxed = plan_with(profile=slow, priorityClasses=loose).shapes
    assert relaxed is not None and relaxed.aggregated_limit != "TPOT"


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
    plan = plan_with("Aggregated", autoscaling=scaling)
    assert plan.prefillers == 0 and plan.decoders == 5  # within the decoders' bounds
    assert any(w.startswith("spec.autoscaling.prefillers does not apply") for w in plan.warnings)
