"""Gateway mode against a real API server: the Gateway API's HTTPRoute and the Inference Extension's InferencePool
CRDs (``e2e/crds``, as their projects publish them) apply, and a pool with ``spec.gateway.enabled`` reconciles into
an InferencePool, the endpoint picker's Deployment and Service, the proxies' NetworkPolicy and an HTTPRoute that
the server accepts and stores; as stored (with the CRDs' defaults) they are not drift; turning the mode off deletes
them.

The CRDs are applied server-side before the module's operator starts, and deleted at the end only if this module
created them (a cluster with a gateway keeps its own). The module works in a namespace of its own. No gateway
controller is assumed: the pool's GatewayReady condition says the picker is not ready or no gateway accepted the
InferencePool, never True.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_cluster import (
    EXAMPLE,
    LEASE,
    RESYNC_S,
    Kubectl,
    Operator,
    acting_operator,
    get_json,
    wait_until,
)

pytestmark = pytest.mark.e2e

CRDS = Path(__file__).resolve().parent / "crds"
GATEWAY_CRDS = ("inferencepools.inference.networking.k8s.io", "httproutes.gateway.networking.k8s.io")
FIELD_MANAGER = "coserve-e2e"
POOL = "e2e-gateway"
GATEWAY_CHILDREN = [
    ("deployment", f"{POOL}-picker"),
    ("service", f"{POOL}-picker"),
    ("networkpolicy", f"{POOL}-gateway-proxies"),
    ("inferencepool.inference.networking.k8s.io", f"{POOL}-inference-pool"),
    ("httproute.gateway.networking.k8s.io", f"{POOL}-route"),
]


@pytest.fixture(scope="module")
def gateway_crds(kubectl: Kubectl) -> Iterator[None]:
    existed = {name for name in GATEWAY_CRDS if kubectl("get", "crd", name, "--ignore-not-found", "-o", "name").stdout}
    kubectl("apply", "--server-side", f"--field-manager={FIELD_MANAGER}", "--force-conflicts", "-f", str(CRDS))
    for name in GATEWAY_CRDS:
        kubectl("wait", "--for", "condition=established", f"crd/{name}", "--timeout=60s")
    for resource in GATEWAY_CRDS:  # discovery can trail the Established condition by a moment
        wait_until(lambda: kubectl("get", resource, "-A", "-o", "name", check=False).returncode == 0,  # noqa: B023
                   f"{resource} served", 60)  # fmt: skip
    yield
    for name in GATEWAY_CRDS:
        if name not in existed:
            kubectl("delete", "crd", name, "--ignore-not-found", "--wait=false", check=False)


@pytest.fixture(scope="module")
def gateway_namespace(kubectl: Kubectl) -> Iterator[str]:
    name = f"coserve-e2e-gw-{uuid.uuid4().hex[:8]}"
    kubectl("create", "namespace", name)
    yield name
    kubectl("delete", "namespace", name, "--ignore-not-found", "--wait=false", check=False)


@pytest.fixture(scope="module")
def gateway_operator(
    crd_applied: object, gateway_crds: None, gateway_namespace: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Operator | None]:
    """An operator started after the CRDs are in (``None`` when E2E_OPERATOR_IN_CLUSTER=1: the chart's)."""
    log = tmp_path_factory.mktemp("gw") / "operator.log"
    with acting_operator(gateway_namespace, "e2e-gateway-operator", log) as started:
        yield started


@pytest.fixture(scope="module")
def gateway_pool(kubectl: Kubectl, gateway_namespace: str, gateway_operator: Operator | None) -> Iterator[str]:
    document = yaml.safe_load(EXAMPLE.read_text())
    document["metadata"] = {"name": POOL, "namespace": gateway_namespace}
    document["spec"]["gateway"] = {"enabled": True, "gatewayName": "e2e-gateway", "pickerReplicas": 1}
    kubectl("apply", "-f", "-", stdin=yaml.safe_dump(document))
    yield gateway_namespace
    kubectl("delete", "coservepool", POOL, "-n", gateway_namespace, "--ignore-not-found", "--wait=false", check=False)


def gateway_ready(kubectl: Kubectl, namespace: str) -> dict[str, Any] | None:
    status = (get_json(kubectl, namespace, "coservepool", POOL) or {}).get("status") or {}
    return {c["type"]: c for c in status.get("conditions") or []}.get("GatewayReady")


def test_a_gateway_pool_gets_an_inference_pool_its_picker_and_a_route(kubectl: Kubectl, gateway_pool: str) -> None:
    namespace = gateway_pool
    wait_until(lambda: all(get_json(kubectl, namespace, k, n) for k, n in GATEWAY_CHILDREN), "gateway children", 120)
    uid = (get_json(kubectl, namespace, "coservepool", POOL) or {})["metadata"]["uid"]
    for kind, name in GATEWAY_CHILDREN:
        (owner,) = (get_json(kubectl, namespace, kind, name) or {})["metadata"]["ownerReferences"]
        assert (owner["name"], owner["uid"], owner["controller"]) == (POOL, uid, True)
    inference_pool = get_json(kubectl, namespace, "inferencepool.inference.networking.k8s.io", f"{POOL}-inference-pool")
    assert inference_pool is not None
    spec = inference_pool["spec"]
    decoder = get_json(kubectl, namespace, "deployment", f"{POOL}-decoder") or {}
    assert spec["selector"]["matchLabels"] == decoder["spec"]["selector"]["matchLabels"]
    assert spec["endpointPickerRef"]["name"] == f"{POOL}-picker"
    assert spec["endpointPickerRef"]["failureMode"] == "FailClose"
    assert spec["appProtocol"] == "http"  # the CRD's default, filled in by the server
    route = get_json(kubectl, namespace, "httproute.gateway.networking.k8s.io", f"{POOL}-route") or {}
    assert route["spec"]["parentRefs"][0]["name"] == "e2e-gateway"
    # no gateway controller accepts it here (and the picker's image may not be pullable): never True
    wait_until(lambda: gateway_ready(kubectl, namespace) is not None, "GatewayReady", 60)
    condition = gateway_ready(kubectl, namespace) or {}
    assert condition["status"] == "False"
    assert condition["reason"] in ("PickerNotReady", "NotAccepted")


def _versions(kubectl: Kubectl, namespace: str) -> dict[str, str]:
    return {f"{k}/{n}": (get_json(kubectl, namespace, k, n) or {})["metadata"]["resourceVersion"]
            for k, n in GATEWAY_CHILDREN}  # fmt: skip


def test_the_gateway_children_as_the_server_stores_them_are_not_rewritten(kubectl: Kubectl, gateway_pool: str) -> None:
    namespace = gateway_pool
    wait_until(lambda: all(get_json(kubectl, namespace, k, n) for k, n in GATEWAY_CHILDREN), "gateway children", 120)
    time.sleep(2 * RESYNC_S)  # let the creation's own follow-ups settle
    before = _versions(kubectl, namespace)
    lease_before = _renewed(kubectl, namespace)
    time.sleep(3 * RESYNC_S + 1)  # three resyncs, each a full reconcile of the pool
    assert _versions(kubectl, namespace) == before, "a converged gateway child was written to"
    if os.environ.get("E2E_OPERATOR_IN_CLUSTER") != "1":
        # the window was not vacuous: the operator was alive and acting (it renewed its Lease meanwhile)
        assert _renewed(kubectl, namespace) != lease_before


def _renewed(kubectl: Kubectl, namespace: str) -> Any:
    """When this module's operator last renewed its Lease (in the module's namespace)."""
    return (get_json(kubectl, namespace, "lease", LEASE) or {}).get("spec", {}).get("renewTime")


def test_a_hand_edit_of_the_inference_pool_is_put_back(kubectl: Kubectl, gateway_pool: str) -> None:
    namespace = gateway_pool
    kind, name = "inferencepool.inference.networking.k8s.io", f"{POOL}-inference-pool"
    wait_until(lambda: get_json(kubectl, namespace, kind, name) is not None, "the InferencePool", 120)
    edit = {"spec": {"endpointPickerRef": {"failureMode": "FailOpen"}}}
    kubectl("patch", kind, name, "-n", namespace, "--type", "merge", "-p", json.dumps(edit))

    def restored() -> bool:
        body = get_json(kubectl, namespace, kind, name) or {}
        return bool(body) and body["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"

    wait_until(restored, "FailClose put back", 60)


def test_turning_gateway_mode_off_deletes_its_children(kubectl: Kubectl, gateway_pool: str) -> None:
    namespace = gateway_pool
    wait_until(lambda: all(get_json(kubectl, namespace, k, n) for k, n in GATEWAY_CHILDREN), "gateway children", 120)
    patch = {"spec": {"gateway": {"enabled": False}}}
    kubectl("patch", "coservepool", POOL, "-n", namespace, "--type", "merge", "-p", json.dumps(patch))
    wait_until(lambda: not any(get_json(kubectl, namespace, k, n) for k, n in GATEWAY_CHILDREN), "their deletion", 120)
    wait_until(lambda: (gateway_ready(kubectl, namespace) or {}).get("reason") == "Disabled", "GatewayReady Disabled")
    assert get_json(kubectl, namespace, "deployment", f"{POOL}-router") is not None  # router mode stays
