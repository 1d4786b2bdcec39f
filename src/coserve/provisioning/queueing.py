"""The waiting times the plan prices: a queue of turn-1 prompts at the prefillers, and the prefill lane of an
engine that decodes.

Two textbook approximations, each a few lines, so a reader can check every number the plan prints:

- **M/G/c** (the prefillers): ``c`` servers, Poisson arrivals at ``λ``, service times of mean ``S`` and squared
  coefficient of variation ``scv``. Erlang's C formula gives the chance an arrival waits, ``C(c, λS)``; the
  Allen–Cunneen approximation gives the mean wait, ``C · (1 + scv)/2 · S / (c·(1 - ρ))`` with ``ρ = λS/c``.
- **M/G/1** (an engine's prefill lane): the Pollaczek–Khinchine mean wait ``λ·E[S²] / (2·(1 - ρ))``, and an
  arrival waits with chance ``ρ``.

In both the wait of an arrival that waits is taken as exponential with the mean that makes the overall mean
right (exact for M/M/c), so the q-quantile of the wait is ``(mean / P(wait)) · ln(P(wait) / (1 - q))`` (0 when
fewer than ``1 - q`` of arrivals wait at all). Both are infinite at or past saturation (``ρ >= 1``).

Who calls it: ``coserve.provisioning.shape``, which turns the waits into each shape's predicted TTFT and TTFET.
Pure: stdlib only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Wait", "erlang_c", "mg1_wait", "mgc_wait"]


@dataclass(frozen=True)
class Wait:
    """How long an arrival waits before its service starts: the chance it waits at all, and the mean wait."""

    chance: float  # P(wait > 0)
    mean_s: float  # E[wait], over every arrival (those that do not wait count as 0)

    @property
    def saturated(self) -> bool:
        return math.isinf(self.mean_s)

    def quantile_s(self, q: float) -> float:
        """The q-quantile of the wait (module docstring)."""
        if self.saturated:
            return math.inf
        if self.chance <= 1.0 - q or self.mean_s <= 0.0:
            return 0.0
        return self.mean_s / self.chance * math.log(self.chance / (1.0 - q))


_SATURATED = Wait(1.0, math.inf)


def erlang_c(servers: int, offered: float) -> float:
    """Erlang's C: the chance an arrival waits at ``servers`` servers offered ``offered = λ·S`` erlangs of work.

    From Erlang's B by its stable recursion ``B(k) = a·B(k-1) / (k + a·B(k-1))``, then
    ``C = B / (1 - ρ·(1 - B))``; 1 at or past saturation."""
    if offered <= 0.0:
        return 0.0
    if offered >= servers:
        return 1.0
    blocking = 1.0
    for k in range(1, servers + 1):
        blocking = offered * blocking / (k + offered * blocking)
    utilization = offered / servers
    return blocking / (1.0 - utilization * (1.0 - blocking))


def mgc_wait(servers: int, rate_per_s: float, service_s: float, service_scv: float) -> Wait:
    """The wait at ``servers`` identical servers fed at ``rate_per_s`` (Allen–Cunneen)."""
    utilization = rate_per_s * service_s / servers
    if utilization >= 1.0:
        return _SATURATED
    chance = erlang_c(servers, rate_per_s * service_s)
    mean = chance * (1.0 + service_scv) / 2.0 * service_s / (servers * (1.0 - utilization))
    return Wait(chance, mean)


def mg1_wait(rate_per_s: float, service_mean_s: float, service_second_moment_s2: float) -> Wait:
    """The wait at one server fed at ``rate_per_s`` with service times of the given mean and second moment
    (Pollaczek–Khinchine)."""
    utilization = rate_per_s * service_mean_s
    if utilization >= 1.0:
        return _SATURATED
    mean = rate_per_s * service_second_moment_s2 / (2.0 * (1.0 - utilization))
    return Wait(utilization, mean)
