"""Batch locks (coserve.router.batch_lock): one holder at a time, taken over when the holder dies.

The file backend is tested across real processes (``flock`` is the kernel's); the Lease backend runs
against kmock's Kubernetes emulator (a test double for the API server, which cannot run here) with fake
clocks, as tests/operator/test_leader.py does for the elector it reuses.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import kmock as kmocklib
import pytest

from coserve.operator.kube import KubeClient, config_for
from coserve.router.batch_lock import FileLocks, LeaseLocks, batch_locks_from_env, lease_name
from operator_kmock import NS, ApiServerEmulator, declare_resources

HOLDER = """
import asyncio, sys
from pathlib import Path

from coserve.router.batch_lock import FileLocks

async def main() -> None:
    hold = await FileLocks(Path(sys.argv[1])).try_acquire(sys.argv[2])
    print("held" if hold is not None else "refused", flush=True)
    if hold is not None:
        await asyncio.Event().wait()  # holds it until killed

asyncio.run(main())
"""


def spawn_holder(directory: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory), "batch_x"], stdout=subprocess.PIPE, text=True
    )


def first_line(process: subprocess.Popen[str], timeout_s: float = 30.0) -> str:
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout_s):
            raise AssertionError(f"process {process.pid} printed nothing in {timeout_s} s")
    return process.stdout.readline().strip()


@pytest.mark.asyncio
async def test_a_file_lock_has_one_holder_while_it_lives_and_is_free_the_moment_it_dies(tmp_path: Path) -> None:
    first = spawn_holder(tmp_path)
    others: list[subprocess.Popen[str]] = []
    try:
        assert first_line(first) == "held"
        others.append(spawn_holder(tmp_path))
        assert first_line(others[-1]) == "refused"  # another process
        for _ in range(100):
            assert await FileLocks(tmp_path).try_acquire("batch_x") is None  # another runner in this process
        assert await FileLocks(tmp_path).try_acquire("batch_y") is not None  # one lock per batch

        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=10)
        hold = await FileLocks(tmp_path).try_acquire("batch_x")  # at once: the kernel dropped it with the process
        assert hold is not None and hold.valid
        others.append(spawn_holder(tmp_path))
        assert first_line(others[-1]) == "refused"
        await hold.release()
        await hold.release()  # idempotent
        assert not hold.valid
        others.append(spawn_holder(tmp_path))
        assert first_line(others[-1]) == "held"
    finally:
        for process in (first, *others):
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)
            if process.stdout is not None:
                process.stdout.close()


def test_the_backend_comes_from_the_environment_and_an_unknown_one_is_refused(tmp_path: Path) -> None:
    assert isinstance(batch_locks_from_env(tmp_path, {}), FileLocks)
    assert isinstance(batch_locks_from_env(tmp_path, {"COSERVE_BATCH_LOCK": "file"}), FileLocks)
    with pytest.raises(ValueError, match="COSERVE_BATCH_LOCK: must be one of file, lease, got 'nfs'"):
        batch_locks_from_env(tmp_path, {"COSERVE_BATCH_LOCK": "nfs"})


@pytest.mark.parametrize(
    ("batch_id", "name"),
    [("batch_0a1b2c", "coserve-batch-0a1b2c"), ("Batch_X.1", "coserve-batch-x.1"), ("b_", "coserve-b")],
)
def test_a_lease_name_is_a_dns_subdomain(batch_id: str, name: str) -> None:
    assert lease_name(batch_id) == name


# --- the Lease backend ------------------------------------------------------------------------------------

T0 = datetime(2026, 12, 3, 16, 0, 0, tzinfo=UTC)
# long real periods: the renewer (which sleeps retry_period_s of real time) never runs within this test
TIMING = {"lease_duration_s": 150.0, "renew_deadline_s": 100.0, "retry_period_s": 20.0}


class Clock:
    def __init__(self, origin: float) -> None:
        self.now, self.origin = origin, origin

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> datetime:
        return T0 + timedelta(seconds=self.now - self.origin)


def holder(kmock: kmocklib.KubernetesEmulator) -> Any:
    return kmock.objects["coordination.k8s.io/v1/leases", NS, "coserve-batch-x"]["spec"].get("holderIdentity")


@pytest.mark.asyncio
@pytest.mark.kmock(cls=ApiServerEmulator)
async def test_a_batch_lease_has_one_holder_which_stops_acting_before_another_takes_over(
    kmock: kmocklib.KubernetesEmulator,
) -> None:
    declare_resources(kmock)
    server = str(kmock.url).rstrip("/")
    clock_a, clock_b = Clock(0.0), Clock(500.0)  # unrelated monotonic origins
    async with (
        KubeClient(config_for(server, token="token-a")) as kube_a,  # noqa: S106 - a test's bearer token
        KubeClient(config_for(server, token="token-b")) as kube_b,  # noqa: S106
    ):
        a = LeaseLocks(kube_a, NS, "a", monotonic=clock_a.monotonic, clock=clock_a.wall, **TIMING)
        b = LeaseLocks(kube_b, NS, "b", monotonic=clock_b.monotonic, clock=clock_b.wall, **TIMING)
        hold_a = await a.try_acquire("batch_x")
        assert hold_a is not None and hold_a.valid and holder(kmock) == "a"
        assert await b.try_acquire("batch_x") is None  # B sees A's record: its clock for it starts here
        seen = len(list(kmock))
        clock_b.now += 19.0
        assert await b.try_acquire("batch_x") is None and len(list(kmock)) == seen  # at most once per retry period

        # A goes silent (its renewer never runs here): it stops acting at its renew deadline...
        clock_a.now += 99.0
        assert hold_a.valid
        clock_a.now += 1.0
        assert not hold_a.valid
        # ...before B may take over, a lease duration after B last saw the record change
        clock_b.now = 500.0 + 130.0
        assert await b.try_acquire("batch_x") is None and holder(kmock) == "a"
        clock_b.now = 500.0 + 150.0  # the next attempt, one retry period on
        hold_b = await b.try_acquire("batch_x")
        assert hold_b is not None and hold_b.valid and holder(kmock) == "b"

        await hold_a.release()  # a lapsed holder's release never erases its successor's record
        assert holder(kmock) == "b"
        await hold_b.release()  # a clean release frees the Lease for the next attempt, without waiting
        assert not holder(kmock)
        hold_a = await a.try_acquire("batch_x")
        assert hold_a is not None and holder(kmock) == "a"
        await hold_a.release()
        await a.close()
        await b.close()
