"""A steady autoscaled pool is quiet: an hour of evaluations on a fake clock, status writes counted.

The real ``Autoscaler`` evaluates one pool every ``evaluationIntervalS`` (30 s) of a fake clock for one
simulated hour, after a warm-up of one stabilization window. Prometheus is an ``httpx.MockTransport``
behind the autoscaler's own HTTP client, so the real query code parses its answers: either up, with steady
values, or down, each query refused after a delay that rotates from one evaluation to the next (as on a
real network, where which query fails first is a matter of timing); with jitter, the answers move by
±0.1 % and an unreachable Prometheus refuses and times out in turn. The API server is a fake that applies
RFC 7386 merge patches and counts them. Target: at most 6 status writes per hour, up or down.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from coserve.api.resource import KIND
from coserve.autoscaling.queries import queries_for
from coserve.operator.autoscaler import Autoscaler
from coserve.operator.cache import ObjectCache
from coserve.operator.kube import KubeError
from coserve.operator.reconcile import PoolEvent
from operator_kmock import merge_patch
from pool_builders import sample_pool

NS, NAME = "serving", "chat"
INTERVAL_S = 30
WINDOW_S = 300
PROMETHEUS = "http://prometheus.test:9090"
# query name -> the steady answer of a pool at 0.5 conversations/s
STEADY = {
    "arrivalRate": 0.5,
    "inputTokens": 2000.0,
    "outputTokens": 500.0,
    "lifetime": 60.0,
    "prefillTokensRate": 900.0,
    "prefillerQueue": 0.0,
    "decoderKvUsage": 0.3,
    "decoderWaiting": 0.0,
    "prefillerRequests": 0.0,
    "decoderRequests": 8.0,
}


class FakeKube:
    """The API server's side of merge patches, over the operator's cache; counts status writes."""

    def __init__(self, cache: ObjectCache, *, old_crd: bool = False) -> None:
        self.cache = cache
        self.old_crd = old_crd  # the CRD of the version that kept history in status, which defaulted two fields
        self.status_writes: list[dict[str, Any]] = []
        self.versions = itertools.count(100)
        self.moved: dict[str, str] = {}  # name -> the version the server has after another writer's change
        self.scales: list[tuple[str, str | None, int]] = []  # (Deployment, version it carried, HTTP status)
        self.status_versions: list[str | None] = []  # the version each status write carried

    def stored_version(self, kind: str, namespace: str, name: str) -> str | None:
        cached = self.cache.get(kind, namespace, name) or {}
        return self.moved.get(name) or cached.get("metadata", {}).get("resourceVersion")

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        found = copy.deepcopy(self.cache.get(kind, namespace, name))
        if found is not None and name in self.moved:
            found["metadata"]["resourceVersion"] = self.moved[name]
        return found

    async def merge_patch(
        self,
        kind: str,
        namespace: str,
        name: str,
        body: Mapping[str, Any],
        subresource: str | None = None,
        *,
        resource_version: str | None = None,
    ) -> dict[str, Any]:
        refused = resource_version is not None and resource_version != self.stored_version(kind, namespace, name)
        if kind == "Deployment":
            self.scales.append((name, resource_version, 409 if refused else 200))
        if refused:
            raise KubeError(409, "Conflict", "the object has been modified")  # as the API server's precondition
        self.moved.pop(name, None)
        if kind == KIND and subresource == "status":
            self.status_versions.append(resource_version)
            self.status_writes.append(copy.deepcopy(dict(body)))
        stored = merge_patch(self.cache.get(kind, namespace, name), body)
        autoscaling = (stored.get("status") or {}).get("autoscaling")
        if self.old_crd and autoscaling is not None:
            autoscaling.setdefault("history", [])
            autoscaling.setdefault("kvHighEvaluations", 0)
        stored["metadata"]["resourceVersion"] = str(next(self.versions))
        return stored

    async def list(self, kind: str, namespace: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        return []


def pool() -> dict[str, Any]:
    body = sample_pool(uid="uid-chat", generation=1, resourceVersion="1")
    body["spec"]["autoscaling"] = {
        "enabled": True,
        "prometheusUrl": PROMETHEUS,
        "evaluationIntervalS": INTERVAL_S,
        "stabilizationWindowS": WINDOW_S,
    }
    return body


def deployment(role: str, replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": f"{NAME}-{role}", "namespace": NS, "resourceVersion": "1"},
        "spec": {"replicas": replicas},
    }


class FakePrometheus:
    """The HTTP API's instant queries: steady answers when up; refused connections when down.

    Down, query number ``i`` of evaluation ``k`` fails after ``(i + k) % 8`` ms, so the first to fail rotates.
    """

    def __init__(self, up: bool, jitter: bool = False) -> None:
        self.up = up
        self.jitter = jitter  # up: each answer ±0.1 %, by evaluation; down: refused and timed out in turn
        self.answers = {promql: STEADY[name] for name, promql in queries_for(NS, NAME).items()}
        self.order = list(self.answers)
        self.requests = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        promql = request.url.params["query"]
        self.requests += 1
        evaluation = (self.requests - 1) // len(self.order)
        if not self.up:
            await asyncio.sleep(((self.order.index(promql) + evaluation) % len(self.order)) / 1000)
            if self.jitter and evaluation % 2:
                raise httpx.ReadTimeout("timed out", request=request)
            raise httpx.ConnectError("connection refused", request=request)
        value = self.answers.get(promql)  # the pins query before a scale-down: no router, no pins
        if value is not None and self.jitter:
            value *= 1 + 0.001 * ((evaluation * 7 + self.order.index(promql)) % 3 - 1)
        result = [] if value is None else [{"metric": {}, "value": [0, str(value)]}]
        body = {"status": "success", "data": {"resultType": "vector", "result": result}}
        return httpx.Response(200, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


class World:
    """One pool, its two Deployments, the real autoscaler, a fake clock."""

    def __init__(self, up: bool, *, old_crd: bool = False, jitter: bool = False) -> None:
        self.now = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
        self.cache = ObjectCache()
        self.cache.put(KIND, pool())
        self.cache.put("Deployment", deployment("prefiller", 1))
        self.cache.put("Deployment", deployment("decoder", 2))
        self.kube = FakeKube(self.cache, old_crd=old_crd)
        self.events: list[PoolEvent] = []
        self.prometheus = FakePrometheus(up, jitter)
        locks: dict[tuple[str, str], asyncio.Lock] = {}

        async def read_profile(namespace: str, body: Mapping[str, Any]) -> tuple[None, None]:
            return None, None

        async def post_event(namespace: str, body: Mapping[str, Any], event: PoolEvent) -> None:
            self.events.append(event)

        self.autoscaler = Autoscaler(
            self.kube,  # type: ignore[arg-type]
            self.cache,
            read_profile=read_profile,
            post_event=post_event,
            lock_for=lambda namespace, name: locks.setdefault((namespace, name), asyncio.Lock()),
            clock=lambda: self.now,
        )
        self.autoscaler.http = httpx.AsyncClient(transport=httpx.MockTransport(self.prometheus))

    async def run(self, seconds: float) -> int:
        """Evaluate every interval for ``seconds``; the status writes made meanwhile."""
        before = len(self.kube.status_writes)
        for _ in range(int(seconds // INTERVAL_S)):
            self.now += timedelta(seconds=INTERVAL_S)
            await self.autoscaler.evaluate(NS, NAME)
        return len(self.kube.status_writes) - before

    def condition(self) -> dict[str, Any]:
        conditions = (self.cache.get(KIND, NS, NAME) or {}).get("status", {}).get("conditions", [])
        return next(c for c in conditions if c["type"] == "AutoscalingActive")


@pytest.mark.asyncio
@pytest.mark.parametrize("jitter", [False, True], ids=["steady", "jitter"])
@pytest.mark.parametrize("old_crd", [False, True], ids=["crd", "previous-crd"])
@pytest.mark.parametrize("up", [True, False], ids=["prometheus-up", "prometheus-down"])
async def test_a_steady_pool_writes_its_status_at_most_six_times_an_hour(up: bool, old_crd: bool, jitter: bool) -> None:
    """``jitter``: Prometheus up answers within ±0.1 % of the steady values; down, it refuses and times out in
    turn (as real answers do): neither is news."""
    world = World(up, old_crd=old_crd, jitter=jitter)
    try:
        await world.run(2 * WINDOW_S)  # warm-up: the first evaluations write, and may scale
        writes = await world.run(3600)
        assert writes <= 6, f"{writes} status writes in an hour: {world.kube.status_writes[-3:]}"
        assert world.condition()["status"] == ("True" if up else "False")
        warnings = [e for e in world.events if e.type == "Warning"]
        assert len(warnings) == (0 if up else 1)
    finally:
        await world.autoscaler.close()


@pytest.mark.asyncio
async def test_prometheus_down_names_every_failed_query_in_order() -> None:
    world = World(up=False)
    try:
        await world.run(INTERVAL_S)
        condition = world.condition()
        assert condition["reason"] == "PrometheusUnreachable"
        names = ", ".join(sorted(STEADY))
        assert condition["message"] == (
            f"Prometheus queries {names}: {PROMETHEUS}/api/v1/query is unreachable, connection failed "
            "(ConnectError); replicas held at 1 prefillers, 2 decoders"
        )
        await world.run(10 * INTERVAL_S)
        assert world.condition() == condition  # the same words every evaluation, whatever failed first
    finally:
        await world.autoscaler.close()


@pytest.mark.asyncio
async def test_an_earlier_versions_history_in_status_seeds_the_memory_once_and_is_removed() -> None:
    world = World(up=True)
    try:
        stored = copy.deepcopy(dict(world.cache.get(KIND, NS, NAME) or {}))
        start = world.now.timestamp()
        stored["status"] = {
            "autoscaling": {  # as an earlier operator version wrote it: the window's history in status
                "lastEvaluationTime": "2026-12-04T11:59:30Z",
                "signals": {"arrivalRatePerS": 0.5},
                "reason": "decoders held at 2: 1 recommended, waiting out the stabilization window",
                "history": [{"at": start - WINDOW_S - 30, "prefillers": 1, "decoders": 1}],
                "kvHighEvaluations": 1,
                "prefillerQueue": 0.0,
            }
        }
        world.cache.put(KIND, stored)
        await world.run(INTERVAL_S)
        written = world.kube.status_writes[-1]["status"]["autoscaling"]
        assert written["history"] is None and written["kvHighEvaluations"] is None
        assert written["prefillerQueue"] is None  # removed by the merge patch
        assert set((world.cache.get(KIND, NS, NAME) or {})["status"]["autoscaling"]) == {
            "lastEvaluationTime", "signals", "recommended", "desired", "reason"
        }  # fmt: skip
        # the seeded history already covers the window: the decoders come down at the first evaluation
        assert (world.cache.get("Deployment", NS, f"{NAME}-decoder") or {})["spec"]["replicas"] == 1
    finally:
        await world.autoscaler.close()


@pytest.mark.asyncio
async def test_after_a_failover_the_new_leader_scales_down_only_after_a_window_of_its_own() -> None:
    world = World(up=True)
    try:
        await world.run(INTERVAL_S)  # the old leader: one evaluation, then it is gone (its memory with it)
        await world.autoscaler.close()
        world.autoscaler = Autoscaler(
            world.kube,  # type: ignore[arg-type]
            world.cache,
            read_profile=world.autoscaler.read_profile,
            post_event=world.autoscaler.post_event,
            lock_for=world.autoscaler.lock_for,
            clock=lambda: world.now,
        )
        world.autoscaler.http = httpx.AsyncClient(transport=httpx.MockTransport(world.prometheus))
        decoders = []
        for _ in range(WINDOW_S // INTERVAL_S + 2):
            await world.run(INTERVAL_S)
            decoders.append((world.cache.get("Deployment", NS, f"{NAME}-decoder") or {})["spec"]["replicas"])
        held = WINDOW_S // INTERVAL_S  # evaluations until one of its own is a full window old
        assert decoders[:held] == [2] * held and decoders[-1] == 1, decoders
    finally:
        await world.autoscaler.close()


@pytest.mark.asyncio
async def test_a_signal_that_moves_beyond_the_tolerance_is_written() -> None:
    world = World(True, jitter=True)
    try:
        await world.run(2 * WINDOW_S)
        rate = next(promql for name, promql in queries_for(NS, NAME).items() if name == "arrivalRate")
        world.prometheus.answers[rate] = 0.5 * 1.08  # 8 % more conversations: news, though the plan is the same
        assert await world.run(INTERVAL_S) == 1
        stored = (world.cache.get(KIND, NS, NAME) or {})["status"]["autoscaling"]["signals"]["arrivalRatePerS"]
        assert stored == pytest.approx(0.54, rel=0.002)
        assert await world.run(10 * INTERVAL_S) == 0  # and then quiet again
    finally:
        await world.autoscaler.close()


@pytest.mark.asyncio
async def test_a_scale_decided_from_a_deployment_that_changed_since_is_refused_and_decided_again() -> None:
    """Another writer changed the decoder Deployment after the cache saw it: the scale-down that was decided from
    the cached version is refused (409), the autoscaler reads the Deployment, and the next evaluation scales it."""
    world = World(up=True)
    try:
        world.kube.moved[f"{NAME}-decoder"] = "50"  # e.g. a label added by hand; the watch has not delivered it
        for _ in range(WINDOW_S // INTERVAL_S + 2):
            await world.run(INTERVAL_S)
        assert world.kube.scales == [(f"{NAME}-decoder", "1", 409), (f"{NAME}-decoder", "50", 200)]
        assert (world.cache.get("Deployment", NS, f"{NAME}-decoder") or {})["spec"]["replicas"] == 1
        assert world.kube.status_versions and all(world.kube.status_versions), "a status write without a version"
    finally:
        await world.autoscaler.close()
