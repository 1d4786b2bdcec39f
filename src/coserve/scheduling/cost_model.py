"""The learned step-latency cost model of the engine.

    latency(P, C) = k1·P + k2·P·(P + C) + k3·P + k4·(P + C) + k5

P is the number of new tokens a step computes, C the cached context tokens
those tokens attend to. The model is fitted by least squares on a grid of
measured steps (``coserve profile``) and used by SlideBatching to turn a time
budget into a token budget, by the preemption monitor to predict whether an
arriving request would miss its deadline, and by the KV offload copy budget.

NOTE: k1·P and k3·P multiply the same feature, so only their sum is
identifiable; the fit reports that sum as k1 and k3 = 0 rather than an
arbitrary split.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["CostSample", "FitReport", "StepCostModel", "fit_cost_model"]


@dataclass(frozen=True)
class CostSample:
    """One measured step: ``new_tokens`` (P), ``context_tokens`` (C) and its latency."""

    new_tokens: int
    context_tokens: int
    latency_s: float


@dataclass(frozen=True)
class StepCostModel:
    """latency(P, C) in seconds; see the module docstring for the terms."""

    k1: float
    k2: float
    k3: float
    k4: float
    k5: float

    def latency_s(self, new_tokens: float, context_tokens: float) -> float:
        """Predicted latency of a step computing ``new_tokens`` over ``context_tokens`` of cached context."""
        p, total = float(new_tokens), float(new_tokens + context_tokens)
        value = self.k1 * p + self.k2 * p * total + self.k3 * p + self.k4 * total + self.k5
        return max(value, 0.0)

    def max_new_tokens(self, budget_s: float, context_tokens: float, limit: int) -> int:
        """The largest P <= ``limit`` whose predicted latency fits in ``budget_s`` (0 when none does).

        Latency is non-decreasing in P for non-negative coefficients, so a binary
        search is exact; it also tolerates a fitted negative coefficient.
        """
        if limit <= 0 or self.latency_s(1, context_tokens) > budget_s:
            return 0
        low, high = 1, limit
        while low < high:
            middle = (low + high + 1) // 2
            if self.latency_s(middle, context_tokens) <= budget_s:
                low = middle
            else:
                high = middle - 1
        return low

    def to_dict(self) -> dict[str, float]:
        return {"k1": self.k1, "k2": self.k2, "k3": self.k3, "k4": self.k4, "k5": self.k5}

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> StepCostModel:
        """Build from ``{"k1": ..., ..., "k5": ...}``; ``ValueError`` names a missing or non-finite key."""
        values = []
        for key in ("k1", "k2", "k3", "k4", "k5"):
            if key not in data:
                raise ValueError(f"costModel.{key}: required")
            value = data[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"costModel.{key}: must be a finite number, got {value!r}")
            values.append(float(value))
        return cls(*values)


@dataclass(frozen=True)
class FitReport:
    """A fitted model and how well it predicts points it was not fitted on."""

    model: StepCostModel
    r2_train: float
    r2_holdout: float
    max_relative_error_holdout: float
    num_train: int
    num_holdout: int


def _features(samples: Sequence[CostSample]) -> np.ndarray:
    p = np.array([s.new_tokens for s in samples], dtype=float)
    total = p + np.array([s.context_tokens for s in samples], dtype=float)
    return np.column_stack([p, p * total, total, np.ones_like(p)])


def _fit(samples: Sequence[CostSample]) -> StepCostModel:
    x = _features(samples)
    y = np.array([s.latency_s for s in samples], dtype=float)
    # Scale columns so P·(P+C) (~1e7) and the constant (1) are equally conditioned.
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
    coefficients, *_ = np.linalg.lstsq(x / scale, y, rcond=None)
    k1, k2, k4, k5 = (coefficients / scale).tolist()
    return StepCostModel(k1=k1, k2=k2, k3=0.0, k4=k4, k5=k5)


def _r2(model: StepCostModel, samples: Sequence[CostSample]) -> float:
    y = np.array([s.latency_s for s in samples])
    predicted = np.array([model.latency_s(s.new_tokens, s.context_tokens) for s in samples])
    total = float(((y - y.mean()) ** 2).sum())
    residual = float(((y - predicted) ** 2).sum())
    return 1.0 - residual / total if total > 0 else (1.0 if residual == 0 else 0.0)


def fit_cost_model(train: Sequence[CostSample], holdout: Sequence[CostSample]) -> FitReport:
    """Least-squares fit on ``train``; R² on both sets and the worst relative error on ``holdout``.

    Raises ``ValueError`` with fewer than 4 training points (4 free coefficients) or no holdout.
    """
    if len(train) < 4:
        raise ValueError(f"need at least 4 training samples to fit 4 coefficients, got {len(train)}")
    if not holdout:
        raise ValueError("need at least one held-out sample to report the fit's quality")
    model = _fit(train)
    worst = max(
        abs(model.latency_s(s.new_tokens, s.context_tokens) - s.latency_s) / max(s.latency_s, 1e-9) for s in holdout
    )
    return FitReport(
        model=model,
        r2_train=_r2(model, train),
        r2_holdout=_r2(model, holdout),
        max_relative_error_holdout=worst,
        num_train=len(train),
        num_holdout=len(holdout),
    )
