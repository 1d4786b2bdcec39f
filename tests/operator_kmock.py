"""Helpers for tests of the real kopf operator against kmock's Kubernetes emulator (a test double for the
API server, which cannot run on these machines): resource discovery, polling, and the running operator."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import kmock as kmocklib
import kopf
from lightkube.config.kubeconfig import SingleConfig

from coserve.operator.handlers import build_registry
from coserve.operator.kube import config_for
from pool_builders import sample_pool

NS = "serving"
POOLS = "coserve.dev/v1alpha1/coservepools"
POOLS_URL = f"/apis/coserve.dev/v1alpha1/namespaces/{NS}/coservepools"
ALL_VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}
MERGE = {"Content-Type": "application/merge-patch+json"}
CHILDREN = [
    ("v1/configmaps", "chat-config"),
    ("apps/v1/deployments", "chat-prefiller"),
    ("apps/v1/deployments", "chat-decoder"),
    ("apps/v1/deployments", "chat-router"),
    ("v1/services", "chat-router"),
    ("v1/services", "chat-prefiller"),
    ("v1/services", "chat-decoder"),
    ("v1/secrets", "chat-router-token"),
    ("networking.k8s.io/v1/networkpolicies", "chat-engines"),
    # on by default (spec.disruption); the sample pool asks for no model cache claim
    ("policy/v1/poddisruptionbudgets", "chat-router"),
    ("policy/v1/poddisruptionbudgets", "chat-prefiller"),
    ("policy/v1/poddisruptionbudgets", "chat-decoder"),
]
# the emulator assigns no uid, generation or resourceVersion: the test gives them
POOL: dict[str, Any] = sample_pool(namespace=NS, uid="uid-chat", generation=1, resourceVersion="1")


def declare_resources(kmock: kmocklib.KubernetesEmulator) -> None:
    """Discovery for every resource kopf touches (kmock serves only what is declared, verbs included)."""

    def declare(key: str, kind: str, namespaced: bool = True, subresources: frozenset[str] = frozenset()) -> None:
        kmock.resources[key] = kmocklib.ResourceInfo(
            kind=kind, singular=kind.lower(), namespaced=namespaced, verbs=ALL_VERBS, subresources=set(subresources)
        )

    declare(POOLS, "CoServePool", subresources=frozenset({"status"}))
    declare("apps/v1/deployments", "Deployment", subresources=frozenset({"status", "scale"}))
    declare("v1/services", "Service", subresources=frozenset({"status"}))
    declare("v1/configmaps", "ConfigMap")
    declare("v1/secrets", "Secret")
    declare("networking.k8s.io/v1/networkpolicies", "NetworkPolicy")
    declare("v1/serviceaccounts", "ServiceAccount")
    declare("rbac.authorization.k8s.io/v1/roles", "Role")
    declare("rbac.authorization.k8s.io/v1/rolebindings", "RoleBinding")
    declare("policy/v1/poddisruptionbudgets", "PodDisruptionBudget", subresources=frozenset({"status"}))
    declare("v1/persistentvolumeclaims", "PersistentVolumeClaim", subresources=frozenset({"status"}))
    declare("v1/pods", "Pod", subresources=frozenset({"status"}))
    declare("v1/events", "Event")
    declare("coordination.k8s.io/v1/leases", "Lease")
    declare("v1/namespaces", "Namespace", namespaced=False)
    declare("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition", namespaced=False)


class ApiServerEmulator(kmocklib.KubernetesEmulator):
    """kmock answering errors as kube-apiserver does: a ``Status`` with ``Content-Type: application/json``.

    kmock's own error answers say ``application/json; charset=utf-8``, and lightkube parses a ``Status`` (its
    reason and message) only under the exact ``application/json``: against stock kmock ``KubeError`` carries the
    HTTP status with the bare reason phrase and body.
    Use it with ``pytestmark = pytest.mark.kmock(cls=ApiServerEmulator)``.
    """

    async def _render_error(self, exc: Exception) -> Any:
        response = await super()._render_error(exc)
        response.charset = None  # "application/json", as the API server writes it
        return response


def as_stored(obj: Any, *, listed: bool = False) -> Any:
    """``obj`` as kube-apiserver 1.35 returns it (recorded in ``data/apiserver``): resource quantities as strings,
    ``publishNotReadyAddresses: false`` and a label selector's empty ``matchLabels`` left out, and in a LIST no
    ``apiVersion``/``kind`` per item. Server defaults are not added. ``tests/operator/test_apiserver_fixtures.py``
    checks it against the recorded stored form of every child kind."""

    def walk(value: Any, keys: tuple[str, ...]) -> Any:
        if isinstance(value, dict):
            out = {}
            for key, item in value.items():
                if (key == "publishNotReadyAddresses" and item is False) or (key == "matchLabels" and item == {}):
                    continue
                out[key] = walk(item, (*keys, key))
            return out
        if isinstance(value, list):
            return [walk(item, keys) for item in value]
        if len(keys) >= 3 and keys[-3] == "resources" and keys[-2] in ("limits", "requests"):
            return str(value)
        return value

    stored = walk(copy.deepcopy(obj), ())
    if listed and isinstance(stored, dict):
        stored.pop("apiVersion", None)
        stored.pop("kind", None)
    return stored


class StoringEmulator(ApiServerEmulator):
    """``ApiServerEmulator`` that also serves objects the way the API server stores them (``as_stored``).

    NOTE: only what the recordings show; kmock still applies no defaults, no schema and no resourceVersion.
    """

    async def _serve_list(self, request: Any) -> Any:
        payload = await super()._serve_list(request)
        return {**payload, "items": [as_stored(item, listed=True) for item in payload["items"]]}

    async def _serve_fetch(self, request: Any) -> Any:
        return as_stored(await super()._serve_fetch(request))

    async def _serve_watch(self, request: Any) -> Any:
        async for event in super()._serve_watch(request):
            if isinstance(event, dict) and "object" in event:
                event = {**event, "object": as_stored(event["object"])}
            yield event


@dataclasses.dataclass(frozen=True)
class Write:
    """One write as the emulator answered it: who sent it (``bearer``), what, and the HTTP status."""

    bearer: str
    method: str
    path: str
    status: int


class VersionedEmulator(ApiServerEmulator):
    """``ApiServerEmulator`` with kube-apiserver's optimistic concurrency, which kmock lacks.

    A test double: no kube-apiserver runs on these machines. What it adds is the API server's documented
    rule (API conventions, "Concurrency Control and Consistency"), nothing more:

    - every create, patch and delete gives the object a new ``metadata.resourceVersion`` from one counter
      (etcd's revision), so the watch and every answer carry it;
    - a patch whose body carries ``metadata.resourceVersion`` is applied only if the object has that version;
      otherwise 409 with reason ``Conflict`` and the API server's message;
    - a delete's ``DeleteOptions.preconditions`` (``uid``, ``resourceVersion``) likewise.

    ``hold(bearer, paths)`` makes writes from the client with that bearer token (to paths containing one of
    ``paths``) wait at the server before they are applied, as a request delayed on the wire, until
    ``release(bearer)``; ``waiting`` lists them meanwhile. ``writes`` records every write's answer.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.revision = 1000
        self.writes: list[Write] = []
        self.waiting: list[Write] = []
        self._gates: dict[str, tuple[asyncio.Event, tuple[str, ...]]] = {}

    def hold(self, bearer: str, paths: tuple[str, ...] = ("/",)) -> None:
        self._gates[bearer] = (asyncio.Event(), paths)

    def release(self, bearer: str) -> None:
        gate, _ = self._gates.pop(bearer)
        gate.set()

    async def _handle(self, request: Any) -> Any:
        method = str(request.method).upper().rsplit(".", 1)[-1]
        if request.resource is None or method not in ("POST", "PATCH", "PUT", "DELETE"):
            return await super()._handle(request)
        bearer = next((v for k, v in request.headers.items() if k.lower() == "authorization"), "").removeprefix(
            "Bearer "
        )
        path = str(request.url.path)
        gate = self._gates.get(bearer)
        if gate is not None and any(part in path for part in gate[1]):
            self.waiting.append(Write(bearer, method, path, 0))
            await gate[0].wait()
        conflict = self._precondition_failure(request, method)
        if conflict is not None:
            response = await self._render_error(kmocklib.KubernetesError(409, "Conflict", conflict))
        else:
            if method in ("POST", "PATCH") and isinstance(request.data, dict):
                self.revision += 1
                request.data.setdefault("metadata", {})["resourceVersion"] = str(self.revision)
            response = await super()._handle(request)
        self.writes.append(Write(bearer, method, path, int(response.status)))
        return response

    def _precondition_failure(self, request: Any, method: str) -> str | None:
        if method not in ("PATCH", "DELETE") or request.name is None:
            return None
        try:
            stored = self.objects[request.resource, request.namespace, request.name]
        except KeyError:
            return None  # the emulator answers 404 itself
        if stored.deleted:
            return None
        metadata = stored.get("metadata", {})
        data = request.data if isinstance(request.data, dict) else {}
        wanted = data.get("preconditions", {}) if method == "DELETE" else {
            "resourceVersion": (data.get("metadata") or {}).get("resourceVersion")}  # fmt: skip
        for field, value in wanted.items():
            if value is not None and value != metadata.get(field):
                what = f'{request.resource.plural} "{request.name}"'
                if field == "uid":
                    return f"Precondition failed: UID in precondition: {value}, UID in object meta: {metadata['uid']}"
                return (f"Operation cannot be fulfilled on {what}: the object has been modified; please apply your "
                        "changes to the latest version and try again")  # fmt: skip
        return None


async def eventually(predicate: Callable[[], Any], what: str, timeout_s: float = 15.0) -> Any:
    """Poll the emulator's state until ``predicate`` holds (KeyError: the object is not there yet)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            result = predicate()
            if result:
                return result
        except (KeyError, ValueError):
            pass
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.05)


def exists(kmock: kmocklib.KubernetesEmulator, resource: str, name: str) -> bool:
    try:
        return not kmock.objects[resource, NS, name].deleted
    except KeyError:
        return False


def events(kmock: kmocklib.KubernetesEmulator, reason: str) -> list[dict[str, Any]]:
    """Events the operator posted on the pool with ``reason``."""
    return [
        dict(request.data)
        for request in kmock
        if str(request.method).upper().endswith("POST")
        and request.resource is not None
        and request.resource.plural == "events"
        and isinstance(request.data, dict)
        and request.data.get("reason") == reason
    ]


def condition(kmock: kmocklib.KubernetesEmulator, kind: str) -> dict[str, Any]:
    status = kmock.objects[POOLS, NS, "chat"]["status"]
    found = next((c for c in status["conditions"] if c["type"] == kind), None)
    if found is None:
        raise KeyError(kind)  # not there yet: ``eventually`` keeps polling
    return dict(found)


@contextlib.asynccontextmanager
async def running_operator(
    kmock: kmocklib.KubernetesEmulator, *, cluster: Callable[[], SingleConfig] | None = None, **options: Any
) -> AsyncIterator[httpx.AsyncClient]:
    """The coserve operator running against the emulator; yields an HTTP client to the same server.

    ``cluster``: where the operator connects and how it logs in (default: straight to the emulator, anonymous);
    tests of credentials point it at an authenticating proxy in front of the emulator (``tls_proxy``).

    NOTE: a context manager inside the test, not a fixture: when it stops, kopf cancels every task created
    after it started, which would include pytest-asyncio's fixture-teardown task.
    """
    declare_resources(kmock)
    server = str(kmock.url).rstrip("/")
    # scanning=False, as `coserve operator -n NS` runs: no namespace or CRD listing (kmock cannot answer the
    # namespace list either).
    registry = build_registry(
        cluster or (lambda: config_for(server)), scanning=False, namespaces=[NS], resync_s=1.0, **options
    )
    settings = kopf.OperatorSettings()
    settings.watching.reconnect_backoff = 0.1
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(
        kopf.operator(
            registry=registry, settings=settings, standalone=True, namespaces=[NS], stop_flag=stop, ready_flag=ready
        )
    )
    try:
        await asyncio.wait_for(ready.wait(), 15)
        watched = {"coservepools", "deployments", "services", "configmaps"}
        await eventually(
            lambda: {r.resource.plural for r in kmock if r.params.get("watch") == "true"} >= watched,
            "kopf's watch requests",
        )
        await asyncio.sleep(0.3)  # the emulator subscribes a watch to changes just after its replay
        async with httpx.AsyncClient(base_url=server, timeout=10) as client:
            yield client
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def create_pool(client: httpx.AsyncClient, body: dict[str, Any] | None = None) -> None:
    response = await client.post(POOLS_URL, json=copy.deepcopy(body or POOL))
    assert response.status_code in (200, 201), response.text


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386, as the API server applies ``application/merge-patch+json`` (tests that emulate the server)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out
