"""Leader election on a coordination.k8s.io/v1 Lease (coserve.operator.leader).

``next_record`` is checked as a table; ``LeaderElector`` runs against kmock's
Kubernetes emulator (over HTTP) with fake clocks, two electors sharing one
Lease, so every boundary (renewal, expiry, renew deadline, release) is exact.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import kmock as kmocklib
import pytest
import pytest_asyncio

from coserve.operator.kube import KubeClient, KubeError, NotLeading, config_for
from coserve.operator.leader import LeaderElector, LeaseSettings, micro_time, next_record
from operator_kmock import NS, ApiServerEmulator, declare_resources, eventually

pytestmark = pytest.mark.kmock(cls=ApiServerEmulator)  # errors as the API server answers them

LEASES = "coordination.k8s.io/v1/leases"
T0 = datetime(2026, 12, 3, 16, 0, 0, tzinfo=UTC)
LATER = T0 + timedelta(seconds=7)
STAMP0, STAMP_LATER = micro_time(T0), micro_time(LATER)

# --- next_record: the pure decision -----------------------------------------------------------------------

HELD_BY_A = {
    "holderIdentity": "a",
    "leaseDurationSeconds": 15,
    "acquireTime": STAMP0,
    "renewTime": STAMP0,
    "leaseTransitions": 3,
}


def taken_by(identity: str, acquired: str, transitions: int) -> dict[str, Any]:
    return {
        "holderIdentity": identity,
        "leaseDurationSeconds": 15,
        "acquireTime": acquired,
        "renewTime": STAMP_LATER,
        "leaseTransitions": transitions,
    }


@pytest.mark.parametrize(
    ("spec", "identity", "expired", "expected"),
    [
        pytest.param(None, "a", False, taken_by("a", STAMP_LATER, 0), id="no lease yet: take it"),
        pytest.param({}, "a", False, taken_by("a", STAMP_LATER, 0), id="an empty spec: take it"),
        pytest.param(HELD_BY_A, "a", False, taken_by("a", STAMP0, 3), id="own renew keeps acquireTime, transitions"),
        pytest.param(HELD_BY_A, "a", True, taken_by("a", STAMP0, 3), id="own renew, even when it looks expired"),
        pytest.param(HELD_BY_A, "b", True, taken_by("b", STAMP_LATER, 4), id="expired other holder: take over +1"),
        pytest.param(HELD_BY_A, "b", False, None, id="live other holder: keep off"),
        # a released Lease: taking it counts as a transition, as in client-go
        pytest.param(
            {**HELD_BY_A, "holderIdentity": ""}, "b", False, taken_by("b", STAMP_LATER, 4), id="empty holder: take"
        ),
        pytest.param(
            {**HELD_BY_A, "holderIdentity": None}, "b", False, taken_by("b", STAMP_LATER, 4), id="null holder: take"
        ),
        pytest.param(
            {"holderIdentity": "a", "renewTime": STAMP0},
            "a",
            False,
            taken_by("a", STAMP_LATER, 0),
            id="own record without acquireTime gets one",
        ),
    ],
)
def test_next_record(
    spec: dict[str, Any] | None, identity: str, expired: bool, expected: dict[str, Any] | None
) -> None:
    assert next_record(spec, identity, expired, LATER, 15.0) == expected


def test_next_record_writes_whole_seconds_of_at_least_one() -> None:
    assert next_record(None, "a", False, T0, 2.6)["leaseDurationSeconds"] == 3  # type: ignore[index]
    assert next_record(None, "a", False, T0, 0.3)["leaseDurationSeconds"] == 1  # type: ignore[index]


def test_micro_time_is_metav1_microtime_in_utc() -> None:
    from datetime import timezone

    assert micro_time(datetime(2026, 12, 3, 17, 0, 0, 123456, tzinfo=timezone(timedelta(hours=1)))) == (
        "2026-12-03T16:00:00.123456Z"
    )


# --- LeaseSettings ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("timing", "message"),
    [
        ({"retry_period_s": 0.0}, "0 < retry period < renew deadline < lease duration"),
        ({"retry_period_s": -1.0}, "0 < retry period"),
        ({"retry_period_s": 10.0}, "got 10.0, 10.0, 15.0"),  # retry == renew deadline
        ({"renew_deadline_s": 15.0}, "got 2.0, 15.0, 15.0"),  # renew deadline == lease duration
        ({"renew_deadline_s": 20.0}, "renew deadline < lease duration"),
        ({"lease_duration_s": 1.0}, "got 2.0, 10.0, 1.0"),
    ],
)
def test_lease_settings_reject_inconsistent_timing(timing: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match="lease timing must satisfy") as raised:
        LeaseSettings("coserve-operator", NS, "a", **timing)
    assert message in str(raised.value)


def test_lease_settings_reject_an_empty_identity_and_take_client_go_defaults() -> None:
    with pytest.raises(ValueError, match="identity must not be empty"):
        LeaseSettings("coserve-operator", NS, "")
    settings = LeaseSettings("coserve-operator", NS, "a")
    assert (settings.lease_duration_s, settings.renew_deadline_s, settings.retry_period_s) == (15.0, 10.0, 2.0)


@pytest.mark.parametrize(
    ("timing", "margin"),
    [
        ({"call_timeout_s": 5.0}, "15.0 - 10.0 = 5.0 s"),  # equal to the margin: not shorter
        ({"call_timeout_s": 30.0}, "15.0 - 10.0 = 5.0 s"),  # lightkube's usual 30 s
        ({"call_timeout_s": 0.0}, "15.0 - 10.0 = 5.0 s"),
        (
            {"lease_duration_s": 6.0, "renew_deadline_s": 4.0, "retry_period_s": 1.0, "call_timeout_s": 2.5},
            "6.0 - 4.0 = 2.0 s",
        ),
    ],
)
def test_lease_settings_reject_a_call_timeout_as_long_as_the_renew_margin(
    timing: dict[str, float], margin: str
) -> None:
    with pytest.raises(ValueError, match="call_timeout_s must be positive and shorter than") as raised:
        LeaseSettings("coserve-operator", NS, "a", **timing)
    assert "lease_duration_s - renew_deadline_s" in str(raised.value)
    assert margin in str(raised.value)


def test_the_call_timeout_is_derived_from_the_renew_margin_unless_set() -> None:
    assert LeaseSettings("coserve-operator", NS, "a").call_timeout == 4.0  # 4/5 of 15 - 10
    fast = LeaseSettings("coserve-operator", NS, "a", lease_duration_s=4.0, renew_deadline_s=2.4, retry_period_s=0.4)
    assert fast.call_timeout < 4.0 - 2.4
    assert LeaseSettings("coserve-operator", NS, "a", call_timeout_s=4.5).call_timeout == 4.5


# --- LeaderElector against the emulator, with fake clocks ------------------------------------------------


class Clock:
    """A replica's clocks: ``monotonic`` (its own origin: replicas' clocks need not agree) and wall time."""

    def __init__(self, origin: float) -> None:
        self.now = origin
        self.origin = origin

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> datetime:
        return T0 + timedelta(seconds=self.now - self.origin)

    def advance(self, seconds: float) -> None:
        self.now += seconds


SETTINGS = {"name": "coserve-operator", "namespace": NS, "lease_duration_s": 15.0, "renew_deadline_s": 10.0,
            "retry_period_s": 2.0}  # fmt: skip


def elector(kube: KubeClient, identity: str, clock: Clock, **kwargs: Any) -> LeaderElector:
    return LeaderElector(
        kube, LeaseSettings(identity=identity, **SETTINGS), monotonic=clock.monotonic, clock=clock.wall, **kwargs
    )


def lease(kmock: kmocklib.KubernetesEmulator) -> dict[str, Any]:
    """The stored Lease spec, its times as datetimes (lightkube writes whole seconds without ``.000000``)."""
    spec = dict(kmock.objects[LEASES, NS, "coserve-operator"]["spec"])
    for key in ("acquireTime", "renewTime"):
        if spec.get(key):
            spec[key] = datetime.fromisoformat(spec[key].replace("Z", "+00:00"))
    return spec


def lease_writes(kmock: kmocklib.KubernetesEmulator) -> list[tuple[str, str | None]]:
    """(method, holder written) of every Lease write, in order."""
    return [
        (str(r.method).upper().rsplit(".", 1)[-1], ((r.data or {}).get("spec") or {}).get("holderIdentity"))
        for r in kmock
        if r.resource is not None
        and r.resource.plural == "leases"
        and str(r.method).upper().rsplit(".", 1)[-1] in ("POST", "PATCH", "PUT")
    ]


@pytest_asyncio.fixture
async def kubes(kmock: kmocklib.KubernetesEmulator) -> Any:
    """Two clients to the emulator, one per replica."""
    declare_resources(kmock)
    server = str(kmock.url).rstrip("/")
    async with (
        KubeClient(config_for(server, token="token-a")) as a,  # noqa: S106 - a test's bearer token
        KubeClient(config_for(server, token="token-b")) as b,  # noqa: S106
    ):
        yield a, b


@pytest.mark.asyncio
async def test_the_first_replica_creates_the_lease_and_the_second_keeps_off_while_it_renews(
    kmock: kmocklib.KubernetesEmulator, kubes: tuple[KubeClient, KubeClient]
) -> None:
    clock_a, clock_b = Clock(100.0), Clock(5000.0)  # unrelated monotonic origins
    started: list[str] = []

    async def on_started() -> None:  # a coroutine is awaited
        started.append("a")

    a = elector(kubes[0], "a", clock_a, on_started_leading=on_started)
    b = elector(kubes[1], "b", clock_b)
    assert not a.is_leader and not b.is_leader

    assert await a.try_acquire_or_renew()
    assert a.is_leader
    created = lease(kmock)
    assert created == {
        "holderIdentity": "a",
        "leaseDurationSeconds": 15,
        "acquireTime": T0,
        "renewTime": T0,
        "leaseTransitions": 0,
    }
    assert lease_writes(kmock) == [("POST", "a")]
    assert not await b.try_acquire_or_renew()
    assert not b.is_leader

    # A renews every retry period for far longer than a lease duration; B never takes over
    for step in range(1, 16):
        clock_a.advance(2.0)
        clock_b.advance(2.0)
        assert await a.try_acquire_or_renew(), step
        assert a.is_leader
        assert not await b.try_acquire_or_renew(), step
        assert not b.is_leader
    renewed = lease(kmock)
    assert renewed["holderIdentity"] == "a"
    assert renewed["acquireTime"] == T0  # kept across renewals
    assert renewed["renewTime"] == T0 + timedelta(seconds=30)
    assert renewed["leaseTransitions"] == 0
    assert lease_writes(kmock) == [("POST", "a")] + [("PATCH", "a")] * 15  # B wrote nothing

    # run() calls on_started_leading once, when A starts leading
    a2 = elector(kubes[0], "a", clock_a, on_started_leading=on_started)
    task = asyncio.create_task(a2.run())
    try:
        await asyncio.wait_for(a2.leading.wait(), 5)
        assert started == ["a"] and a2.is_leader
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


EPS = 2**-10  # about a millisecond, exact in binary: the clocks' sums carry no rounding


@pytest.mark.asyncio
@pytest.mark.parametrize(("waited", "takes_over"), [(15.0 - EPS, False), (15.0, True)])
async def test_a_silent_holder_is_replaced_only_after_a_lease_duration_on_the_taker_s_clock(
    kmock: kmocklib.KubernetesEmulator, kubes: tuple[KubeClient, KubeClient], waited: float, takes_over: bool
) -> None:
    clock_a, clock_b = Clock(0.0), Clock(777.0)
    a, b = elector(kubes[0], "a", clock_a), elector(kubes[1], "b", clock_b)
    assert await a.try_acquire_or_renew()
    clock_a.advance(2.0)
    clock_b.advance(3.0)
    assert not await b.try_acquire_or_renew()  # B sees the creation: its clock starts here
    clock_a.advance(2.0)
    clock_b.advance(1.5)
    assert await a.try_acquire_or_renew()  # A's last renewal
    clock_b.advance(0.5)
    assert not await b.try_acquire_or_renew()  # B sees the renewal: its clock starts again here
    # A stops renewing. B polls every retry period; nothing changes in the record...
    for _ in range(7):
        clock_b.advance(2.0)  # 14 s
        assert not await b.try_acquire_or_renew()
    clock_b.advance(waited - 14.0)
    assert await b.try_acquire_or_renew() is takes_over
    assert b.is_leader is takes_over
    record = lease(kmock)
    if takes_over:
        assert record["holderIdentity"] == "b"
        assert record["leaseTransitions"] == 1
        assert record["acquireTime"] == record["renewTime"] == clock_b.wall()
        # A comes back: it sees B's live record and stands by
        clock_a.advance(1.0)
        assert not await a.try_acquire_or_renew()
        assert not a.is_leader
        assert lease(kmock)["holderIdentity"] == "b"
    else:
        assert record["holderIdentity"] == "a"
        assert record["leaseTransitions"] == 0
        # ...and A's renewal just before expiry restarts B's count from when B sees it
        clock_a.advance(1.0)
        assert await a.try_acquire_or_renew()
        clock_b.advance(2 * EPS)  # past the old expiry
        assert not await b.try_acquire_or_renew()
        clock_b.advance(15.0 - EPS)
        assert not await b.try_acquire_or_renew()
        clock_b.advance(EPS)
        assert await b.try_acquire_or_renew()
        assert lease(kmock)["holderIdentity"] == "b"


@pytest.mark.asyncio
async def test_a_partitioned_holder_stops_acting_at_its_renew_deadline(
    kmock: kmocklib.KubernetesEmulator, kubes: tuple[KubeClient, KubeClient]
) -> None:
    clock_a = Clock(50.0)
    a = elector(kubes[0], "a", clock_a)
    assert await a.try_acquire_or_renew()
    # the partition: A's requests go to a closed port
    async with KubeClient(config_for("http://127.0.0.1:9"), timeout_s=2) as cut_off:
        a.kube = cut_off
        for _ in range(4):  # 8 s of failed renewals: still within the deadline
            clock_a.advance(2.0)
            with pytest.raises(KubeError) as raised:
                await a.try_acquire_or_renew()
            assert raised.value.status == 0
            assert a.is_leader
        clock_a.advance(1.999)
        assert a.is_leader
        clock_a.advance(0.001)  # 10 s since the last successful renewal
        assert not a.is_leader
    assert lease(kmock)["holderIdentity"] == "a"  # nobody else wrote: the record still names A


@pytest.mark.asyncio
async def test_a_partitioned_holder_stops_before_the_other_replica_starts(
    kmock: kmocklib.KubernetesEmulator, kubes: tuple[KubeClient, KubeClient]
) -> None:
    """Both run() loops in real time (short timings): when B starts leading, A already stopped acting."""
    # Short, but with room for a loaded CI machine: a 2.4 s renew deadline, renewals every 0.4 s.
    fast = {"name": "coserve-operator", "namespace": NS, "lease_duration_s": 4.0, "renew_deadline_s": 2.4,
            "retry_period_s": 0.4}  # fmt: skip
    seen: list[tuple[str, float, bool]] = []
    a: LeaderElector | None = None

    def b_started() -> None:
        assert a is not None
        seen.append(("b", time.monotonic(), a.is_leader))

    a = LeaderElector(kubes[0], LeaseSettings(identity="a", **fast), on_started_leading=lambda: seen.append(
        ("a", time.monotonic(), True)))  # fmt: skip
    b = LeaderElector(kubes[1], LeaseSettings(identity="b", **fast), on_started_leading=b_started)
    run_a = asyncio.create_task(a.run())
    await asyncio.wait_for(a.leading.wait(), 5)
    run_b = asyncio.create_task(b.run())
    try:
        await asyncio.sleep(5.0)  # over a lease duration: A renews, B stands by
        assert a.is_leader and not b.is_leader and [who for who, _, _ in seen] == ["a"]

        async def unreachable(*_: Any, **__: Any) -> Any:
            raise KubeError(0, "Unreachable", "ConnectError: partitioned")

        a.kube.get = unreachable  # type: ignore[method-assign]
        cut = time.monotonic()
        await eventually(lambda: not a.is_leader, "A standing by", 10)
        stopped_after = time.monotonic() - cut
        await asyncio.wait_for(b.leading.wait(), 10)
        assert [who for who, _, _ in seen] == ["a", "b"]
        _, b_started_at, a_still_leading = seen[-1]
        assert not a_still_leading  # never two acting replicas
        assert stopped_after <= 2.4 + 0.4 + 1.0  # the renew deadline (from its last renewal) + slack
        assert b_started_at - cut >= 4.0 - 0.4  # B waited a lease duration (from its last view of A's renewal)
        assert lease(kmock)["holderIdentity"] == "b"
        assert lease(kmock)["leaseTransitions"] == 1
    finally:
        for task in (run_a, run_b):
            task.cancel()
        await asyncio.gather(run_a, run_b, return_exceptions=True)


@pytest.mark.asyncio
async def test_a_released_lease_is_taken_at_the_next_try_without_waiting_for_expiry(
    kmock: kmocklib.KubernetesEmulator, kubes: tuple[KubeClient, KubeClient]
) -> None:
    clock_a, clock_b = Clock(0.0), Clock(300.0)
    a, b = elector(kubes[0], "a", clock_a), elector(kubes[1], "b", clock_b)
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()
    clock_a.advance(1.0)
    await a.release()
    assert not a.is_leader and not a.leading.is_set()
    record = lease(kmock)
    assert not record.get("holderIdentity")
    assert record["renewTime"] == T0 + timedelta(seconds=1)
    clock_b.advance(2.0)  # one retry period, far from the 15 s expiry
    assert await b.try_acquire_or_renew()
    assert b.is_leader
    record = lease(kmock)
    assert record["holderIdentity"] == "b"
    assert record["acquireTime"] == clock_b.wall()
    # A released, so it holds nothing to give back again: a second release writes nothing
    writes = len(lease_writes(kmock))
    await a.release()
    assert len(lease_writes(kmock)) == writes
    assert lease(kmock)["holderIdentity"] == "b"


@pytest.mark.asyncio
async def test_releasing_without_ever_leading_writes_nothing(
    kmock: kmocklib.KubernetesEmulator, kubes: tuple[KubeClient, KubeClient]
) -> None:
    a, b = elector(kubes[0], "a", Clock(0.0)), elector(kubes[1], "b", Clock(0.0))
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()
    await b.release()
    assert lease(kmock)["holderIdentity"] == "a"
    assert lease_writes(kmock) == [("POST", "a")]


@pytest.mark.asyncio
async def test_a_release_failure_is_swallowed(kubes: tuple[KubeClient, KubeClient]) -> None:
    clock = Clock(0.0)
    a = elector(kubes[0], "a", clock)
    assert await a.try_acquire_or_renew()
    async with KubeClient(config_for("http://127.0.0.1:9"), timeout_s=2) as cut_off:
        a.kube = cut_off
        await a.release()  # logs nothing fatal, raises nothing
    assert not a.is_leader


@pytest.mark.asyncio
async def test_a_stale_holder_s_release_leaves_the_new_holder_s_lease_alone(
    kmock: kmocklib.KubernetesEmulator, kubes: tuple[KubeClient, KubeClient]
) -> None:
    clock_a, clock_b = Clock(0.0), Clock(0.0)
    a, b = elector(kubes[0], "a", clock_a), elector(kubes[1], "b", clock_b)
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()
    # A is partitioned (makes no request) for 16 s; B takes over after 15 s
    clock_a.advance(16.0)
    clock_b.advance(15.0)
    assert not a.is_leader
    assert await b.try_acquire_or_renew()
    # the partition heals and A is stopped (SIGTERM) before its next try
    await a.release()
    assert lease(kmock)["holderIdentity"] == "b"


@pytest.mark.asyncio
async def test_a_partitioned_holder_says_it_stands_by(
    kubes: tuple[KubeClient, KubeClient], caplog: pytest.LogCaptureFixture
) -> None:
    # Short, but with room for a loaded CI machine: a 2.4 s renew deadline, renewals every 0.4 s.
    fast = {"name": "coserve-operator", "namespace": NS, "lease_duration_s": 4.0, "renew_deadline_s": 2.4,
            "retry_period_s": 0.4}  # fmt: skip
    a = LeaderElector(kubes[0], LeaseSettings(identity="a", **fast))
    run_a = asyncio.create_task(a.run())
    try:
        await asyncio.wait_for(a.leading.wait(), 5)

        async def unreachable(*_: Any, **__: Any) -> Any:
            raise KubeError(0, "Unreachable", "ConnectError: partitioned")

        a.kube.get = unreachable  # type: ignore[method-assign]
        await eventually(lambda: not a.is_leader, "A past its renew deadline", 5)
        await asyncio.sleep(0.5)  # a few more rounds
        assert not a.leading.is_set()
        assert "lost the lease; standing by" in caplog.text
    finally:
        run_a.cancel()
        await asyncio.gather(run_a, return_exceptions=True)


# --- fenced writes and a deleted Lease ------------------------------------------------------------------


def writes_to(kmock: kmocklib.KubernetesEmulator, plural: str) -> list[tuple[str, str | None]]:
    """(method, object name) of every write the emulator received on ``plural``, in order."""
    out = []
    for r in kmock:
        method = str(r.method).upper().rsplit(".", 1)[-1]
        if r.resource is not None and r.resource.plural == plural and method in ("POST", "PATCH", "PUT", "DELETE"):
            out.append((method, r.name or ((r.data or {}).get("metadata") or {}).get("name")))
    return out


def config_map(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {"by": name}}


@pytest.mark.asyncio
@pytest.mark.parametrize(("delayed", "sent"), [(11.0 - EPS, True), (11.0, False), (14.0, False)])
async def test_a_write_delayed_past_the_lease_is_never_sent(
    kmock: kmocklib.KubernetesEmulator, kubes: tuple[KubeClient, KubeClient], delayed: float, sent: bool
) -> None:
    """Leading was checked before a slow step (a Prometheus query); the write after it is fenced.

    With a 15 s Lease renewed at 0 and a 4 s call timeout, a write may start until 11 s: a write
    sent later could still be in flight when another replica takes over at 15 s.
    """
    clock = Clock(0.0)
    a = elector(kubes[0], "a", clock)
    assert await a.try_acquire_or_renew()
    async with KubeClient(config_for(str(kmock.url).rstrip("/")), timeout_s=4.0) as client:
        writer = client.fenced(a.fence)
        await writer.create("ConfigMap", NS, config_map("before"))
        assert a.is_leader  # the handler's check, then the slow step: nothing renews meanwhile
        clock.advance(delayed)
        if sent:
            await writer.merge_patch("ConfigMap", NS, "before", {"data": {"late": "yes"}})
        else:
            with pytest.raises(NotLeading, match="patch ConfigMap before not sent: the lease is valid for"):
                await writer.merge_patch("ConfigMap", NS, "before", {"data": {"late": "yes"}})
            with pytest.raises(NotLeading):
                await writer.create("ConfigMap", NS, config_map("late"))
            with pytest.raises(NotLeading):
                await writer.delete("ConfigMap", NS, "before")
    expected = [("POST", "before")] + ([("PATCH", "before")] if sent else [])
    assert writes_to(kmock, "configmaps") == expected  # the API server never received the fenced writes


@pytest.mark.asyncio
async def test_a_fence_without_the_lease_sends_nothing(
    kmock: kmocklib.KubernetesEmulator, kubes: tuple[KubeClient, KubeClient]
) -> None:
    a, b = elector(kubes[0], "a", Clock(0.0)), elector(kubes[1], "b", Clock(0.0))
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()
    async with KubeClient(config_for(str(kmock.url).rstrip("/")), timeout_s=1.0) as client:
        with pytest.raises(NotLeading, match="does not hold the lease"):
            await client.fenced(b.fence).create("ConfigMap", NS, config_map("b"))
        # a client whose timeout outlasts the Lease itself never writes, even right after a renewal
        with pytest.raises(NotLeading):
            await kubes[0].fenced(a.fence).create("ConfigMap", NS, config_map("a"))
    assert writes_to(kmock, "configmaps") == []


@pytest.mark.asyncio
async def test_a_404_on_renewal_ends_leadership_at_once(
    kmock: kmocklib.KubernetesEmulator, kubes: tuple[KubeClient, KubeClient], caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock(0.0)
    a = elector(kubes[0], "a", clock)
    assert await a.try_acquire_or_renew()
    a.leading.set()
    read = kubes[0].get

    async def read_then_deleted(kind: str, namespace: str, name: str) -> Any:
        found = await read(kind, namespace, name)
        if kind == "Lease":
            await kubes[1].delete("Lease", namespace, name)  # deleted between the read and the renewal
        return found

    a.kube.get = read_then_deleted  # type: ignore[method-assign]
    clock.advance(2.0)
    assert not await a.try_acquire_or_renew()
    assert not a.is_leader and not a.leading.is_set()  # at once, not at the renew deadline 8 s later
    assert "a stops leading: the Lease was deleted (404 on renewal)" in caplog.text
    async with KubeClient(config_for(str(kmock.url).rstrip("/")), timeout_s=4.0) as client:
        with pytest.raises(NotLeading):
            await client.fenced(a.fence).create("ConfigMap", NS, config_map("a"))
    # a candidate again: the next round creates the Lease anew
    a.kube.get = read  # type: ignore[method-assign]
    clock.advance(2.0)
    assert await a.try_acquire_or_renew()
    assert lease(kmock)["holderIdentity"] == "a"


@pytest.mark.asyncio
async def test_after_the_lease_is_deleted_the_old_leader_stops_before_a_new_one_acts(
    kmock: kmocklib.KubernetesEmulator, kubes: tuple[KubeClient, KubeClient]
) -> None:
    clock_a, clock_b = Clock(0.0), Clock(900.0)
    a, b = elector(kubes[0], "a", clock_a), elector(kubes[1], "b", clock_b)
    server = str(kmock.url).rstrip("/")
    async with (
        KubeClient(config_for(server), timeout_s=4.0) as client_a,
        KubeClient(config_for(server), timeout_s=4.0) as client_b,
    ):
        writer_a, writer_b = client_a.fenced(a.fence), client_b.fenced(b.fence)
        assert await a.try_acquire_or_renew()
        assert not await b.try_acquire_or_renew()  # B sees A's record
        await writer_a.create("ConfigMap", NS, config_map("a-1"))
        await kubes[1].delete("Lease", NS, "coserve-operator")  # e.g. kubectl delete lease
        clock_a.advance(1.0)
        clock_b.advance(1.0)
        # B's round comes first: the Lease is gone, but A's record was live a second ago on B's clock
        assert not await b.try_acquire_or_renew()
        assert not b.is_leader
        with pytest.raises(NotLeading):
            await writer_b.create("ConfigMap", NS, config_map("b-0"))
        # A's round: its Lease is gone, so it stops at once
        assert not await a.try_acquire_or_renew()
        assert not a.is_leader
        with pytest.raises(NotLeading):
            await writer_a.create("ConfigMap", NS, config_map("a-2"))
        # B keeps off until A's record would have expired on its clock, then takes a fresh Lease
        clock_b.advance(13.0)
        assert not await b.try_acquire_or_renew()
        clock_b.advance(1.0)
        assert await b.try_acquire_or_renew()
        assert not a.is_leader
        await writer_b.create("ConfigMap", NS, config_map("b-1"))
    assert writes_to(kmock, "configmaps") == [("POST", "a-1"), ("POST", "b-1")]
    assert lease(kmock)["holderIdentity"] == "b"
