"""Prometheus metrics of the KV offload and the safepoints, through vLLM's KV connector stats.

Who calls it: vLLM. Each worker's ``CoServeConnector.get_kv_connector_stats``
returns ``CoServeKVStats`` (bytes copied, per-step copy time, time at
safepoints); the scheduler
side adds the host pool's counters and occupancy in
``update_connector_output``; vLLM aggregates them and calls
``CoServeKVPromMetrics.observe`` in the API server, which serves them on
``/metrics`` beside vLLM's own:

- ``coserve:kv_offload_bytes_total{direction="offloaded"|"reloaded"}``
- ``coserve:kv_offload_blocks_total{event=...}``: hit, miss, saved, dropped, evicted, aborted, loaded,
  handoff_loaded, handoff_written, handoff_wait (a decoder's step in which a request waited for its
  prefiller's blocks to appear), handoff_missed (a request that stopped waiting and computes them)
- ``coserve:kv_offload_copy_seconds`` (histogram, one observation per step that copied)
- ``coserve:kv_offload_pool_occupancy`` (fraction of the host pool's slots in use)
- ``coserve:safepoint_seconds_total`` and ``coserve:safepoint_steps_total``: time the workers spent
  at layer safepoints (the abort check and, with tensor parallelism, the ranks' agreement) and the
  steps that ran them, both summed over a step's workers; their ratio is the cost per step per
  worker, the overhead safepoints add to every step
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

__all__ = ["CONNECTOR_KEY", "CoServeKVPromMetrics", "CoServeKVStats", "merge_stats", "own_stats"]

_BLOCK_EVENTS = {
    "hits": "hit",
    "misses": "miss",
    "saved": "saved",
    "dropped": "dropped",
    "evicted": "evicted",
    "aborted": "aborted",
    "loaded_blocks": "loaded",
    "handoff_blocks": "handoff_loaded",
    "handoff_files": "handoff_written",
    "handoff_waits": "handoff_wait",
    "handoff_misses": "handoff_missed",
}
_GAUGES = ("pool_occupancy", "pool_blocks", "copy_bandwidth_bytes_per_s")


@dataclass
class CoServeKVStats(KVConnectorStats):
    """Counters sum, gauges keep the latest value, per-step copy times concatenate."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            if key == "step_copy_s":
                self.data["step_copy_s"] = [*self.data.get("step_copy_s", []), *value]
            elif key in _GAUGES:
                self.data[key] = value
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: v for k, v in self.data.items() if k != "step_copy_s"}
        steps = self.data.get("step_copy_s") or []
        if steps:
            out["copy_ms_per_step"] = round(1000 * sum(steps) / len(steps), 3)
        return out

    def is_empty(self) -> bool:
        return not self.data


CONNECTOR_KEY = "CoServeConnector"  # MultiConnector keys its children's stats by class name


def own_stats(stats: KVConnectorStats | None) -> KVConnectorStats | None:
    """coserve's workers' stats in a step's output: the stats themselves when coserve's connector is alone,
    or its entry in a MultiConnector's per-connector stats (GPU pods: coserve's first, NixlConnector next)."""
    if stats is None or isinstance(stats, CoServeKVStats):
        return stats
    inner = stats.data.get(CONNECTOR_KEY) if isinstance(stats.data, dict) else None
    return inner if isinstance(inner, KVConnectorStats) else None


def merge_stats(stats: KVConnectorStats | None, ours: CoServeKVStats, *, nested: bool = False) -> KVConnectorStats:
    """The step's stats with the scheduler side's counters added where vLLM will look for them.

    Alone, coserve's stats are the step's. Inside a MultiConnector (``nested``) they are one entry of
    ``MultiKVConnectorStats``: merging ours into the outer object would put bare numbers where vLLM
    expects each connector's stats, and the engine core dies in ``to_dict`` at the next step. That holds
    when no worker reported stats for the step (``stats`` None) too: the API server reads whatever comes
    as the MultiConnector's per-connector stats.
    """
    if stats is None:
        if nested:
            from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorStats

            return MultiKVConnectorStats(data={CONNECTOR_KEY: ours})
        return ours
    if isinstance(stats, CoServeKVStats):
        return stats.aggregate(ours)
    inner = own_stats(stats)
    stats.data[CONNECTOR_KEY] = inner.aggregate(ours) if inner is not None else ours
    return stats


class CoServeKVPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM's metric classes (its own subclasses in multi-process mode), typed loosely on purpose.
        gauge: Any = self._gauge_cls
        counter: Any = self._counter_cls
        histogram: Any = self._histogram_cls
        self._bytes = counter(
            name="coserve:kv_offload_bytes",
            documentation="KV bytes copied between vLLM's KV cache and the host pool or handoff directory.",
            labelnames=[*labelnames, "direction"],
        )
        self._blocks = counter(
            name="coserve:kv_offload_blocks",
            documentation="KV blocks by what happened to them in the host pool and the handoff.",
            labelnames=[*labelnames, "event"],
        )
        self._copy = histogram(
            name="coserve:kv_offload_copy_seconds",
            documentation="Time spent copying KV per step that copied (overlapped with the forward).",
            labelnames=labelnames,
            buckets=[0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0],
        )
        self._occupancy = gauge(
            name="coserve:kv_offload_pool_occupancy",
            documentation="Fraction of the host KV pool's slots in use.",
            labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )

        self._safepoint_s = counter(
            name="coserve:safepoint_seconds",
            documentation="Time workers spent at layer safepoints (check and TP agreement), summed over workers.",
            labelnames=labelnames,
        )
        self._safepoint_steps = counter(
            name="coserve:safepoint_steps",
            documentation="Steps run with layer safepoints, counted once per worker.",
            labelnames=labelnames,
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        for key, direction in (("bytes_offloaded", "offloaded"), ("bytes_reloaded", "reloaded")):
            if transfer_stats_data.get(key):
                self._bytes.labels(*labels, direction).inc(transfer_stats_data[key])
        for key, event in _BLOCK_EVENTS.items():
            if transfer_stats_data.get(key):
                self._blocks.labels(*labels, event).inc(transfer_stats_data[key])
        for seconds in transfer_stats_data.get("step_copy_s") or []:
            self._copy.labels(*labels).observe(seconds)
        if "pool_occupancy" in transfer_stats_data:
            self._occupancy.labels(*labels).set(transfer_stats_data["pool_occupancy"])
        if transfer_stats_data.get("safepoint_steps"):
            self._safepoint_s.labels(*labels).inc(transfer_stats_data.get("safepoint_s", 0.0))
            self._safepoint_steps.labels(*labels).inc(transfer_stats_data["safepoint_steps"])
