"""The real kopf operator (coserve.operator.handlers) against kmock's Kubernetes emulator, over HTTP.

No kube-apiserver can run on these machines, so kmock stands in for it (a test
double, by necessity). What it does not emulate is covered by ``e2e/`` against
a real cluster: schema validation, a separate status subresource, garbage
collection of children when the pool is deleted, resourceVersion. The emulator
never bumps resourceVersion, so kopf may run a handler twice for one change;
the handlers are idempotent, which these tests also exercise.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import kmock as kmocklib
import pytest

kopf = pytest.importorskip("kopf")

from coserve.operator.handlers import PoolReconciler, build_registry  # noqa: E402 - after the importorskip
from coserve.operator.kube import ClusterAccess, KubeClient  # noqa: E402
from pool_builders import sample_pool  # noqa: E402

pytestmark = pytest.mark.asyncio

NS = "serving"
POOLS = "coserve.dev/v1alpha1/coservepools"
POOLS_URL = f"/apis/coserve.dev/v1alpha1/namespaces/{NS}/coservepools"
ALL_VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}
MERGE = {"Content-Type": "application/merge-patch+json"}
CHILDREN = [
    ("v1/configmaps", "chat-config"),
    ("apps/v1/deployments", "chat-prefiller"),
    ("apps/v1/deployments", "chat-decoder"),
    ("apps/v1/deployments", "chat-router"),
    ("v1/services", "chat-router"),
    ("v1/services", "chat-prefiller"),
    ("v1/services", "chat-decoder"),
]
# the emulator assigns no uid, generation or resourceVersion: the test gives them
POOL: dict[str, Any] = sample_pool(namespace=NS, uid="uid-chat", generation=1, resourceVersion="1")


def declare_resources(kmock: kmocklib.KubernetesEmulator) -> None:
    """Discovery for every resource kopf touches (kmock serves only what is declared, verbs included)."""

    def declare(key: str, kind: str, namespaced: bool = True, subresources: frozenset[str] = frozenset()) -> None:
        kmock.resources[key] = kmocklib.ResourceInfo(
            kind=kind, singular=kind.lower(), namespaced=namespaced, verbs=ALL_VERBS, subresources=set(subresources)
        )

    declare(POOLS, "CoServePool", subresources=frozenset({"status"}))
    declare("apps/v1/deployments", "Deployment", subresources=frozenset({"status", "scale"}))
    declare("v1/services", "Service", subresources=frozenset({"status"}))
    declare("v1/configmaps", "ConfigMap")
    declare("v1/events", "Event")
    declare("v1/namespaces", "Namespace", namespaced=False)
    declare("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition", namespaced=False)


async def eventually(predicate: Callable[[], Any], what: str, timeout_s: float = 15.0) -> Any:
    """Poll the emulator's state until ``predicate`` holds (KeyError: the object is not there yet)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            result = predicate()
            if result:
                return result
        except (KeyError, ValueError):
            pass
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.05)


def exists(kmock: kmocklib.KubernetesEmulator, resource: str, name: str) -> bool:
    try:
        return not kmock.objects[resource, NS, name].deleted
    except KeyError:
        return False


def events(kmock: kmocklib.KubernetesEmulator, reason: str) -> list[dict[str, Any]]:
    """Events the operator posted on the pool with ``reason``."""
    return [
        dict(request.data)
        for request in kmock
        if str(request.method).upper().endswith("POST")
        and request.resource is not None
        and request.resource.plural == "events"
        and isinstance(request.data, dict)
        and request.data.get("reason") == reason
    ]


def condition(kmock: kmocklib.KubernetesEmulator, kind: str) -> dict[str, Any]:
    status = kmock.objects[POOLS, NS, "chat"]["status"]
    return next(c for c in status["conditions"] if c["type"] == kind)


@contextlib.asynccontextmanager
async def running_operator(kmock: kmocklib.KubernetesEmulator) -> AsyncIterator[httpx.AsyncClient]:
    """The coserve operator running against the emulator; yields an HTTP client to the same server.

    NOTE: a context manager inside the test, not a fixture: when it stops, kopf cancels every task created
    after it started, which would include pytest-asyncio's fixture-teardown task.
    """
    declare_resources(kmock)
    server = str(kmock.url).rstrip("/")
    # scanning=False, as `coserve operator -n NS` runs: no namespace or CRD listing (kmock cannot answer the
    # namespace list either).
    registry = build_registry(
        lambda: ClusterAccess(server=server, verify=False), scanning=False, namespaces=[NS], resync_s=1.0
    )
    settings = kopf.OperatorSettings()
    settings.watching.reconnect_backoff = 0.1
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(
        kopf.operator(
            registry=registry, settings=settings, standalone=True, namespaces=[NS], stop_flag=stop, ready_flag=ready
        )
    )
    try:
        await asyncio.wait_for(ready.wait(), 15)
        watched = {"coservepools", "deployments", "services", "configmaps"}
        await eventually(
            lambda: {r.resource.plural for r in kmock if r.params.get("watch") == "true"} >= watched,
            "kopf's watch requests",
        )
        await asyncio.sleep(0.3)  # the emulator subscribes a watch to changes just after its replay
        async with httpx.AsyncClient(base_url=server, timeout=10) as client:
            yield client
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def create_pool(client: httpx.AsyncClient, body: dict[str, Any] | None = None) -> None:
    response = await client.post(POOLS_URL, json=copy.deepcopy(body or POOL))
    assert response.status_code in (200, 201), response.text


async def test_a_new_pool_gets_its_children_and_an_honest_status(kmock: kmocklib.KubernetesEmulator) -> None:
    async with running_operator(kmock) as operator:
        await create_pool(operator)
        await eventually(lambda: all(exists(kmock, r, n) for r, n in CHILDREN), "all seven children")
        for resource, name in CHILDREN:
            child = kmock.objects[resource, NS, name]
            (owner,) = child["metadata"]["ownerReferences"]
            assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
                "CoServePool",
                "chat",
                "uid-chat",
                True,
            )
            assert child["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "coserve-operator"
        await eventually(lambda: kmock.objects[POOLS, NS, "chat"]["status"].get("plan"), "the plan in the status")
        status = kmock.objects[POOLS, NS, "chat"]["status"]
        decoders = kmock.objects["apps/v1/deployments", NS, "chat-decoder"]["spec"]["replicas"]
        assert status["plan"]["decoders"] == decoders
        assert status["observedGeneration"] == 1
        assert condition(kmock, "PlanValid")["status"] == "True"
        # the emulator runs no Deployment controller: nothing becomes ready, and the status says so
        assert condition(kmock, "Ready")["status"] == "False"
        assert status["decoders"] == f"{decoders}/0"
        # no finalizer: deleting a pool never waits for the operator
        assert not kmock.objects[POOLS, NS, "chat"]["metadata"].get("finalizers")
        # children are read from the watch-fed cache, never one by one from the API server
        assert not [
            request
            for request in kmock
            if str(request.method).upper().endswith("GET")
            and request.name is not None
            and request.resource is not None
            and request.resource.plural in ("deployments", "services", "configmaps")
        ]


async def test_a_spec_change_patches_the_children_in_place(kmock: kmocklib.KubernetesEmulator) -> None:
    async with running_operator(kmock) as operator:
        await create_pool(operator)
        await eventually(lambda: exists(kmock, "apps/v1/deployments", "chat-decoder"), "the decoder Deployment")
        before = kmock.objects["apps/v1/deployments", NS, "chat-decoder"]["spec"]["replicas"]
        response = await operator.patch(
            f"{POOLS_URL}/chat",
            headers=MERGE,
            json={"metadata": {"generation": 2}, "spec": {"workload": {"arrivalRatePerS": 8.0}}},
        )
        assert response.status_code == 200, response.text
        await eventually(
            lambda: kmock.objects["apps/v1/deployments", NS, "chat-decoder"]["spec"]["replicas"] > before,
            "more decoders",
        )
        await eventually(lambda: kmock.objects[POOLS, NS, "chat"]["status"]["observedGeneration"] == 2, "generation 2")
        decoder = kmock.objects["apps/v1/deployments", NS, "chat-decoder"]
        # patched in place: nothing was deleted and created again
        assert not [request for request in kmock if str(request.method).upper().endswith("DELETE")]
        assert kmock.objects[POOLS, NS, "chat"]["status"]["plan"]["decoders"] == decoder["spec"]["replicas"]


async def test_a_child_deleted_or_edited_by_hand_is_put_back(kmock: kmocklib.KubernetesEmulator) -> None:
    async with running_operator(kmock) as operator:
        await create_pool(operator)
        await eventually(lambda: all(exists(kmock, r, n) for r, n in CHILDREN), "all seven children")
        await asyncio.sleep(1.0)  # let kopf drain the events of the pool's own creation

        response = await operator.delete(f"/api/v1/namespaces/{NS}/services/chat-router")
        assert response.status_code == 200
        await eventually(lambda: exists(kmock, "v1/services", "chat-router"), "the router Service recreated")

        response = await operator.patch(
            f"/apis/apps/v1/namespaces/{NS}/deployments/chat-router", headers=MERGE, json={"spec": {"replicas": 7}}
        )
        assert response.status_code == 200
        await eventually(
            lambda: kmock.objects["apps/v1/deployments", NS, "chat-router"]["spec"]["replicas"] == 2,
            "the router's replica count put back (spec.router.replicas defaults to 2)",
        )


async def test_a_semantically_invalid_pool_creates_nothing_and_says_why(kmock: kmocklib.KubernetesEmulator) -> None:
    async with running_operator(kmock) as operator:
        body = copy.deepcopy(POOL)
        body["spec"]["autoscaling"] = {
            "enabled": True,
            "prometheusUrl": "http://prometheus:9090",
            "decoders": {"minReplicas": 5, "maxReplicas": 2},
        }
        await create_pool(operator, body)
        await eventually(lambda: condition(kmock, "PlanValid")["status"] == "False", "PlanValid=False")
        plan_valid = condition(kmock, "PlanValid")
        assert plan_valid["reason"] == "InvalidSpec"
        assert "spec.autoscaling.decoders.minReplicas" in plan_valid["message"]
        warning = await eventually(lambda: events(kmock, "InvalidSpec"), "a Warning event")
        assert warning[0]["type"] == "Warning" and warning[0]["involvedObject"]["name"] == "chat"
        assert "spec.autoscaling.decoders.minReplicas" in warning[0]["message"]
        await asyncio.sleep(1.5)  # a resync later, still nothing
        assert not any(exists(kmock, r, n) for r, n in CHILDREN)


async def test_deleting_a_pool_lets_go_cleanly(kmock: kmocklib.KubernetesEmulator) -> None:
    async with running_operator(kmock) as operator:
        await create_pool(operator)
        await eventually(lambda: all(exists(kmock, r, n) for r, n in CHILDREN), "all seven children")
        response = await operator.delete(f"{POOLS_URL}/chat")
        assert response.status_code == 200
        await eventually(lambda: kmock.objects[POOLS, NS, "chat"].deleted, "the pool gone (no finalizer holds it)")
        # The emulator has no garbage collector (e2e/ checks that one); the operator must not recreate the pool's
        # children for a pool that is gone, nor fail: delete one and watch nothing come back over a resync.
        await operator.delete(f"/api/v1/namespaces/{NS}/services/chat-router")
        await asyncio.sleep(1.5)
        assert not exists(kmock, "v1/services", "chat-router")


async def test_concurrent_triggers_share_a_reconcile_that_started_after_them(
    kmock: kmocklib.KubernetesEmulator,
) -> None:
    """Ten triggers at once (a burst of child events): two reconciles, and each caller gets a later one's outcome."""
    declare_resources(kmock)
    server = str(kmock.url).rstrip("/")
    async with KubeClient(ClusterAccess(server=server, verify=False)) as kube:
        await kube.create("CoServePool", NS, copy.deepcopy(POOL))
        reconciler = PoolReconciler(kube)
        runs = 0
        decide = reconciler._reconcile

        async def counted(namespace: str, name: str) -> Any:
            nonlocal runs
            runs += 1
            if runs == 2:
                raise RuntimeError("the second reconcile fails")
            return await decide(namespace, name)

        reconciler._reconcile = counted  # type: ignore[method-assign]
        outcomes = await asyncio.gather(*(reconciler.reconcile(NS, "chat") for _ in range(10)), return_exceptions=True)
        assert runs == 2
        first, *rest = outcomes
        assert not isinstance(first, BaseException) and first is not None and first.plan_valid
        # the nine that asked while the first ran share the second, failed reconcile: none is told "done"
        assert all(isinstance(outcome, RuntimeError) for outcome in rest)
        assert all(exists(kmock, r, n) for r, n in CHILDREN)
        posts = [r for r in kmock if str(r.method).upper().endswith("POST") and r.resource is not None]
        assert len([r for r in posts if r.resource.plural == "deployments"]) == 3  # created once each
        assert await reconciler.reconcile(NS, "chat") is not None and runs == 3  # a later trigger runs anew
