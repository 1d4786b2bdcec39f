"""The kopf operator: handlers that feed ``coserve.operator.reconcile`` and carry out its decisions.

Who calls it: ``coserve operator`` (``kopf.run`` with ``build_registry()``), and
``kopf run operator/main.py``, which registers the same handlers in kopf's
default registry. Tests build a registry against kmock's Kubernetes emulator.

When a reconcile runs (always the whole pool; triggers that arrive while one
runs are coalesced into the next):

- the pool is created or changes (every watch event that is news to the cache),
  or this replica starts acting (start-up, or taking the Lease over);
- every ``resync_s`` seconds for every known pool, after listing all pools and
  managed children afresh (what a lost watch event hid shows up), which also
  picks up readiness changes;
- a child (of a kind in ``resources.CHILDREN``) labelled ``app.kubernetes.io/managed-by:
  coserve-operator`` changes or disappears: its controlling pool is reconciled,
  so a child deleted or edited by hand is put back within a watch event. A
  watch event that only echoes the operator's own write triggers nothing.

A reconcile reads the pool and its children from the watch-fed
``ObjectCache`` (no request), reads the measured profile if
``spec.profile.configMapRef`` names one, asks ``reconcile()`` what to do,
re-reads the pool from the API server if that means creating something, creates
or merge-patches children, writes the status (only if it changed) and posts the
decision's Events. A pool in its desired state costs no request at all; a new
one costs its creates, a status patch, its Events and one GET. The only child
ever deleted is a PodDisruptionBudget the pool no longer asks for (only the
object seen: its uid is the delete's precondition); owner references let the
garbage collector remove the children with the pool, so no finalizer is added
and deleting a pool never waits for the operator. A PersistentVolumeClaim
resize the API server refuses (its storage class cannot expand) is a Warning
event, not a failed reconcile.

Pools with ``spec.autoscaling.enabled`` are also evaluated by the autoscaler
(``coserve.operator.autoscaler``) every ``evaluationIntervalS``, under the same
per-pool lock as reconciles.

Two operator replicas never both act: they elect one through a
``coordination.k8s.io`` Lease (``coserve.operator.leader``; ``--lease NAME``, the
default). Every replica watches and keeps its cache warm; only the Lease holder
reconciles, resyncs, autoscales and posts Events. ``--standalone`` skips the
election for a single replica.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import logging
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf
import yaml
from lightkube.config.kubeconfig import SingleConfig

from coserve import __version__
from coserve.api.parse import parse_profile
from coserve.api.problems import InvalidInput, Problem
from coserve.api.profile import EngineProfile
from coserve.api.resource import GROUP, KIND, PLURAL, VERSION
from coserve.operator.autoscaler import Autoscaler
from coserve.operator.cache import ObjectCache
from coserve.operator.events import EventRecorder
from coserve.operator.kube import KubeClient, KubeError, NotLeading, describe, fetch_credential
from coserve.operator.leader import LeaderElector, LeaseSettings
from coserve.operator.metrics import (
    CHILD_CHANGES,
    POOLS,
    RECONCILE_SECONDS,
    RECONCILES,
    forget_pool,
    keep_pools,
    observe_pool,
)
from coserve.operator.reconcile import ChildKey, PoolEvent, Reconciliation, reconcile
from coserve.operator.resources import CHILDREN, MANAGED_BY, MANAGED_BY_LABEL, TOKEN_KEY, child_keys

__all__ = ["CHILD_RESOURCES", "DEFAULT_RESYNC_S", "PoolReconciler", "build_registry", "configure"]

DEFAULT_RESYNC_S = 30.0
logger = logging.getLogger("coserve.operator")

# kind -> (API group, plural) of every child kind the operator creates and watches (its RBAC must grant each)
CHILD_RESOURCES: dict[str, tuple[str, str]] = {
    "Deployment": ("apps", "deployments"),
    "Service": ("", "services"),
    "ConfigMap": ("", "configmaps"),
    "Secret": ("", "secrets"),
    "NetworkPolicy": ("networking.k8s.io", "networkpolicies"),
    "ServiceAccount": ("", "serviceaccounts"),
    "Role": ("rbac.authorization.k8s.io", "roles"),
    "RoleBinding": ("rbac.authorization.k8s.io", "rolebindings"),
    "PodDisruptionBudget": ("policy", "poddisruptionbudgets"),
    "PersistentVolumeClaim": ("", "persistentvolumeclaims"),
}


@dataclass
class _Flight:
    """Single-flight bookkeeping for one pool: concurrent triggers share a reconcile that starts after them."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    requested: int = 0  # triggers so far
    covered: int = 0  # triggers the last finished reconcile covers (it started after all of them)
    result: Reconciliation | None = None
    error: BaseException | None = None


class PoolReconciler:
    """Reads a pool's world from the cache, calls the pure ``reconcile`` and applies its decision.

    One per operator. Triggers for a pool that arrive while it is being
    reconciled are coalesced: the next reconcile covers all of them, and each
    caller gets the outcome (or the error) of a reconcile that started after it
    asked, so kopf still retries a failed create and nothing is decided on a
    view older than the trigger.
    """

    def __init__(
        self,
        kube: KubeClient,
        *,
        cache: ObjectCache | None = None,
        image_tag: str | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.kube = kube
        self.events = EventRecorder(kube, clock=clock)
        self.cache = cache if cache is not None else ObjectCache()
        self.image_tag = image_tag
        self.clock = clock
        self._flights: dict[tuple[str, str], _Flight] = {}

    async def reconcile(self, namespace: str, name: str) -> Reconciliation | None:
        """Reconcile one pool; ``None`` when it is gone or being deleted."""
        flight = self._flights.setdefault((namespace, name), _Flight())
        flight.requested += 1
        ticket = flight.requested
        async with flight.lock:
            if flight.covered >= ticket:  # a reconcile that started after this trigger has just finished
                if flight.error is not None:
                    raise flight.error
                return flight.result
            flight.covered = flight.requested
            started = time.perf_counter()
            try:
                result = await self._reconcile(namespace, name)
            except NotLeading as error:  # the Lease may expire before a write: skipped, not failed
                flight.result, flight.error = None, error
                raise
            except Exception as error:
                RECONCILES.labels("error").inc()
                flight.result, flight.error = None, error
                raise
            finally:
                RECONCILE_SECONDS.observe(time.perf_counter() - started)
            flight.result, flight.error = result, None
            if result is None:
                self._flights.pop((namespace, name), None)
                forget_pool(namespace, name)  # gone or being deleted: its series go with it
            else:
                RECONCILES.labels("ok" if result.plan_valid else "invalid").inc()
            return result

    def lock_for(self, namespace: str, name: str) -> asyncio.Lock:
        """The pool's reconcile lock: the autoscaler holds it while it evaluates, so their writes never interleave."""
        return self._flights.setdefault((namespace, name), _Flight()).lock

    async def read_profile(
        self, namespace: str, body: Mapping[str, Any]
    ) -> tuple[EngineProfile | None, Problem | None]:
        return await self._profile(namespace, body)

    async def post_event(self, namespace: str, pool: Mapping[str, Any], event: PoolEvent) -> None:
        await self._post_event(namespace, pool, event)

    async def _reconcile(self, namespace: str, name: str, attempts: int = 3) -> Reconciliation | None:
        """Read (cache), decide, write; again from the top when a create shows the cache was behind.

        Before creating anything the pool is read from the API server: a child's
        deletion can be seen before its pool's, and a child created for a pool
        that is gone would be an orphan. Patches need no such check.
        """
        fresh = False
        for _ in range(attempts):
            body = self.cache.get(KIND, namespace, name)
            if body is None and not fresh:
                body, fresh = await self._read_pool(namespace, name), True
            if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
                return None
            keys = child_keys(name)
            observed: dict[ChildKey, Mapping[str, Any] | None] = {
                (kind, child): self.cache.get(kind, namespace, child) for kind, child in keys
            }
            profile, problem = await self._profile(namespace, body)
            result = reconcile(
                body,
                observed,
                self.clock(),
                measured_profile=profile,
                profile_problem=problem,
                operator_image_tag=self.image_tag,
            )
            if not fresh and any(action.verb == "create" for action in result.actions):
                fresh = True
                if await self._read_pool(namespace, name) != body:
                    continue  # the pool changed (or is gone): decide on what the API server holds
            current, refusals = await self._apply(namespace, name, result)
            if not current:
                continue
            if body.get("status") != result.status:
                await self._write_status(namespace, name, result.status)
            for event in (*result.events, *refusals):
                await self._post_event(namespace, body, event)
            observe_pool(namespace, name, body, result.status, observed)  # plan vs ready replicas, spec workload
            return result
        raise KubeError(409, "Conflict", f"{namespace}/{name}: the children kept changing during {attempts} reconciles")

    async def _read_pool(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The pool as the API server has it now (the cache learns it too); ``None`` when it is gone."""
        body = await self.kube.get(KIND, namespace, name)
        if body is None:
            self.cache.forget(KIND, namespace, name)
        else:
            self.cache.put(KIND, body)
        return body

    async def _apply(self, namespace: str, name: str, result: Reconciliation) -> tuple[bool, list[PoolEvent]]:
        """Create, patch or delete the children.

        ``False`` when the cache was behind (it is refreshed: decide again); with Warning events for the
        changes the API server refused by policy (a PersistentVolumeClaim it cannot expand).
        """
        current = True
        refusals: list[PoolEvent] = []
        for action in result.actions:
            try:
                if action.verb == "create":
                    written = await self.kube.create(action.kind, namespace, _with_generated(action.body))
                elif action.verb == "delete":
                    uid = (action.body.get("metadata") or {}).get("uid")
                    await self._delete(namespace, action.kind, action.name, uid if isinstance(uid, str) else None)
                    CHILD_CHANGES.labels(action.verb, action.kind).inc()
                    logger.info("%s/%s: delete %s %s (%s)", namespace, name, action.kind, action.name, action.reason)
                    continue
                else:
                    body = _with_generated(action.body) if action.kind == "Secret" else action.body
                    written = await self.kube.merge_patch(action.kind, namespace, action.name, body)
            except KubeError as error:
                if action.kind == "PersistentVolumeClaim" and action.verb == "patch" and error.status in (403, 422):
                    # NOTE: e.g. a storage class without allowVolumeExpansion; retrying at once would fail again
                    message = f"{action.kind} {action.name} was not patched ({action.reason}): {error}"
                    logger.warning("%s/%s: %s", namespace, name, message)
                    refusals.append(PoolEvent("Warning", "ChildRefused", message))
                    continue
                if error.status not in (404, 409):
                    raise
                # 409 on create: it exists after all; 404 on patch: it is gone. Learn which, decide again.
                found = await self.kube.get(action.kind, namespace, action.name)
                if found is None:
                    self.cache.forget(action.kind, namespace, action.name)
                else:
                    self.cache.put(action.kind, found)
                current = False
                continue
            self.cache.put(action.kind, written)
            CHILD_CHANGES.labels(action.verb, action.kind).inc()
            logger.info("%s/%s: %s %s %s (%s)", namespace, name, action.verb, action.kind, action.name, action.reason)
        return current, refusals

    async def _delete(self, namespace: str, kind: str, name: str, uid: str | None) -> None:
        """Delete the child seen with ``uid``; already gone is done (a 409: another object took the name)."""
        try:
            await self.kube.delete(kind, namespace, name, uid=uid)
        except KubeError as error:
            if error.status != 404:
                raise
        self.cache.forget(kind, namespace, name)

    async def _post_event(self, namespace: str, pool: Mapping[str, Any], event: PoolEvent) -> None:
        await self.events.post(namespace, pool, event)

    async def _write_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        # A merge patch replaces lists (conditions) whole; the status subresource keeps spec untouched.
        try:
            written = await self.kube.merge_patch(KIND, namespace, name, {"status": status}, subresource="status")
            self.cache.put(KIND, written)
        except KubeError as error:
            if error.status != 404:  # 404: the pool was deleted meanwhile; nothing to report on
                raise

    async def _profile(self, namespace: str, body: Mapping[str, Any]) -> tuple[EngineProfile | None, Problem | None]:
        """The measured profile ``spec.profile.configMapRef`` names, or why it cannot be used."""
        ref = ((body.get("spec") or {}).get("profile") or {}).get("configMapRef")
        if not isinstance(ref, Mapping) or not isinstance(ref.get("name"), str):
            return None, None
        path = "spec.profile.configMapRef"
        key = ref.get("key", "profile.yaml")
        config_map = await self.kube.get("ConfigMap", namespace, ref["name"])
        if config_map is None:
            return None, Problem(f"{path}.name", f"ConfigMap {ref['name']!r} not found in namespace {namespace}")
        text = (config_map.get("data") or {}).get(key)
        if not isinstance(text, str):
            return None, Problem(f"{path}.key", f"ConfigMap {ref['name']!r} has no key {key!r}")
        try:
            return parse_profile(yaml.safe_load(text)), None
        except yaml.YAMLError as error:
            return None, Problem(f"{path}.key", f"{ref['name']}[{key}] is not YAML: {error}")
        except InvalidInput as error:
            return None, Problem(f"{path}.key", f"{ref['name']}[{key}]: " + "; ".join(map(str, error.problems)))


def _with_generated(body: Mapping[str, Any]) -> Mapping[str, Any]:
    """A router-token Secret without a token gets a random one here (the pure layer renders none): a new Secret,
    or a patch of one whose token was emptied or removed (reconcile's patch carries the token when it is good)."""
    data = body.get("data") if isinstance(body.get("data"), Mapping) else {}
    if body.get("kind") != "Secret" or (data or {}).get(TOKEN_KEY):
        return body
    token = base64.b64encode(secrets.token_urlsafe(32).encode()).decode()
    return {**body, "data": {**(data or {}), TOKEN_KEY: token}}


def configure(settings: kopf.OperatorSettings, *, scanning: bool = True) -> None:
    """Operator-wide kopf settings: no kopf bookkeeping on the pools, no peering, scanning.

    Only ``on.event`` handlers are registered, so kopf writes nothing to the pools
    (no progress or diff-base annotations, no finalizers). kopf peering is off:
    it pauses replicas of *lower* priority only, so two replicas of one chart
    would both act; a Lease elects the one that does (``coserve.operator.leader``).
    ``scanning=False`` (namespaced mode, explicit namespaces) keeps kopf from listing
    namespaces and CRDs, which a Role in each namespace does not allow.
    """
    settings.scanning.disabled = not scanning
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="coserve.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="coserve.dev")
    settings.posting.level = logging.WARNING  # kopf's own log lines are not Events; ours are
    settings.watching.server_timeout = 300
    settings.peering.standalone = True


ClusterLoader = Callable[[], SingleConfig]


def build_registry(
    cluster: ClusterLoader,
    *,
    registry: kopf.OperatorRegistry | None = None,
    lease: LeaseSettings | None = None,
    scanning: bool = True,
    namespaces: Sequence[str] | None = None,
    resync_s: float = DEFAULT_RESYNC_S,
    image_tag: str | None = None,
    autoscale_tick_s: float = 1.0,
) -> kopf.OperatorRegistry:
    """Register coserve's handlers; ``cluster`` says where the API server is and how to log in.

    ``cluster`` is called at start-up; kopf's login handler and the operator's own
    client both authenticate from what it returns (client certificates, token
    files, exec plugins), and both fetch a fresh credential after a 401.
    ``lease``: act only while holding this Lease (``None``: a single replica that
    always acts). ``namespaces`` are the ones kopf watches (``None``: every
    namespace); the resync lists pools and children there.
    """
    registry = registry or kopf.OperatorRegistry()
    state: dict[str, Any] = {}
    tag = image_tag if image_tag is not None else os.environ.get("COSERVE_IMAGE_TAG", __version__)
    cache = ObjectCache()
    scope = set(namespaces) if namespaces else None
    child_kinds = tuple(dict.fromkeys(kind for kind, _ in CHILDREN))
    wake = asyncio.Event()  # set when this replica starts leading: resync at once

    def managed(body: Mapping[str, Any]) -> bool:
        return ((body.get("metadata") or {}).get("labels") or {}).get(MANAGED_BY_LABEL) == MANAGED_BY

    def acting() -> bool:
        elector: LeaderElector | None = state.get("elector")
        return elector is None or elector.is_leader

    def config() -> SingleConfig:
        if "config" not in state:
            state["config"] = cluster()
        loaded: SingleConfig = state["config"]
        return loaded

    async def refresh(kube: KubeClient) -> None:
        """List every pool and managed child: what a lost watch event hid (a deletion above all) shows up."""
        for kind in (KIND, *child_kinds):
            since = cache.mark()
            selector = None if kind == KIND else f"{MANAGED_BY_LABEL}={MANAGED_BY}"
            listed: list[dict[str, Any]] = []
            for namespace in sorted(scope) if scope else [None]:
                listed += await kube.list(kind, namespace, selector)
            ghosts = cache.replace(kind, [b for b in listed if kind == KIND or managed(b)], since, scope)
            if ghosts:
                logger.info("resync: %d %s(s) gone without a watch event", ghosts, kind)
        POOLS.set(len(cache.names(KIND)))
        keep_pools(cache.names(KIND))  # pools deleted without a watch event lose their series

    async def resync_forever() -> None:
        # NOTE: a plain task rather than a kopf timer: kopf puts a finalizer on every object with a timer,
        # and a finalizer would make deleting a pool wait for the operator.
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), resync_s)
            wake.clear()
            reconciler: PoolReconciler | None = state.get("reconciler")
            if reconciler is None or not acting():
                continue
            try:
                await refresh(reconciler.kube)
            except KubeError as error:
                logger.warning("resync: could not list pools and children (using the watch's view): %s", error)
            for namespace, name in cache.names(KIND):
                try:
                    await run(namespace, name)
                except kopf.TemporaryError as error:
                    logger.warning("%s/%s: resync failed: %s", namespace, name, error)
                except Exception:  # one bad pool must not stop the resync of the others
                    logger.exception("%s/%s: resync failed", namespace, name)

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure(settings, scanning=scanning)
        logger.info("API server: %s", describe(config()))
        # With a Lease, every call gets a timeout shorter than the margin between the renew deadline and
        # the lease duration, and every write by the reconciler, the autoscaler and the event recorder is
        # fenced: it is sent only while the Lease outlives the write's timeout (coserve.operator.leader).
        kube = KubeClient(config(), timeout_s=lease.call_timeout) if lease is not None else KubeClient(config())
        writer = kube
        elector: LeaderElector | None = None
        if lease is not None:
            elector = LeaderElector(kube, lease, on_started_leading=wake.set)
            writer = kube.fenced(elector.fence)
        reconciler = PoolReconciler(writer, cache=cache, image_tag=tag)
        state["reconciler"] = reconciler
        if elector is not None:
            state["elector"] = elector
            state["leading"] = asyncio.create_task(elector.run())
        else:
            wake.set()
        state["resync"] = asyncio.create_task(resync_forever())
        autoscaler = Autoscaler(
            writer,
            cache,
            read_profile=reconciler.read_profile,
            post_event=reconciler.post_event,
            lock_for=reconciler.lock_for,
            acting=acting,
        )
        state["autoscaler"] = autoscaler
        state["autoscaling"] = asyncio.create_task(autoscaler.run_forever(autoscale_tick_s))

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        for key in ("autoscaling", "resync", "leading"):
            task = state.pop(key, None)
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        elector: LeaderElector | None = state.pop("elector", None)
        if elector is not None:
            await elector.release()
        autoscaler = state.pop("autoscaler", None)
        if autoscaler is not None:
            await autoscaler.close()
        reconciler = state.pop("reconciler", None)
        if reconciler is not None:
            await reconciler.kube.close()

    @kopf.on.login(registry=registry)
    async def login(**_: Any) -> kopf.ConnectionInfo:
        # Called at start-up and again after a 401 or at the credential's expiration: read it afresh.
        credential = await fetch_credential(config())
        return kopf.ConnectionInfo(
            server=credential.server,
            ca_path=credential.ca_path,
            ca_data=credential.ca_data,
            insecure=credential.insecure,
            scheme="Bearer" if credential.token else None,
            token=credential.token,
            username=credential.username,
            password=credential.password,
            certificate_path=credential.certificate_path,
            certificate_data=credential.certificate_data,
            private_key_path=credential.private_key_path,
            private_key_data=credential.private_key_data,
            default_namespace=credential.namespace,
            expiration=credential.expiration,
        )

    async def run(namespace: str | None, name: str | None) -> None:
        reconciler: PoolReconciler | None = state.get("reconciler")
        if reconciler is None or namespace is None or name is None or not acting():
            return
        try:
            await reconciler.reconcile(namespace, name)
        except NotLeading as error:  # the Lease may expire before the write lands: the next leader acts
            logger.info("%s/%s: not leading, reconcile skipped: %s", namespace, name, error)
        except KubeError as error:
            raise kopf.TemporaryError(f"the API server refused a change: {error}", delay=5) from error

    @kopf.on.event(GROUP, VERSION, PLURAL, id="pool", registry=registry)
    async def pool_event(type: str | None, body: Mapping[str, Any], namespace: str | None, name: str | None,
                         **_: Any) -> None:  # fmt: skip
        # Every replica keeps its cache warm; only the leader acts. An echo of the operator's own status
        # write changes nothing the reconcile reads but the status it wrote, so it decides nothing new.
        changed = cache.observe(KIND, type, copy.deepcopy(dict(body)))
        POOLS.set(len(cache.names(KIND)))
        keep_pools(cache.names(KIND))  # a deleted pool loses its series
        if changed and type != "DELETED" and not (body.get("metadata") or {}).get("deletionTimestamp"):
            await run(namespace, name)

    labels = {MANAGED_BY_LABEL: MANAGED_BY}
    for kind in child_kinds:
        group, plural = CHILD_RESOURCES[kind]

        def handler(kind: str) -> Callable[..., Any]:
            async def child_changed(type: str | None, body: Mapping[str, Any], namespace: str | None, **_: Any) -> None:
                # An echo of the operator's own write changes nothing in the cache, and triggers nothing.
                if not cache.observe(kind, type, copy.deepcopy(dict(body))):
                    return
                for owner in (body.get("metadata") or {}).get("ownerReferences") or []:
                    if owner.get("kind") == KIND and owner.get("apiVersion", "").startswith(GROUP + "/"):
                        await run(namespace, owner.get("name"))

            return child_changed

        kopf.on.event(group=group, version="v1", plural=plural, labels=labels, id=f"child-{plural}", registry=registry)(
            handler(kind)
        )

    return registry
