"""Token-level deadline-aware gain (TDG): what the scheduler maximises and benchmarks report.

    gain(r) = Σ_i weight(class, i == 0) · [token i emitted before its deadline]

with token i due at ``arrival + TTFT SLO + i·TPOT SLO``. Late tokens earn
nothing, so postponing a request never pays: every token after it is due
sooner relative to when it can be produced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from coserve.scheduling.requests import RequestClass

__all__ = ["GainReport", "request_gain", "slo_attained"]


@dataclass(frozen=True)
class GainReport:
    """The gain one request earned and the most it could have earned."""

    earned: float
    possible: float
    on_time_tokens: int
    total_tokens: int

    @property
    def all_on_time(self) -> bool:
        """Every token met its deadline: the request attained its SLO in the deadline sense the gain uses."""
        return self.total_tokens > 0 and self.on_time_tokens == self.total_tokens


def request_gain(
    cls: RequestClass, arrival_s: float, ttft_slo_s: float, tpot_slo_s: float, token_times_s: Sequence[float]
) -> GainReport:
    """TDG of one finished request whose output tokens were emitted at ``token_times_s``."""
    earned = possible = 0.0
    on_time = 0
    for index, emitted_s in enumerate(token_times_s):
        weight = cls.first_token_weight if index == 0 else cls.weight
        possible += weight
        if emitted_s <= arrival_s + ttft_slo_s + index * tpot_slo_s:
            earned += weight
            on_time += 1
    return GainReport(earned, possible, on_time, len(token_times_s))


def slo_attained(arrival_s: float, ttft_slo_s: float, tpot_slo_s: float, token_times_s: Sequence[float]) -> bool:
    """Request-level SLO attainment: TTFT within its SLO and mean time per output token within its SLO."""
    if not token_times_s:
        return False
    if token_times_s[0] - arrival_s > ttft_slo_s:
        return False
    if len(token_times_s) == 1:
        return True
    tpot = (token_times_s[-1] - token_times_s[0]) / (len(token_times_s) - 1)
    return tpot <= tpot_slo_s
