"""The autoscaler in the simulated pool: ``coserve.autoscaling.decide``, called as the operator calls it.

Who calls it: ``coserve simulate --autoscale`` and the ``autoscaling`` benchmark
pass ``coserve_scaler(spec)`` to ``PoolSim`` as its ``scaler``; the pool calls it
every ``scale_interval_s`` with what Prometheus would show. The decision's
history and the guard's memory are kept between calls, as the operator keeps
them in the pool's status; a measured workload the model rejects holds the
replicas where they are (the operator reports it and holds).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from coserve.api.problems import InvalidInput
from coserve.autoscaling.policy import Decision, Replicas, Thresholds, decide

if TYPE_CHECKING:
    from coserve.api.profile import EngineProfile
    from coserve.api.spec import SpecModel
    from coserve.sim.pool import Observation, Scaler

__all__ = ["coserve_scaler"]


def coserve_scaler(
    spec: SpecModel,
    thresholds: Thresholds | None = None,
    profile: EngineProfile | None = None,
    decisions: list[tuple[float, Decision]] | None = None,
) -> Scaler:
    """A ``Scaler`` around ``decide``; each decision is appended to ``decisions`` when given (for reports)."""
    state: dict[str, Any] = {"history": (), "kv_high": 0, "queue": None, "arrival": None}

    def scaler(now_s: float, current: Replicas, seen: Observation) -> Replicas:
        try:
            decision = decide(
                spec,
                seen.signals(),
                current,
                now_s,
                profile=profile,
                thresholds=thresholds,
                history=state["history"],
                kv_high_evaluations=state["kv_high"],
                last_prefiller_queue=state["queue"],
                last_arrival=state["arrival"],
            )
        except InvalidInput:
            return current
        state.update(
            history=decision.history,
            kv_high=decision.kv_high_evaluations,
            queue=decision.prefiller_queue,
            arrival=decision.arrival,
        )
        if decisions is not None:
            decisions.append((now_s, decision))
        return decision.replicas

    return scaler
