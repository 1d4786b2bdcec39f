"""The learned step-latency cost model of the engine.

    latency = k1·P + k2·Σᵢ pᵢ·(pᵢ + cᵢ) + k3·P + k4·(P + C) + k5

A step computes pᵢ new tokens for each request i over its cᵢ cached context
tokens; P = Σ pᵢ and C = Σ cᵢ are the step's totals. The attention term is per
request because a request's tokens attend to its own context only: read over
the batch's totals, k2·P·(P + C) charges a decode batch of 64 requests at 16k
of context about 64 times the attention it does (on an H200 grid that form fit
at R² 0.925, worst error 27 %, with k2 negative; per request, R² 0.987, worst
14 %). For one request both forms agree.

The model is fitted by least squares on a grid of measured steps (``coserve
profile``: single-request prefills and chunks plus batched decodes) and used by
SlideBatching to turn a time budget into a token budget and to predict the load,
by the engine's scheduler to post each step's predicted time, by the preemption
monitor to predict whether an arriving request would miss its deadline, by the
KV offload copy budget, and by the simulator (``coserve.sim``) for every step.

NOTE: k1·P and k3·P multiply the same feature, so only their sum is
identifiable; the fit reports that sum as k1 and k3 = 0 rather than an
arbitrary split.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["CostSample", "FitReport", "StepCostModel", "fit_cost_model", "hold_out_interior", "served_sample"]


@dataclass(frozen=True)
class CostSample:
    """One measured step: ``new_tokens`` (P) and ``context_tokens`` (C) in total, and its latency.

    ``requests`` is how many requests shared the step equally (a uniform batch: each computed P/requests
    new tokens over C/requests of context); 1 for a single prefill or chunk, B for a decode batch of B.
    A served step (the engine's step trace: a prefill chunk beside decodes) is not uniform: give its
    ``attention_sum`` Σᵢ pᵢ·(pᵢ + cᵢ) as the scheduler computed it (``served_sample``).
    """

    new_tokens: int
    context_tokens: int
    latency_s: float
    requests: int = 1
    attention_sum: float | None = None

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise ValueError(f"requests: must be at least 1, got {self.requests}")

    @property
    def attention(self) -> float:
        """Σᵢ pᵢ·(pᵢ + cᵢ): as given, else for equal requests P·(P + C) / requests."""
        if self.attention_sum is not None:
            return self.attention_sum
        return self.new_tokens * (self.new_tokens + self.context_tokens) / self.requests


@dataclass(frozen=True)
class StepCostModel:
    """latency(P, C) in seconds; see the module docstring for the terms."""

    k1: float
    k2: float
    k3: float
    k4: float
    k5: float

    def latency_s(self, new_tokens: float, context_tokens: float, requests: int = 1) -> float:
        """Predicted latency of a step computing ``new_tokens`` over ``context_tokens`` of cached context.

        Both are the step's totals, shared equally by ``requests`` requests (1: one request's prefill or
        chunk; B: a decode batch of B requests at the same context). ``step_latency_s`` takes unequal ones.
        """
        p, total = float(new_tokens), float(new_tokens + context_tokens)
        attention = p * total / max(requests, 1)
        value = self.k1 * p + self.k2 * attention + self.k3 * p + self.k4 * total + self.k5
        return max(value, 0.0)

    def step_latency_s(self, pieces: Iterable[tuple[int, int]]) -> float:
        """Predicted latency of a step of ``pieces``: (new tokens, cached context tokens) per request."""
        new = context = 0
        attention = 0.0
        for p, c in pieces:
            new += p
            context += c
            attention += p * (p + c)
        return self.latency_from(new, context, attention)

    def latency_from(self, new_tokens: float, context_tokens: float, attention: float) -> float:
        """The model from a step's sums: P, C and Σᵢ pᵢ·(pᵢ + cᵢ) (callers that keep running sums)."""
        value = (self.k1 + self.k3) * new_tokens + self.k2 * attention + self.k4 * (new_tokens + context_tokens)
        return max(value + self.k5, 0.0)

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
    attention = np.array([s.attention for s in samples], dtype=float)
    return np.column_stack([p, attention, total, np.ones_like(p)])


def _predicted(model: StepCostModel, sample: CostSample) -> float:
    return model.latency_from(sample.new_tokens, sample.context_tokens, sample.attention)


def served_sample(step: dict[str, float]) -> CostSample:
    """A step the engine served, from its step trace line (``COSERVE_STEP_TRACE``, written by the scheduler):
    ``new`` and ``context`` tokens in total, their ``attention`` sum, ``requests``, and ``start``/``end``.

    Fitted like profiled steps, served steps give the cost model as the engine really runs: with the
    per-request work of large batches, the sampler and the scheduler itself, which single-request
    profile steps leave out (``benchmarks/simulator_fidelity.py`` measures the difference).
    """
    return CostSample(
        new_tokens=int(step["new"]),
        context_tokens=int(step["context"]),
        latency_s=float(step["end"]) - float(step["start"]),
        requests=max(int(step["requests"]), 1),
        attention_sum=float(step["attention"]),
    )


def _fit(samples: Sequence[CostSample]) -> StepCostModel:
    """Least squares on the relative error: each step's residual is divided by its latency.

    NOTE: a grid spans 5 ms decode steps and 500 ms prefills. Plain least squares fits the long steps and
    lets the short ones be off by a fifth (on the H200 grid: R² 0.9997, worst 21 %); the scheduler needs
    every step size right relatively (a decode step's error is a TPOT error), so the fit weighs them alike
    (the same grid: worst 14 %).
    """
    x = _features(samples)
    y = np.array([s.latency_s for s in samples], dtype=float)
    weights = 1.0 / np.maximum(y, 1e-9)
    x, y = x * weights[:, None], y * weights
    # Scale columns so P·(P+C) (~1e7) and the constant (1) are equally conditioned.
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
    coefficients, *_ = np.linalg.lstsq(x / scale, y, rcond=None)
    k1, k2, k4, k5 = (coefficients / scale).tolist()
    return StepCostModel(k1=k1, k2=k2, k3=0.0, k4=k4, k5=k5)


def _r2(model: StepCostModel, samples: Sequence[CostSample]) -> float:
    y = np.array([s.latency_s for s in samples])
    predicted = np.array([_predicted(model, s) for s in samples])
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
    worst = max(abs(_predicted(model, s) - s.latency_s) / max(s.latency_s, 1e-9) for s in holdout)
    return FitReport(
        model=model,
        r2_train=_r2(model, train),
        r2_holdout=_r2(model, holdout),
        max_relative_error_holdout=worst,
        num_train=len(train),
        num_holdout=len(holdout),
    )


def hold_out_interior(samples: Sequence[CostSample]) -> tuple[list[CostSample], list[CostSample]]:
    """Split a measured grid into (train, holdout) so the held-out points lie between trained ones.

    A grid is a set of sweeps: full prefills (C = 0) by P, chunks (C > 0, one request) by (P, C), and
    each decode batch size's contexts. In every sweep, every other interior point is held out, starting
    from the second; the ends are always trained on, so the held-out error measures interpolation, as
    ``coserve.scheduling.profile_fit.ProfileGrid``'s own held-out points do. Used on grids measured
    elsewhere: the H200 grid in ``data/gpu`` (``benchmarks/cost_model.py``) and the GPU check's own grid
    (``benchmarks/gpu/torch_check.py``, which must import without pydantic).
    """
    sweeps: dict[tuple[str, int], list[CostSample]] = {}
    for sample in samples:
        if sample.requests > 1 or (sample.new_tokens == 1 and sample.context_tokens > 0):
            key = ("decode", sample.requests)
        else:
            key = ("prefill" if sample.context_tokens == 0 else "chunk", 1)
        sweeps.setdefault(key, []).append(sample)
    train: list[CostSample] = []
    holdout: list[CostSample] = []
    for sweep in sweeps.values():
        ordered = sorted(sweep, key=lambda s: (s.new_tokens, s.context_tokens))
        for index, sample in enumerate(ordered):
            interior = 0 < index < len(ordered) - 1
            (holdout if interior and index % 2 == 1 else train).append(sample)
    return train, holdout
