"""reconcile() against what a real kube-apiserver returned for coserve's own objects.

The recordings in ``data/apiserver`` (see its README.md) are, first, the two
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

Recorded later (at 8ba8e40), the pool ``assistant`` of ``examples/pool-production.yaml`` has a child of
every kind a pool may have, as the server stored each. Reconciled against them, the operator decides
nothing for any kind; a hand edit of a field it sets on any kind is drift; and ``as_stored``, the
tests' own model of the stored form (used by ``upgraded`` and by the kmock tests), agrees with them.
That pool was stored with the metrics scraper 8ba8e40 defaulted, which admitted Prometheus-labelled pods
of every namespace; this version refuses it, so those tests read the pool as its owner fixes it (see
``assistant``), after the one patch that fix makes to the recorded NetworkPolicy.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from conftest import APISERVER_RECORDINGS as FIXTURES
from coserve.api.resource import KIND
from coserve.operator.cache import ObjectCache
from coserve.operator.kube import KubeError
from coserve.operator.reconcile import ChildKey, Reconciliation, drift, reconcile
from coserve.operator.reconciler import PoolReconciler
from coserve.operator.resources import CHILDREN, GATEWAY_API_KINDS
from operator_kmock import as_stored, merge_patch

# coserve's version at the commit the recordings were made at: a router on the default image follows it.
RECORDED_OPERATOR_TAG = "0.1.0"
NOW = datetime(2026, 12, 3, 14, 30, tzinfo=UTC)  # after the recordings (pools applied at 14:13-14:14)
LATER = datetime(2026, 12, 3, 14, 31, tzinfo=UTC)

POOLS = [("llm", "agents"), ("serving", "tiered")]
_LISTS = (("Deployment", "deploy"), ("Service", "svc"), ("ConfigMap", "cm"))

Observed = dict[ChildKey, dict[str, Any]]


def load(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())


def recorded_pool_body(namespace: str, name: str) -> dict[str, Any]:
    """The pool as stored, ``status`` (what the operator last wrote) included."""
    body: dict[str, Any] = load(f"{namespace}.{name}.coservepool.json")
    return body


def pool_body(namespace: str, name: str) -> dict[str, Any]:
    """The pool as stored, its ``status.plan`` as this version's first reconcile writes it: the recorded plan is an
    older model's (fewer prefillers: it sized them for saturation, not for the TTFT objective), and that first
    reconcile re-plans once, with a Planned event (``test_an_upgrade_re_plans_a_recorded_pool_once``)."""
    body = recorded_pool_body(namespace, name)
    planned = reconcile(body, listed(namespace, name), NOW, operator_image_tag=RECORDED_OPERATOR_TAG).status["plan"]
    body["status"]["plan"] = planned
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
            out[key] = patched(observed[key], action.body)
    return out


def patched(child: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """``child`` after a merge patch, stored as the server stores it (a LIST item stays one: no type fields)."""
    stored = as_stored(merge_patch(child, patch))
    for field in ("apiVersion", "kind"):
        if field not in child:
            stored.pop(field, None)
    return stored


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


# --- every child kind as the server stored it: the pool "assistant" (examples/pool-production.yaml), at 8ba8e40 ---

# The kinds recorded in llm.assistant.<kind>.list.json: every kind resources.CHILDREN names.
KINDS = ("ConfigMap", "PersistentVolumeClaim", "Deployment", "Service", "Secret", "NetworkPolicy", "ServiceAccount",
         "Role", "RoleBinding", "PodDisruptionBudget")  # fmt: skip
ASSISTANT_NOW = datetime(2026, 12, 4, 15, 20, tzinfo=UTC)  # after the recording (the pool was applied at 15:13)
ASSISTANT_SOURCES = {"kubectl-lists": SOURCES["kubectl-lists"], "no-apiVersion-kind": without_type}


# What the CRD of 8ba8e40 defaulted spec.engine.metricsScrapers to, stored in the recorded pool: pods labelled
# app.kubernetes.io/name=prometheus in every namespace (namespaceLabels {} selects them all), which any pod can pass
# for. This version refuses that peer, and has no scraper by default.
RECORDED_SCRAPERS = [{"namespaceLabels": {}, "podLabels": {"app.kubernetes.io/name": "prometheus"}}]
# The fix its owner makes, as examples/pool-production.yaml now sets it: the same pods, in namespace monitoring.
NAMED_SCRAPERS = [
    {
        "namespaceLabels": {"kubernetes.io/metadata.name": "monitoring"},
        "podLabels": {"app.kubernetes.io/name": "prometheus"},
    }
]
SCRAPER_DRIFT = (
    "patch",
    "NetworkPolicy",
    "assistant-engines",
    "drifted: spec.ingress[1].from[0].namespaceSelector.matchLabels",
)


# The recorded pool runs on GPUs: its engines render NixlConnector, and this version's router asks for the handoff
# they provide (router.json's kvTransferParams, derived from the same decision). 8ba8e40's router never did, so
# the upgrade patches router.json, and the config hash rolls the pods that read it.
CONFIG_HASH = "spec.template.metadata.annotations.coserve.dev/config-hash"
HANDOFF_DRIFT = [
    ("patch", "ConfigMap", "assistant-config", "drifted: data.router.json"),
    *(
        ("patch", "Deployment", f"assistant-{role}", f"drifted: {CONFIG_HASH}")
        for role in ("prefiller", "decoder", "router")
    ),
]


def _security(*where: str) -> list[str]:
    return [
        f"spec.template.spec.{at}securityContext.{field}"
        for at in where
        for field in ("runAsNonRoot", "seccompProfile")
    ]


# This version's pods pass the Pod Security Standards restricted profile; 8ba8e40's did not. The recorded engine pods
# lack the pod's runAsNonRoot and seccompProfile (and, with the pool's model cache, the fsGroup that lets the
# non-root download write it), and each container's; the router's container lacks its seccompProfile. The upgrade
# patches them in, and the same patches carry the config hash (HANDOFF_DRIFT): every path of each Deployment's
# patch, of which its reason names the first five.
SECURITY_DRIFT = {
    **{
        f"assistant-{role}": [
            *_security(""),
            "spec.template.spec.securityContext.fsGroup",
            "spec.template.spec.securityContext.fsGroupChangePolicy",
            *_security("initContainers[0].", "containers[0]."),
        ]
        for role in ("prefiller", "decoder")
    },
    "assistant-router": ["spec.template.spec.containers[0].securityContext.seccompProfile"],
}
# This version's engines run without async scheduling (--no-async-scheduling in args) and with vLLM's V1 model runner
# (VLLM_USE_V2_MODEL_RUNNER=0 in env) and, in a GPU pool such as this one, listen for NIXL's handshake on their own
# pod's address (VLLM_NIXL_SIDE_CHANNEL_HOST and _PORT in env, the containerPort nixl-side): the upgrade patches
# those three lists of both engines' container, whole.
ENGINE_DRIFT = [f"spec.template.spec.containers[0].{field}" for field in ("args", "env", "ports")]
ASYNC_FLAG = "--no-async-scheduling"
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
NIXL_ENV = ("VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT")
NIXL_PORT = "nixl-side"


def _upgrade_paths(name: str) -> list[str]:
    """Every path of the upgrade patch of the Deployment ``name``, in the order ``drift`` reports them."""
    paths = [CONFIG_HASH, *SECURITY_DRIFT[name]]
    if name == "assistant-router":
        return paths
    at = paths.index("spec.template.spec.containers[0].securityContext.runAsNonRoot")
    return [*paths[:at], *ENGINE_DRIFT, *paths[at:]]


UPGRADE_PATHS = {name: _upgrade_paths(name) for name in SECURITY_DRIFT}
UPGRADE_DRIFT = [
    HANDOFF_DRIFT[0],
    *(("patch", "Deployment", name, "drifted: " + ", ".join(UPGRADE_PATHS[name][:5])) for name in UPGRADE_PATHS),
    SCRAPER_DRIFT,
]


def recorded_assistant() -> dict[str, Any]:
    """The pool as the server stored it at 8ba8e40."""
    body: dict[str, Any] = load("llm.assistant.coservepool.json")
    return body


def assistant() -> dict[str, Any]:
    """The recorded pool with its scraper named as this version requires (the recording is not changed)."""
    body = recorded_assistant()
    assert body["spec"]["engine"]["metricsScrapers"] == RECORDED_SCRAPERS
    body["spec"]["engine"]["metricsScrapers"] = copy.deepcopy(NAMED_SCRAPERS)
    # ... and its plan as this version makes it (pool_body says why)
    body["status"]["plan"] = reconcile(body, {}, ASSISTANT_NOW, operator_image_tag=RECORDED_OPERATOR_TAG).status["plan"]
    return body


def recorded(kind: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = load(f"llm.assistant.{kind.lower()}.list.json")["items"]
    assert items and all(item["kind"] == kind for item in items)
    return items


def recorded_children(source: str = "kubectl-lists") -> Observed:
    """Every child of the pool ``assistant`` exactly as the server stored it, read afresh (the way ``source``
    reads it)."""
    observed = {(kind, item["metadata"]["name"]): item for kind in KINDS for item in recorded(kind)}
    return ASSISTANT_SOURCES[source](observed)


def every_kind(source: str = "kubectl-lists") -> Observed:
    """``recorded_children`` after this version's first reconcile of the fixed pool (``assistant``): the
    recorded NetworkPolicy's scraper peer has namespaceSelector {} (8ba8e40's default), and the fix names the
    namespace; router.json gains the handoff (``HANDOFF_DRIFT``). Merge patches, stored as the server stores
    them. Every other child is the recording's."""
    observed = recorded_children(source)
    result = decide(assistant(), observed, ASSISTANT_NOW)
    assert actions(result) == UPGRADE_DRIFT
    return {**observed, **{(a.kind, a.name): patched(observed[(a.kind, a.name)], a.body) for a in result.actions}}


def decide_assistant(observed: Observed) -> Reconciliation:
    return decide(assistant(), observed, ASSISTANT_NOW)


def test_the_upgrade_changes_the_recorded_deployments_only_where_this_version_renders_them_differently() -> None:
    """Every path each upgrade patch of a Deployment is for (a reason names five): the config hash, the security
    contexts of the restricted profile, the engines' args, env and ports (ENGINE_DRIFT), nothing else."""
    observed = recorded_children()
    patches = [a for a in decide_assistant(observed).actions if a.kind == "Deployment"]
    assert {a.name: drift(a.body, observed[(a.kind, a.name)]) for a in patches} == UPGRADE_PATHS


@pytest.mark.parametrize("source", ASSISTANT_SOURCES)
def test_the_recorded_pools_default_scraper_is_refused_and_its_children_left_as_they_are(source: str) -> None:
    """Upgrading from 8ba8e40: the stored default admits Prometheus-labelled pods of every namespace; the pool is
    InvalidSpec, naming the field, until its owner names the scraper's namespace (the NetworkPolicy it had stays)."""
    result = decide(recorded_assistant(), recorded_children(source), ASSISTANT_NOW)
    assert not result.plan_valid
    assert actions(result) == []
    plan_valid = next(c for c in result.status["conditions"] if c["type"] == "PlanValid")
    assert plan_valid["reason"] == "InvalidSpec"
    assert plan_valid["message"] == (
        "spec.engine.metricsScrapers[0].namespaceLabels: must name at least one label: "
        "an empty selector selects every namespace"
    )
    # Fixed, the changes are the NetworkPolicy's scraper peer and the router's handoff (every_kind applies them).
    assert actions(decide(assistant(), recorded_children(source), ASSISTANT_NOW)) == UPGRADE_DRIFT


def test_the_recordings_hold_every_child_of_every_kind() -> None:
    # NOTE: no API server that served the Gateway API's kinds was recorded; gateway mode's other children are of
    # recorded kinds, and its InferencePool and HTTPRoute are checked against their published CRDs (test_gateway)
    assert set(KINDS) == {kind for kind, _ in CHILDREN} - set(GATEWAY_API_KINDS)
    created = decide_assistant({})
    assert all(a.verb == "create" for a in created.actions)
    assert {(a.kind, a.name) for a in created.actions} == set(every_kind())  # every child rendered, each recorded


@pytest.mark.parametrize("source", ASSISTANT_SOURCES)
@pytest.mark.parametrize("kind", KINDS)
def test_no_child_of_any_kind_as_the_server_stored_it_is_drift(kind: str, source: str) -> None:
    result = decide_assistant(every_kind(source))
    assert result.plan_valid
    assert [action for action in actions(result) if action[1] == kind] == []
    assert result.events == ()


def test_the_side_channel_address_as_the_server_stores_it_is_not_drift() -> None:
    """The server fills in a fieldRef's apiVersion (the recorded router's POD_NAMESPACE has it), which
    ``as_stored`` does not model: the engines' VLLM_NIXL_SIDE_CHANNEL_HOST stored that way is no change."""
    observed = every_kind()
    for role in ("prefiller", "decoder"):
        container = observed[("Deployment", f"assistant-{role}")]["spec"]["template"]["spec"]["containers"][0]
        (host,) = [entry for entry in container["env"] if entry["name"] == NIXL_ENV[0]]
        assert host["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        host["valueFrom"]["fieldRef"]["apiVersion"] = "v1"
    assert actions(decide_assistant(observed)) == []


def _stored_differently(sent: Any, stored: Any, path: str = "") -> list[str]:
    """Paths where ``stored`` lacks a value of ``sent`` or holds it in another JSON form (fields only in
    ``stored``, the server's defaults and bookkeeping, are not compared)."""
    if isinstance(sent, dict) and isinstance(stored, dict):
        out = []
        for key, value in sent.items():
            here = f"{path}.{key}"
            out += _stored_differently(value, stored[key], here) if key in stored else [f"{here} (left out)"]
        return out
    if isinstance(sent, list) and isinstance(stored, list) and len(sent) == len(stored):
        out = []
        for index, (one, other) in enumerate(zip(sent, stored, strict=True)):
            out += _stored_differently(one, other, f"{path}[{index}]")
        return out
    return [] if type(sent) is type(stored) and sent == stored else [f"{path} ({sent!r} stored as {stored!r})"]


@pytest.mark.parametrize("kind", KINDS)
def test_as_stored_is_what_the_server_stored(kind: str) -> None:
    """``as_stored`` of what the operator sends holds nothing the server left out or changed (defaults aside)."""
    stored = recorded_children()  # the recordings themselves: every_kind's patched NetworkPolicy is as_stored's
    sent = [a.body for a in decide_assistant({}).actions if a.kind == kind]
    assert sent
    for body in sent:
        differences = _stored_differently(as_stored(body), stored[(kind, body["metadata"]["name"])])
        if kind == "NetworkPolicy":
            # The recording is what 8ba8e40 sent for its default scraper peer, namespaceSelector {matchLabels: {}},
            # which the server stored as {}; this version sends the fixed pool's named namespace there, so that
            # one path differs. With that peer as 8ba8e40 sent it, the rest must match the recording.
            assert differences == [".spec.ingress[1].from[0].namespaceSelector.matchLabels (left out)"]
            as_recorded = copy.deepcopy(body)
            as_recorded["spec"]["ingress"][1]["from"][0]["namespaceSelector"] = {"matchLabels": {}}
            differences = _stored_differently(as_stored(as_recorded), stored[(kind, body["metadata"]["name"])])
        if kind == "ConfigMap":
            # This version's router.json asks for the pool's handoff (HANDOFF_DRIFT): that value differs; with
            # the recorded router.json in its place, the rest must match the recording.
            recorded_router = stored[(kind, body["metadata"]["name"])]["data"]["router.json"]
            sent_router = body["data"]["router.json"]
            assert differences == [f".data.router.json ({sent_router!r} stored as {recorded_router!r})"]
            assert json.loads(sent_router) == {**json.loads(recorded_router), "kvTransferParams": True}
            as_recorded = copy.deepcopy(body)
            as_recorded["data"]["router.json"] = recorded_router
            differences = _stored_differently(as_stored(as_recorded), stored[(kind, body["metadata"]["name"])])
        if kind == "Deployment" and body["metadata"]["name"] != "assistant-router":
            # The engines' --no-async-scheduling, NIXL side channel variables and port are new in this version
            # (ENGINE_DRIFT): those lists differ whole; without the new entries, the rest must match the recording.
            new_lists = [f".{path}" for path in ENGINE_DRIFT]
            assert [path.split(" (")[0] for path in differences if path.split(" (")[0] in new_lists] == new_lists
            body = _without_new_engine_entries(body)
            differences = _stored_differently(as_stored(body), stored[(kind, body["metadata"]["name"])])
        if kind == "Deployment":
            # ... and the config hash of the pods that read it (every Deployment's) follows it; the security
            # contexts of the restricted profile (SECURITY_DRIFT) are new in this version, not in the recording
            hash_path = ".spec.template.metadata.annotations.coserve.dev/config-hash"
            new = {f".{path} (left out)" for path in SECURITY_DRIFT[body["metadata"]["name"]]}
            differences = [d for d in differences if not d.startswith(hash_path + " (") and d not in new]
        replanned = {"assistant-prefiller": ".spec.replicas (2 stored as 1)",
                     "assistant-decoder": ".spec.replicas (5 stored as 6)"}  # fmt: skip
        if kind == "Deployment" and body["metadata"]["name"] in replanned:
            # the recording was sized by an older model (prefillers for their saturation rate, decoders for it);
            # this version sizes both for the objectives at the design rate
            # (test_an_upgrade_re_plans_a_recorded_pool_once)
            assert differences == [replanned[body["metadata"]["name"]]]
            differences = []
        assert differences == []
        listed = as_stored(body, listed=True)
        assert "apiVersion" not in listed and "kind" not in listed


def _without_new_engine_entries(body: dict[str, Any]) -> dict[str, Any]:
    """An engine Deployment as this version renders it, less what is new since the recording (ENGINE_DRIFT): each
    new entry removed is checked to be there exactly once."""
    out = copy.deepcopy(body)
    container = out["spec"]["template"]["spec"]["containers"][0]
    assert container["args"].count(ASYNC_FLAG) == 1
    container["args"].remove(ASYNC_FLAG)
    # and coserve's connector renders the safepoint threshold (safepoint_min_step_s) in --kv-transfer-config
    at = container["args"].index("--kv-transfer-config") + 1
    transfer = json.loads(container["args"][at])
    for connector in [transfer, *transfer.get("kv_connector_extra_config", {}).get("connectors", [])]:
        if connector.get("kv_connector") == "CoServeConnector":
            assert connector["kv_connector_extra_config"].pop("safepoint_min_step_s") > 0
    # and a failed KV load is recomputed, not a failed request (read at the top level only)
    assert transfer.pop("kv_load_failure_policy") == "recompute"
    container["args"][at] = json.dumps(transfer, sort_keys=True, separators=(",", ":"))
    new_env = (V2_RUNNER_ENV, *NIXL_ENV)
    assert [entry["name"] for entry in container["env"] if entry["name"] in new_env] == list(new_env)
    container["env"] = [entry for entry in container["env"] if entry["name"] not in new_env]
    assert [port["name"] for port in container["ports"]] == ["http", NIXL_PORT]
    container["ports"] = container["ports"][:1]
    return out


def _kind_edits() -> list[Any]:
    """(edit of a field the operator sets on one recorded child, that child, the path the patch names)."""

    def label(kind: str, name: str) -> Any:
        def edit(observed: Observed) -> str:
            observed[(kind, name)]["metadata"]["labels"]["app.kubernetes.io/managed-by"] = "someone-else"
            return "metadata.labels.app.kubernetes.io/managed-by"

        return pytest.param(edit, (kind, name), id=f"{kind}-label")

    def config(observed: Observed) -> str:
        observed[("ConfigMap", "assistant-config")]["data"]["router.json"] = "{}\n"
        return "data.router.json"

    def image(observed: Observed) -> str:
        deployment = observed[("Deployment", "assistant-decoder")]
        deployment["spec"]["template"]["spec"]["containers"][0]["image"] = "example.com/hacked:latest"
        return "spec.template.spec.containers[0].image"

    def port(observed: Observed) -> str:
        observed[("Service", "assistant-router")]["spec"]["ports"][0]["port"] = 8081
        return "spec.ports[0].port"

    def secret_type(observed: Observed) -> str:
        observed[("Secret", "assistant-router-token")]["type"] = "kubernetes.io/basic-auth"
        return "type"

    def scrape_port(observed: Observed) -> str:
        observed[("NetworkPolicy", "assistant-engines")]["spec"]["ingress"][1]["ports"][0]["port"] = 9000
        return "spec.ingress[1].ports[0].port"

    def scrapers_from_this_namespace_only(observed: Observed) -> str:
        # a peer without its namespaceSelector selects the pool's own namespace instead of the named one
        del observed[("NetworkPolicy", "assistant-engines")]["spec"]["ingress"][1]["from"][0]["namespaceSelector"]
        return "spec.ingress[1].from[0].namespaceSelector"

    def verbs(observed: Observed) -> str:
        observed[("Role", "assistant-router")]["rules"][0]["verbs"].append("delete")
        return "rules[0].verbs"

    def subject(observed: Observed) -> str:
        observed[("RoleBinding", "assistant-router")]["subjects"][0]["name"] = "default"
        return "subjects[0].name"

    def budget(observed: Observed) -> str:
        observed[("PodDisruptionBudget", "assistant-decoder")]["spec"]["minAvailable"] = 1
        return "spec.minAvailable"

    return [
        label("ConfigMap", "assistant-config"),
        label("PersistentVolumeClaim", "assistant-model-cache"),
        label("Deployment", "assistant-router"),
        label("Service", "assistant-decoder"),
        label("Secret", "assistant-router-token"),
        label("NetworkPolicy", "assistant-engines"),
        label("ServiceAccount", "assistant-router"),
        label("Role", "assistant-router"),
        label("RoleBinding", "assistant-router"),
        label("PodDisruptionBudget", "assistant-prefiller"),
        pytest.param(config, ("ConfigMap", "assistant-config"), id="ConfigMap-data"),
        pytest.param(image, ("Deployment", "assistant-decoder"), id="Deployment-image"),
        pytest.param(port, ("Service", "assistant-router"), id="Service-port"),
        pytest.param(secret_type, ("Secret", "assistant-router-token"), id="Secret-type"),
        pytest.param(scrape_port, ("NetworkPolicy", "assistant-engines"), id="NetworkPolicy-port"),
        pytest.param(
            scrapers_from_this_namespace_only, ("NetworkPolicy", "assistant-engines"), id="NetworkPolicy-namespaces"
        ),
        pytest.param(verbs, ("Role", "assistant-router"), id="Role-verbs"),
        pytest.param(subject, ("RoleBinding", "assistant-router"), id="RoleBinding-subject"),
        pytest.param(budget, ("PodDisruptionBudget", "assistant-decoder"), id="PodDisruptionBudget-minAvailable"),
    ]


@pytest.mark.parametrize("source", ASSISTANT_SOURCES)
@pytest.mark.parametrize(("edit", "child"), _kind_edits())
def test_a_hand_edit_of_any_kind_patches_exactly_that_child(
    edit: Callable[[Observed], str], child: ChildKey, source: str
) -> None:
    observed = every_kind(source)  # read afresh from the files
    path = edit(observed)
    result = decide_assistant(observed)
    assert actions(result) == [("patch", *child, f"drifted: {path}")]


# --- the security-relevant children are the operator's whole ---------------------------------------------------------


def restored(observed: Observed, result: Reconciliation) -> Observed:
    """``observed`` after ``result``'s patches, as the server stores them; a router-token patch without a token is
    filled in as the adapter does (a new random token)."""
    out = dict(observed)
    for action in result.actions:
        assert action.verb == "patch", action
        body = action.body
        if action.kind == "Secret" and not (body.get("data") or {}).get("token"):
            body = {**body, "data": {**(body.get("data") or {}), "token": "bmV3LXRva2Vu"}}
        out[(action.kind, action.name)] = patched(observed[(action.kind, action.name)], body)
    return out


def _whole_edits() -> list[Any]:
    """(edit that adds to or empties a security-relevant child, that child, the paths the patch names)."""
    policy, role, binding, secret = (
        ("NetworkPolicy", "assistant-engines"),
        ("Role", "assistant-router"),
        ("RoleBinding", "assistant-router"),
        ("Secret", "assistant-router-token"),
    )

    def selector_label(observed: Observed) -> list[str]:  # the policy then selects no pod: the engines are open
        observed[policy]["spec"]["podSelector"]["matchLabels"]["example.com/nobody"] = "x"
        return ["spec.podSelector.matchLabels.example.com/nobody"]

    def every_namespace(observed: Observed) -> list[str]:  # the pool's own pods, from every namespace
        observed[policy]["spec"]["ingress"][0]["from"][0]["namespaceSelector"] = {}
        return ["spec.ingress[0].from[0].namespaceSelector"]

    def selector_expression(observed: Observed) -> list[str]:
        observed[policy]["spec"]["ingress"][0]["from"][0]["podSelector"]["matchExpressions"] = [
            {"key": "x", "operator": "Exists"}
        ]
        return ["spec.ingress[0].from[0].podSelector.matchExpressions"]

    def verb(observed: Observed) -> list[str]:
        observed[role]["rules"][0]["verbs"] = ["*"]
        return ["rules[0].verbs"]

    def resource(observed: Observed) -> list[str]:
        observed[role]["rules"][0]["resources"].append("secrets")
        return ["rules[0].resources"]

    def rule(observed: Observed) -> list[str]:
        observed[role]["rules"].append({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]})
        return ["rules"]

    def subject(observed: Observed) -> list[str]:
        observed[binding]["subjects"].append({"kind": "Group", "name": "system:authenticated", "apiGroup": "rbac"})
        return ["subjects"]

    def secret_key(observed: Observed) -> list[str]:
        observed[secret]["data"]["other"] = "eA=="
        return ["data.other"]

    def empty_token(observed: Observed) -> list[str]:
        observed[secret]["data"]["token"] = ""
        return ["data.token"]

    def no_token(observed: Observed) -> list[str]:
        del observed[secret]["data"]
        return ["data.token"]

    return [
        pytest.param(selector_label, policy, id="NetworkPolicy-podSelector-label"),
        pytest.param(every_namespace, policy, id="NetworkPolicy-namespaceSelector-added"),
        pytest.param(selector_expression, policy, id="NetworkPolicy-peer-expression-added"),
        pytest.param(verb, role, id="Role-verb"),
        pytest.param(resource, role, id="Role-resource"),
        pytest.param(rule, role, id="Role-rule"),
        pytest.param(subject, binding, id="RoleBinding-subject"),
        pytest.param(secret_key, secret, id="Secret-extra-key"),
        pytest.param(empty_token, secret, id="Secret-empty-token"),
        pytest.param(no_token, secret, id="Secret-no-token"),
    ]


@pytest.mark.parametrize("source", ASSISTANT_SOURCES)
@pytest.mark.parametrize(("edit", "child"), _whole_edits())
def test_an_addition_to_a_security_relevant_child_is_drift_and_taken_out(
    edit: Callable[[Observed], list[str]], child: ChildKey, source: str
) -> None:
    observed = every_kind(source)
    before = copy.deepcopy(observed[child])
    paths = edit(observed)
    result = decide_assistant(observed)
    assert actions(result) == [("patch", *child, "drifted: " + ", ".join(paths))]
    after = restored(observed, result)
    assert actions(decide_assistant(after)) == []
    if child[0] == "Secret":
        data = after[child]["data"]
        assert set(data) == {"token"} and data["token"]
        if data["token"] != before["data"]["token"]:
            assert paths == ["data.token"]  # only an emptied or missing token is replaced
    else:
        assert after[child] == before


def test_what_the_server_defaults_in_a_network_policy_or_binding_is_not_drift() -> None:
    observed = every_kind()
    policy = observed[("NetworkPolicy", "assistant-engines")]["spec"]
    policy["policyTypes"] = ["Ingress"]
    for rule in policy["ingress"]:
        for port in rule.get("ports", []):
            port["protocol"] = "TCP"
    observed[("RoleBinding", "assistant-router")]["subjects"][0]["apiGroup"] = ""
    assert actions(decide_assistant(observed)) == []


def test_a_good_token_is_kept_by_a_patch_of_its_secret() -> None:
    observed = every_kind()
    observed[("Secret", "assistant-router-token")]["metadata"]["labels"]["app.kubernetes.io/managed-by"] = "x"
    (action,) = decide_assistant(observed).actions
    assert action.body["data"] == {"token": "UkVEQUNURUQ="}


# --- pod templates: tolerant of webhooks, not of dangerous additions ----------------------------------------------

_ENGINE, _ROUTER = ("Deployment", "assistant-decoder"), ("Deployment", "assistant-router")


def _pod(observed: Observed, child: ChildKey) -> dict[str, Any]:
    pod: dict[str, Any] = observed[child]["spec"]["template"]["spec"]
    return pod


def _sidecar(**security: Any) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "mesh-proxy",
        "image": "example.com/proxy:1",
        "env": [{"name": "MESH", "value": "on"}],
        "resources": {},
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File",
        "imagePullPolicy": "IfNotPresent",
    }
    return {**container, "securityContext": security} if security else container


def _dangerous_edits() -> list[Any]:
    """(edit adding something dangerous to a pod template, the Deployment, the paths the patch names)."""

    def host(field: str) -> Callable[[Observed, ChildKey], list[str]]:
        def edit(observed: Observed, child: ChildKey) -> list[str]:
            _pod(observed, child)[field] = True
            return [f"spec.template.spec.{field}"]

        return edit

    def privileged(observed: Observed, child: ChildKey) -> list[str]:
        _pod(observed, child)["containers"][0]["securityContext"]["privileged"] = True
        return ["spec.template.spec.containers[0].securityContext.privileged"]

    def privileged_sidecar(observed: Observed, child: ChildKey) -> list[str]:
        _pod(observed, child)["containers"].append(_sidecar(privileged=True))
        return ["spec.template.spec.containers[1].securityContext.privileged"]

    def escalation(observed: Observed, child: ChildKey) -> list[str]:
        _pod(observed, child)["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
        return ["spec.template.spec.containers[0].securityContext.allowPrivilegeEscalation"]

    def escalating_init(observed: Observed, child: ChildKey) -> list[str]:
        pod = _pod(observed, child)
        pod.setdefault("initContainers", []).append({**_sidecar(allowPrivilegeEscalation=True), "name": "setup"})
        return [f"spec.template.spec.initContainers[{len(pod['initContainers']) - 1}]"
                ".securityContext.allowPrivilegeEscalation"]  # fmt: skip

    def capabilities(observed: Observed, child: ChildKey) -> list[str]:
        _pod(observed, child)["containers"][0]["securityContext"]["capabilities"]["add"] = ["NET_ADMIN"]
        return ["spec.template.spec.containers[0].securityContext.capabilities.add"]

    def sidecar_capabilities(observed: Observed, child: ChildKey) -> list[str]:
        _pod(observed, child)["containers"].insert(0, _sidecar(capabilities={"add": ["SYS_ADMIN"]}))
        return ["spec.template.spec.containers[0].securityContext.capabilities.add"]

    def host_path(observed: Observed, child: ChildKey) -> list[str]:
        pod = _pod(observed, child)
        pod["volumes"].append({"name": "host", "hostPath": {"path": "/", "type": ""}})
        pod["containers"].append({**_sidecar(), "volumeMounts": [{"name": "host", "mountPath": "/host"}]})
        return [f"spec.template.spec.volumes[{len(pod['volumes']) - 1}].hostPath"]

    edits = [
        ("hostNetwork", host("hostNetwork")),
        ("hostPID", host("hostPID")),
        ("hostIPC", host("hostIPC")),
        ("privileged", privileged),
        ("privileged-sidecar", privileged_sidecar),
        ("allowPrivilegeEscalation", escalation),
        ("escalating-init-container", escalating_init),
        ("capabilities-add", capabilities),
        ("sidecar-capabilities-add", sidecar_capabilities),
        ("hostPath-volume", host_path),
    ]
    return [
        pytest.param(edit, child, id=f"{child[1].removeprefix('assistant-')}-{name}")
        for child in (_ENGINE, _ROUTER)
        for name, edit in edits
    ]


def _dangers(pod: dict[str, Any]) -> list[str]:
    """What the edits above add, wherever it is in ``pod``."""
    found = [field for field in ("hostNetwork", "hostPID", "hostIPC") if pod.get(field)]
    for field in ("containers", "initContainers"):
        for container in pod.get(field) or []:
            context = container.get("securityContext") or {}
            found += [f for f in ("privileged", "allowPrivilegeEscalation") if context.get(f) is True]
            found += ["capabilities.add"] if (context.get("capabilities") or {}).get("add") else []
            found += [m["name"] for m in container.get("volumeMounts") or [] if m["name"] == "host"]
    found += [v["name"] for v in pod.get("volumes") or [] if "hostPath" in v]
    return found


@pytest.mark.parametrize("source", ASSISTANT_SOURCES)
@pytest.mark.parametrize(("edit", "child"), _dangerous_edits())
def test_a_dangerous_addition_to_a_pod_template_is_drift_and_taken_out(
    edit: Callable[[Observed, ChildKey], list[str]], child: ChildKey, source: str
) -> None:
    observed = every_kind(source)
    paths = edit(observed, child)
    result = decide_assistant(observed)
    assert actions(result) == [("patch", *child, "drifted: " + ", ".join(paths))]
    after = restored(observed, result)
    assert _dangers(_pod(after, child)) == []
    assert actions(decide_assistant(after)) == []


def _tolerated_edits() -> list[Any]:
    """Edits admission webhooks commonly make to a pod template: never drift."""

    def sidecar(pod: dict[str, Any]) -> None:
        pod["containers"].insert(0, _sidecar(runAsUser=1337, allowPrivilegeEscalation=False))

    def init_container(pod: dict[str, Any]) -> None:
        pod.setdefault("initContainers", []).insert(0, {**_sidecar(), "name": "mesh-init"})

    def volumes(pod: dict[str, Any]) -> None:
        pod["volumes"].insert(0, {"name": "mesh-certs", "emptyDir": {"medium": "Memory"}})
        pod["volumes"].append({"name": "ca-bundle", "configMap": {"name": "ca", "defaultMode": 420}})
        pod["containers"].append({**_sidecar(), "volumeMounts": [{"name": "mesh-certs", "mountPath": "/certs"}]})

    def sidecar_env(pod: dict[str, Any]) -> None:
        pod["containers"].append(_sidecar())
        pod["containers"][-1]["env"].append(
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
        )

    return [
        pytest.param(edit, child, id=f"{child[1].removeprefix('assistant-')}-{edit.__name__}")
        for child in (_ENGINE, _ROUTER)
        for edit in (sidecar, init_container, volumes, sidecar_env)
    ]


@pytest.mark.parametrize(("edit", "child"), _tolerated_edits())
def test_what_admission_webhooks_add_to_a_pod_template_is_tolerated_and_kept(
    edit: Callable[[dict[str, Any]], None], child: ChildKey
) -> None:
    observed = every_kind()
    template = observed[child]["spec"]["template"]
    template["metadata"]["annotations"]["sidecar.example.com/status"] = '{"injected": true}'
    edit(template["spec"])
    assert actions(decide_assistant(observed)) == []
    # A patch for something the operator sets keeps what the webhook added.
    theirs = copy.deepcopy(template["spec"])
    template["spec"]["containers"][next(i for i, c in enumerate(theirs["containers"]) if c["name"] != "mesh-proxy")][
        "image"
    ] = "example.com/hacked:latest"
    result = decide_assistant(observed)
    assert [a[:3] for a in actions(result)] == [("patch", *child)]
    after = _pod(restored(observed, result), child)
    for field in ("containers", "initContainers", "volumes"):
        assert sorted(c["name"] for c in after.get(field) or []) == sorted(c["name"] for c in theirs.get(field) or [])
    assert actions(decide_assistant(restored(observed, result))) == []


# --- writes fenced by resourceVersion, against the recorded objects --------------------------------------------


class RecordedServer:
    """The API server's side of the reconciler's writes, over the recorded objects (a stand-in: no kube-apiserver
    runs on these machines). Merge patches apply as ``merge_patch``; each write stores a new resourceVersion; a
    write whose ``resource_version`` is not the stored one is refused with 409, as the API server's precondition
    check refuses it. ``sent`` lists every patch as (kind, name, subresource, version it carried, HTTP status)."""

    def __init__(self, objects: dict[tuple[str, str], dict[str, Any]]) -> None:
        self.objects = copy.deepcopy(objects)
        self.sent: list[tuple[str, str, str | None, str | None, int]] = []
        self.revision = 9000

    def bump(self, kind: str, name: str, patch: dict[str, Any]) -> str:
        """Another writer's change (a user, the new leader): applied with a new resourceVersion."""
        self.revision += 1
        stored = merge_patch(self.objects[(kind, name)], patch)
        stored["metadata"]["resourceVersion"] = str(self.revision)
        self.objects[(kind, name)] = stored
        return str(self.revision)

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        found = self.objects.get((kind, name))
        return copy.deepcopy(found) if found is not None else None

    async def merge_patch(
        self,
        kind: str,
        namespace: str,
        name: str,
        body: dict[str, Any],
        subresource: str | None = None,
        *,
        resource_version: str | None = None,
    ) -> dict[str, Any]:
        stored = self.objects[(kind, name)]
        if resource_version is not None and resource_version != stored["metadata"]["resourceVersion"]:
            self.sent.append((kind, name, subresource, resource_version, 409))
            raise KubeError(409, "Conflict", f"Operation cannot be fulfilled on {name}: the object has been modified")
        self.sent.append((kind, name, subresource, resource_version, 200))
        self.bump(kind, name, body)
        return copy.deepcopy(self.objects[(kind, name)])


class QuietReconciler(PoolReconciler):
    """The operator's reconciler with its Events kept in a list (the Event API is not what these tests are about)."""

    def __init__(self, server: RecordedServer, cache: ObjectCache) -> None:
        super().__init__(server, cache=cache, image_tag=RECORDED_OPERATOR_TAG, clock=lambda: ASSISTANT_NOW)  # type: ignore[arg-type]
        self.posted: list[str] = []

    async def _post_event(self, namespace: str, pool: Any, event: Any) -> None:
        self.posted.append(event.reason)


def recorded_world(edit: Callable[[Observed], None] = lambda observed: None) -> dict[tuple[str, str], dict[str, Any]]:
    """The pool ``assistant`` (fixed, with the status this version writes for it) and its children after this
    version's first reconcile, each with the resourceVersion the server recorded; ``edit`` changes the children."""
    children = every_kind()
    edit(children)
    pool = assistant()
    pool["status"] = decide_assistant(children).status
    return {(KIND, "assistant"): pool, **children}


def cached(world: dict[tuple[str, str], dict[str, Any]]) -> ObjectCache:
    cache = ObjectCache()
    for (kind, _), body in world.items():
        cache.put(kind, copy.deepcopy(body))
    return cache


def _hacked_image(observed: Observed) -> None:
    observed[("Deployment", "assistant-decoder")]["spec"]["template"]["spec"]["containers"][0]["image"] = "x/hacked:1"


@pytest.mark.asyncio
async def test_a_child_patch_carries_the_resource_version_it_was_decided_from() -> None:
    world = recorded_world(_hacked_image)
    server = RecordedServer(world)
    recorded_version = world[("Deployment", "assistant-decoder")]["metadata"]["resourceVersion"]
    await QuietReconciler(server, cached(world)).reconcile("llm", "assistant")
    assert server.sent == [("Deployment", "assistant-decoder", None, recorded_version, 200)]
    decoder = server.objects[("Deployment", "assistant-decoder")]
    assert decoder["spec"]["template"]["spec"]["containers"][0]["image"] != "x/hacked:1"


@pytest.mark.asyncio
async def test_a_patch_decided_from_a_child_that_changed_since_is_refused_and_decided_again() -> None:
    """The cache still shows the hand edit, but another writer has put the child back meanwhile: the late patch
    is refused (409), the reconciler reads the child and, deciding again, finds nothing to do."""
    world = recorded_world(_hacked_image)
    server = RecordedServer(world)
    original = every_kind()[("Deployment", "assistant-decoder")]["spec"]["template"]["spec"]["containers"][0]
    put_back = {"spec": {"template": {"spec": {"containers": [original]}}}}
    theirs = server.bump("Deployment", "assistant-decoder", put_back)
    stale = world[("Deployment", "assistant-decoder")]["metadata"]["resourceVersion"]
    reconciler = QuietReconciler(server, cached(world))
    result = await reconciler.reconcile("llm", "assistant")
    assert result is not None
    children = [sent for sent in server.sent if sent[0] != KIND]  # the status is written for what is there now
    assert children == [("Deployment", "assistant-decoder", None, stale, 409)]
    assert server.objects[("Deployment", "assistant-decoder")]["metadata"]["resourceVersion"] == theirs
    assert "Patched" not in reconciler.posted


@pytest.mark.asyncio
async def test_a_status_decided_from_a_pool_that_changed_since_is_refused_and_decided_again() -> None:
    """The pool's spec changed after the cache read it: the status decided from the old spec is refused (409);
    the reconciler reads the pool and writes the status of what the server holds, with its resourceVersion."""
    world = recorded_world()
    world[(KIND, "assistant")]["status"]["conditions"] = []  # a status to write
    server = RecordedServer(world)
    theirs = server.bump(KIND, "assistant", {"metadata": {"labels": {"team": "search"}}})
    stale = world[(KIND, "assistant")]["metadata"]["resourceVersion"]
    await QuietReconciler(server, cached(world)).reconcile("llm", "assistant")
    assert server.sent == [(KIND, "assistant", "status", stale, 409), (KIND, "assistant", "status", theirs, 200)]
    assert server.objects[(KIND, "assistant")]["status"]["conditions"]


# --- the pool's shape across an upgrade ------------------------------------------------------------------------


def test_an_upgrade_re_plans_a_recorded_pool_once() -> None:
    """The recorded plan of ``examples/pool.yaml`` is one prefiller and three decoders, sized for the prefiller's
    saturation rate; this version sizes the prefillers for the 1 s TTFT objective at the design rate: three."""
    body = recorded_pool_body("llm", "agents")
    assert (body["status"]["plan"]["prefillers"], body["status"]["plan"]["decoders"]) == (1, 3)
    result = decide(body, observed_for("llm", "agents", "kubectl-lists"))
    assert (result.status["plan"]["prefillers"], result.status["plan"]["decoders"]) == (3, 3)
    assert [event.reason for event in result.events] == ["Planned"]


def test_an_upgrade_keeps_a_running_pool_s_shape_and_an_edited_spec_takes_the_plans() -> None:
    """``examples/pool.yaml`` as the server stored it (planned P/D before shapes existed). Its spec defaults to
    Auto. Where this version's model would take aggregated engines for the same generation of the spec (here:
    the spec's objectives made loose and its conversations' KV held for a minute, without a new generation, as a
    model change would), the upgrade keeps P/D and says so; once its owner edits the spec (a new generation),
    the plan takes aggregated engines: the prefillers go to 0 and the router stops looking for them."""
    body = recorded_pool_body("llm", "agents")
    body["spec"]["priorityClasses"] = [{"name": "standard", "weight": 1.0, "ttftSloMs": 3_600_000,
                                        "tpotSloMs": 60_000}]  # fmt: skip
    body["spec"]["workload"]["lifetimeS"] = 60  # KV memory sets the count: a prefiller is one engine more
    observed = observed_for("llm", "agents", "kubectl-lists")
    kept = decide(body, observed)
    shapes = kept.status["plan"]["shapes"]
    assert shapes["shape"] == "Disaggregated"
    assert shapes["aggregated"]["engines"] < shapes["disaggregated"]["engines"]
    assert shapes["reason"].startswith("kept Disaggregated: the spec has not changed")

    edited = copy.deepcopy(body)
    edited["metadata"]["generation"] += 1
    edited["spec"]["headroom"] = 1.6
    moved = decide(edited, observed)
    assert moved.status["plan"]["shapes"]["shape"] == "Aggregated" and moved.status["plan"]["prefillers"] == 0
    patches = {(a.kind, a.name): a for a in moved.actions if a.verb == "patch"}
    assert patches[("Deployment", "agents-prefiller")].body["spec"]["replicas"] == 0
    router = json.loads(patches[("ConfigMap", "agents-config")].body["data"]["router.json"])
    assert "prefillerService" not in router
    assert "Planned" in [event.reason for event in moved.events]
