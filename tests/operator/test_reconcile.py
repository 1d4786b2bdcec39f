"""Tests of coserve.operator.reconcile: the operator's decisions, without a cluster."""

from __future__ import annotations

import contextlib
import copy
from datetime import UTC, datetime
from fractions import Fraction
from typing import Any

import pytest

from coserve.api.problems import Problem
from coserve.operator.normalize import parse_quantity, same_quantity
from coserve.operator.reconcile import ChildKey, drift, reconcile
from operator_kmock import as_stored
from pool_builders import sample_pool

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
LATER = datetime(2026, 12, 2, 12, 5, tzinfo=UTC)
UID = "0b6a1c0e-7d4f-4b8e-9a57-3f1f6f0c2a11"

POOL: dict[str, Any] = sample_pool(uid=UID, generation=1)


def pool(**spec_updates: Any) -> dict[str, Any]:
    body = copy.deepcopy(POOL)
    body["spec"].update(copy.deepcopy(spec_updates))
    return body


def applied(body: dict[str, Any], ready: bool = True) -> dict[ChildKey, dict[str, Any]]:
    """What the API server holds after the operator's first reconcile, stored as the server stores it (``as_stored``,
    checked against the recordings in test_apiserver_fixtures.py), with some server-side additions."""
    result = reconcile(body, {}, NOW)
    observed: dict[ChildKey, dict[str, Any]] = {}
    for action in result.actions:
        child = as_stored(action.body)
        if child["kind"] == "Secret":
            child["data"] = {"token": "c2VjcmV0"}  # the adapter generates the router token when it creates the Secret
        child["metadata"]["uid"] = f"uid-{action.name}"
        child["metadata"]["resourceVersion"] = "17"
        if child["kind"] == "Deployment":
            child["spec"]["progressDeadlineSeconds"] = 600  # a server default the operator never sets
            replicas = child["spec"]["replicas"]
            child["status"] = {"replicas": replicas, "readyReplicas": replicas if ready else 0}
        observed[(action.kind, action.name)] = child
    return observed


def with_status(
    body: dict[str, Any], observed: dict[ChildKey, dict[str, Any]], written_for: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``body`` as the next reconcile sees it: with the status the last one (of ``written_for``) wrote."""
    out = copy.deepcopy(body)
    out["status"] = reconcile(written_for or body, observed, NOW).status
    return out


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == kind)


def test_a_new_pool_creates_every_child_and_reports_progress() -> None:
    result = reconcile(pool(), {}, NOW)
    assert [(a.verb, a.kind, a.name) for a in result.actions] == [
        ("create", "ConfigMap", "chat-config"),
        ("create", "Deployment", "chat-prefiller"),
        ("create", "Deployment", "chat-decoder"),
        ("create", "Deployment", "chat-router"),
        ("create", "Service", "chat-router"),
        ("create", "Service", "chat-prefiller"),
        ("create", "Service", "chat-decoder"),
        ("create", "Secret", "chat-router-token"),
        ("create", "NetworkPolicy", "chat-engines"),
        ("create", "ServiceAccount", "chat-router"),
        ("create", "Role", "chat-router"),
        ("create", "RoleBinding", "chat-router"),
        # on by default; no model cache claim: the sample pool asks for none
        ("create", "PodDisruptionBudget", "chat-router"),
        ("create", "PodDisruptionBudget", "chat-prefiller"),
        ("create", "PodDisruptionBudget", "chat-decoder"),
    ]
    for action in result.actions:
        (owner,) = action.body["metadata"]["ownerReferences"]
        assert owner["uid"] == UID and owner["controller"] is True
    status = result.status
    assert status["observedGeneration"] == 1
    assert status["plan"]["prefillers"] == 1 and status["plan"]["decoders"] >= 1
    assert condition(status, "PlanValid")["status"] == "True"
    assert condition(status, "Progressing")["reason"] == "Reconciling"
    assert condition(status, "Ready")["status"] == "False"
    assert [e.reason for e in result.events] == ["Planned", "Created"]  # one Event per verb, not per child
    assert all(name in result.events[1].message for name in ("chat-config", "chat-decoder", "chat-router"))


def test_a_converged_pool_does_nothing_and_is_ready() -> None:
    observed = applied(pool())
    body = with_status(pool(), observed)
    result = reconcile(body, observed, LATER)
    assert result.actions == ()
    assert result.events == ()  # nothing changed: no event noise on every resync
    status = result.status
    assert condition(status, "Ready") | {"lastTransitionTime": None} == condition(status, "Ready") | {
        "status": "True",
        "reason": "AllReplicasReady",
        "lastTransitionTime": None,
    }
    assert condition(status, "Progressing")["reason"] == "Converged"
    assert condition(status, "Degraded")["status"] == "False"
    decoders = status["replicas"]["decoders"]
    assert status["decoders"] == f"{decoders['ready']}/{decoders['desired']}"  # as kubectl prints READY


def test_two_reconciles_of_the_same_state_decide_the_same_thing() -> None:
    first = reconcile(pool(), {}, NOW)
    second = reconcile(pool(), {}, NOW)
    assert first == second


def test_conditions_keep_their_transition_time_while_their_status_holds() -> None:
    observed = applied(pool())
    body = with_status(pool(), {})  # written when the children were being created
    again = reconcile(body, observed, LATER).status
    assert condition(again, "PlanValid")["lastTransitionTime"] == "2026-12-02T12:00:00Z"
    assert condition(again, "Ready")["lastTransitionTime"] == "2026-12-02T12:05:00Z"  # False -> True now


def test_a_spec_change_patches_the_children_it_affects() -> None:
    observed = applied(pool())
    busier = pool(workload={**POOL["spec"]["workload"], "arrivalRatePerS": 6.0})
    busier["metadata"]["generation"] = 2
    result = reconcile(with_status(busier, observed, written_for=pool()), observed, LATER)
    patched = {(a.kind, a.name): a for a in result.actions}
    assert set(patched) <= {
        ("Deployment", "chat-prefiller"),
        ("Deployment", "chat-decoder"),
        ("ConfigMap", "chat-config"),
        ("PodDisruptionBudget", "chat-prefiller"),  # the budgets follow the plan
        ("PodDisruptionBudget", "chat-decoder"),
    }
    assert ("Deployment", "chat-decoder") in patched
    assert all(a.verb == "patch" for a in result.actions)
    assert "spec.replicas" in patched[("Deployment", "chat-decoder")].reason
    assert result.status["observedGeneration"] == 2
    assert "Planned" in [e.reason for e in result.events]


def test_a_child_deleted_by_hand_is_recreated_and_nothing_else_is_touched() -> None:
    observed = applied(pool())
    del observed[("Service", "chat-router")]
    result = reconcile(with_status(pool(), observed), observed, LATER)
    assert [(a.verb, a.kind, a.name) for a in result.actions] == [("create", "Service", "chat-router")]


def test_a_child_edited_by_hand_is_brought_back() -> None:
    observed = applied(pool())
    container = observed[("Deployment", "chat-decoder")]["spec"]["template"]["spec"]["containers"][0]
    container["image"] = "example.com/hacked:latest"
    observed[("Deployment", "chat-router")]["spec"]["replicas"] = 9
    result = reconcile(with_status(pool(), observed), observed, LATER)
    reasons = {a.name: a.reason for a in result.actions}
    assert set(reasons) == {"chat-decoder", "chat-router"}
    assert "spec.template.spec.containers" in reasons["chat-decoder"]
    assert reasons["chat-router"] == "drifted: spec.replicas"


def test_replica_counts_belong_to_the_autoscaler_when_it_is_on() -> None:
    autoscaled = pool(autoscaling={"enabled": True, "prometheusUrl": "http://prometheus:9090"})
    observed = applied(autoscaled)
    observed[("Deployment", "chat-decoder")]["spec"]["replicas"] = 7
    observed[("Deployment", "chat-decoder")]["status"]["readyReplicas"] = 7
    result = reconcile(with_status(autoscaled, observed), observed, LATER)
    assert result.actions == ()
    assert result.status["replicas"]["decoders"] == {"desired": 7, "ready": 7}
    # ... but only the replica count: an edited image is still put back.
    observed[("Deployment", "chat-decoder")]["spec"]["template"]["spec"]["containers"][0]["image"] = "x:1"
    (action,) = reconcile(with_status(autoscaled, observed), observed, LATER).actions
    assert action.body["spec"]["replicas"] == 7


@pytest.mark.parametrize(
    ("spec_updates", "field"),
    [
        (
            {
                "autoscaling": {
                    "enabled": True,
                    "prometheusUrl": "http://prometheus:9090",
                    "decoders": {"minReplicas": 5, "maxReplicas": 2},
                }
            },
            "spec.autoscaling.decoders.minReplicas",
        ),
        ({"autoscaling": {"enabled": True}}, "spec.autoscaling.prometheusUrl"),
        ({"workload": {**POOL["spec"]["workload"], "arrivalRatePerS": 1e9}}, "spec.workload.arrivalRatePerS"),
    ],
)
def test_a_semantically_invalid_spec_creates_and_changes_nothing(spec_updates: dict[str, Any], field: str) -> None:
    observed = applied(pool())
    body = pool(**spec_updates)
    for children in ({}, observed):
        result = reconcile(body, children, NOW)
        assert not result.plan_valid
        assert result.actions == ()
        plan_valid = condition(result.status, "PlanValid")
        assert plan_valid["status"] == "False" and plan_valid["reason"] == "InvalidSpec"
        assert field in plan_valid["message"]
        assert [(e.type, e.reason) for e in result.events] == [("Warning", "InvalidSpec")]
        assert field in result.events[0].message


def test_an_unreadable_profile_reference_is_reported_like_an_invalid_spec() -> None:
    problem = Problem("spec.profile.configMapRef.name", 'ConfigMap "missing" not found in namespace serving')
    result = reconcile(pool(), {}, NOW, profile_problem=problem)
    assert result.actions == ()
    assert "configMapRef" in condition(result.status, "PlanValid")["message"]


def test_a_child_that_belongs_to_someone_else_is_never_touched() -> None:
    observed = applied(pool())
    before = with_status(pool(), observed)  # converged
    foreign = observed[("Service", "chat-router")]
    foreign["metadata"]["ownerReferences"] = []
    foreign["spec"]["type"] = "LoadBalancer"
    result = reconcile(before, observed, LATER)
    assert result.actions == ()
    degraded = condition(result.status, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ChildConflict")
    assert "Service chat-router" in degraded["message"]
    assert ("Warning", "ChildConflict") in [(e.type, e.reason) for e in result.events]
    # the next resync sees the same conflict: the condition says it, no new Warning
    again = reconcile({**before, "status": result.status}, observed, LATER)
    assert again.actions == () and again.events == ()
    assert again.status == result.status


def test_an_invalid_spec_is_warned_about_once_and_again_when_the_problem_changes() -> None:
    bad = pool(autoscaling={"enabled": True})
    first = reconcile(bad, {}, NOW)
    assert [(e.type, e.reason) for e in first.events] == [("Warning", "InvalidSpec")]
    again = reconcile({**bad, "status": first.status}, {}, LATER)
    assert again.events == () and again.actions == ()
    worse = pool(workload={**POOL["spec"]["workload"], "arrivalRatePerS": 1e9})
    changed = reconcile({**worse, "status": again.status}, {}, LATER)
    assert [(e.type, e.reason) for e in changed.events] == [("Warning", "InvalidSpec")]


def test_a_failing_deployment_marks_the_pool_degraded() -> None:
    observed = applied(pool(), ready=False)
    observed[("Deployment", "chat-decoder")]["status"]["conditions"] = [
        {
            "type": "Progressing",
            "status": "False",
            "reason": "ProgressDeadlineExceeded",
            "message": 'ReplicaSet "chat-decoder-5d9" has timed out progressing.',
        }
    ]
    status = reconcile(with_status(pool(), observed), observed, LATER).status
    degraded = condition(status, "Degraded")
    assert degraded["reason"] == "DeploymentFailing" and "ProgressDeadlineExceeded" in degraded["message"]
    assert condition(status, "Ready")["reason"] == "ReplicasNotReady"
    assert condition(status, "Progressing")["reason"] == "WaitingForReplicas"


def test_status_written_by_others_does_not_break_a_reconcile() -> None:
    body = pool()
    body["status"] = {"kopf": {"progress": {}}, "conditions": [{"type": "Bogus"}], "plan": "not a plan"}
    result = reconcile(body, {}, NOW)
    assert result.plan_valid and len(result.actions) == 15
    assert "kopf" not in result.status


@pytest.mark.parametrize(
    ("desired", "observed", "paths"),
    [
        ({"a": 1}, {"a": 1, "server": "default"}, []),
        ({"a": {"b": [1, 2]}}, {"a": {"b": [1, 3]}}, ["a.b[1]"]),
        ({"a": [1]}, {"a": [1, 2]}, ["a"]),
        ({"a": True}, {"a": 1}, ["a"]),
        ({"a": {"b": 1}}, {}, ["a"]),
        ({"a": [{"x": 1}]}, {"a": [{"x": 1, "y": 2}]}, []),
        # false and empty values the API server leaves out match an absent field ...
        ({"a": False}, {}, []),
        ({"a": ""}, {}, []),
        ({"a": []}, {}, []),
        ({"a": {}}, {}, []),
        ({"a": None}, {}, []),
        ({"a": {"b": False, "c": 1}}, {"a": {"c": 1}}, []),
        ({"a": [{"b": False}]}, {"a": [{}]}, []),
        # ... but not a present field with another value, nor true, non-empty or zero values
        ({"a": False}, {"a": True}, ["a"]),
        ({"a": []}, {"a": [1]}, ["a"]),
        ({"a": {}}, {"a": "x"}, ["a"]),
        ({"a": True}, {}, ["a"]),
        ({"a": "x"}, {}, ["a"]),
        ({"a": [False]}, {}, ["a"]),
        ({"a": {"b": False}}, {}, ["a"]),
        ({"a": 0}, {}, ["a"]),
        # apiVersion and kind: LIST items carry neither; a different one is drift; only at the top
        ({"apiVersion": "v1", "kind": "Service", "a": 1}, {"a": 1}, []),
        ({"apiVersion": "apps/v1", "kind": "Deployment"}, {"apiVersion": "apps/v1beta2", "kind": "Deployment"},
         ["apiVersion"]),
        ({"a": {"apiVersion": "v1", "kind": "Pod"}}, {"a": {}}, ["a.apiVersion", "a.kind"]),
        # resource quantities compare by value, only under resources.limits / resources.requests
        ({"resources": {"limits": {"nvidia.com/gpu": 1}}}, {"resources": {"limits": {"nvidia.com/gpu": "1"}}}, []),
        ({"resources": {"requests": {"cpu": "0.5"}}}, {"resources": {"requests": {"cpu": "500m"}}}, []),
        ({"resources": {"limits": {"nvidia.com/gpu": 1}}}, {"resources": {"limits": {"nvidia.com/gpu": "2"}}},
         ["resources.limits.nvidia.com/gpu"]),
        ({"resources": {"limits": {"memory": "1Gi"}}}, {"resources": {"limits": {"memory": "1G"}}},
         ["resources.limits.memory"]),
        ({"c": [{"resources": {"requests": {"memory": "1024Mi"}}}]},
         {"c": [{"resources": {"requests": {"memory": "1Gi"}}}]}, []),
        ({"resources": {"limits": {"memory": "1Gi"}}}, {"resources": {"limits": {}}}, ["resources.limits.memory"]),
        ({"args": ["--port", 8000]}, {"args": ["--port", "8000"]}, ["args[1]"]),
        ({"args": ["1000m"]}, {"args": ["1"]}, ["args[0]"]),
        ({"limits": {"cpu": 1}}, {"limits": {"cpu": "1"}}, ["limits.cpu"]),
        ({"replicas": 1}, {"replicas": "1"}, ["replicas"]),
    ],
)  # fmt: skip
def test_drift_only_looks_at_fields_the_operator_sets(desired: Any, observed: Any, paths: list[str]) -> None:
    assert drift(desired, observed) == paths


@pytest.mark.parametrize(
    ("desired", "observed", "same"),
    [
        (1, "1", True),
        (8, "8", True),
        ("8", "8000m", True),
        ("0.5", "500m", True),
        (0.5, "500m", True),
        (".5", "500m", True),
        ("1.", "1", True),
        ("+1", "1", True),
        ("1024Mi", "1Gi", True),
        ("1.5Gi", "1536Mi", True),
        ("1Ki", "1024", True),
        ("1000m", "1", True),
        ("1e3", "1k", True),
        ("1E3", "1k", True),
        ("1e-3", "1m", True),
        ("1E", "1e18", True),
        ("2M", "2000k", True),
        ("1000000n", "1m", True),
        ("1000u", "1m", True),
        ("0.1m", "1m", True),  # the API server rounds resource amounts up to 1m
        ("100n", "1m", True),
        ("0", "0m", True),
        ("-0.1m", "-1m", True),
        ("1", "2", False),
        ("1Gi", "1G", False),
        ("1m", "1M", False),
        ("1001m", "1", False),
        ("1.1m", "1m", False),  # rounded up to 2m
        (1, "1x", False),
        ("1x", "1x", False),  # not a quantity: drift's plain comparison decides
        ("1e", "1", False),
        ("", "0", False),
        (True, "1", False),
        (None, "0", False),
        ("1e9999", "1e9999", False),
    ],
)
def test_quantities_are_compared_as_the_api_server_stores_them(desired: Any, observed: Any, same: bool) -> None:
    assert same_quantity(desired, observed) is same
    assert same_quantity(observed, desired) is same


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1", Fraction(1)),
        ("500m", Fraction(1, 2)),
        ("1.5Gi", Fraction(3 * 2**29)),
        ("12e-2", Fraction(3, 25)),
        ("-2k", Fraction(-2000)),
        ("3n", Fraction(3, 10**9)),
        ("7u", Fraction(7, 10**6)),
        ("1Ei", Fraction(2**60)),
        ("2P", Fraction(2 * 10**15)),
        (0.1, Fraction(1, 10)),
        ("Gi", None),
        ("1 Gi", None),
        ("1gi", None),
        ("1.2.3", None),
        (float("nan"), None),
        ([1], None),
    ],
)
def test_quantities_parse_exactly(text: Any, value: Fraction | None) -> None:
    assert parse_quantity(text) == value


def test_turning_autoscaling_off_clears_its_status_and_says_so() -> None:
    autoscaled = pool(autoscaling={"enabled": True, "prometheusUrl": "http://prometheus:9090"})
    observed = applied(autoscaled)
    body = with_status(autoscaled, observed)
    body["status"]["autoscaling"] = {"reason": "the model wants 1 prefillers and 2 decoders", "history": []}
    body["status"]["conditions"].append(
        {"type": "AutoscalingActive", "status": "True", "reason": "Evaluated", "message": "ok",
         "lastTransitionTime": "2026-12-02T12:00:00Z"}
    )  # fmt: skip
    body["spec"]["autoscaling"]["enabled"] = False
    result = reconcile(body, observed, LATER)
    assert result.status["autoscaling"] is None  # the merge patch removes it
    assert condition(result.status, "AutoscalingActive")["status"] == "False"
    assert condition(result.status, "AutoscalingActive")["reason"] == "Disabled"
    body["status"] = {k: v for k, v in result.status.items() if v is not None}  # what the API server then holds
    again = reconcile(body, observed, LATER)
    assert "autoscaling" not in again.status and again.status == body["status"]  # and nothing more to write


def test_a_removed_false_security_setting_is_drift() -> None:
    desired = {"securityContext": {"allowPrivilegeEscalation": False, "runAsNonRoot": True}}
    assert drift(desired, {"securityContext": {"runAsNonRoot": True}}) == ["securityContext.allowPrivilegeEscalation"]
    assert drift({"spec": {"publishNotReadyAddresses": False}}, {"spec": {}}) == []


# --- optional children: disruption budgets and the model cache claim -----------------------------------------------

OPTIONAL_KINDS = ("PodDisruptionBudget", "PersistentVolumeClaim")


def _child(kind: str, api_version: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """An optional child as the pool renders it (by hand, so these tests do not depend on which are rendered)."""
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {
            "name": name,
            "namespace": "serving",
            "labels": {"app.kubernetes.io/instance": "chat", "app.kubernetes.io/managed-by": "coserve-operator"},
            "ownerReferences": [{"apiVersion": "coserve.dev/v1alpha1", "kind": "CoServePool", "name": "chat",
                                 "uid": UID, "controller": True, "blockOwnerDeletion": True}],
        },
        "spec": spec,
    }  # fmt: skip


def budget(role: str, **spec: Any) -> dict[str, Any]:
    selector = {"matchLabels": {"app.kubernetes.io/instance": "chat", "coserve.dev/role": role}}
    return _child("PodDisruptionBudget", "policy/v1", f"chat-{role}", {"selector": selector, **spec})


def claim(storage: str = "100Gi", **spec: Any) -> dict[str, Any]:
    body = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": storage}}, **spec}
    return _child("PersistentVolumeClaim", "v1", "chat-model-cache", body)


def stored_claim(rendered: dict[str, Any]) -> dict[str, Any]:
    """A claim as the API server and the provisioner keep it: defaults, a bound volume, a finalizer, status.

    The server's part (the finalizer, ``volumeMode``) is what it added to the recorded claim
    (``data/apiserver/llm.assistant.persistentvolumeclaim.list.json``, checked in test_apiserver_fixtures.py);
    that claim stayed Pending, so the provisioner's part (a default class, ``volumeName``, Bound) is not recorded.
    """
    out = copy.deepcopy(rendered)
    out["metadata"] |= {"uid": "uid-claim", "resourceVersion": "9", "finalizers": ["kubernetes.io/pvc-protection"]}
    out["spec"].setdefault("storageClassName", "standard")
    out["spec"] |= {"volumeMode": "Filesystem", "volumeName": "pvc-0b6a1c0e"}
    out["status"] = {"phase": "Bound", "accessModes": ["ReadWriteOnce"], "capacity": {"storage": "100Gi"}}
    return out


@pytest.fixture
def optional(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The optional children the pool renders: the test fills the list; the real ones are left out."""
    from coserve.operator import reconcile as module

    rendered: list[dict[str, Any]] = []
    real = module.build_children

    def build(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        children = [c for c in real(*args, **kwargs) if c["kind"] not in OPTIONAL_KINDS]
        return children + copy.deepcopy(rendered)

    monkeypatch.setattr(module, "build_children", build)
    return rendered


def converged(body: dict[str, Any]) -> dict[ChildKey, dict[str, Any] | None]:
    """Every rendered child as stored, and every optional child the pool does not render absent."""
    observed: dict[ChildKey, dict[str, Any] | None] = dict(applied(body))
    for key in [("PodDisruptionBudget", f"chat-{r}") for r in ("router", "prefiller", "decoder")] + [
        ("PersistentVolumeClaim", "chat-model-cache")
    ]:
        observed.setdefault(key, None)
    return observed


def test_an_optional_child_not_rendered_is_neither_created_nor_waited_for(optional: list[dict[str, Any]]) -> None:
    observed = converged(pool())
    assert all(observed[key] is None for key in observed if key[0] in OPTIONAL_KINDS)
    result = reconcile(with_status(pool(), observed), observed, LATER)
    assert result.actions == () and result.events == ()
    assert condition(result.status, "Ready")["status"] == "True"
    assert condition(result.status, "Progressing")["reason"] == "Converged"


def test_a_rendered_budget_is_created_then_left_alone(optional: list[dict[str, Any]]) -> None:
    optional.append(budget("decoder", maxUnavailable=1))
    first = reconcile(pool(), {}, NOW)
    assert ("create", "PodDisruptionBudget", "chat-decoder") in [(a.verb, a.kind, a.name) for a in first.actions]
    observed = converged(pool())
    stored = observed[("PodDisruptionBudget", "chat-decoder")]
    assert stored is not None
    stored["status"] = {"currentHealthy": 2, "desiredHealthy": 1, "disruptionsAllowed": 1, "expectedPods": 2}
    result = reconcile(with_status(pool(), observed), observed, LATER)
    assert result.actions == ()


def test_a_budget_the_pool_no_longer_renders_is_deleted_if_the_pool_controls_it(
    optional: list[dict[str, Any]],
) -> None:
    optional.append(budget("decoder", maxUnavailable=1))
    observed = converged(pool())
    body = with_status(pool(), observed)
    optional.clear()  # the user turned the budget off
    result = reconcile(body, observed, LATER)
    (action,) = result.actions
    assert (action.verb, action.kind, action.name) == ("delete", "PodDisruptionBudget", "chat-decoder")
    assert action.body == {"metadata": {"name": "chat-decoder", "uid": "uid-chat-decoder"}}  # only that object
    assert [(e.type, e.reason) for e in result.events] == [("Normal", "Deleted")]
    assert "PodDisruptionBudget chat-decoder deleted" in result.events[0].message
    assert condition(result.status, "Progressing")["reason"] == "Reconciling"
    # once it is gone, nothing more to do
    observed[("PodDisruptionBudget", "chat-decoder")] = None
    again = reconcile({**body, "status": result.status}, observed, LATER)
    assert again.actions == () and condition(again.status, "Progressing")["reason"] == "Converged"


def test_a_budget_someone_else_owns_or_that_is_going_is_not_deleted(optional: list[dict[str, Any]]) -> None:
    optional.append(budget("decoder", maxUnavailable=1))
    observed = converged(pool())
    body = with_status(pool(), observed)
    optional.clear()
    theirs = observed[("PodDisruptionBudget", "chat-decoder")]
    assert theirs is not None
    theirs["metadata"]["ownerReferences"] = []
    result = reconcile(body, observed, LATER)
    assert result.actions == ()
    assert condition(result.status, "Degraded")["status"] == "False"  # not the pool's, not asked for: no conflict
    theirs["metadata"]["ownerReferences"] = budget("decoder")["metadata"]["ownerReferences"]
    theirs["metadata"]["deletionTimestamp"] = "2026-12-02T12:04:00Z"
    assert reconcile(body, observed, LATER).actions == ()


def test_a_budget_switching_to_the_other_bound_removes_the_old_one(optional: list[dict[str, Any]]) -> None:
    optional.append(budget("decoder", minAvailable=1))
    observed = converged(pool())
    body = with_status(pool(), observed)
    optional[:] = [budget("decoder", maxUnavailable="25%")]
    (action,) = reconcile(body, observed, LATER).actions
    assert action.verb == "patch" and "spec.minAvailable" in action.reason and "spec.maxUnavailable" in action.reason
    assert action.body["spec"]["minAvailable"] is None  # a merge patch removes it only when told to
    assert action.body["spec"]["maxUnavailable"] == "25%"
    stored = observed[("PodDisruptionBudget", "chat-decoder")]
    assert stored is not None
    del stored["spec"]["minAvailable"]
    stored["spec"]["maxUnavailable"] = "25%"
    assert reconcile(body, observed, LATER).actions == ()


def test_a_claim_the_server_filled_in_needs_nothing(optional: list[dict[str, Any]]) -> None:
    optional.append(claim())
    first = reconcile(pool(), {}, NOW)
    assert ("create", "PersistentVolumeClaim", "chat-model-cache") in [(a.verb, a.kind, a.name) for a in first.actions]
    observed = converged(pool())
    observed[("PersistentVolumeClaim", "chat-model-cache")] = stored_claim(claim())
    result = reconcile(with_status(pool(), observed), observed, LATER)
    assert result.actions == ()
    assert condition(result.status, "Degraded")["status"] == "False"


def test_a_claim_grows_but_never_shrinks_and_its_other_spec_fields_are_never_patched(
    optional: list[dict[str, Any]],
) -> None:
    optional.append(claim("100Gi", storageClassName="fast"))
    observed = converged(pool())
    observed[("PersistentVolumeClaim", "chat-model-cache")] = stored_claim(claim("100Gi", storageClassName="fast"))
    body = with_status(pool(), observed)

    optional[:] = [claim("200Gi", storageClassName="fast")]  # growth: only the storage request is sent
    (action,) = reconcile(body, observed, LATER).actions
    assert (action.verb, action.kind) == ("patch", "PersistentVolumeClaim")
    assert action.body == {"spec": {"resources": {"requests": {"storage": "200Gi"}}}}
    assert action.reason == "drifted: spec.resources.requests.storage"

    optional[:] = [claim("102400Mi", storageClassName="fast")]  # the same size, written another way
    assert reconcile(body, observed, LATER).actions == ()

    optional[:] = [claim("50Gi", storageClassName="slow", accessModes=["ReadWriteMany"])]
    result = reconcile(body, observed, LATER)
    assert result.actions == ()  # the API server would refuse each of these
    degraded = condition(result.status, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ChildImmutable")
    for part in ("PersistentVolumeClaim chat-model-cache", "spec.accessModes", "spec.storageClassName",
                 "spec.resources.requests.storage (cannot shrink from 100Gi to 50Gi)"):  # fmt: skip
        assert part in degraded["message"]
    assert condition(result.status, "Ready")["status"] == "True"  # the pool still serves
    assert [(e.type, e.reason) for e in result.events] == [("Warning", "ChildImmutable")]
    again = reconcile({**body, "status": result.status}, observed, LATER)
    assert again.events == () and again.status == result.status  # said once, kept in the condition


def test_a_claim_gets_its_labels_back_and_is_not_deleted_when_no_longer_rendered(
    optional: list[dict[str, Any]],
) -> None:
    optional.append(claim())
    observed = converged(pool())
    stored = stored_claim(claim())
    stored["metadata"]["labels"]["app.kubernetes.io/managed-by"] = "someone"
    observed[("PersistentVolumeClaim", "chat-model-cache")] = stored
    body = with_status(pool(), observed)
    (action,) = reconcile(body, observed, LATER).actions
    assert action.body == {"metadata": claim()["metadata"]}  # metadata only: never the spec
    optional.clear()  # the pool stops asking for a cache: the claim and its data stay
    assert reconcile(body, observed, LATER).actions == ()


def test_turning_the_budgets_off_deletes_them() -> None:
    observed = applied(pool())
    assert {name for kind, name in observed if kind == "PodDisruptionBudget"} == {
        "chat-router", "chat-prefiller", "chat-decoder"}  # fmt: skip
    off = pool(disruption={"enabled": False})
    result = reconcile(with_status(off, observed, written_for=pool()), observed, LATER)
    assert sorted((a.verb, a.kind, a.name) for a in result.actions) == [
        ("delete", "PodDisruptionBudget", name) for name in ("chat-decoder", "chat-prefiller", "chat-router")
    ]
    for kind, name in [k for k in observed if k[0] == "PodDisruptionBudget"]:
        del observed[(kind, name)]
    assert reconcile(with_status(off, observed), observed, LATER).actions == ()


def test_a_model_cache_size_creates_a_claim_that_then_only_grows() -> None:
    cached = pool(model={**POOL["spec"]["model"], "cache": {"size": "100Gi"}})
    created = [a for a in reconcile(cached, {}, NOW).actions if a.kind == "PersistentVolumeClaim"]
    assert [(a.verb, a.name) for a in created] == [("create", "chat-model-cache")]
    observed = applied(cached)
    observed[("PersistentVolumeClaim", "chat-model-cache")] = stored_claim(created[0].body)
    assert reconcile(with_status(cached, observed), observed, LATER).actions == ()
    bigger = pool(model={**POOL["spec"]["model"], "cache": {"size": "200Gi"}})
    claims = [a for a in reconcile(with_status(bigger, observed), observed, LATER).actions
              if a.kind == "PersistentVolumeClaim"]  # fmt: skip
    assert [(a.verb, a.body) for a in claims] == [
        ("patch", {"spec": {"resources": {"requests": {"storage": "200Gi"}}}})
    ]
    # no size (the user's own claim, or none): the operator's claim stays, with the model's weights on it
    uncached = pool()
    actions = reconcile(with_status(uncached, observed), observed, LATER).actions
    assert not [a for a in actions if a.kind == "PersistentVolumeClaim"]


def test_lightkubes_quantity_parser_still_departs_from_the_api_servers_grammar() -> None:
    """Why ``coserve.operator.normalize`` parses quantities itself: when this fails, lightkube follows the
    grammar (n and u suffixes, an E exponent, no Z/Y suffixes) and normalize can use it instead."""
    from lightkube.utils.quantity import parse_quantity as lightkube_quantity

    departs = []
    for text in ("3n", "7u", "1E3"):
        try:
            lightkube_quantity(text)
        except ValueError:
            departs.append(text)
    with contextlib.suppress(ValueError):
        if lightkube_quantity("1Zi") is not None:
            departs.append("1Zi")
    assert parse_quantity("3n") is not None and parse_quantity("1E3") == 1000 and parse_quantity("1Zi") is None
    assert departs, "lightkube's parser now follows the API server's quantity grammar: use it in normalize"
