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
import base64
import copy
from typing import Any

import kmock as kmocklib
import pytest

kopf = pytest.importorskip("kopf")

from coserve.operator.handlers import PoolReconciler  # noqa: E402 - after the importorskip
from coserve.operator.kube import KubeClient, KubeError, config_for  # noqa: E402
from coserve.operator.reconcile import ChildAction, Reconciliation  # noqa: E402
from operator_kmock import (  # noqa: E402
    CHILDREN,
    MERGE,
    NS,
    POOL,
    POOLS,
    POOLS_URL,
    ApiServerEmulator,
    StoringEmulator,
    condition,
    create_pool,
    declare_resources,
    events,
    eventually,
    exists,
    running_operator,
)

pytestmark = pytest.mark.asyncio


async def test_a_new_pool_gets_its_children_and_an_honest_status(kmock: kmocklib.KubernetesEmulator) -> None:
    async with running_operator(kmock) as operator:
        await create_pool(operator)
        await eventually(lambda: all(exists(kmock, r, n) for r, n in CHILDREN), "every child")
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
        assert status["decoders"] == f"0/{decoders}"  # ready/desired
        # no finalizer: deleting a pool never waits for the operator
        assert not kmock.objects[POOLS, NS, "chat"]["metadata"].get("finalizers")
        # the router token: random, generated once, mounted by router and engines
        token = base64.b64decode(kmock.objects["v1/secrets", NS, "chat-router-token"]["data"]["token"])
        assert len(token) >= 32
        for role in ("router", "decoder", "prefiller"):
            pod = kmock.objects["apps/v1/deployments", NS, f"chat-{role}"]["spec"]["template"]["spec"]
            assert {"name": "router-token", "secret": {"secretName": "chat-router-token"}} in pod["volumes"]
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
        await eventually(lambda: all(exists(kmock, r, n) for r, n in CHILDREN), "every child")
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

        # autoscaling is off: a decoder scaled by hand goes back to the plan, and the operator says so
        response = await operator.patch(
            f"/apis/apps/v1/namespaces/{NS}/deployments/chat-decoder", headers=MERGE, json={"spec": {"replicas": 9}}
        )
        assert response.status_code == 200
        await eventually(
            lambda: kmock.objects["apps/v1/deployments", NS, "chat-decoder"]["spec"]["replicas"] == 2, "the plan's 2"
        )
        reset = await eventually(lambda: events(kmock, "ReplicasReset"), "a ReplicasReset event")
        assert reset[0]["type"] == "Warning" and "enable spec.autoscaling" in reset[0]["message"]


async def test_an_emptied_token_and_an_opened_policy_are_put_back(kmock: kmocklib.KubernetesEmulator) -> None:
    async with running_operator(kmock) as operator:
        await create_pool(operator)
        await eventually(lambda: all(exists(kmock, r, n) for r, n in CHILDREN), "every child")
        await asyncio.sleep(1.0)  # let kopf drain the events of the pool's own creation
        policy = "networking.k8s.io/v1/networkpolicies", NS, "chat-engines"
        wanted = copy.deepcopy(kmock.objects[policy]["spec"])

        response = await operator.patch(
            f"/api/v1/namespaces/{NS}/secrets/chat-router-token",
            headers=MERGE,
            json={"data": {"token": "", "x": "eA=="}},
        )
        assert response.status_code == 200
        await eventually(
            lambda: (
                set(kmock.objects["v1/secrets", NS, "chat-router-token"]["data"]) == {"token"}
                and len(base64.b64decode(kmock.objects["v1/secrets", NS, "chat-router-token"]["data"]["token"])) >= 32
            ),
            "a new random token, and nothing else in the Secret",
        )

        response = await operator.patch(
            f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies/chat-engines",
            headers=MERGE,
            json={"spec": {"podSelector": {"matchLabels": {"example.com/nobody": "x"}}}},
        )
        assert response.status_code == 200
        await eventually(lambda: kmock.objects[policy]["spec"] == wanted, "the policy's selector put back")


def writes(kmock: kmocklib.KubernetesEmulator) -> list[str]:
    """Every write the operator sent (the tests' own go through other calls): method and resource."""
    return [
        f"{str(r.method).upper()} {r.resource.plural}/{r.name or ''}"
        for r in kmock
        if r.resource is not None
        and r.resource.plural != "leases"
        and any(str(r.method).upper().endswith(verb) for verb in ("POST", "PATCH", "PUT", "DELETE"))
    ]


def pool_lists(kmock: kmocklib.KubernetesEmulator) -> int:
    """LIST requests for pools that are not watches: one per resync."""
    return sum(
        1
        for r in kmock
        if r.resource is not None and r.resource.plural == "coservepools" and r.params.get("watch") != "true"
        and str(r.method).upper().endswith("GET") and r.name is None
    )  # fmt: skip


@pytest.mark.kmock(cls=StoringEmulator)  # objects come back as the real API server stores them
async def test_ten_resyncs_of_a_converged_pool_write_nothing_and_post_no_event(
    kmock: kmocklib.KubernetesEmulator,
) -> None:
    async with running_operator(kmock) as operator:
        await create_pool(operator)
        await eventually(lambda: all(exists(kmock, r, n) for r, n in CHILDREN), "every child")
        await eventually(lambda: condition(kmock, "Progressing")["reason"] == "WaitingForReplicas", "converged")
        # Someone else's annotation and a server-added default on a child: not the operator's to undo.
        others = {"metadata": {"annotations": {"example.com/owner": "someone-else"}},
                  "spec": {"revisionHistoryLimit": 10, "progressDeadlineSeconds": 600}}  # fmt: skip
        response = await operator.patch(f"/apis/apps/v1/namespaces/{NS}/deployments/chat-decoder", headers=MERGE,
                                        json=others)  # fmt: skip
        assert response.status_code == 200
        before, lists = len(writes(kmock)), pool_lists(kmock)
        # the window: ten resyncs (resync_s=1), each a LIST of pools and a full reconcile of this one
        await eventually(lambda: pool_lists(kmock) >= lists + 10, "ten resyncs", timeout_s=30)
        assert writes(kmock)[before:] == []
        decoder = kmock.objects["apps/v1/deployments", NS, "chat-decoder"]
        assert decoder["metadata"]["annotations"]["example.com/owner"] == "someone-else"


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
        await eventually(lambda: all(exists(kmock, r, n) for r, n in CHILDREN), "every child")
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
    async with KubeClient(config_for(server)) as kube:
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


PDBS = "policy/v1/poddisruptionbudgets"


@pytest.fixture
def decoder_budget(monkeypatch: pytest.MonkeyPatch) -> dict[str, bool]:
    """The pool renders a decoder PodDisruptionBudget while ``["on"]``; built here, so these tests do not depend on
    which budgets the pool's spec renders by default (any other budget is left out)."""
    from coserve.operator import handlers, resources
    from coserve.operator import reconcile as module

    wanted = {"on": True}
    children = tuple(dict.fromkeys((*resources.CHILDREN, ("PodDisruptionBudget", "decoder"))))
    monkeypatch.setattr(resources, "CHILDREN", children)  # what the reconciler reads
    monkeypatch.setattr(handlers, "CHILDREN", children)  # what the operator watches
    real = module.build_children

    def build(pool: Any, plan: Any, **kwargs: Any) -> list[dict[str, Any]]:
        out = [child for child in real(pool, plan, **kwargs) if child["kind"] != "PodDisruptionBudget"]
        if wanted["on"]:
            metadata = {"name": "chat-decoder", "namespace": NS, "labels": resources.labels_for("chat", "decoder"),
                        "ownerReferences": resources.owner_references(pool)}  # fmt: skip
            spec = {"maxUnavailable": 1, "selector": {"matchLabels": resources.selector_for("chat", "decoder")}}
            out.append({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": metadata, "spec": spec})
        return out

    monkeypatch.setattr(module, "build_children", build)
    return wanted


async def test_a_budget_is_kept_while_asked_for_and_deleted_when_turned_off(
    kmock: kmocklib.KubernetesEmulator, decoder_budget: dict[str, bool]
) -> None:
    async with running_operator(kmock) as operator:
        await create_pool(operator)
        await eventually(lambda: exists(kmock, PDBS, "chat-decoder"), "the decoder's disruption budget")
        budget = kmock.objects[PDBS, NS, "chat-decoder"]
        assert budget["spec"]["maxUnavailable"] == 1 and budget["metadata"]["ownerReferences"][0]["uid"] == "uid-chat"
        await asyncio.sleep(1.0)  # let kopf drain the events of the pool's own creation
        url = f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/chat-decoder"
        response = await operator.delete(url)  # deleted by hand: put back (the watch on policy/v1)
        assert response.status_code == 200
        await eventually(lambda: exists(kmock, PDBS, "chat-decoder"), "the budget recreated")
        # the emulator assigns no uid; the API server would: the delete must name the object seen
        response = await operator.patch(url, headers=MERGE, json={"metadata": {"uid": "uid-budget"}})
        assert response.status_code == 200
        await asyncio.sleep(1.5)  # a resync sees it

        decoder_budget["on"] = False  # the user turns the budget off
        await eventually(lambda: not exists(kmock, PDBS, "chat-decoder"), "the budget deleted", 10)
        deletes = [dict(r.data or {}) for r in kmock
                   if str(r.method).upper().endswith("DELETE") and r.name == "chat-decoder"][1:]  # fmt: skip
        assert deletes == [{"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": "uid-budget"}}]
        deleted = await eventually(lambda: events(kmock, "Deleted"), "a Deleted event")
        assert "PodDisruptionBudget chat-decoder deleted" in deleted[0]["message"]
        await asyncio.sleep(1.5)  # a resync later: not created again, nothing else deleted
        assert not exists(kmock, PDBS, "chat-decoder")
        assert all(exists(kmock, r, n) for r, n in CHILDREN if r != PDBS)


async def test_the_client_reads_writes_and_deletes_the_new_kinds(kmock: kmocklib.KubernetesEmulator) -> None:
    declare_resources(kmock)
    async with KubeClient(config_for(str(kmock.url).rstrip("/"))) as kube:
        labels = {"app.kubernetes.io/instance": "chat", "coserve.dev/role": "decoder"}
        await kube.create("PodDisruptionBudget", NS, {
            "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "chat-decoder"},
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels}}})  # fmt: skip
        await kube.create("PersistentVolumeClaim", NS, {
            "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "chat-model-cache"},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "100Gi"}}}})  # fmt: skip
        await kube.create("Pod", NS, {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "chat-decoder-a", "labels": labels},
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]}})  # fmt: skip
        (pod,) = await kube.list("Pod", NS, "app.kubernetes.io/instance=chat,coserve.dev/role=decoder")
        assert (pod["apiVersion"], pod["kind"], pod["metadata"]["name"]) == ("v1", "Pod", "chat-decoder-a")
        patch = {"metadata": {"annotations": {"controller.kubernetes.io/pod-deletion-cost": "3"}}}
        await kube.merge_patch("Pod", NS, "chat-decoder-a", patch)
        assert (
            kmock.objects["v1/pods", NS, "chat-decoder-a"]["metadata"]["annotations"]
            == patch["metadata"]["annotations"]
        )
        claim = await kube.get("PersistentVolumeClaim", NS, "chat-model-cache")
        assert claim is not None and claim["spec"]["resources"]["requests"]["storage"] == "100Gi"
        (budget,) = await kube.list("PodDisruptionBudget", NS)
        assert budget["apiVersion"] == "policy/v1"
        await kube.delete("PodDisruptionBudget", NS, "chat-decoder", uid="uid-budget")
        assert not exists(kmock, PDBS, "chat-decoder")
        with pytest.raises(KubeError) as gone:
            await kube.delete("PodDisruptionBudget", NS, "chat-decoder")
        assert gone.value.status == 404


@pytest.mark.kmock(cls=ApiServerEmulator)  # errors as the API server answers them
async def test_a_claim_resize_the_api_server_refuses_is_a_warning_not_a_failed_reconcile(
    kmock: kmocklib.KubernetesEmulator,
) -> None:
    declare_resources(kmock)
    # what the PersistentVolumeClaimResize admission plugin answers for a storage class that cannot expand
    refusal = ("only dynamically provisioned pvc can be resized and the storageclass that provisions the pvc must "
               "support resize")  # fmt: skip
    grow = ChildAction("patch", "PersistentVolumeClaim", "chat-model-cache",
                       {"spec": {"resources": {"requests": {"storage": "200Gi"}}}},
                       "drifted: spec.resources.requests.storage")  # fmt: skip
    async with KubeClient(config_for(str(kmock.url).rstrip("/"))) as kube:
        await kube.create("PersistentVolumeClaim", NS, {
            "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "chat-model-cache"},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "100Gi"}}}})  # fmt: skip
        kmock[kmocklib.resource("", "v1", "persistentvolumeclaims")] << kmocklib.KubernetesError(
            403, "Forbidden", refusal
        )
        current, refusals = await PoolReconciler(kube)._apply(NS, "chat", Reconciliation((grow,), {}, (), True), {})
    assert current  # nothing to decide again: the next resync tries once more
    (warning,) = refusals
    assert (warning.type, warning.reason) == ("Warning", "ChildRefused")
    assert warning.message == (
        "PersistentVolumeClaim chat-model-cache was not patched (drifted: spec.resources.requests.storage): "
        f"HTTP 403 Forbidden: {refusal}"
    )
