"""Two real ``coserve operator`` processes against one kmock Kubernetes emulator: one acts, one stands by.

Each process has its own kubeconfig with its own bearer token, and kmock
records every request with its headers, so each request is attributed to the
replica that made it. The checks: only the Lease holder writes (the other one
polls the Lease and watches); when the holder is killed (SIGKILL, no release)
the other takes over within a lease duration plus a retry period and acts;
when the holder stops cleanly (SIGTERM) it releases the Lease and the other
takes over within about a retry period.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import kmock as kmocklib
import pytest

from operator_kmock import (
    CHILDREN,
    MERGE,
    NS,
    POOL,
    POOLS,
    POOLS_URL,
    ApiServerEmulator,
    VersionedEmulator,
    condition,
    declare_resources,
    exists,
)

pytestmark = [pytest.mark.asyncio, pytest.mark.kmock(cls=ApiServerEmulator)]  # errors as the API server answers

LEASE = "coserve-operator"
LEASES = "coordination.k8s.io/v1/leases"
LEASE_DURATION_S = 3.0
RETRY_S = LEASE_DURATION_S * 2 / 15  # what `coserve operator` derives: 0.4 s
SLACK_S = 2.0  # two Python processes and the emulator share two cores
ROUTER_URL = f"/apis/apps/v1/namespaces/{NS}/deployments/chat-router"
WRITES = {"POST", "PATCH", "PUT", "DELETE"}
WATCHED = {"coservepools", "deployments", "services", "configmaps"}


def autoscaled_pool() -> dict[str, Any]:
    """The sample pool, autoscaled against a Prometheus that is not there: the acting replica's autoscaler
    evaluates it every second (it writes the status and posts a Warning Event once, then holds quietly)."""
    pool = copy.deepcopy(POOL)
    pool["spec"]["autoscaling"] = {"enabled": True, "prometheusUrl": "http://127.0.0.1:9", "evaluationIntervalS": 1}
    return pool


def kubeconfig(path: Path, server: str, token: str) -> Path:
    path.write_text(
        f"""apiVersion: v1
kind: Config
clusters:
- name: kmock
  cluster: {{server: "{server}"}}
users:
- name: operator
  user: {{token: {token}}}
contexts:
- name: kmock
  context: {{cluster: kmock, user: operator, namespace: {NS}}}
current-context: kmock
"""
    )
    return path


def verb(request: kmocklib.Request) -> str:
    return str(request.method).upper().rsplit(".", 1)[-1]


def who(request: kmocklib.Request) -> str:
    """``a``, ``b`` (by bearer token) or ``test`` (this test's own requests carry none)."""
    auth = next((value for key, value in request.headers.items() if key.lower() == "authorization"), "")
    return {"": "test", "Bearer token-a": "a", "Bearer token-b": "b"}.get(auth, auth)


def plural(request: kmocklib.Request) -> str:
    return request.resource.plural if request.resource is not None else ""


def describe(request: kmocklib.Request) -> str:
    return f"{who(request)} {verb(request)} {request.url.path_qs}"


def writes(requests: list[kmocklib.Request], *, leases: bool = False) -> dict[str, list[str]]:
    """Write requests by replica: children, pools, status, Events (``leases``: the Lease's writes instead)."""
    found: dict[str, list[str]] = {"a": [], "b": [], "test": []}
    for request in requests:
        if verb(request) in WRITES and (plural(request) == "leases") == leases:
            found.setdefault(who(request), []).append(describe(request))
    return found


def holder(kmock: kmocklib.KubernetesEmulator) -> str | None:
    try:
        return (kmock.objects[LEASES, NS, LEASE]["spec"] or {}).get("holderIdentity")
    except KeyError:
        return None


class Replicas:
    """The operator processes, each logging to its own file; all killed at the end."""

    def __init__(self, tmp_path: Path, server: str) -> None:
        self.tmp_path, self.server = tmp_path, server
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: list[Path] = []
        self.alive: set[str] = set()  # expected to be running: one that exits fails the wait at once

    def start(self, identity: str) -> subprocess.Popen[bytes]:
        config = kubeconfig(self.tmp_path / f"kubeconfig-{identity}", self.server, f"token-{identity}")
        log = self.tmp_path / f"operator-{identity}-{len(self.logs)}.log"
        self.logs.append(log)
        command = [
            sys.executable, "-m", "coserve", "operator", "--kubeconfig", str(config), "-n", NS,
            "--lease", LEASE, "--lease-namespace", NS, "--identity", identity,
            "--lease-duration-s", str(LEASE_DURATION_S), "--resync-s", "1", "--log-level", "INFO",
        ]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        with log.open("wb") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.processes[identity] = process
        return process

    async def stop(self, identity: str, how: signal.Signals, timeout_s: float = 15.0) -> int:
        """Send ``how`` and wait (without blocking the emulator, which runs in this event loop) until it exits."""
        process = self.processes[identity]
        process.send_signal(how)
        deadline = time.monotonic() + timeout_s
        while process.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"operator {identity} still running {timeout_s} s after {how.name}")
            await asyncio.sleep(0.02)
        return process.returncode

    def kill_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
        for process in self.processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)

    def report(self) -> str:
        return "\n".join(f"===== {log.name}\n{log.read_text(errors='replace')[-8000:]}" for log in self.logs)


@pytest.fixture
def replicas(tmp_path: Path, kmock: kmocklib.KubernetesEmulator) -> Iterator[Replicas]:
    group = Replicas(tmp_path, str(kmock.url).rstrip("/"))
    try:
        yield group
    finally:
        group.kill_all()
        print(group.report())  # pytest shows it when the test fails


async def until(predicate: Any, what: str, replicas: Replicas, timeout_s: float = 20.0, poll_s: float = 0.05) -> Any:
    """Poll the emulator until ``predicate`` holds; fail early with the logs if an operator died."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = predicate()
            if result:
                return result
        except (KeyError, ValueError, TypeError):
            pass
        for identity, process in replicas.processes.items():
            if process.poll() is not None and identity in replicas.alive:
                raise AssertionError(f"operator {identity} exited ({process.returncode}) waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(poll_s)


def watching(requests: list[kmocklib.Request], identity: str) -> bool:
    return {plural(r) for r in requests if who(r) == identity and r.params.get("watch") == "true"} >= WATCHED


def polled_lease(requests: list[kmocklib.Request], identity: str) -> int:
    return sum(1 for r in requests if who(r) == identity and plural(r) == "leases" and verb(r) == "GET")


async def a_leads_and_b_stands_by(kmock: kmocklib.KubernetesEmulator, replicas: Replicas) -> None:
    """A starts and takes the Lease; B starts, watches, and polls the Lease in vain."""
    requests = lambda: list(kmock)  # noqa: E731 - every request so far, in arrival order
    replicas.start("a")
    replicas.alive.add("a")
    await until(lambda: holder(kmock) == "a", "the Lease held by a", replicas, timeout_s=30)
    await until(lambda: watching(requests(), "a"), "a's watches", replicas)
    replicas.start("b")
    replicas.alive.add("b")
    await until(lambda: watching(requests(), "b") and polled_lease(requests(), "b") >= 2, "b standing by", replicas)


async def edit_router_and_wait_until_put_back(
    client: httpx.AsyncClient, kmock: kmocklib.KubernetesEmulator, replicas: Replicas, by_hand: int
) -> None:
    response = await client.patch(ROUTER_URL, headers=MERGE, json={"spec": {"replicas": by_hand}})
    assert response.status_code == 200, response.text
    await until(
        lambda: kmock.objects["apps/v1/deployments", NS, "chat-router"]["spec"]["replicas"] == 2,
        "the router's replicas put back to 2",
        replicas,
        timeout_s=10,
    )


async def test_only_the_lease_holder_writes_and_the_other_takes_over(
    kmock: kmocklib.KubernetesEmulator, replicas: Replicas
) -> None:
    declare_resources(kmock)
    server = str(kmock.url).rstrip("/")
    requests = lambda: list(kmock)  # noqa: E731 - every request so far, in arrival order
    started = time.monotonic()

    await a_leads_and_b_stands_by(kmock, replicas)
    await asyncio.sleep(0.3)  # the emulator subscribes a watch to changes just after its replay
    assert holder(kmock) == "a"

    async with httpx.AsyncClient(base_url=server, timeout=10) as client:
        response = await client.post(f"/apis/coserve.dev/v1alpha1/namespaces/{NS}/coservepools", json=autoscaled_pool())
        assert response.status_code in (200, 201), response.text
        await until(lambda: all(exists(kmock, r, n) for r, n in CHILDREN), "all seven children", replicas)
        await until(
            lambda: condition(kmock, "AutoscalingActive")["reason"] == "PrometheusUnreachable",
            "the autoscaler's verdict in the status",
            replicas,
        )

        # the window: 4 s (four resyncs, ten Lease rounds) with three hand edits, each one a race for both replicas
        mark, window_started = len(requests()), time.monotonic()
        for replicas_by_hand in (7, 5, 9):
            await edit_router_and_wait_until_put_back(client, kmock, replicas, replicas_by_hand)
            await asyncio.sleep(1.0)
        await asyncio.sleep(max(0.0, 4.0 - (time.monotonic() - window_started)))
        window = requests()[mark:]
        done = writes(window)
        assert sum("deployments/chat-router" in line for line in done["a"]) == 3, done["a"]
        assert done["b"] == [], f"b wrote while a held the Lease: {done['b']}"
        assert polled_lease(window, "b") >= 4  # b was alive and asking (every 0.4 s)
        everything = requests()
        assert writes(everything)["b"] == [] and writes(everything, leases=True)["b"] == [], "b wrote before"
        assert {verb(r) for r in everything if who(r) == "b"} == {"GET"}  # reads, lists and watches only
        assert writes(everything, leases=True)["a"][0].startswith("a POST")  # a created the Lease
        assert any("/events" in line for line in writes(everything)["a"])  # a's autoscaler reported Prometheus down

        # SIGKILL: A dies without releasing the Lease
        replicas.alive.discard("a")
        killed_at = time.monotonic()
        assert await replicas.stop("a", signal.SIGKILL) == -signal.SIGKILL
        await asyncio.sleep(0.2)  # let the emulator take in what was already on the wire
        mark = len(requests())
        assert holder(kmock) == "a"
        await until(lambda: holder(kmock) == "b", "the Lease taken over by b", replicas, timeout_s=15, poll_s=0.02)
        takeover_s = time.monotonic() - killed_at
        print(f"SIGKILL: b holds the Lease {takeover_s:.2f} s after a was killed")
        assert takeover_s <= LEASE_DURATION_S + RETRY_S + SLACK_S, takeover_s
        assert takeover_s >= LEASE_DURATION_S - RETRY_S - 0.2, f"b took over a live Lease after {takeover_s:.2f} s"
        assert kmock.objects[LEASES, NS, LEASE]["spec"]["leaseTransitions"] == 1

        # B acts: it puts a hand-edited child back
        await edit_router_and_wait_until_put_back(client, kmock, replicas, 6)
        after = requests()[mark:]
        done = writes(after)
        assert done["a"] == [] and writes(after, leases=True)["a"] == [], "a wrote after it was killed"
        assert any("deployments/chat-router" in line for line in done["b"]), done["b"]

    # a restarted A stands by; SIGTERM on B releases the Lease and A takes over within about a retry period
    replicas.start("a")
    replicas.alive.add("a")
    mark = len(requests())
    await until(lambda: watching(requests()[mark:], "a") and polled_lease(requests()[mark:], "a") >= 2, "a back",
                replicas)  # fmt: skip
    assert holder(kmock) == "b"
    standing_by = requests()[mark:]
    assert writes(standing_by)["a"] == [] and writes(standing_by, leases=True)["a"] == [], "a wrote standing by"
    replicas.alive.discard("b")
    terminated_at = time.monotonic()
    assert await replicas.stop("b", signal.SIGTERM) == 0
    exited_s = time.monotonic() - terminated_at
    released = [r for r in requests()[mark:] if who(r) == "b" and plural(r) == "leases" and verb(r) == "PATCH"
                and not ((r.data or {}).get("spec") or {}).get("holderIdentity", "b")]  # fmt: skip
    assert released, "b did not release the Lease on SIGTERM"
    await until(lambda: holder(kmock) == "a", "the Lease taken over by a", replicas, timeout_s=10, poll_s=0.02)
    handover_s = time.monotonic() - terminated_at
    print(f"SIGTERM: b exited after {exited_s:.2f} s; a holds the Lease {handover_s:.2f} s after the signal")
    # a Lease left to expire would take over 2.6 s (a lease duration less a retry period) after b's last renewal
    assert handover_s - exited_s <= RETRY_S + SLACK_S / 2, (exited_s, handover_s)
    handed_over = len(requests())
    async with httpx.AsyncClient(base_url=server, timeout=10) as client:
        await edit_router_and_wait_until_put_back(client, kmock, replicas, 8)
    done = writes(requests()[handed_over:])
    assert any("deployments/chat-router" in line for line in done["a"]) and done["b"] == [], done
    assert kmock.objects[POOLS, NS, "chat"]["status"]["plan"]
    assert time.monotonic() - started < 60


@pytest.mark.kmock(cls=VersionedEmulator)  # resourceVersion preconditions, as kube-apiserver enforces them
async def test_a_deposed_leader_s_late_writes_never_land(kmock: VersionedEmulator, replicas: Replicas) -> None:
    """A leader decides a write and sends it; the request is held on the way (``hold``) and the leader is paused
    (SIGSTOP) past its Lease. The other replica takes over, and the pool's spec changes, so it writes the same
    child. Then the held request lands and the old leader resumes. The write was decided from a version of the
    child that is no longer there: the API server refuses it (409), and the old leader stands down instead of
    writing again. Without the ``resourceVersion`` precondition the late patch lands and the router is put
    back to the old spec's replica count."""
    declare_resources(kmock)
    server = str(kmock.url).rstrip("/")
    await a_leads_and_b_stands_by(kmock, replicas)
    async with httpx.AsyncClient(base_url=server, timeout=10) as client:
        response = await client.post(f"/apis/coserve.dev/v1alpha1/namespaces/{NS}/coservepools", json=POOL)
        assert response.status_code in (200, 201), response.text
        await until(lambda: all(exists(kmock, r, n) for r, n in CHILDREN), "all the children", replicas)
        await until(lambda: kmock.objects[POOLS, NS, "chat"].get("status", {}).get("plan"), "a's status", replicas)

        # a's write to the router is held on the way; a is paused as soon as it has sent it
        kmock.hold("token-a", ("/deployments/chat-router",))
        response = await client.patch(ROUTER_URL, headers=MERGE, json={"spec": {"replicas": 7}})
        assert response.status_code == 200, response.text
        await until(lambda: kmock.waiting, "a's patch of the router, on its way", replicas)
        replicas.processes["a"].send_signal(signal.SIGSTOP)

        # b takes over; the spec now asks for 3 routers, and b writes them
        response = await client.patch(f"{POOLS_URL}/chat", headers=MERGE, json={"spec": {"router": {"replicas": 3}}})
        assert response.status_code == 200, response.text
        await until(lambda: holder(kmock) == "b", "the Lease taken over by b", replicas, timeout_s=15)
        # from here on a is deposed: what it had on the wire when it stopped (a Lease renewal, say) has landed by
        # now, while it still held the Lease; anything of a's that lands after this point is a stale write
        taken = len(kmock.writes)
        await until(
            lambda: kmock.objects["apps/v1/deployments", NS, "chat-router"]["spec"]["replicas"] == 3,
            "b's write of 3 routers",
            replicas,
        )

        # the held request lands, and a resumes
        log = replicas.logs[0]
        seen = len(log.read_text(errors="replace"))
        kmock.release("token-a")
        replicas.processes["a"].send_signal(signal.SIGCONT)
        await until(lambda: [w for w in kmock.writes[taken:] if w.bearer == "token-a"], "a's late write", replicas)
        await until(
            lambda: re.search(r"stops leading|lost the lease|not leading", log.read_text(errors="replace")[seen:]),
            "a standing down",
            replicas,
        )
        late = [w for w in kmock.writes[taken:] if w.bearer == "token-a"]
        landed = [w for w in late if w.status < 400]
        assert not landed, f"the deposed leader's writes landed: {landed}"
        assert any(w.status == 409 and w.path.endswith("/deployments/chat-router") for w in late), late
        assert kmock.objects["apps/v1/deployments", NS, "chat-router"]["spec"]["replicas"] == 3
