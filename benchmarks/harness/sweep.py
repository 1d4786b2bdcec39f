"""Sweeps and their judgement: the best setting of a swept baseline, and Pareto frontiers.

Who calls what: a script sweeps the baseline's knobs (the settings a competent operator would tune),
then compares coserve with ``best_of`` the sweep or with its ``pareto`` frontier.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

Item = TypeVar("Item")


def best_of(rows: Sequence[Item], key: str | Callable[[Item], Any], highest: bool = False) -> Item:
    """The swept configuration best at ``key`` (lowest, or ``highest``); the first such on a tie.

    ``key`` names a column of dict rows, or is a function scoring any row (a tuple of figures orders as
    tuples do: a tie on the first is broken by the next). Rows whose ``key`` is None (an arm that failed,
    too few samples) are never the best; ValueError when no row has it.
    """
    score = key if callable(key) else lambda row: row.get(key)  # type: ignore[attr-defined]
    candidates = [(value, row) for row in rows if (value := score(row)) is not None]
    if not candidates:
        raise ValueError(f"no swept configuration has {key if isinstance(key, str) else 'a score'}")
    pick = max if highest else min
    return pick(candidates, key=lambda pair: pair[0])[1]


def pareto(items: Sequence[Item], score: Callable[[Item], tuple[float, float]]) -> list[Item]:
    """The items no other item beats on both scores (higher is better on each), sorted by the first score.

    An item with the same scores as an earlier one is left out: the frontier holds each point once.
    Pass negated scores for a figure where lower is better (cost, violations).
    """
    scored = [(score(item), item) for item in items]
    front: list[tuple[tuple[float, float], Item]] = []
    for point, item in scored:
        dominated = any(other[0] >= point[0] and other[1] >= point[1] and other != point for other, _ in scored)
        if not dominated and all(point != kept for kept, _ in front):
            front.append((point, item))
    return [item for _, item in sorted(front, key=lambda pair: pair[0])]
