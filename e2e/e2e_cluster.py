"""What the e2e modules share: waiting on the cluster, reading objects through kubectl, and the operator process.

Who uses it: ``e2e/test_operator.py`` and ``e2e/test_gateway.py`` (e2e/ is on pytest's pythonpath; not named
``conftest``, which is tests/conftest.py there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
Kubectl = Callable[..., "subprocess.CompletedProcess[str]"]  # the `kubectl` fixture's type (e2e/conftest.py)

EXAMPLE = ROOT / "examples" / "pool.yaml"
RESYNC_S = 5
LEASE_DURATION_S = 6
LEASE = "coserve-e2e-operator"


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(1)


def get_json(kubectl: Kubectl, namespace: str, kind: str, name: str) -> dict[str, Any] | None:
    proc = kubectl("get", kind, name, "-n", namespace, "-o", "json", "--ignore-not-found", check=False)
    return json.loads(proc.stdout) if proc.returncode == 0 and proc.stdout.strip() else None


OPERATOR_KUBECONFIG_ENV = "COSERVE_E2E_OPERATOR_KUBECONFIG"


def operator_env() -> dict[str, str]:
    """The operator's environment: this one, with ``COSERVE_E2E_OPERATOR_KUBECONFIG`` as its KUBECONFIG when
    set. Then the operator runs with that kubeconfig's credentials (the chart's ServiceAccount, say, with only
    the chart's RBAC) while the tests act as the user who creates and edits pools (the default kubeconfig)."""
    own = os.environ.get(OPERATOR_KUBECONFIG_ENV)
    if not own:
        return dict(os.environ)
    if not Path(own).is_file():
        pytest.fail(f"{OPERATOR_KUBECONFIG_ENV}={own}: no such file")
    return {**os.environ, "KUBECONFIG": own}


@dataclass(frozen=True)
class Operator:
    """A ``coserve operator`` process this suite started, and its log."""

    process: subprocess.Popen[str]
    log: Path

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        if self.process.returncode not in (0, -15):
            print(self.log.read_text()[-4000:])


def start_operator(namespace: str, identity: str, log: Path) -> Operator:
    """``coserve operator`` on this machine, one replica of the suite's Lease."""
    coserve = Path(sys.executable).with_name("coserve")
    command = [str(coserve), "operator", "-n", namespace, "--resync-s", str(RESYNC_S), "--lease", LEASE,
               "--lease-namespace", namespace, "--identity", identity,
               "--lease-duration-s", str(LEASE_DURATION_S)]  # fmt: skip
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=operator_env(), text=True)
    return Operator(process, log)


@contextmanager
def acting_operator(namespace: str, identity: str, log: Path) -> Iterator[Operator | None]:
    """A ``coserve operator`` this suite starts for ``namespace``, stopped at the end; ``None`` when
    E2E_OPERATOR_IN_CLUSTER=1 says the chart's operator runs in the cluster."""
    if os.environ.get("E2E_OPERATOR_IN_CLUSTER") == "1":
        yield None
        return
    started = start_operator(namespace, identity, log)
    try:
        yield started
    finally:
        started.stop()
