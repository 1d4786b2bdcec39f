"""What every benchmark's statistics rest on: percentiles (numpy), Student's t (scipy), paired overheads.

Who imports it: every benchmark script, through ``harness``, and the GPU check (``gpu/torch_check.py``),
which runs on a lent machine that has PyTorch and numpy and nothing of the serving stack (no vLLM, no
httpx, no scipy). So this module imports numpy and the standard library only, and takes scipy's t
quantile where scipy is installed (``make test`` installs it with the ``bench`` extra); without it,
the Cornish-Fisher expansion of the t quantile (Abramowitz and Stegun 26.7.5), within 0.13 % of
scipy's from 3 degrees of freedom, stands in.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

import numpy as np

try:
    from scipy import stats as _scipy_stats
except ImportError:  # the GPU lender's image: numpy and PyTorch only
    _scipy_stats = None


def say(message: str) -> None:
    """Progress on stderr (the tables go to stdout)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` as one of them (numpy's "nearest" method); NaN when there are none."""
    ordered = np.asarray(list(values), dtype=float)
    if ordered.size == 0:
        return float("nan")
    return float(np.percentile(ordered, q, method="nearest"))


# The fewest observations a percentile is reported from (p99 from 200, p95 from 100, p90 from 50, p50 from 10).
MIN_SAMPLES = {99: 200, 95: 100, 90: 50, 50: 10}


def reportable_percentile(values: Sequence[float], q: int) -> float | None:
    """The ``q``-th percentile, or ``None`` when ``values`` are too few to support it (``MIN_SAMPLES``)."""
    if len(values) < MIN_SAMPLES[q]:
        return None
    return percentile(values, q)


_Z975 = NormalDist().inv_cdf(0.975)


def t975(df: int) -> float:
    """Student's t two-sided 95 % quantile at ``df`` degrees of freedom (scipy; see the module docstring)."""
    if _scipy_stats is not None:
        return float(_scipy_stats.t.ppf(0.975, df))
    if df < 3:  # the expansion is 0.7-11 % short here: no interval rather than a narrow one
        return float("inf")
    z = _Z975
    terms = (
        (z**3 + z) / 4,
        (5 * z**5 + 16 * z**3 + 3 * z) / 96,
        (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
        (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160,
    )
    return z + sum(term / df**power for power, term in enumerate(terms, 1))


def mean_interval(values: Sequence[float]) -> tuple[float, float]:
    """The mean of ``values`` and the half-width of its 95% confidence interval (Student's t; inf for n < 2)."""
    n = len(values)
    mean = statistics.fmean(values) if values else float("nan")
    if n < 2:
        return mean, float("inf")
    return mean, t975(n - 1) * statistics.stdev(values) / n**0.5


def percentile_ratio_interval(
    ours: Sequence[float], theirs: Sequence[float], q: float, resamples: int = 2000, seed: int = 7
) -> list[float] | None:
    """95 % bootstrap interval of ``percentile(ours, q) / percentile(theirs, q)``, each sample resampled on its
    own; ``None`` when either sample is too small for the percentile (``MIN_SAMPLES``)."""
    if len(ours) < MIN_SAMPLES.get(int(q), 1) or len(theirs) < MIN_SAMPLES.get(int(q), 1):
        return None
    rng = np.random.default_rng(seed)
    a, b = np.asarray(ours, dtype=float), np.asarray(theirs, dtype=float)
    pa = np.percentile(rng.choice(a, (resamples, a.size)), q, axis=1, method="nearest")
    pb = np.percentile(rng.choice(b, (resamples, b.size)), q, axis=1, method="nearest")
    ratios = pa / pb
    return [float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))]


@dataclass
class PairedOverhead:
    """An overhead measured as interleaved A/B pairs until its 95% interval is narrower than the target.

    Each pair measures the treatment (``a``) and the baseline (``b``) back to back, in alternating order
    (so a drift in the machine falls on both sides equally), and records the relative loss ``1 - a/b``
    of a higher-is-better figure. Pairs continue until at least ``min_pairs`` have run and the interval's
    half-width is below ``target``, or ``max_pairs`` have run. ``met`` judges the interval's upper bound.
    """

    target: float
    min_pairs: int = 8
    max_pairs: int = 40
    a: list[float] = field(default_factory=list)
    b: list[float] = field(default_factory=list)

    def run(self, measure: Callable[[bool], float], label: str) -> PairedOverhead:
        """``measure(True)`` measures the treatment, ``measure(False)`` the baseline."""
        while len(self.a) < self.max_pairs and not self.resolved:
            order = (True, False) if len(self.a) % 2 == 0 else (False, True)
            got = {side: measure(side) for side in order}
            self.a.append(got[True])
            self.b.append(got[False])
            loss, half = mean_interval(self.losses)
            say(f"[{label}] pair {len(self.a)}: loss {self.losses[-1]:+.2%}; mean {loss:+.2%} +/- {half:.2%}")
        return self

    @property
    def losses(self) -> list[float]:
        return [1 - a / b for a, b in zip(self.a, self.b, strict=True)]

    @property
    def resolved(self) -> bool:
        return len(self.a) >= self.min_pairs and mean_interval(self.losses)[1] < self.target

    def summary(self) -> dict[str, Any]:
        loss, half = mean_interval(self.losses)
        return {
            "n": len(self.a),
            "loss_mean": loss,
            "loss_ci95": [loss - half, loss + half],
            "met": bool(loss + half <= self.target),
            "stopped": "interval below target" if self.resolved else f"cap of {self.max_pairs} pairs",
            "pair_losses": self.losses,
            "treatment": self.a,
            "baseline": self.b,
        }


def finite(document: Any) -> Any:
    """NaN (an empty percentile) becomes null, so the JSON stays strict."""
    if isinstance(document, float):
        return None if document != document else document
    if isinstance(document, dict):
        return {key: finite(value) for key, value in document.items()}
    if isinstance(document, list):
        return [finite(value) for value in document]
    return document
