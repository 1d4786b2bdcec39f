"""Fixtures for end-to-end tests against the real cluster in KUBECONFIG (or ~/.kube/config).

The tests talk to a kube-apiserver through the `kubectl` binary, so they check what no emulator
gives: schema validation, defaulting, printer columns and the status subresource. Without kubectl
or a reachable server every test skips with the same reason.

Side effects on the cluster: the CoServePool CRD is applied (server-side, field manager
`coserve-e2e`) and deleted at the end only if this session created it; each session works in its
own namespace, deleted at the end.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CRD_DIR = ROOT / "crds"
CRD_NAME = "coservepools.coserve.dev"
FIELD_MANAGER = "coserve-e2e"
NO_CLUSTER = "no cluster: set KUBECONFIG to run e2e tests"

# kubectl(*args, stdin=None, check=True, timeout_s=120) -> the finished process; check=True fails the test.
Kubectl = Callable[..., "subprocess.CompletedProcess[str]"]


def _run(binary: str, *args: str, stdin: str | None, timeout_s: float) -> subprocess.CompletedProcess[str]:
    # The binary comes from $KUBECTL or PATH, the arguments from these tests: no shell involved.
    return subprocess.run([binary, *args], input=stdin, capture_output=True, text=True, timeout=timeout_s, check=False)


@pytest.fixture(scope="session")
def kubectl() -> Kubectl:
    """Run kubectl against the configured cluster; skips the session when there is none."""
    binary = shutil.which(os.environ.get("KUBECTL", "kubectl"))
    if binary is None:
        pytest.skip(f"{NO_CLUSTER} (kubectl not found: put it on PATH or set KUBECTL)")
    try:
        probe = _run(binary, "version", "--request-timeout=5s", stdin=None, timeout_s=30)
    except subprocess.TimeoutExpired:
        pytest.skip(f"{NO_CLUSTER} (kubectl version timed out)")
    if probe.returncode != 0:
        reason = probe.stderr.strip().splitlines()[-1:] or [f"exit status {probe.returncode}"]
        pytest.skip(f"{NO_CLUSTER} ({reason[0]})")

    def run(
        *args: str, stdin: str | None = None, check: bool = True, timeout_s: float = 120
    ) -> subprocess.CompletedProcess[str]:
        proc = _run(binary, *args, stdin=stdin, timeout_s=timeout_s)
        if check and proc.returncode != 0:
            pytest.fail(f"kubectl {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
        return proc

    return run


@pytest.fixture(scope="session")
def namespace(kubectl: Kubectl) -> Iterator[str]:
    """A fresh namespace for this session, deleted (without waiting) at the end."""
    name = f"coserve-e2e-{uuid.uuid4().hex[:8]}"
    kubectl("create", "namespace", name)
    yield name
    kubectl("delete", "namespace", name, "--ignore-not-found", "--wait=false", check=False)


@pytest.fixture(scope="session")
def crd_applied(kubectl: Kubectl) -> Iterator[subprocess.CompletedProcess[str]]:
    """`kubectl apply --server-side -f crds/`, waited for until CoServePools can be listed.

    Yields the apply's result. The CRD is deleted afterwards only if it did not exist before, so a
    cluster that already runs coserve keeps its CRD (and its pools).
    """
    existed = bool(kubectl("get", "crd", CRD_NAME, "--ignore-not-found", "-o", "name").stdout.strip())
    applied = kubectl(
        "apply", "--server-side", f"--field-manager={FIELD_MANAGER}", "--force-conflicts", "-f", str(CRD_DIR)
    )
    kubectl("wait", "--for", "condition=established", f"crd/{CRD_NAME}", "--timeout=60s")
    # NOTE: discovery can trail the Established condition by a moment; wait until the resource is served.
    deadline = time.monotonic() + 60
    while kubectl("get", "coservepools", "--all-namespaces", "-o", "name", check=False).returncode != 0:
        if time.monotonic() > deadline:
            pytest.fail("coservepools not served 60 s after the CRD was established")
        time.sleep(1)
    yield applied
    if not existed:
        kubectl("delete", "crd", CRD_NAME, "--ignore-not-found", "--wait=false", check=False)
