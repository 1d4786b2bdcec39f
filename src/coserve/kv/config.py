"""The KV offload and handoff settings of one engine, from ``kv_connector_extra_config``.

Who calls it: ``coserve.engine.connector.CoServeConnector`` when vLLM builds
it (in the scheduler and in every worker), so a bad setting stops the engine
at start-up with a message naming it. The operator renders these keys
(``coserve.operator.resources.kv_transfer_config``); ``coserve.engine.launch``
renders them for local engines.

    {"kv_offload_backend": "host",          # host: this connector; "none": off
     "host_memory_bytes": 8589934592,       # hard bound of the host pool; 0: off
     "copy_budget_fraction": 0.1,           # of a step's predicted time spent copying KV out
     "copy_bandwidth_bytes_per_s": 2e9,     # the budget's estimate until the engine has timed its own copies
     "class_shares": {"offline": 0.5},      # most of the pool a class may hold (default 1.0)
     "handoff_backend": "shm",              # none | shm (one machine, CPU or GPU)
     "handoff_path": "/dev/shm/coserve-kv", # shm: the directory prefillers and decoders share
     "handoff_max_bytes": 1073741824,       # shm: its bound; the oldest blocks go first
     "handoff_wait_s": 2.0}                 # shm: how long a decoder waits for a prefiller's blocks to appear
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["HANDOFF_BACKENDS", "OFFLOAD_BACKENDS", "KVSettings", "parse_kv_settings"]

OFFLOAD_BACKENDS = ("host", "none")
HANDOFF_BACKENDS = ("none", "shm")
_KNOWN = {
    "kv_offload_backend",
    "host_memory_bytes",
    "copy_budget_fraction",
    "copy_bandwidth_bytes_per_s",
    "class_shares",
    "handoff_backend",
    "handoff_path",
    "handoff_max_bytes",
    "handoff_wait_s",
}
# Keys the connector shares with others in the same extra config (not KV offload settings).
_OTHERS = {"safepoints", "safepoint_runahead", "safepoint_min_step_s", "coserve_config"}
_PREFIX = "kv_connector_extra_config"


@dataclass(frozen=True)
class KVSettings:
    """Validated settings; ``offload`` / ``handoff`` say whether each part is on."""

    host_memory_bytes: int = 0
    copy_budget_fraction: float = 0.1
    copy_bandwidth_bytes_per_s: float = 2e9
    class_shares: Mapping[str, float] = field(default_factory=dict)
    handoff_backend: str = "none"
    handoff_path: str = "/dev/shm/coserve-kv"  # noqa: S108 - shared memory on purpose; one directory per pool
    handoff_max_bytes: int = 1 << 30
    # the prefiller answers as its last prefill step ends and its worker writes the blocks just after; a
    # decoder that finds one missing waits this long (vLLM asks again every step) before computing the rest
    handoff_wait_s: float = 2.0

    @property
    def offload(self) -> bool:
        return self.host_memory_bytes > 0

    @property
    def handoff(self) -> bool:
        return self.handoff_backend != "none"


def parse_kv_settings(extra: Mapping[str, Any]) -> KVSettings:
    """Validate ``extra``; ``ValueError`` naming the first bad setting (``kv_connector_extra_config.<key>``)."""
    unknown = sorted(set(extra) - _KNOWN - _OTHERS)
    if unknown:
        raise ValueError(f"{_PREFIX}.{unknown[0]}: unknown setting (known: {', '.join(sorted(_KNOWN | _OTHERS))})")
    backend = extra.get("kv_offload_backend", "host")
    if backend not in OFFLOAD_BACKENDS:
        raise ValueError(
            f"{_PREFIX}.kv_offload_backend: unknown backend {backend!r} for coserve's connector "
            f"(expected one of {', '.join(OFFLOAD_BACKENDS)}; lmcache and native are separate vLLM connectors)"
        )
    host_bytes = _integer(extra, "host_memory_bytes", 0)
    handoff = extra.get("handoff_backend", "none")
    if handoff not in HANDOFF_BACKENDS:
        raise ValueError(
            f"{_PREFIX}.handoff_backend: unknown backend {handoff!r} (expected one of {', '.join(HANDOFF_BACKENDS)}; "
            "on GPUs the operator renders vLLM's NixlConnector instead)"
        )
    path = extra.get("handoff_path", KVSettings.handoff_path)
    if not isinstance(path, str) or not path.startswith("/"):
        raise ValueError(f"{_PREFIX}.handoff_path: must be an absolute directory path, got {path!r}")
    shares = extra.get("class_shares", {})
    if not isinstance(shares, Mapping):
        raise ValueError(f"{_PREFIX}.class_shares: must map class names to fractions, got {shares!r}")
    for name, share in shares.items():
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise ValueError(f"{_PREFIX}.class_shares.{name}: must be a fraction in [0, 1], got {share!r}")
    fraction = _number(extra, "copy_budget_fraction", KVSettings.copy_budget_fraction)
    if not 0 < fraction <= 1:
        raise ValueError(f"{_PREFIX}.copy_budget_fraction: must be in (0, 1], got {fraction}")
    bandwidth = _number(extra, "copy_bandwidth_bytes_per_s", KVSettings.copy_bandwidth_bytes_per_s)
    if bandwidth <= 0:
        raise ValueError(f"{_PREFIX}.copy_bandwidth_bytes_per_s: must be positive, got {bandwidth}")
    wait = _number(extra, "handoff_wait_s", KVSettings.handoff_wait_s)
    if wait < 0:
        raise ValueError(f"{_PREFIX}.handoff_wait_s: must be >= 0 seconds, got {wait}")
    return KVSettings(
        host_memory_bytes=host_bytes if backend == "host" else 0,
        copy_budget_fraction=fraction,
        copy_bandwidth_bytes_per_s=bandwidth,
        class_shares={str(k): float(v) for k, v in shares.items()},
        handoff_backend=str(handoff),
        handoff_path=path,
        handoff_max_bytes=_integer(extra, "handoff_max_bytes", KVSettings.handoff_max_bytes),
        handoff_wait_s=wait,
    )


def _number(extra: Mapping[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{_PREFIX}.{key}: must be a number, got {value!r}")
    return float(value)


def _integer(extra: Mapping[str, Any], key: str, default: int) -> int:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{_PREFIX}.{key}: must be a whole number of bytes, got {value!r}")
    if value < 0:
        raise ValueError(f"{_PREFIX}.{key}: must not be negative, got {value}")
    return value
