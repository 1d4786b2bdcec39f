"""ttfet_at_scale's judgement against aggregated engines under affinity: a point where they beat conversation
placement counts as met only where the plan itself (spec.shape Auto) would run aggregated engines."""

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


def row(affinity_wins: bool) -> dict[str, Any]:
    return {"not_worse_than_affinity": not affinity_wins}


def test_affinity_winning_is_met_only_where_the_plan_picks_aggregated(simulator_at_scale: ModuleType) -> None:
    verdict = simulator_at_scale.plans_verdict
    assert verdict(row(True), _Plan(PoolShape.AGGREGATED))["affinity_judged"]
    assert not verdict(row(True), _Plan(PoolShape.DISAGGREGATED))["affinity_judged"]
    assert verdict(row(False), _Plan(PoolShape.DISAGGREGATED))["affinity_judged"]
    found = verdict(row(True), _Plan(PoolShape.AGGREGATED))
    assert found["plan_picks"] == "Aggregated" and found["plan_options"]["aggregated"]["saturationRatePerS"] == 1.2
