"""The operator's Prometheus metrics (served on ``coserve operator --metrics-port``).

Who updates them: ``coserve.operator.handlers`` after every reconcile, ``coserve.operator.autoscaler``
after every evaluation.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

__all__ = ["AUTOSCALER_EVALUATIONS", "CHILD_CHANGES", "POOLS", "RECONCILES", "RECONCILE_SECONDS"]

RECONCILES = Counter(
    "coserve_operator_reconciles_total",
    "Reconciles of CoServePools by result: ok, invalid (PlanValid=False) or error (the API server refused).",
    ["result"],
)
RECONCILE_SECONDS = Histogram(
    "coserve_operator_reconcile_duration_seconds",
    "Wall time of one reconcile: reads, decision, writes.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
CHILD_CHANGES = Counter(
    "coserve_operator_child_changes_total", "Children created or patched, by verb and kind.", ["verb", "kind"]
)
POOLS = Gauge("coserve_operator_pools", "CoServePools the operator currently knows.")
AUTOSCALER_EVALUATIONS = Counter(
    "coserve_operator_autoscaler_evaluations_total",
    "Autoscaler evaluations by outcome: Evaluated, Scaled, or why replicas were held (PrometheusUnreachable, "
    "QueryFailed, NoData, ProfileUnavailable, WorkloadNotPlannable).",
    ["outcome"],
)
