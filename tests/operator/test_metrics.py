"""The operator's per-pool series: set from what a reconcile decided and read, removed when the pool goes."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

import kmock as kmocklib
import pytest
from prometheus_client import REGISTRY

from coserve.operator.handlers import PoolReconciler
from coserve.operator.kube import KubeClient, config_for
from coserve.operator.metrics import forget_pool, keep_pools, observe_pool
from coserve.operator.reconcile import ChildKey, reconcile
from operator_kmock import NS, POOL, declare_resources
from pool_builders import sample_pool

NOW = datetime(2025, 1, 1, tzinfo=UTC)
ROLES = ("prefiller", "decoder", "router")


def value(metric: str, namespace: str, pool: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(metric, {"pool_namespace": namespace, "pool": pool, **labels})


def series(namespace: str, pool: str) -> list[tuple[str, dict[str, str], float]]:
    """Every operator sample that names this pool."""
    return [
        (sample.name, sample.labels, sample.value)
        for family in REGISTRY.collect()
        if family.name.startswith("coserve_operator_")
        for sample in family.samples
        if sample.labels.get("pool_namespace") == namespace and sample.labels.get("pool") == pool
    ]


def children(body: dict[str, Any], **ready: int) -> dict[ChildKey, dict[str, Any]]:
    """The pool's children as the first reconcile creates them, with ``ready`` replicas per role."""
    observed: dict[ChildKey, dict[str, Any]] = {}
    for action in reconcile(body, {}, NOW).actions:
        child = copy.deepcopy(action.body)
        role = action.name.removeprefix(body["metadata"]["name"] + "-")
        if child["kind"] == "Deployment" and role in ready:
            child["status"] = {"readyReplicas": ready[role]}
        observed[(action.kind, action.name)] = child
    return observed


def test_a_reconcile_sets_plan_ready_plan_info_and_the_spec_workload() -> None:
    body = sample_pool(namespace="metrics-a", uid="uid-a")
    observed = children(body, decoder=2, router=1)
    result = reconcile(body, observed, NOW)
    observe_pool("metrics-a", "chat", body, result.status, observed)
    try:
        plan = result.status["plan"]
        assert value("coserve_operator_plan_replicas", "metrics-a", "chat", role="prefiller") == plan["prefillers"]
        assert value("coserve_operator_plan_replicas", "metrics-a", "chat", role="decoder") == plan["decoders"]
        assert (
            value("coserve_operator_plan_replicas", "metrics-a", "chat", role="router")
            == (result.status["replicas"]["routers"]["desired"])
        )
        ready = {role: value("coserve_operator_ready_replicas", "metrics-a", "chat", role=role) for role in ROLES}
        assert ready == {"prefiller": 0, "decoder": 2, "router": 1}
        info = {"binding_constraint": plan["bindingConstraint"], "bottleneck": plan["bottleneck"]}
        assert value("coserve_operator_plan_info", "metrics-a", "chat", **info) == 1
        workload = {
            s: value("coserve_operator_workload", "metrics-a", "chat", symbol=s) for s in ("R", "L_in", "L_d", "W")
        }
        assert workload == {"R": 2.0, "L_in": 2000, "L_d": 500, "W": 60.0}

        # the plan changes what binds: the old label set goes, one plan_info series stays
        changed = copy.deepcopy(result.status)
        other = "DecoderMemory" if plan["bindingConstraint"] != "DecoderMemory" else "DecoderThroughput"
        changed["plan"]["bindingConstraint"] = other
        observe_pool("metrics-a", "chat", body, changed, observed)
        infos = [labels for name, labels, _ in series("metrics-a", "chat") if name == "coserve_operator_plan_info"]
        assert [(i["binding_constraint"], i["bottleneck"]) for i in infos] == [(other, plan["bottleneck"])]

        # a spec the operator cannot read: no plan in the status yet, no number in the workload
        broken = copy.deepcopy(body)
        broken["spec"]["workload"]["arrivalRatePerS"] = "fast"
        observe_pool("metrics-a", "chat", broken, {}, {})
        names = {(name, labels.get("role") or labels.get("symbol")) for name, labels, _ in series("metrics-a", "chat")}
        assert not any(name in {"coserve_operator_plan_info", "coserve_operator_plan_replicas"} for name, _ in names)
        assert ("coserve_operator_workload", "R") not in names and ("coserve_operator_workload", "W") in names
        assert value("coserve_operator_ready_replicas", "metrics-a", "chat", role="decoder") == 0  # none observed
    finally:
        forget_pool("metrics-a", "chat")
    assert series("metrics-a", "chat") == []


def test_with_autoscaling_the_wanted_replicas_are_the_autoscalers() -> None:
    body = sample_pool(namespace="metrics-b", uid="uid-b")
    body["spec"]["autoscaling"] = {"enabled": True, "prometheusUrl": "http://prometheus:9090"}
    observed = children(body)
    observed[("Deployment", "chat-decoder")]["spec"]["replicas"] = 7  # the autoscaler's choice
    result = reconcile(body, observed, NOW)
    observe_pool("metrics-b", "chat", body, result.status, observed)
    try:
        assert value("coserve_operator_plan_replicas", "metrics-b", "chat", role="decoder") == 7
    finally:
        forget_pool("metrics-b", "chat")


def test_pools_no_longer_known_lose_their_series() -> None:
    kept, gone = sample_pool(namespace="metrics-c", uid="uid-c"), sample_pool(namespace="metrics-d", uid="uid-d")
    for body in (kept, gone):
        observed = children(body)
        observe_pool(body["metadata"]["namespace"], "chat", body, reconcile(body, observed, NOW).status, observed)
    keep_pools([("metrics-c", "chat"), ("elsewhere", "other")])
    try:
        assert series("metrics-d", "chat") == []
        assert len(series("metrics-c", "chat")) == 3 + 3 + 1 + 4  # plan, ready per role; plan_info; R, L_in, L_d, W
    finally:
        forget_pool("metrics-c", "chat")


@pytest.mark.asyncio
async def test_the_reconciler_sets_the_series_and_clears_them_when_the_pool_is_deleted(
    kmock: kmocklib.KubernetesEmulator,
) -> None:
    declare_resources(kmock)
    async with KubeClient(config_for(str(kmock.url).rstrip("/"))) as kube:
        await kube.create("CoServePool", NS, copy.deepcopy(POOL))
        reconciler = PoolReconciler(kube)
        result = await reconciler.reconcile(NS, "chat")
        assert result is not None
        try:
            assert (
                value("coserve_operator_plan_replicas", NS, "chat", role="decoder") == result.status["plan"]["decoders"]
            )
            assert value("coserve_operator_ready_replicas", NS, "chat", role="decoder") == 0

            # the Deployment's controller reports ready replicas: the next reconcile reads them
            decoder = copy.deepcopy(dict(reconciler.cache.get("Deployment", NS, "chat-decoder") or {}))
            decoder["status"] = {"readyReplicas": 1}
            reconciler.cache.put("Deployment", decoder)
            await reconciler.reconcile(NS, "chat")
            assert value("coserve_operator_ready_replicas", NS, "chat", role="decoder") == 1

            # the pool is being deleted: its series go
            pool = copy.deepcopy(dict(reconciler.cache.get("CoServePool", NS, "chat") or {}))
            pool["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z"
            reconciler.cache.put("CoServePool", pool)
            assert await reconciler.reconcile(NS, "chat") is None
            assert series(NS, "chat") == []
        finally:
            forget_pool(NS, "chat")
