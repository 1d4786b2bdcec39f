"""What every benchmark's statistics rest on, with nothing but the standard library.

``_harness`` re-exports all of it; the GPU check (``gpu/torch_check.py``) imports it directly, because
the machine a GPU is lent on has PyTorch and nothing of the serving stack (no vLLM, no httpx).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


def say(message: str) -> None:
    """Progress on stderr (the tables go to stdout)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def percentile(values: Iterable[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


# The fewest observations a percentile is reported from (p99 from 200, p95 from 100, p90 from 50, p50 from 10).
MIN_SAMPLES = {99: 200, 95: 100, 90: 50, 50: 10}


def reportable_percentile(values: Sequence[float], q: int) -> float | None:
    """The ``q``-th percentile, or ``None`` when ``values`` are too few to support it (``MIN_SAMPLES``)."""
    if len(values) < MIN_SAMPLES[q]:
        return None
    return percentile(values, q)


_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
        20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
        29: 2.045, 30: 2.042}  # fmt: skip


def mean_interval(values: Sequence[float]) -> tuple[float, float]:
    """The mean of ``values`` and the half-width of its 95% confidence interval (Student's t; inf for n < 2)."""
    n = len(values)
    mean = statistics.fmean(values) if values else float("nan")
    if n < 2:
        return mean, float("inf")
    t = _T95.get(n - 1, 1.96 + 2.4 / (n - 1))  # Cornish-Fisher's first term past the table
    return mean, t * statistics.stdev(values) / n**0.5


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
