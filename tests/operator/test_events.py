"""Aggregated Kubernetes Events (coserve.operator.events) against kmock's Kubernetes emulator, over HTTP."""

from __future__ import annotations

import copy
import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import kmock as kmocklib
import pytest
import pytest_asyncio

from coserve.operator.events import EventRecorder, event_name
from coserve.operator.kube import KubeClient, KubeError, config_for
from coserve.operator.reconcile import PoolEvent
from operator_kmock import NS, POOL, ApiServerEmulator, declare_resources

pytestmark = [pytest.mark.asyncio, pytest.mark.kmock(cls=ApiServerEmulator)]  # errors as the API server answers

T0 = datetime(2026, 12, 3, 16, 0, 0, tzinfo=UTC)
SCALED = PoolEvent("Normal", "Scaled", "decoders 2 -> 3")
HELD = PoolEvent("Warning", "PrometheusUnreachable", "replicas held")


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


def stamp(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def stored_events(kmock: kmocklib.KubernetesEmulator) -> dict[str, dict[str, Any]]:
    """The Event objects the emulator holds now (deleted ones left out), by name."""
    return {
        name: dict(obj)
        for (resource, _, name), obj in kmock.objects.items()
        if resource.plural == "events" and not obj.deleted
    }


def event_requests(kmock: kmocklib.KubernetesEmulator) -> list[str]:
    """The verbs of every request on Events, in order."""
    return [
        str(r.method).upper().rsplit(".", 1)[-1]
        for r in kmock
        if r.resource is not None and r.resource.plural == "events"
    ]


@pytest_asyncio.fixture
async def kube(kmock: kmocklib.KubernetesEmulator) -> AsyncIterator[KubeClient]:
    declare_resources(kmock)
    async with KubeClient(config_for(str(kmock.url).rstrip("/"))) as client:
        yield client


async def test_a_repeated_event_is_one_object_counted_with_one_post(
    kmock: kmocklib.KubernetesEmulator, kube: KubeClient
) -> None:
    clock = Clock()
    recorder = EventRecorder(kube, instance="replica-a", clock=clock)
    for _ in range(3):
        await recorder.post(NS, POOL, SCALED)
        clock.advance(60)
    stored = stored_events(kmock)
    name = event_name("chat", "uid-chat", SCALED)
    assert list(stored) == [name]
    event = stored[name]
    assert event["count"] == 3
    assert event["firstTimestamp"] == stamp(T0)
    assert event["lastTimestamp"] == stamp(T0 + timedelta(seconds=120))
    assert (event["type"], event["reason"], event["message"]) == ("Normal", "Scaled", "decoders 2 -> 3")
    assert event["involvedObject"] == {
        "apiVersion": "coserve.dev/v1alpha1",
        "kind": "CoServePool",
        "name": "chat",
        "namespace": NS,
        "uid": "uid-chat",
    }
    assert event["reportingInstance"] == "replica-a"
    assert event["source"] == {"component": "coserve-operator"}
    assert event["reportingComponent"] == "coserve.dev/coserve-operator"
    # each increment is counted on the Event as read, never on a remembered count
    assert event_requests(kmock) == ["POST", "GET", "PATCH", "GET", "PATCH"]

    # a different message is a different Event
    await recorder.post(NS, POOL, PoolEvent("Normal", "Scaled", "decoders 3 -> 4"))
    stored = stored_events(kmock)
    assert len(stored) == 2
    other = stored[event_name("chat", "uid-chat", PoolEvent("Normal", "Scaled", "decoders 3 -> 4"))]
    assert other["count"] == 1 and other["message"] == "decoders 3 -> 4"
    assert stored[name]["count"] == 3


async def test_a_restarted_operator_counts_on_its_predecessor_s_event(
    kmock: kmocklib.KubernetesEmulator, kube: KubeClient
) -> None:
    clock = Clock()
    await EventRecorder(kube, clock=clock).post(NS, POOL, HELD)
    await EventRecorder(kube, clock=clock).post(NS, POOL, HELD)  # same name: the create is answered 409
    clock.advance(30)
    restarted = EventRecorder(kube, clock=clock)
    await restarted.post(NS, POOL, HELD)
    (event,) = stored_events(kmock).values()
    assert event["count"] == 3
    assert event["firstTimestamp"] == stamp(T0)
    assert event["lastTimestamp"] == stamp(T0 + timedelta(seconds=30))
    assert event_requests(kmock) == ["POST", "POST", "GET", "PATCH", "POST", "GET", "PATCH"]
    # the restarted recorder remembers the count it wrote: the next one is a patch alone
    await restarted.post(NS, POOL, HELD)
    (event,) = stored_events(kmock).values()
    assert event["count"] == 4
    assert event_requests(kmock)[-1:] == ["PATCH"]


async def test_an_expired_event_is_created_afresh(kmock: kmocklib.KubernetesEmulator, kube: KubeClient) -> None:
    clock = Clock()
    recorder = EventRecorder(kube, clock=clock)
    for _ in range(2):
        await recorder.post(NS, POOL, SCALED)
    name = event_name("chat", "uid-chat", SCALED)
    assert stored_events(kmock)[name]["count"] == 2
    async with httpx.AsyncClient(base_url=str(kmock.url).rstrip("/")) as client:  # the API server's TTL
        response = await client.delete(f"/api/v1/namespaces/{NS}/events/{name}")
        assert response.status_code == 200
    assert not stored_events(kmock)
    clock.advance(3600)
    await recorder.post(NS, POOL, SCALED)
    event = stored_events(kmock)[name]
    assert event["count"] == 1
    assert event["firstTimestamp"] == event["lastTimestamp"] == stamp(T0 + timedelta(seconds=3600))
    assert event_requests(kmock)[-3:] == ["DELETE", "GET", "POST"]  # the increment's read finds it gone
    await recorder.post(NS, POOL, SCALED)
    assert stored_events(kmock)[name]["count"] == 2


async def test_a_forgotten_count_is_read_back(kmock: kmocklib.KubernetesEmulator, kube: KubeClient) -> None:
    """Past ``capacity`` Events the oldest count is forgotten; the Event itself is not duplicated."""
    recorder = EventRecorder(kube, clock=Clock(), capacity=1)
    await recorder.post(NS, POOL, SCALED)
    await recorder.post(NS, POOL, SCALED)
    await recorder.post(NS, POOL, HELD)  # evicts SCALED's count
    await recorder.post(NS, POOL, SCALED)
    counts = {event["reason"]: event["count"] for event in stored_events(kmock).values()}
    assert counts == {"Scaled": 3, "PrometheusUnreachable": 1}


async def test_events_of_pools_with_other_uids_or_namespaces_stay_apart(
    kmock: kmocklib.KubernetesEmulator, kube: KubeClient
) -> None:
    recorder = EventRecorder(kube, clock=Clock())
    again = copy.deepcopy(POOL)
    again["metadata"]["uid"] = "uid-chat-2"  # the pool deleted and created again under the same name
    await recorder.post(NS, POOL, SCALED)
    await recorder.post(NS, again, SCALED)
    assert sorted(e["involvedObject"]["uid"] for e in stored_events(kmock).values()) == ["uid-chat", "uid-chat-2"]
    assert all(name.startswith("chat.") for name in stored_events(kmock))


async def test_a_long_message_is_cut_to_1024_characters(kmock: kmocklib.KubernetesEmulator, kube: KubeClient) -> None:
    await EventRecorder(kube, clock=Clock()).post(NS, POOL, PoolEvent("Warning", "InvalidSpec", "x" * 5000))
    (event,) = stored_events(kmock).values()
    assert event["message"] == "x" * 1024


async def test_posting_never_raises_when_the_api_server_fails(
    kmock: kmocklib.KubernetesEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="coserve.operator.events")
    # unreachable
    async with KubeClient(config_for("http://127.0.0.1:9"), timeout_s=2) as down:
        await EventRecorder(down, clock=Clock()).post(NS, POOL, SCALED)
    assert f"{NS}/chat: could not post event Scaled: Unreachable" in caplog.text
    caplog.clear()
    # reachable, but it refuses Events: RBAC says no
    declare_resources(kmock)
    forbidden = kmocklib.KubernetesError(403, "Forbidden", 'events is forbidden: cannot create resource "events"')
    kmock[kmocklib.resource("", "v1", "events")] << forbidden  # every verb
    async with KubeClient(config_for(str(kmock.url).rstrip("/"))) as refusing:
        recorder = EventRecorder(refusing, clock=Clock())
        await recorder.post(NS, POOL, SCALED)
        await recorder.post(NS, POOL, SCALED)
    assert caplog.text.count(f"{NS}/chat: could not post event Scaled: HTTP 403 Forbidden: events is forbidden") == 2
    assert "PATCH" not in event_requests(kmock)  # nothing counted on a refusal


@pytest.mark.kmock(cls=kmocklib.KubernetesEmulator)  # stock kmock: its Status answers say "; charset=utf-8"
async def test_a_conflict_answered_with_a_charset_is_still_a_conflict(
    kmock: kmocklib.KubernetesEmulator, kube: KubeClient
) -> None:
    """lightkube parses a Status only under the exact ``application/json``; the status code must still count."""
    assert await kube.get("Event", NS, "no-such-event") is None
    await EventRecorder(kube, clock=Clock()).post(NS, POOL, HELD)
    await EventRecorder(kube, clock=Clock()).post(NS, POOL, HELD)  # 409, read back, counted
    (event,) = stored_events(kmock).values()
    assert event["count"] == 2


async def test_an_increment_survives_a_conflict_with_another_replica(
    kmock: kmocklib.KubernetesEmulator, kube: KubeClient
) -> None:
    """A failover: replica B counted the Event after A last did. A's increment must not undo B's.

    kmock keeps no resourceVersion, so the test gives the Event one and makes A's patches conditional on
    it, as the API server does: a patch naming another resourceVersion is answered 409.
    """
    name = event_name("chat", "uid-chat", HELD)
    a = EventRecorder(kube, instance="replica-a", clock=Clock())
    await a.post(NS, POOL, HELD)  # count 1, created by A
    async with KubeClient(config_for(str(kmock.url).rstrip("/"))) as other:
        await other.merge_patch("Event", NS, name, {"metadata": {"resourceVersion": "1"}})
        patch, read = kube.merge_patch, kube.get
        conflicts: list[str] = []

        async def conditional(kind: str, namespace: str, obj: str, body: Any, subresource: str | None = None) -> Any:
            stored = (await other.get(kind, namespace, obj) or {}).get("metadata") or {}
            sent = (body.get("metadata") or {}).get("resourceVersion")
            if sent is not None and sent != stored.get("resourceVersion"):
                conflicts.append(sent)
                raise KubeError(409, "Conflict", "the object has been modified")
            bumped = str(int(stored.get("resourceVersion") or 0) + 1)
            return await patch(kind, namespace, obj, {**body, "metadata": {"resourceVersion": bumped}}, subresource)

        async def read_then_b_counts(kind: str, namespace: str, obj: str) -> Any:
            found = await read(kind, namespace, obj)
            if kind == "Event" and not conflicts:  # B counts between A's read and A's write, once
                await other.merge_patch(kind, namespace, obj, {"count": 2, "metadata": {"resourceVersion": "2"}})
            return found

        kube.merge_patch = conditional  # type: ignore[method-assign]
        kube.get = read_then_b_counts  # type: ignore[method-assign]
        await a.post(NS, POOL, HELD)
    (event,) = stored_events(kmock).values()
    assert conflicts == ["1"]  # A's first increment was conditioned on what it read, and refused
    assert event["count"] == 3  # B's increment and A's: counts never go back
    assert event["metadata"]["resourceVersion"] == "3"
