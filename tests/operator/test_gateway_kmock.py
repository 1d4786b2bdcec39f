"""Gateway mode with the real kopf operator against kmock's Kubernetes emulator (a test double: no kube-apiserver
runs here; e2e/test_gateway.py runs the same story against a real one).

A cluster without the Gateway API's CRDs answers 404 to every call on InferencePools and HTTPRoutes. The operator
must still serve the pool (router mode's children and the picker), say what to install, and create the two once
the CRDs are there, without a restart.
"""

from __future__ import annotations

import kmock as kmocklib
import pytest

pytest.importorskip("kopf")

from operator_kmock import (
    ALL_VERBS,
    CHILDREN,
    MERGE,
    NS,
    POOL,
    POOLS_URL,
    ApiServerEmulator,
    condition,
    create_pool,
    eventually,
    exists,
    running_operator,
)

pytestmark = [pytest.mark.asyncio, pytest.mark.kmock(cls=ApiServerEmulator)]

INFERENCE_POOLS = "inference.networking.k8s.io/v1/inferencepools"
HTTP_ROUTES = "gateway.networking.k8s.io/v1/httproutes"
PICKER = [("apps/v1/deployments", "chat-picker"), ("v1/services", "chat-picker")]
GATEWAY_API = [(INFERENCE_POOLS, "chat-inference-pool"), (HTTP_ROUTES, "chat-route")]


def install_gateway_crds(kmock: kmocklib.KubernetesEmulator) -> None:
    """What installing the Gateway API and Inference Extension CRDs does to discovery: the kinds are served."""
    for key, kind in ((INFERENCE_POOLS, "InferencePool"), (HTTP_ROUTES, "HTTPRoute")):
        kmock.resources[key] = kmocklib.ResourceInfo(
            kind=kind, singular=kind.lower(), namespaced=True, verbs=ALL_VERBS, subresources={"status"}
        )


def gateway_pool() -> dict[str, object]:
    body = {**POOL, "spec": {**POOL["spec"], "gateway": {"enabled": True}}}  # type: ignore[dict-item]
    return body


async def test_without_the_crds_the_pool_is_served_and_says_what_to_install_then_follows_their_install(
    kmock: kmocklib.KubernetesEmulator,
) -> None:
    async with running_operator(kmock) as operator:
        await create_pool(operator, gateway_pool())
        await eventually(lambda: all(exists(kmock, r, n) for r, n in [*CHILDREN, *PICKER]), "router mode + picker")
        missing = await eventually(
            lambda: (
                condition(kmock, "GatewayReady")["reason"] == "GatewayAPIMissing" and condition(kmock, "GatewayReady")
            ),
            "GatewayReady=False, GatewayAPIMissing",
        )
        assert missing["status"] == "False"
        assert "install the Gateway API Inference Extension's CRDs" in missing["message"]
        assert condition(kmock, "PlanValid")["status"] == "True"  # the rest of the pool is fine

        install_gateway_crds(kmock)  # the user installs the CRDs; the operator keeps running
        await eventually(lambda: all(exists(kmock, r, n) for r, n in GATEWAY_API), "the InferencePool and route", 10)
        inference_pool = kmock.objects[INFERENCE_POOLS, NS, "chat-inference-pool"]
        assert inference_pool["spec"]["endpointPickerRef"]["name"] == "chat-picker"
        assert inference_pool["metadata"]["ownerReferences"][0]["uid"] == "uid-chat"
        # the emulator runs no Deployment controller: the picker never becomes ready, and the condition says so
        await eventually(lambda: condition(kmock, "GatewayReady")["reason"] == "PickerNotReady", "PickerNotReady", 10)

        response = await operator.patch(
            f"{POOLS_URL}/chat", headers=MERGE, json={"spec": {"gateway": {"enabled": False}}}
        )
        assert response.status_code == 200
        await eventually(
            lambda: not any(exists(kmock, r, n) for r, n in [*PICKER, *GATEWAY_API]), "gateway mode's children gone", 10
        )
        # the status is written after the deletions land: wait for it rather than read it at once
        await eventually(lambda: condition(kmock, "GatewayReady")["reason"] == "Disabled", "GatewayReady Disabled", 10)
        assert all(exists(kmock, r, n) for r, n in CHILDREN)
