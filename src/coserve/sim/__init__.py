"""``coserve simulate``: a pool on a simulated clock that runs coserve's own policies.

``coserve.sim.engine`` is one engine (SlideBatching decides each step, the step
cost model times it); ``coserve.sim.pool`` wires prefillers, decoders, the KV
link and the router's placement, pinning and polling.
"""

from coserve.sim.engine import SimEngine, SimRequest
from coserve.sim.pool import (
    PLACEMENTS,
    ROUTINGS,
    Observation,
    OfflineWork,
    PoolSim,
    Scaler,
    SimConfig,
    SimResult,
)
from coserve.sim.scaling import coserve_scaler

__all__ = [
    "PLACEMENTS",
    "ROUTINGS",
    "Observation",
    "OfflineWork",
    "PoolSim",
    "Scaler",
    "SimConfig",
    "SimEngine",
    "SimRequest",
    "SimResult",
    "coserve_scaler",
]
