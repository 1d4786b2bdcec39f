"""The operator against a real cluster: a pool converges to its plan, and deleting it garbage-collects the children.

The operator runs on this machine (`coserve operator -n NS --lease ...`, with the
same KUBECONFIG: a client-certificate kubeconfig such as kind's, a token, or an
exec plugin; or with COSERVE_E2E_OPERATOR_KUBECONFIG's, the chart's ServiceAccount
say, while the tests act as the user) unless E2E_OPERATOR_IN_CLUSTER=1 says one is already installed
(`e2e/kind-up.sh --with-operator` installs the helm chart). Engine pods need GPUs
and a model, so the tests check what the operator owns: the Deployments' replica
counts, owner references and the pool's status, not pod readiness.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

# NOTE: not `from conftest import ...`: with tests/ on pythonpath that name is tests/conftest.py.
from e2e_cluster import (
    EXAMPLE,
    LEASE,
    RESYNC_S,
    Kubectl,
    Operator,
    acting_operator,
    get_json,
    start_operator,
    wait_until,
)

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.e2e

IDENTITY = "e2e-operator-a"
POOL = "e2e-agents"
CHILDREN = [
    ("configmap", f"{POOL}-config"),
    ("deployment", f"{POOL}-prefiller"),
    ("deployment", f"{POOL}-decoder"),
    ("deployment", f"{POOL}-router"),
    ("service", f"{POOL}-router"),
    ("service", f"{POOL}-prefiller"),
    ("service", f"{POOL}-decoder"),
    ("secret", f"{POOL}-router-token"),
    ("networkpolicy", f"{POOL}-engines"),
    ("serviceaccount", f"{POOL}-router"),
    ("role", f"{POOL}-router"),
    ("rolebinding", f"{POOL}-router"),
]


@pytest.fixture(scope="module")
def operator(
    kubectl: Kubectl, crd_applied: object, namespace: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Operator | None]:
    """The acting operator (``None`` when E2E_OPERATOR_IN_CLUSTER=1 says the chart's runs in the cluster)."""
    with acting_operator(namespace, IDENTITY, tmp_path_factory.mktemp("operator") / "operator.log") as started:
        yield started


@pytest.fixture(scope="module")
def pool(kubectl: Kubectl, namespace: str, operator: Operator | None) -> Iterator[dict[str, Any]]:
    document = yaml.safe_load(EXAMPLE.read_text())
    document["metadata"] = {"name": POOL, "namespace": namespace}
    kubectl("apply", "-f", "-", stdin=yaml.safe_dump(document))
    plan = json.loads(
        subprocess.run(
            [str(Path(sys.executable).with_name("coserve")), "plan", str(EXAMPLE), "-o", "json"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    yield plan
    kubectl("delete", "coservepool", POOL, "-n", namespace, "--ignore-not-found", "--wait=false", check=False)


def test_the_pool_converges_to_its_plan(kubectl: Kubectl, namespace: str, pool: dict[str, Any]) -> None:
    wait_until(lambda: all(get_json(kubectl, namespace, k, n) for k, n in CHILDREN), "every child", 120)
    body = get_json(kubectl, namespace, "coservepool", POOL)
    assert body is not None
    for kind, name in CHILDREN:
        child = get_json(kubectl, namespace, kind, name)
        assert child is not None
        (owner,) = child["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
            "CoServePool",
            POOL,
            body["metadata"]["uid"],
            True,
        )
    prefiller = get_json(kubectl, namespace, "deployment", f"{POOL}-prefiller")
    decoder = get_json(kubectl, namespace, "deployment", f"{POOL}-decoder")
    assert prefiller and decoder
    plan = pool.get("plan", pool)
    assert prefiller["spec"]["replicas"] == plan["prefillers"]
    assert decoder["spec"]["replicas"] == plan["decoders"]

    def status_written() -> bool:
        current = get_json(kubectl, namespace, "coservepool", POOL) or {}
        return (current.get("status") or {}).get("observedGeneration") == current["metadata"]["generation"]

    wait_until(status_written, "status.observedGeneration", 60)
    status = (get_json(kubectl, namespace, "coservepool", POOL) or {})["status"]
    types = {c["type"]: c for c in status["conditions"]}
    assert types["PlanValid"]["status"] == "True"
    assert status["plan"]["decoders"] == plan["decoders"]


def converged(kubectl: Kubectl, namespace: str) -> bool:
    """Every child exists and the status describes the current generation with nothing left to do."""
    if not all(get_json(kubectl, namespace, k, n) for k, n in CHILDREN):
        return False
    body = get_json(kubectl, namespace, "coservepool", POOL) or {}
    status = body.get("status") or {}
    progressing = {c["type"]: c for c in status.get("conditions") or []}.get("Progressing") or {}
    # pods may stay Pending (no GPUs, no model): waiting for replicas is as converged as the operator gets
    return status.get("observedGeneration") == body["metadata"]["generation"] and progressing.get("reason") in (
        "WaitingForReplicas",
        "Converged",
    )


def versions(kubectl: Kubectl, namespace: str) -> dict[str, str]:
    out = {"pool": (get_json(kubectl, namespace, "coservepool", POOL) or {})["metadata"]["resourceVersion"]}
    for kind, name in CHILDREN:
        out[f"{kind}/{name}"] = (get_json(kubectl, namespace, kind, name) or {})["metadata"]["resourceVersion"]
    return out


def pool_events(kubectl: Kubectl, namespace: str) -> dict[str, int]:
    listed = json.loads(kubectl("get", "events", "-n", namespace, "-o", "json").stdout)["items"]
    return {e["metadata"]["name"]: e.get("count") or 1 for e in listed if e["involvedObject"]["name"] == POOL}


def test_the_acting_replica_holds_the_lease(kubectl: Kubectl, namespace: str, pool: dict[str, Any]) -> None:
    if os.environ.get("E2E_OPERATOR_IN_CLUSTER") == "1":
        pytest.skip("the installed operator's Lease lives in its own namespace")
    wait_until(lambda: get_json(kubectl, namespace, "lease", LEASE) is not None, "the Lease", 60)
    lease = get_json(kubectl, namespace, "lease", LEASE) or {}
    assert lease["spec"]["holderIdentity"] == IDENTITY


def test_a_converged_pool_costs_no_writes_and_no_events(kubectl: Kubectl, namespace: str, pool: dict[str, Any]) -> None:
    wait_until(lambda: converged(kubectl, namespace), "the pool to converge", 180)
    before, events_before = versions(kubectl, namespace), pool_events(kubectl, namespace)
    lease_before = (get_json(kubectl, namespace, "lease", LEASE) or {}).get("spec", {}).get("renewTime")
    time.sleep(3 * RESYNC_S + 1)  # the window: three resyncs, each a full reconcile of the pool
    assert versions(kubectl, namespace) == before, "a converged pool was written to"
    assert pool_events(kubectl, namespace) == events_before, "a converged pool got Events"
    if os.environ.get("E2E_OPERATOR_IN_CLUSTER") != "1":
        # the window was not vacuous: the operator was alive and acting (it renewed its Lease meanwhile)
        lease_after = (get_json(kubectl, namespace, "lease", LEASE) or {}).get("spec", {}).get("renewTime")
        assert lease_after != lease_before


def test_an_owned_field_edited_by_hand_is_put_back_and_others_fields_are_kept(
    kubectl: Kubectl, namespace: str, pool: dict[str, Any]
) -> None:
    wait_until(lambda: converged(kubectl, namespace), "the pool to converge", 180)
    decoder = f"{POOL}-decoder"
    image = (get_json(kubectl, namespace, "deployment", decoder) or {})["spec"]["template"]["spec"]["containers"][0][
        "image"
    ]
    edit = {"metadata": {"annotations": {"example.com/owner": "someone-else"}},
            "spec": {"template": {"spec": {"containers": [{"name": "vllm", "image": "busybox:edited"}]}}}}  # fmt: skip
    kubectl("patch", "deployment", decoder, "-n", namespace, "--type", "strategic", "-p", json.dumps(edit))

    def restored() -> bool:
        body = get_json(kubectl, namespace, "deployment", decoder) or {}
        return body["spec"]["template"]["spec"]["containers"][0]["image"] == image

    wait_until(restored, "the decoder's image to be put back", 60)
    body = get_json(kubectl, namespace, "deployment", decoder) or {}
    assert body["metadata"]["annotations"]["example.com/owner"] == "someone-else"


def test_a_network_policy_opened_by_hand_is_closed_again(
    kubectl: Kubectl, namespace: str, pool: dict[str, Any]
) -> None:
    """Who may reach the engines is the operator's: an ingress rule admitting everyone (``{}``), added by hand,
    is taken out again; a foreign annotation on the policy is kept."""
    wait_until(lambda: converged(kubectl, namespace), "the pool to converge", 180)
    name = f"{POOL}-engines"
    rendered = (get_json(kubectl, namespace, "networkpolicy", name) or {})["spec"]["ingress"]
    edit = {"metadata": {"annotations": {"example.com/audited": "yes"}}, "spec": {"ingress": [{}]}}
    kubectl("patch", "networkpolicy", name, "-n", namespace, "--type", "merge", "-p", json.dumps(edit))

    def closed() -> bool:
        return (get_json(kubectl, namespace, "networkpolicy", name) or {})["spec"].get("ingress") == rendered

    wait_until(closed, "the engines' NetworkPolicy to be put back", 60)
    body = get_json(kubectl, namespace, "networkpolicy", name) or {}
    assert body["metadata"]["annotations"]["example.com/audited"] == "yes"


def lease_holder(kubectl: Kubectl, namespace: str) -> str | None:
    holder: str | None = ((get_json(kubectl, namespace, "lease", LEASE) or {}).get("spec") or {}).get("holderIdentity")
    return holder


def test_a_leader_paused_past_its_lease_writes_nothing_after_it_resumes(
    kubectl: Kubectl, namespace: str, pool: dict[str, Any], operator: Operator | None, tmp_path: Path
) -> None:
    """SIGSTOP the acting replica past its Lease; a second replica takes over and, as the pool's spec changes,
    writes the router's Deployment; SIGCONT the first. It stands down, and none of its writes lands: the
    router's spec keeps the new leader's replicas and generation. (The unit suite holds a request on the wire
    for the same check, deterministically: ``tests/operator/test_two_operators.py``.)"""
    if operator is None:
        pytest.skip("the installed operator runs in a pod, which this suite cannot pause")
    wait_until(lambda: converged(kubectl, namespace), "the pool to converge", 180)
    assert lease_holder(kubectl, namespace) == IDENTITY
    router = f"{POOL}-router"
    second = start_operator(namespace, "e2e-operator-b", tmp_path / "operator-b.log")
    try:
        seen = len(operator.log.read_text(errors="replace"))
        operator.process.send_signal(signal.SIGSTOP)
        try:
            kubectl("patch", "coservepool", POOL, "-n", namespace, "--type", "merge",
                    "-p", json.dumps({"spec": {"router": {"replicas": 3}}}))  # fmt: skip
            wait_until(lambda: lease_holder(kubectl, namespace) == "e2e-operator-b", "the second replica to lead", 60)
            replicas = lambda: (get_json(kubectl, namespace, "deployment", router) or {})["spec"]["replicas"]  # noqa: E731
            wait_until(lambda: replicas() == 3, "the new leader's 3 routers", 60)
            generation = (get_json(kubectl, namespace, "deployment", router) or {})["metadata"]["generation"]
        finally:
            operator.process.send_signal(signal.SIGCONT)
        stood_down = re.compile(r"stops leading|lost the lease|not leading")
        wait_until(lambda: bool(stood_down.search(operator.log.read_text(errors="replace")[seen:])), "a to stand down",
                   60)  # fmt: skip
        wait_until(lambda: converged(kubectl, namespace), "the pool to converge under the new leader", 60)
        after = get_json(kubectl, namespace, "deployment", router) or {}
        assert (after["spec"]["replicas"], after["metadata"]["generation"]) == (3, generation)
        assert lease_holder(kubectl, namespace) == "e2e-operator-b"
    finally:
        kubectl("patch", "coservepool", POOL, "-n", namespace, "--type", "merge",
                "-p", json.dumps({"spec": {"router": {"replicas": None}}}), check=False)  # fmt: skip
        second.stop()  # releases the Lease: the first replica leads again
    wait_until(lambda: lease_holder(kubectl, namespace) == IDENTITY, "the first replica to lead again", 60)


def test_deleting_the_pool_garbage_collects_its_children(
    kubectl: Kubectl, namespace: str, pool: dict[str, Any]
) -> None:
    wait_until(lambda: all(get_json(kubectl, namespace, k, n) for k, n in CHILDREN), "every child", 120)
    kubectl("delete", "coservepool", POOL, "-n", namespace, "--wait=true", "--timeout=60s")
    wait_until(lambda: not any(get_json(kubectl, namespace, k, n) for k, n in CHILDREN), "garbage collection", 120)


def test_an_autoscaled_pool_without_prometheus_holds_its_replicas_and_says_why(
    kubectl: Kubectl, namespace: str, operator: Operator | None
) -> None:
    # The real status subresource validates status.autoscaling against the CRD's schema, which kmock cannot.
    name = "e2e-autoscaled"
    document = yaml.safe_load(EXAMPLE.read_text())
    document["metadata"] = {"name": name, "namespace": namespace}
    document["spec"]["autoscaling"] = {
        "enabled": True,
        "prometheusUrl": "http://127.0.0.1:1",  # nothing listens there
        "evaluationIntervalS": 2,
    }
    kubectl("apply", "-f", "-", stdin=yaml.safe_dump(document))
    try:

        def held() -> bool:
            status = (get_json(kubectl, namespace, "coservepool", name) or {}).get("status") or {}
            found = {c["type"]: c for c in status.get("conditions") or []}.get("AutoscalingActive")
            return bool(found and found["reason"] == "PrometheusUnreachable" and status.get("autoscaling"))

        wait_until(held, "AutoscalingActive=False, reason PrometheusUnreachable", 120)
        body = get_json(kubectl, namespace, "coservepool", name) or {}
        condition = next(c for c in body["status"]["conditions"] if c["type"] == "AutoscalingActive")
        assert condition["status"] == "False" and "replicas held" in condition["message"]
        plan = body["status"]["plan"]
        decoder = get_json(kubectl, namespace, "deployment", f"{name}-decoder") or {}
        assert decoder["spec"]["replicas"] == plan["decoders"]  # held at the plan, never scaled on missing data
    finally:
        kubectl("delete", "coservepool", name, "-n", namespace, "--ignore-not-found", "--wait=false", check=False)
