"""The helm chart, rendered by a real helm binary and validated with kubernetes-validate (strict)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "coserve-operator"
KUBERNETES_VERSION = "1.37.0"
# Custom resources the schema bundle does not know: checked here by hand instead.
CUSTOM_KINDS = {"ServiceMonitor", "PodMonitor"}


def helm_binary() -> str:
    found = shutil.which("helm", path=str(ROOT / ".venv" / "bin")) or shutil.which("helm")
    if found is None:
        pytest.fail("helm not found: `make` installs it into .venv/bin (scripts/install_k8s_tools.py)")
    return found


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=120, check=False)
    if check and result.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed:\n{result.stderr}")
    return result


def render(*sets: str) -> list[dict[str, Any]]:
    args = ["template", "coserve", str(CHART), "--namespace", "coserve-system", "--include-crds"]
    for value in sets:
        args += ["--set", value]
    return [doc for doc in yaml.safe_load_all(helm(*args).stdout) if doc]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def test_helm_lint_is_clean() -> None:
    result = helm("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize(
    "sets",
    [
        (),
        ("watchNamespaces={llm,batch}",),
        ("serviceMonitor.enabled=true", "replicaCount=2", "image.tag=9.9.9"),
    ],
    ids=["cluster-wide", "namespaced", "service-monitor"],
)
def test_every_rendered_object_is_valid_in_strict_mode(sets: tuple[str, ...]) -> None:
    objects = render(*sets)
    assert objects
    for obj in objects:
        if obj["kind"] in CUSTOM_KINDS:
            assert obj["metadata"]["name"]
            continue
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_the_chart_crds_are_the_repository_crds() -> None:
    top = sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    assert top == sorted(p.name for p in (CHART / "crds").glob("*.yaml"))
    for name in top:
        assert (CHART / "crds" / name).read_bytes() == (ROOT / "crds" / name).read_bytes(), f"run `make crd` ({name})"


def test_the_operator_pod_is_locked_down() -> None:
    (deployment,) = by_kind(render(), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    assert container["args"][:2] == ["operator", "--all-namespaces"]
    assert "--lease=coserve-operator" in container["args"]
    assert deployment["spec"]["replicas"] == 2  # a standby that takes over
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert container["image"] == "ghcr.io/coserve/coserve:0.1.0"  # the chart's appVersion


def rules_of(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [rule for role in by_kind(objects, kind) for rule in role["rules"]]


def granted_by(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """(API group, resource, verb) of everything ``rules`` grant."""
    return {
        (group, resource, verb)
        for r in rules
        for group in r["apiGroups"]
        for resource in r["resources"]
        for verb in r["verbs"]
    }


def test_rbac_grants_only_what_the_operator_uses() -> None:
    granted = granted_by(rules_of(render(), "ClusterRole"))
    assert not any("*" in item for item in granted)
    assert not any(verb in {"deletecollection", "update", "escalate", "bind", "impersonate"} for _, _, verb in granted)
    # the things deleted: a disruption budget the user turned off, gateway mode's children when it is turned off
    assert {(group, resource) for group, resource, verb in granted if verb == "delete"} == {
        ("policy", "poddisruptionbudgets"),
        ("apps", "deployments"),
        ("", "services"),
        ("networking.k8s.io", "networkpolicies"),
        ("inference.networking.k8s.io", "inferencepools"),
        ("gateway.networking.k8s.io", "httproutes"),
    }
    assert ("", "configmaps", "delete") not in granted
    # pods: annotated with a deletion cost before a scale-down, never created, deleted or watched
    assert {verb for _, resource, verb in granted if resource == "pods"} == {"get", "list", "patch"}
    assert {verb for _, resource, verb in granted if resource == "persistentvolumeclaims"} == {
        "get",
        "list",
        "watch",
        "create",
        "patch",
    }
    # Secrets: only the verbs the pools' router tokens need (no delete, no update)
    assert {verb for _, resource, verb in granted if resource == "secrets"} == {
        "get",
        "list",
        "watch",
        "create",
        "patch",
    }
    assert ("networking.k8s.io", "networkpolicies", "create") in granted
    assert ("apps", "deployments", "create") in granted
    assert ("coserve.dev", "coservepools/status", "patch") in granted
    assert ("coserve.dev", "coservepools", "create") not in granted  # users create pools, not the operator
    assert ("", "events", "create") in granted
    assert ("", "events", "patch") in granted  # a repeated Event is counted, not posted anew


def test_the_leader_election_lease_is_the_only_thing_granted_in_the_release_namespace() -> None:
    objects = render()
    (role,) = [r for r in by_kind(objects, "Role") if r["metadata"]["name"].endswith("-leader-election")]
    assert role["metadata"]["namespace"] == "coserve-system"
    assert {g for r in role["rules"] for g in r["apiGroups"]} == {"coordination.k8s.io"}
    named = [r for r in role["rules"] if r.get("resourceNames")]
    assert named == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                      "resourceNames": ["coserve-operator"], "verbs": ["get", "patch"]}]  # fmt: skip
    (binding,) = [b for b in by_kind(objects, "RoleBinding") if b["roleRef"]["name"] == role["metadata"]["name"]]
    assert binding["metadata"]["namespace"] == "coserve-system"


def test_without_leader_election_the_operator_runs_standalone() -> None:
    objects = render("operator.leaderElection.enabled=false", "replicaCount=1")
    (deployment,) = by_kind(objects, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--standalone" in args and not any(a.startswith("--lease") for a in args)
    assert not [r for r in by_kind(objects, "Role") if r["metadata"]["name"].endswith("-leader-election")]


def test_namespaced_mode_creates_nothing_cluster_wide() -> None:
    objects = render("watchNamespaces={llm,batch}")
    assert not by_kind(objects, "ClusterRole") and not by_kind(objects, "ClusterRoleBinding")
    pool_roles = [r for r in by_kind(objects, "Role") if not r["metadata"]["name"].endswith("-leader-election")]
    assert sorted(r["metadata"]["namespace"] for r in pool_roles) == ["batch", "llm"]
    bindings = [b for b in by_kind(objects, "RoleBinding") if not b["metadata"]["name"].endswith("-leader-election")]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["batch", "llm"]
    (deployment,) = by_kind(objects, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=llm" in args and "--namespace=batch" in args and "--all-namespaces" not in args


@pytest.mark.parametrize(
    ("value", "complaint"),
    [
        ("replicaCount=0", "replicaCount"),
        ("image.pullPolicy=Sometimes", "pullPolicy"),
        ("operatr.leaderElection.enabled=false", "operatr"),
        ("watchNamespaces={Bad_Name}", "watchNamespaces"),
        ("operator.resyncSeconds=0", "resyncSeconds"),
    ],
)
def test_bad_values_are_refused_with_the_field_named(value: str, complaint: str) -> None:
    result = helm("template", "coserve", str(CHART), "--set", value, check=False)
    assert result.returncode != 0
    assert complaint in result.stderr


def test_the_install_notes_name_only_files_that_exist() -> None:
    """What ``helm install`` prints a user to run next: every file it names is in the source, and it sends
    nobody to a URL (the chart does not know where its user got the source)."""
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    assert "http://" not in notes and "https://" not in notes
    named = re.findall(r"(?:-f|plan)\s+(\S+\.ya?ml)", notes)
    assert named, "the notes show how to create a pool"
    for path in named:
        assert (ROOT / path).is_file(), path
