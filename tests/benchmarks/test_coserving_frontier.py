"""The coserving benchmark's judgement: stock's Pareto frontier and what it offers at an attainment."""

from __future__ import annotations

from types import ModuleType


def point(tokens: float, attainment: float) -> dict[str, float]:
    return {"offline_tokens_per_s": tokens, "online_attainment": attainment}


def test_the_frontier_keeps_only_points_nothing_beats_on_both(coserving: ModuleType) -> None:
    points = [point(0, 0.98), point(100, 0.97), point(90, 0.90), point(300, 0.80), point(300, 0.70)]
    front = coserving.stock_frontier(points)
    assert front == [point(0, 0.98), point(100, 0.97), point(300, 0.80)]


def test_stock_offers_the_most_throughput_at_or_above_an_attainment(coserving: ModuleType) -> None:
    points = [point(0, 0.98), point(100, 0.97), point(300, 0.80)]
    assert coserving.frontier_throughput(points, 0.96) == 100
    assert coserving.frontier_throughput(points, 0.80) == 300
    assert coserving.frontier_throughput(points, 0.985) is None  # not even online-only reaches it
