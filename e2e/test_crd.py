"""The CoServePool CRD against a real kube-apiserver, driven through kubectl.

These check what neither jsonschema nor the kmock emulator can: the API server accepts and
establishes the CRD, `kubectl explain` teaches the API from its descriptions, the examples apply,
the printer columns, server-side defaulting and validation, and the status subresource.
Run with `pytest e2e -m e2e` and a cluster in KUBECONFIG; see e2e/README.md.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

# Every test needs the CRD; crd_applied is a session fixture from conftest.py.
pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("crd_applied")]

ROOT = Path(__file__).resolve().parents[1]
CRD = yaml.safe_load((ROOT / "crds" / "coserve.dev_coservepools.yaml").read_text())
SPEC_SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
EXAMPLES = sorted((ROOT / "examples").glob("pool*.yaml"))
FIELD_MANAGER = "coserve-e2e"

# The `kubectl` fixture from conftest.py: kubectl(*args, stdin=None, check=True, timeout_s=120).
Kubectl = Callable[..., "subprocess.CompletedProcess[str]"]


def minimal_pool(name: str) -> dict[str, Any]:
    """A pool with only the required fields, so the schema's defaults fill in the rest."""
    return {
        "apiVersion": "coserve.dev/v1alpha1",
        "kind": "CoServePool",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": "Qwen/Qwen3-8B"},
            "workload": {"arrivalRatePerS": 1.5, "inputTokens": 15000, "outputTokens": 1000, "lifetimeS": 12},
            "profile": {
                "prefillLatency": {"perTokenS": 4.0e-5},
                "decodeThroughputTokensPerS": 1000,
                "kvCapacityTokens": 300000,
            },
        },
    }


def apply(
    kubectl: Kubectl, namespace: str, doc: dict[str, Any], *, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Server-side apply one object into namespace, written as YAML on kubectl's stdin."""
    args = ("apply", "--server-side", f"--field-manager={FIELD_MANAGER}", "-n", namespace, "-f", "-")
    return kubectl(*args, stdin=yaml.safe_dump(doc), check=check)


def get_pool(kubectl: Kubectl, namespace: str, name: str) -> dict[str, Any]:
    pool: dict[str, Any] = json.loads(kubectl("get", "coservepool", name, "-n", namespace, "-o", "json").stdout)
    return pool


def pool_names(kubectl: Kubectl, namespace: str) -> set[str]:
    # `-o name` prints coservepool.coserve.dev/NAME, one a line.
    listing = kubectl("get", "coservepools", "-n", namespace, "-o", "name").stdout
    return {line.rsplit("/", 1)[-1] for line in listing.split()}


def words(text: str) -> str:
    """text with its whitespace collapsed, since kubectl explain wraps descriptions."""
    return " ".join(text.split())


def explain(kubectl: Kubectl, field: str, *phrases: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """`kubectl explain field`, retried until it shows every phrase or timeout_s passes.

    The API server publishes a new CRD's OpenAPI schema a few seconds after it is established.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        proc = kubectl("explain", field, check=False)
        shown = proc.returncode == 0 and all(phrase in words(proc.stdout) for phrase in phrases)
        if shown or time.monotonic() > deadline:
            return proc
        time.sleep(2)


@pytest.fixture(scope="module")
def example_pools(kubectl: Kubectl, namespace: str, crd_applied: object) -> list[str]:
    """Apply every examples/pool*.yaml into the test namespace; returns the pools' names."""
    names = []
    for path in EXAMPLES:
        doc = yaml.safe_load(path.read_text())
        doc["metadata"].pop("namespace", None)  # kubectl refuses -n that disagrees with the file
        apply(kubectl, namespace, doc)
        names.append(doc["metadata"]["name"])
    return names


def test_crd_applies_and_is_established(kubectl: Kubectl, crd_applied: subprocess.CompletedProcess[str]) -> None:
    name = CRD["metadata"]["name"]
    assert f"customresourcedefinition.apiextensions.k8s.io/{name} serverside-applied" in crd_applied.stdout
    kubectl("wait", "--for", "condition=established", f"crd/{name}", "--timeout=60s")

    status = json.loads(kubectl("get", "crd", name, "-o", "json").stdout)["status"]
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions["Established"] == "True"
    assert conditions["NamesAccepted"] == "True"  # False when the plural or short name clashes
    assert status["acceptedNames"]["shortNames"] == ["csp"]


def test_explain_shows_field_descriptions(kubectl: Kubectl) -> None:
    workload = SPEC_SCHEMA["workload"]["properties"]
    rate_doc = words(workload["arrivalRatePerS"]["description"])
    proc = explain(kubectl, "coservepool.spec.workload", "arrivalRatePerS", rate_doc)
    assert proc.returncode == 0, proc.stderr
    shown = words(proc.stdout)
    assert rate_doc in shown
    for field in workload:
        assert field in shown

    url_doc = words(SPEC_SCHEMA["autoscaling"]["properties"]["prometheusUrl"]["description"])
    proc = explain(kubectl, "coservepool.spec.autoscaling.prometheusUrl", url_doc)
    assert proc.returncode == 0, proc.stderr
    assert "prometheusUrl" in proc.stdout
    assert url_doc in words(proc.stdout)


def test_examples_apply_and_list_with_printer_columns(
    kubectl: Kubectl, namespace: str, example_pools: list[str]
) -> None:
    assert len(example_pools) == len(EXAMPLES) > 0

    lines = kubectl("get", "csp", "-n", namespace).stdout.splitlines()
    assert lines[0].split() == ["NAME", "SHAPE", "PREFILLERS", "DECODERS", "READY", "BOTTLENECK", "AGE"]
    assert set(example_pools) <= {line.split()[0] for line in lines[1:]}


def test_server_fills_in_schema_defaults(kubectl: Kubectl, namespace: str) -> None:
    apply(kubectl, namespace, minimal_pool("defaults"))
    spec = get_pool(kubectl, namespace, "defaults")["spec"]

    assert spec["headroom"] == SPEC_SCHEMA["headroom"]["default"] == 1.5
    # engine is absent: the server defaults it to {} and then fills in the fields nested inside.
    assert spec["engine"]["image"] == SPEC_SCHEMA["engine"]["properties"]["image"]["default"]
    assert spec["priorityClasses"] == SPEC_SCHEMA["priorityClasses"]["default"]
    assert [c["name"] for c in spec["priorityClasses"]] == ["interactive", "standard", "offline"]


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        pytest.param(("workload", "inputTokens"), -1, "spec.workload.inputTokens", id="negative-input-tokens"),
        pytest.param(("workload", "arrivalRatePerS"), "fast", "spec.workload.arrivalRatePerS", id="string-rate"),
        pytest.param(("kvOffload", "backend"), "nvme", "spec.kvOffload.backend", id="unknown-offload-backend"),
        pytest.param(("headroom",), 0.5, "spec.headroom", id="headroom-below-one"),
    ],
)
def test_server_rejects_invalid_spec(
    kubectl: Kubectl,
    namespace: str,
    path: tuple[str, ...],
    value: object,
    field: str,
) -> None:
    name = f"invalid-{path[-1].lower()}"
    doc = minimal_pool(name)
    parent = doc["spec"]
    for key in path[:-1]:
        parent = parent.setdefault(key, {})
    parent[path[-1]] = value

    proc = apply(kubectl, namespace, doc, check=False)

    assert proc.returncode != 0, f"the API server accepted {field}={value!r}"
    assert field in proc.stderr
    assert name not in pool_names(kubectl, namespace)


def test_status_is_a_subresource(kubectl: Kubectl, namespace: str) -> None:
    apply(kubectl, namespace, minimal_pool("status-check"))
    generation = get_pool(kubectl, namespace, "status-check")["metadata"]["generation"]

    status_patch = json.dumps({"status": {"prefillers": "2/1"}})
    kubectl(
        "patch",
        "coservepool",
        "status-check",
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        status_patch,
    )
    pool = get_pool(kubectl, namespace, "status-check")
    assert pool["status"]["prefillers"] == "2/1"
    assert pool["metadata"]["generation"] == generation  # status writes do not bump the spec's generation
    row = kubectl("get", "csp", "status-check", "-n", namespace, "--no-headers").stdout.split()
    assert row[2] == "2/1"  # the PREFILLERS printer column (SHAPE, before it, is <none>: no plan yet)

    # A write to the main resource changes spec; the status it carries is ignored.
    spec_patch = json.dumps({"spec": {"headroom": 2.0}, "status": {"prefillers": "9/9"}})
    kubectl("patch", "coservepool", "status-check", "-n", namespace, "--type=merge", "-p", spec_patch)
    pool = get_pool(kubectl, namespace, "status-check")
    assert pool["spec"]["headroom"] == 2.0
    assert pool["status"]["prefillers"] == "2/1"
    assert pool["metadata"]["generation"] == generation + 1


def test_delete_pools(kubectl: Kubectl, namespace: str, example_pools: list[str]) -> None:
    assert set(example_pools) <= pool_names(kubectl, namespace)

    kubectl("delete", "coservepools", "--all", "-n", namespace, "--wait=true", "--timeout=60s")

    assert pool_names(kubectl, namespace) == set()
