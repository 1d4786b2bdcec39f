"""ttfet_at_scale's judgement against aggregated engines under affinity: where the plan itself (spec.shape Auto)
picks P/D, conversation placement must be 1.2x below them; where it picks them, they must be no worse."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from coserve.api.spec import PoolShape
from coserve.api.status import ShapeComparison, ShapeOption


def option(prefillers: int, decoders: int, saturation: float) -> ShapeOption:
    return ShapeOption(prefillers=prefillers, decoders=decoders, engines=prefillers + decoders, limit="TTFT",
                       ttft_p95_s=1.0, ttfet_p95_s=2.0, tpot_s=0.02, saturation_rate_per_s=saturation)  # fmt: skip


class _Plan:
    def __init__(self, shape: PoolShape) -> None:
        self.shapes = ShapeComparison(shape=shape, design_rate_per_s=1.0, ttft_objective_s=1.0, tpot_objective_s=0.1,
                                      disaggregated=option(1, 3, 1.0), aggregated=option(0, 4, 1.2),
                                      reason="r")  # fmt: skip


def row(ratio: float | None) -> dict[str, Any]:
    """A point where conversation placement's p95 TTFET is ``ratio`` times affinity's."""
    return {"p95_vs_affinity": ratio}


def test_a_pd_pick_must_be_1_2x_below_affinity_and_an_aggregated_pick_no_worse(simulator_at_scale: ModuleType) -> None:
    verdict = simulator_at_scale.plans_verdict
    assert verdict(row(0.8), _Plan(PoolShape.DISAGGREGATED))["affinity_judged"]  # 1.25x below
    assert not verdict(row(0.9), _Plan(PoolShape.DISAGGREGATED))["affinity_judged"]  # better, but not 1.2x
    assert not verdict(row(1.1), _Plan(PoolShape.DISAGGREGATED))["affinity_judged"]
    assert verdict(row(1.1), _Plan(PoolShape.AGGREGATED))["affinity_judged"]  # aggregated engines were better
    assert verdict(row(1.0), _Plan(PoolShape.AGGREGATED))["affinity_judged"]
    assert not verdict(row(0.8), _Plan(PoolShape.AGGREGATED))["affinity_judged"]  # P/D would have been better
    assert not verdict(row(None), _Plan(PoolShape.AGGREGATED))["affinity_judged"]
    found = verdict(row(1.1), _Plan(PoolShape.AGGREGATED))
    assert found["plan_picks"] == "Aggregated" and found["plan_options"]["aggregated"]["saturationRatePerS"] == 1.2
