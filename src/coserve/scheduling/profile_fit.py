"""Turn measured engine steps into a CoServeProfile: the grid, the fits and the profile object.

``coserve profile`` (through ``coserve.engine.profiler``) measures one step per
grid point (P new tokens over C cached context tokens), decode steps of batches
at several contexts, and one decode throughput run;
everything it then does with the numbers lives here, so it is tested without an
engine:

- ``ProfileGrid`` says which (P, C) points to measure; the held-out points lie
  between the training points, so the reported held-out R² is an interpolation
  test, not a re-fit.
- ``fit_prefill_curve`` fits latency(L) = a + b·L + c·L² with a, b, c >= 0 to
  the C = 0 steps (the provisioning model's prefill curve).
- ``build_profile`` fits the step cost model (``fit_cost_model``) and assembles
  the ``EngineProfile``; ``summary_table`` renders what a person checks.

Imports the stdlib, numpy, ``coserve.api`` and ``coserve.scheduling`` only.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from coserve.api.profile import EngineProfile
from coserve.api.spec import PrefillLatencyCurve
from coserve.scheduling.cost_model import CostSample, FitReport, fit_cost_model

__all__ = [
    "DECODE_STEPS",
    "ProfileGrid",
    "ProfileMeasurements",
    "build_profile",
    "fit_prefill_curve",
    "summary_table",
]

# Significant digits kept in the profile file: the measurements are noisier than this.
_SIGNIFICANT_DIGITS = 6

# A decode point times DECODE_STEPS decode steps (the difference between B requests generating
# 1 + DECODE_STEPS tokens and generating 1), so its context grows by DECODE_STEPS during the timing.
DECODE_STEPS = 16


@dataclass(frozen=True)
class ProfileGrid:
    """The steps to measure: ``train`` fits the cost model, ``holdout`` judges it.

    ``train`` and ``holdout`` are single-request (P, C) points: P new tokens over
    C cached ones. ``decode_train`` and ``decode_holdout`` are batched decode
    points (B, c): B requests decoding together at c tokens of context each.
    The batches are what identify the cost model's per-request attention term
    against its context-reading term: one request alone cannot tell k2·p·(p + c)
    from k4·(p + c) when p = 1.

    C and c values should be multiples of the engine's KV block size (128 on
    vLLM's CPU backend, 16 on GPU), because prefix caching only reuses whole blocks.
    """

    train: tuple[tuple[int, int], ...]
    holdout: tuple[tuple[int, int], ...]
    decode_train: tuple[tuple[int, int], ...] = ()
    decode_holdout: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        for name, points in (("train", self.train), ("holdout", self.holdout)):
            for index, (new_tokens, context_tokens) in enumerate(points):
                if new_tokens < 1 or context_tokens < 0:
                    raise ValueError(
                        f"grid.{name}[{index}]: need P >= 1 and C >= 0, got P={new_tokens} C={context_tokens}"
                    )
        for name, points in (("decodeTrain", self.decode_train), ("decodeHoldout", self.decode_holdout)):
            for index, (batch, context_tokens) in enumerate(points):
                if batch < 1 or context_tokens < 1:
                    raise ValueError(
                        f"grid.{name}[{index}]: need B >= 1 requests and c >= 1 context tokens, "
                        f"got B={batch} c={context_tokens}"
                    )
        for kind, train, holdout in (
            ("points", self.train, self.holdout),
            ("decode points", self.decode_train, self.decode_holdout),
        ):
            overlap = set(train) & set(holdout)
            if overlap:
                raise ValueError(f"grid: {kind} {sorted(overlap)} are both trained on and held out")

    @classmethod
    def default(cls) -> ProfileGrid:
        """33 single-request points up to P=1024, C=2048 and 11 decode batches of 1-16 requests.

        A few minutes with the benchmark's 16-layer model on 2 cores.
        """
        return cls(
            train=_lattice((16, 64, 128, 256, 512, 1024), (0, 256, 1024, 2048)),
            holdout=_lattice((32, 192, 768), (0, 512, 1536)),
            decode_train=_lattice((1, 4, 16), (128, 1024, 2048)),
            decode_holdout=_lattice((8,), (512, 1536)),
        )

    @classmethod
    def quick(cls) -> ProfileGrid:
        """10 small points and 3 decode batches, for tests: enough to fit 4 coefficients and the prefill curve."""
        return cls(
            train=_lattice((16, 128, 512), (0, 512)),
            holdout=_lattice((64, 256), (0, 256)),
            decode_train=((4, 256),),
            decode_holdout=((2, 128), (8, 128)),
        )

    @property
    def max_new_tokens(self) -> int:
        """The largest P: the engine's per-step token budget must hold it so each point is one step."""
        return max(p for p, _ in self.train + self.holdout)

    @property
    def max_batch(self) -> int:
        """The largest decode batch: the engine must run that many requests at once."""
        return max((b for b, _ in self.decode_train + self.decode_holdout), default=1)

    @property
    def decode_kv_tokens(self) -> int:
        """The most KV a decode point holds at once (B·c plus its decoded tokens, see ``DECODE_STEPS``)."""
        return max((b * (c + DECODE_STEPS + 1) for b, c in self.decode_train + self.decode_holdout), default=0)

    def fitting(self, max_total_tokens: int) -> ProfileGrid:
        """The points whose P + C fit in ``max_total_tokens``; ``ValueError`` if too few remain to fit.

        The caller passes max_model_len - 1: each measured request also samples one token (a decode
        point's requests decode ``DECODE_STEPS`` more).
        """
        grid = ProfileGrid(
            train=tuple(pt for pt in self.train if sum(pt) <= max_total_tokens),
            holdout=tuple(pt for pt in self.holdout if sum(pt) <= max_total_tokens),
            decode_train=tuple(pt for pt in self.decode_train if pt[1] + DECODE_STEPS <= max_total_tokens),
            decode_holdout=tuple(pt for pt in self.decode_holdout if pt[1] + DECODE_STEPS <= max_total_tokens),
        )
        if len(grid.train) < 4 or not grid.holdout:
            raise ValueError(
                f"only {len(grid.train)} training and {len(grid.holdout)} held-out grid points have "
                f"P + C <= {max_total_tokens}; need at least 4 and 1"
            )
        return grid


def _lattice(new_tokens: Iterable[int], context_tokens: Iterable[int]) -> tuple[tuple[int, int], ...]:
    return tuple(itertools.product(new_tokens, context_tokens))


@dataclass(frozen=True)
class ProfileMeasurements:
    """What the profiler measured on one engine; ``build_profile`` turns it into a profile.

    ``train`` and ``holdout`` hold one sample per grid point (the median of its
    repeats); ``kv_capacity_tokens`` is what the engine reports after start-up.
    """

    train: tuple[CostSample, ...]
    holdout: tuple[CostSample, ...]
    decode_throughput_tokens_per_s: float
    kv_capacity_tokens: int
    model: str | None = None
    engine: str | None = None
    measured_at: str | None = None


def fit_prefill_curve(lengths: Sequence[float], latencies_s: Sequence[float]) -> PrefillLatencyCurve:
    """Least-squares latency(L) = a + b·L + c·L² with every coefficient >= 0.

    A plain fit of noisy CPU timings often gives a slightly negative a or c, which
    the profile's schema (and physics) forbid. NOTE: with three terms, the
    non-negative least-squares optimum is the best of the unconstrained fits on each
    subset of terms whose coefficients all come out >= 0, so trying all 7 subsets is
    exact, not a heuristic. Raises ``ValueError`` with fewer than 3 distinct lengths.
    """
    x = np.asarray(lengths, dtype=float)
    y = np.asarray(latencies_s, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"need as many lengths as latencies, got {x.shape} and {y.shape}")
    if len(np.unique(x)) < 3:
        raise ValueError(f"need at least 3 distinct prompt lengths to fit a + b·L + c·L², got {sorted(set(x))}")
    if not (np.all(np.isfinite(y)) and np.all(y >= 0)):
        raise ValueError("latencies must be finite and non-negative")
    columns = np.column_stack([np.ones_like(x), x, x * x])
    scale = np.abs(columns).max(axis=0)  # L² (~1e6) and 1 equally conditioned
    candidates: list[tuple[float, np.ndarray]] = []  # (sum of squared residuals, [a, b, c])
    for size in (3, 2, 1):
        for terms in itertools.combinations(range(3), size):
            subset = list(terms)
            solution, *_ = np.linalg.lstsq(columns[:, subset] / scale[subset], y, rcond=None)
            if np.all(solution >= 0):
                coefficients = np.zeros(3)
                coefficients[subset] = solution / scale[subset]
                candidates.append((float(((columns @ coefficients - y) ** 2).sum()), coefficients))
    # Never empty: one term fitted to latencies >= 0 gets a coefficient >= 0.
    _, best = min(candidates, key=lambda candidate: candidate[0])
    a, b, c = (_rounded(float(v)) for v in best)
    return PrefillLatencyCurve(constant_s=a, per_token_s=b, per_token_squared_s=c)


def build_profile(measurements: ProfileMeasurements) -> tuple[EngineProfile, FitReport]:
    """Fit the step cost model and the prefill curve; return the profile and the cost model's fit report.

    The prefill curve uses every C = 0 sample (trained on and held out): it is a
    different model from the step cost model, and those are all the full prefills
    there are. Raises ``ValueError`` when the samples cannot support either fit.
    """
    report = fit_cost_model(measurements.train, measurements.holdout)
    full_prefills = [
        s for s in (*measurements.train, *measurements.holdout) if s.context_tokens == 0 and s.requests == 1
    ]
    curve = fit_prefill_curve([s.new_tokens for s in full_prefills], [s.latency_s for s in full_prefills])
    cost_model: dict[str, float | int] = {key: _rounded(value) for key, value in report.model.to_dict().items()}
    cost_model |= {
        "r2Train": _rounded(report.r2_train),
        "r2Holdout": _rounded(report.r2_holdout),
        "maxRelativeErrorHoldout": _rounded(report.max_relative_error_holdout),
        "numTrain": report.num_train,
        "numHoldout": report.num_holdout,
    }
    profile = EngineProfile(
        model=measurements.model,
        engine=measurements.engine,
        measured_at=measurements.measured_at,
        prefill_latency=curve,
        decode_throughput_tokens_per_s=_rounded(measurements.decode_throughput_tokens_per_s),
        kv_capacity_tokens=measurements.kv_capacity_tokens,
        cost_model=cost_model,
    )
    return profile, report


def summary_table(report: FitReport, holdout: Sequence[CostSample]) -> str:
    """The held-out points with measured and predicted latency, then the fit's quality, as text.

    P and C are the step's totals; B is how many requests shared them (a decode batch).
    """
    lines = [f"{'B':>4} {'P':>6} {'C':>7} {'measured ms':>12} {'predicted ms':>13} {'error':>7}"]
    for sample in sorted(holdout, key=lambda s: (s.requests, s.new_tokens, s.context_tokens)):
        predicted = report.model.latency_s(sample.new_tokens, sample.context_tokens, sample.requests)
        error = (predicted - sample.latency_s) / sample.latency_s if sample.latency_s > 0 else math.inf
        lines.append(
            f"{sample.requests:>4} {sample.new_tokens:>6} {sample.context_tokens:>7} {sample.latency_s * 1e3:>12.2f} "
            f"{predicted * 1e3:>13.2f} {error:>+7.1%}"
        )
    lines.append(
        f"R² train {report.r2_train:.4f} ({report.num_train} points), held out {report.r2_holdout:.4f} "
        f"({report.num_holdout} points), worst held-out error {report.max_relative_error_holdout:.1%}"
    )
    return "\n".join(lines)


def _rounded(value: float) -> float:
    return float(f"{value:.{_SIGNIFICANT_DIGITS}g}")
