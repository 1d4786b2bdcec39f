"""reconcile() against what a real kube-apiserver returned for coserve's own objects.

The recordings in ``shared/apiserver-fixtures`` (see its README.md) are the two
example pools and their seven children each, as Kubernetes 1.35 stored them after
the operator created them: quantities as strings, false booleans left out, server
defaults filled in, and (in a raw LIST) items without ``apiVersion`` or ``kind``.
A reconcile of those must decide nothing; it once patched all seven children on
every resync. The negative tests change the recordings to show the check can fail.

The recordings predate the pool's router-token Secret, engine NetworkPolicy, router
identity (ServiceAccount, Role, RoleBinding for its batch Leases) and PodDisruptionBudgets
(one per role, on by default), the token's mount in the pods
and the router's batch lock setting: ``upgraded`` applies what this version adds to them once, as the
server would store it (a merge patch; quantities as strings; false booleans left out), and
checks that an upgrade is exactly that. The world after the upgrade must then decide nothing.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from coserve.operator.reconcile import ChildKey, Reconciliation, reconcile
from operator_kmock import as_stored

FIXTURES = Path(__file__).resolve().parents[2].parent / "shared" / "apiserver-fixtures"
pytestmark = pytest.mark.skipif(
    not FIXTURES.is_dir(), reason=f"no API server recordings at {FIXTURES} (shared/ beside the checkout)"
)

# coserve's version at the commit the recordings were made at: a router on the default image follows it.
RECORDED_OPERATOR_TAG = "0.1.0"
NOW = datetime(2026, 12, 3, 14, 30, tzinfo=UTC)  # after the recordings (pools applied at 14:13-14:14)
LATER = datetime(2026, 12, 3, 14, 31, tzinfo=UTC)

POOLS = [("llm", "agents"), ("serving", "tiered")]
_LISTS = (("Deployment", "deploy"), ("Service", "svc"), ("ConfigMap", "cm"))

Observed = dict[ChildKey, dict[str, Any]]


def load(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())


def pool_body(namespace: str, name: str) -> dict[str, Any]:
    """The pool as stored, ``status`` (what the operator last wrote) included."""
    body: dict[str, Any] = load(f"{namespace}.{name}.coservepool.json")
    return body


def listed(namespace: str, name: str) -> Observed:
    """The pool's children as ``kubectl get -o json`` lists them (items with ``apiVersion`` and ``kind``)."""
    observed: Observed = {}
    for kind, suffix in _LISTS:
        for item in load(f"{namespace}.{name}.{suffix}.list.json")["items"]:
            observed[(kind, item["metadata"]["name"])] = item
    return observed


def _replace(observed: Observed, kind: str, objects: list[dict[str, Any]]) -> Observed:
    """``observed`` with ``objects`` (the same children, read another way) in place of the listed ones."""
    out = dict(observed)
    for item in objects:
        key = (kind, item["metadata"]["name"])
        assert out[key]["metadata"]["uid"] == item["metadata"]["uid"], f"{key} is another object in the recordings"
        out[key] = item
    return out


def from_raw_list(observed: Observed) -> Observed:
    items = load("llm.deployments.raw-list.json")["items"]
    assert items and not any("apiVersion" in i or "kind" in i for i in items)  # what this source is here to cover
    return _replace(observed, "Deployment", items)


def from_raw_gets(observed: Observed) -> Observed:
    observed = _replace(observed, "Deployment", [load("llm.agents-decoder.raw-get.json")])
    return _replace(observed, "Service", [load("llm.agents-decoder-svc.raw-get.json")])


def from_watch(observed: Observed) -> Observed:
    latest: dict[str, dict[str, Any]] = {}
    for line in (FIXTURES / "llm.deployments.watch-events.jsonl").read_text().splitlines():
        if line.strip():
            event = json.loads(line)
            if event["type"] in ("ADDED", "MODIFIED"):
                latest[event["object"]["metadata"]["name"]] = event["object"]
    assert latest
    return _replace(observed, "Deployment", list(latest.values()))


def without_type(observed: Observed) -> Observed:
    """Every child as a raw LIST item has it: no ``apiVersion``, no ``kind``."""
    return {key: {k: v for k, v in child.items() if k not in ("apiVersion", "kind")} for key, child in observed.items()}


SOURCES: dict[str, Callable[[Observed], Observed]] = {
    "kubectl-lists": lambda observed: observed,
    "raw-list": from_raw_list,
    "raw-gets": from_raw_gets,
    "watch": from_watch,
    "no-apiVersion-kind": without_type,
}
# The raw LIST, GETs and watch were recorded for namespace llm only.
CASES = [pytest.param("llm", "agents", source, id=f"llm.agents-{source}") for source in SOURCES] + [
    pytest.param("serving", "tiered", source, id=f"serving.tiered-{source}")
    for source in ("kubectl-lists", "no-apiVersion-kind")
]


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386, as the API server applies ``application/merge-patch+json``."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


# What this version adds to what the recorded version created: five children and three disruption budgets, the
# token in three pod templates, the router's ServiceAccount and namespace, and its batch lock in router.json.
UPGRADE_CREATES = {"Secret", "NetworkPolicy", "ServiceAccount", "Role", "RoleBinding", "PodDisruptionBudget"}
UPGRADE_PATCHES = {"Deployment", "ConfigMap"}


def upgraded(namespace: str, name: str, observed: Observed) -> Observed:
    """``observed`` after this version's first reconcile of it, stored as the API server stores objects."""
    result = decide(pool_body(namespace, name), observed)
    assert {a.kind for a in result.actions if a.verb == "create"} == UPGRADE_CREATES
    assert {a.kind for a in result.actions if a.verb == "patch"} <= UPGRADE_PATCHES
    out = dict(observed)
    for action in result.actions:
        key = (action.kind, action.name)
        if action.verb == "create":
            body = {**action.body, "data": {"token": "c2VjcmV0"}} if action.kind == "Secret" else action.body
            out[key] = as_stored(body)
        else:
            stored = as_stored(merge_patch(observed[key], action.body))
            for field in ("apiVersion", "kind"):  # a LIST item stays one
                if field not in observed[key]:
                    stored.pop(field, None)
            out[key] = stored
    return out


def observed_for(namespace: str, name: str, source: str) -> Observed:
    return upgraded(namespace, name, copy.deepcopy(SOURCES[source](listed(namespace, name))))


def decide(body: dict[str, Any], observed: Observed, now: datetime = NOW) -> Reconciliation:
    return reconcile(body, observed, now, operator_image_tag=RECORDED_OPERATOR_TAG)


def actions(result: Reconciliation) -> list[tuple[str, str, str, str]]:
    return [(a.verb, a.kind, a.name, a.reason) for a in result.actions]


def test_the_recordings_cover_every_child() -> None:
    for namespace, name in POOLS:
        observed = listed(namespace, name)
        created = decide(pool_body(namespace, name), {})
        recorded = {(a.kind, a.name) for a in created.actions if a.kind not in UPGRADE_CREATES}
        assert recorded == set(observed)


@pytest.mark.parametrize(("namespace", "name", "source"), CASES)
def test_a_pool_as_the_api_server_stores_it_needs_no_action(namespace: str, name: str, source: str) -> None:
    body = pool_body(namespace, name)
    observed = observed_for(namespace, name, source)
    result = decide(body, observed)
    assert result.plan_valid
    assert actions(result) == []
    assert result.events == ()
    # The recordings were made before any pod ran: the pool waits for replicas, it is not reconciling.
    progressing = next(c for c in result.status["conditions"] if c["type"] == "Progressing")
    assert progressing["reason"] == "WaitingForReplicas"

    # The status it writes is a fixed point: read back, it decides the same nothing and writes nothing new.
    again = decide({**body, "status": result.status}, observed, LATER)
    assert actions(again) == [] and again.events == ()
    assert again.status == result.status


def _decoder(observed: Observed) -> dict[str, Any]:
    container: dict[str, Any] = observed[("Deployment", "agents-decoder")]["spec"]["template"]["spec"]["containers"][0]
    return container


def _set_arg(observed: Observed, flag: str, value: str) -> str:
    args = _decoder(observed)["args"]
    index = args.index(flag) + 1
    args[index] = value
    return f"spec.template.spec.containers[0].args[{index}]"


def _owned_edits() -> list[Any]:
    """(edit of the observed children, the child it should patch, the path it names)."""

    def image(observed: Observed) -> str:
        _decoder(observed)["image"] = "example.com/hacked:latest"
        return "spec.template.spec.containers[0].image"

    def gpus(observed: Observed) -> str:
        _decoder(observed)["resources"]["limits"]["nvidia.com/gpu"] = "2"
        return "spec.template.spec.containers[0].resources.limits.nvidia.com/gpu"

    def cpu(observed: Observed) -> str:
        _decoder(observed)["resources"]["requests"]["cpu"] = "7999m"
        return "spec.template.spec.containers[0].resources.requests.cpu"

    def arg(observed: Observed) -> str:
        return _set_arg(observed, "--served-model-name", "someone-else")

    def replicas(observed: Observed) -> str:
        observed[("Deployment", "agents-decoder")]["spec"]["replicas"] = 5
        return "spec.replicas"

    def publish_not_ready(observed: Observed) -> str:
        observed[("Service", "agents-decoder")]["spec"]["publishNotReadyAddresses"] = True
        return "spec.publishNotReadyAddresses"

    def config(observed: Observed) -> str:
        observed[("ConfigMap", "agents-config")]["data"]["router.json"] = "{}\n"
        return "data.router.json"

    def api_version(observed: Observed) -> str:
        observed[("Deployment", "agents-decoder")]["apiVersion"] = "apps/v1beta2"
        return "apiVersion"

    return [
        pytest.param(image, ("Deployment", "agents-decoder"), id="decoder-image"),
        pytest.param(gpus, ("Deployment", "agents-decoder"), id="decoder-gpu-limit"),
        pytest.param(cpu, ("Deployment", "agents-decoder"), id="decoder-cpu-request"),
        pytest.param(arg, ("Deployment", "agents-decoder"), id="decoder-arg"),
        pytest.param(replicas, ("Deployment", "agents-decoder"), id="replicas-while-autoscaling-is-off"),
        pytest.param(publish_not_ready, ("Service", "agents-decoder"), id="publish-not-ready-true"),
        pytest.param(config, ("ConfigMap", "agents-config"), id="configmap-data"),
        pytest.param(api_version, ("Deployment", "agents-decoder"), id="another-apiVersion"),
    ]


@pytest.mark.parametrize("source", ["kubectl-lists", "raw-list"])
@pytest.mark.parametrize(("edit", "child"), _owned_edits())
def test_a_hand_edit_of_an_owned_field_patches_exactly_that_child(
    edit: Callable[[Observed], str], child: ChildKey, source: str
) -> None:
    observed = observed_for("llm", "agents", source)
    path = edit(observed)
    result = decide(pool_body("llm", "agents"), observed)
    assert actions(result) == [("patch", *child, f"drifted: {path}")]
    (action,) = result.actions
    assert action.body["metadata"]["name"] == child[1]  # the patch is the desired object, which puts it back
    assert "Patched" in [e.reason for e in result.events]


def test_the_patch_puts_the_recorded_value_back() -> None:
    observed = observed_for("llm", "agents", "raw-list")
    recorded = copy.deepcopy(_decoder(observed))
    _decoder(observed)["resources"]["limits"]["nvidia.com/gpu"] = "2"
    _decoder(observed)["image"] = "example.com/hacked:latest"
    (action,) = decide(pool_body("llm", "agents"), observed).actions
    container = action.body["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == recorded["image"]
    assert str(container["resources"]["limits"]["nvidia.com/gpu"]) == recorded["resources"]["limits"]["nvidia.com/gpu"]


def _others_edits() -> list[Any]:
    """Edits of fields the operator does not set, or of values the server stores differently: never drift."""

    def restarted(observed: Observed) -> None:  # `kubectl rollout restart`
        template = observed[("Deployment", "agents-decoder")]["spec"]["template"]
        template["metadata"]["annotations"]["kubectl.kubernetes.io/restartedAt"] = "2026-12-03T14:20:00Z"

    def server_defaults(observed: Observed) -> None:
        deployment = observed[("Deployment", "agents-router")]
        deployment["spec"]["minReadySeconds"] = 0
        deployment["spec"]["template"]["spec"]["enableServiceLinks"] = True
        service = observed[("Service", "agents-router")]
        service["spec"]["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": 10800}}

    def other_controllers(observed: Observed) -> None:
        for child in observed.values():
            metadata = child["metadata"]
            metadata.setdefault("annotations", {})["example.com/owner"] = "someone-else"
            metadata.setdefault("labels", {})["example.com/team"] = "ml"
            metadata["finalizers"] = ["example.com/protect"]
            metadata["managedFields"] = [{"manager": "kubectl", "operation": "Update"}]

    def canonical_forms(observed: Observed) -> None:  # the same amounts, written another way
        resources = _decoder(observed)["resources"]
        resources["requests"]["cpu"] = "8000m"
        resources["limits"]["memory"] = "65536Mi"
        resources["limits"]["nvidia.com/gpu"] = 1

    return [
        pytest.param(restarted, id="rollout-restart-annotation"),
        pytest.param(server_defaults, id="server-defaults"),
        pytest.param(other_controllers, id="other-controllers-metadata"),
        pytest.param(canonical_forms, id="equal-quantities"),
    ]


@pytest.mark.parametrize("source", ["kubectl-lists", "raw-list"])
@pytest.mark.parametrize("edit", _others_edits())
def test_fields_others_own_are_not_drift(edit: Callable[[Observed], None], source: str) -> None:
    observed = observed_for("llm", "agents", source)
    edit(observed)
    result = decide(pool_body("llm", "agents"), observed)
    assert actions(result) == [] and result.events == ()


def test_replicas_the_autoscaler_set_are_kept() -> None:
    body = pool_body("llm", "agents")
    body["spec"]["autoscaling"].update(enabled=True, prometheusUrl="http://prometheus.monitoring:9090")
    observed = observed_for("llm", "agents", "raw-list")
    # turning autoscaling on moves the engines' disruption budgets to its minReplicas: that is applied first
    for action in decide(body, observed).actions:
        assert (action.verb, action.kind) == ("patch", "PodDisruptionBudget"), action
        observed[(action.kind, action.name)] = as_stored(merge_patch(observed[(action.kind, action.name)], action.body))
    observed[("Deployment", "agents-decoder")]["spec"]["replicas"] = 5
    observed[("Deployment", "agents-prefiller")]["spec"]["replicas"] = 2
    result = decide(body, observed)
    assert actions(result) == [] and result.events == ()
    assert result.status["replicas"]["decoders"]["desired"] == 5
    assert result.status["replicas"]["prefillers"]["desired"] == 2
    # ... but the router's replicas still belong to the plan.
    observed[("Deployment", "agents-router")]["spec"]["replicas"] = 9
    assert actions(decide(body, observed)) == [("patch", "Deployment", "agents-router", "drifted: spec.replicas")]
