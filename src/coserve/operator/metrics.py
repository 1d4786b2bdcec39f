"""The operator's Prometheus metrics (served on ``coserve operator --metrics-port``).

Who updates them: ``coserve.operator.reconciler`` after every reconcile (the per-pool series with
``observe_pool``, removed with ``forget_pool`` when a pool goes), ``coserve.operator.handlers`` on
every pool watch event and resync (``POOLS``, and ``keep_pools`` for pools gone unseen),
``coserve.operator.autoscaler`` after every evaluation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeGuard

from prometheus_client import Counter, Gauge, Histogram

from coserve.operator.resources import child_name

__all__ = [
    "AUTOSCALER_EVALUATIONS",
    "CHILD_CHANGES",
    "PLAN_INFO",
    "PLAN_REPLICAS",
    "POOLS",
    "READY_REPLICAS",
    "RECONCILES",
    "RECONCILE_SECONDS",
    "WORKLOAD",
    "forget_pool",
    "keep_pools",
    "observe_pool",
]

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

# Per-pool series. The pool's namespace is the label `pool_namespace`, not `namespace`: Prometheus
# gives every scraped target a `namespace` label of its own (the ServiceMonitor's target is the
# operator's Service, so it names the operator's namespace), and a metric label of the same name is
# renamed `exported_namespace` unless the scrape honours the target's labels. `honorLabels: true`
# would fix that only where the Prometheus lets it (prometheus-operator's `overrideHonorLabels`, used
# by multi-tenant installs, turns it off everywhere), and it would make `namespace` mean the pool's
# namespace on these series but the operator's on the others. A label of its own name reaches the
# dashboard intact whatever the scrape configuration; the dashboard matches it to `$namespace`.
_POOL = ["pool_namespace", "pool"]
PLAN_REPLICAS = Gauge(
    "coserve_operator_plan_replicas",
    "Replicas the operator wants per role (prefiller, decoder, router): the plan's count; for prefillers "
    "and decoders of a pool with spec.autoscaling.enabled, the autoscaler's (the Deployment's spec.replicas). "
    "While the spec is invalid, what the last valid plan set (nothing is changed until it is fixed).",
    [*_POOL, "role"],
)
READY_REPLICAS = Gauge(
    "coserve_operator_ready_replicas",
    "Ready replicas per role, from the role's Deployment's status.readyReplicas (0 while it is missing).",
    [*_POOL, "role"],
)
PLAN_INFO = Gauge(
    "coserve_operator_plan_info",
    "1 for the plan in effect: bindingConstraint (the decoder constraint that set decoders) and bottleneck "
    "(the resource that saturates first as load rises), as in the pool's status.plan.",
    [*_POOL, "binding_constraint", "bottleneck"],
)
WORKLOAD = Gauge(
    "coserve_operator_workload",
    "The workload spec.workload sizes the pool for, by symbol: R (arrivalRatePerS, conversations/s), "
    "L_in (inputTokens), L_d (outputTokens), W (lifetimeS, seconds).",
    [*_POOL, "symbol"],
)

# role label (the PodMonitor's `role` on the pods' own series) -> the key in status.replicas
ROLES = {"prefiller": "prefillers", "decoder": "decoders", "router": "routers"}
# symbol -> the key in spec.workload
WORKLOAD_FIELDS = {"R": "arrivalRatePerS", "L_in": "inputTokens", "L_d": "outputTokens", "W": "lifetimeS"}

_plan_labels: dict[tuple[str, str], tuple[str, str]] = {}  # the plan_info label values each pool has now
_observed: set[tuple[str, str]] = set()  # pools with series


def observe_pool(
    namespace: str,
    name: str,
    body: Mapping[str, Any],
    status: Mapping[str, Any],
    observed: Mapping[tuple[str, str], Mapping[str, Any] | None],
) -> None:
    """Set a pool's series after a reconcile: ``body`` is the pool, ``status`` the status the reconcile
    decided, ``observed`` its children by (kind, name) as the reconcile read them."""
    pool = (namespace, name)
    _observed.add(pool)
    replicas = status.get("replicas") or {}
    for role, key in ROLES.items():
        desired = (replicas.get(key) or {}).get("desired")
        if _is_number(desired):
            PLAN_REPLICAS.labels(namespace, name, role).set(desired)
        else:
            PLAN_REPLICAS.remove(namespace, name, role)
        deployment = observed.get(("Deployment", child_name(name, role))) or {}
        ready = (deployment.get("status") or {}).get("readyReplicas", 0)
        READY_REPLICAS.labels(namespace, name, role).set(ready if _is_number(ready) else 0)

    plan = status.get("plan") or {}
    labels = (str(plan.get("bindingConstraint", "")), str(plan.get("bottleneck", "")))
    previous = _plan_labels.get(pool)
    if previous is not None and previous != labels:
        PLAN_INFO.remove(namespace, name, *previous)
    if all(labels):
        PLAN_INFO.labels(namespace, name, *labels).set(1)
        _plan_labels[pool] = labels
    else:
        _plan_labels.pop(pool, None)

    workload = (body.get("spec") or {}).get("workload") or {}
    for symbol, key in WORKLOAD_FIELDS.items():
        value = workload.get(key) if isinstance(workload, Mapping) else None
        if _is_number(value):
            WORKLOAD.labels(namespace, name, symbol).set(value)
        else:
            WORKLOAD.remove(namespace, name, symbol)


def forget_pool(namespace: str, name: str) -> None:
    """Remove a pool's series: it is deleted (or being deleted)."""
    pool = (namespace, name)
    _observed.discard(pool)
    for role in ROLES:
        PLAN_REPLICAS.remove(namespace, name, role)
        READY_REPLICAS.remove(namespace, name, role)
    labels = _plan_labels.pop(pool, None)
    if labels is not None:
        PLAN_INFO.remove(namespace, name, *labels)
    for symbol in WORKLOAD_FIELDS:
        WORKLOAD.remove(namespace, name, symbol)


def keep_pools(known: Iterable[tuple[str, str]]) -> None:
    """Remove the series of every pool not in ``known`` (namespace, name): deleted, with or without a watch
    event saying so."""
    for namespace, name in _observed - set(known):
        forget_pool(namespace, name)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)
