"""The kopf operator: handlers that feed ``coserve.operator.reconcile`` and carry out its decisions.

Who calls it: ``coserve operator`` (``kopf.run`` with ``build_registry()``), and
``kopf run operator/main.py``, which registers the same handlers in kopf's
default registry. Tests build a registry against kmock's Kubernetes emulator.

When a reconcile runs (always the whole pool, under a per-pool lock):

- the pool is created, its spec changes, or the operator starts (resume);
- every ``resync_s`` seconds for every known pool, which picks up readiness changes;
- a Deployment, Service or ConfigMap labelled ``app.kubernetes.io/managed-by:
  coserve-operator`` changes or disappears: its controlling pool is reconciled,
  so a child deleted or edited by hand is put back within a watch event.

A reconcile reads the pool and its seven children, reads the measured profile
if ``spec.profile.configMapRef`` names one, asks ``reconcile()`` what to do,
creates or merge-patches children, writes the status (only if it changed) and
posts the decision's Events. Nothing is deleted: owner references let the
garbage collector remove the children with the pool, so no finalizer is added
and deleting a pool never waits for the operator.

Two operator replicas never both act: kopf peering (``--peering NAME``, the
chart's default) pauses every replica but the one with the highest priority;
``--standalone`` turns peering off for a single replica.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import httpx
import kopf
import yaml

from coserve import __version__
from coserve.api.conditions import rfc3339
from coserve.api.parse import parse_profile
from coserve.api.problems import InvalidInput, Problem
from coserve.api.profile import EngineProfile
from coserve.api.resource import GROUP, KIND, PLURAL, VERSION
from coserve.operator.kube import ClusterAccess, KubeClient, KubeError
from coserve.operator.metrics import CHILD_CHANGES, POOLS, RECONCILE_SECONDS, RECONCILES
from coserve.operator.reconcile import ChildKey, PoolEvent, Reconciliation, reconcile
from coserve.operator.resources import MANAGED_BY, MANAGED_BY_LABEL, child_keys

__all__ = ["DEFAULT_RESYNC_S", "PoolReconciler", "build_registry", "configure"]

DEFAULT_RESYNC_S = 30.0
logger = logging.getLogger("coserve.operator")


class PoolReconciler:
    """Reads a pool's world, calls the pure ``reconcile`` and applies its decision; one per operator."""

    def __init__(
        self,
        kube: KubeClient,
        *,
        image_tag: str | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.kube = kube
        self.image_tag = image_tag
        self.clock = clock
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

    async def reconcile(self, namespace: str, name: str) -> Reconciliation | None:
        """Reconcile one pool; ``None`` when it is gone or being deleted."""
        lock = self._locks.setdefault((namespace, name), asyncio.Lock())
        async with lock:
            started = time.perf_counter()
            try:
                result = await self._reconcile(namespace, name)
            except Exception:
                RECONCILES.labels("error").inc()
                raise
            finally:
                RECONCILE_SECONDS.observe(time.perf_counter() - started)
            if result is not None:
                RECONCILES.labels("ok" if result.plan_valid else "invalid").inc()
            return result

    async def _reconcile(self, namespace: str, name: str) -> Reconciliation | None:
        """Read, decide, write (the lock is held)."""
        body = await self.kube.get(KIND, namespace, name)
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            self._locks.pop((namespace, name), None)
            return None
        keys = child_keys(name)
        children = await asyncio.gather(*(self.kube.get(kind, namespace, child) for kind, child in keys))
        observed: dict[ChildKey, Mapping[str, Any] | None] = dict(zip(keys, children, strict=True))
        profile, problem = await self._profile(namespace, body)
        result = reconcile(
            body,
            observed,
            self.clock(),
            measured_profile=profile,
            profile_problem=problem,
            operator_image_tag=self.image_tag,
        )
        for action in result.actions:
            if action.verb == "create":
                try:
                    await self.kube.create(action.kind, namespace, action.body)
                except KubeError as error:
                    if error.status != 409:  # created meanwhile: the watch event reconciles again
                        raise
            else:
                await self.kube.merge_patch(action.kind, namespace, action.name, action.body)
            CHILD_CHANGES.labels(action.verb, action.kind).inc()
            logger.info("%s/%s: %s %s %s (%s)", namespace, name, action.verb, action.kind, action.name, action.reason)
        if body.get("status") != result.status:
            await self._write_status(namespace, name, result.status)
        for event in result.events:
            await self._post_event(namespace, body, event)
        return result

    async def _post_event(self, namespace: str, pool: Mapping[str, Any], event: PoolEvent) -> None:
        """A core/v1 Event on the pool (``kubectl describe csp`` shows it); failures are logged, not raised."""
        metadata = pool.get("metadata") or {}
        now = rfc3339(self.clock())
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            # a unique name instead of generateName: the same on every API server, and one round trip
            "metadata": {"name": f"{metadata.get('name')}.{uuid.uuid4().hex[:16]}", "namespace": namespace},
            "involvedObject": {
                "apiVersion": pool.get("apiVersion"),
                "kind": KIND,
                "name": metadata.get("name"),
                "namespace": namespace,
                "uid": metadata.get("uid"),
                "resourceVersion": metadata.get("resourceVersion"),
            },
            "type": event.type,
            "reason": event.reason,
            "message": event.message[:1024],
            "source": {"component": MANAGED_BY},
            "reportingComponent": f"coserve.dev/{MANAGED_BY}",
            "reportingInstance": os.environ.get("HOSTNAME", MANAGED_BY),
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await self.kube.create("Event", namespace, body)
        except (KubeError, httpx.HTTPError) as error:
            logger.warning("%s/%s: could not post event %s: %s", namespace, metadata.get("name"), event.reason, error)

    async def _write_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        # A merge patch replaces lists (conditions) whole; the status subresource keeps spec untouched.
        try:
            await self.kube.merge_patch(KIND, namespace, name, {"status": status}, subresource="status")
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


def configure(settings: kopf.OperatorSettings, *, peering: str | None, scanning: bool = True) -> None:
    """Operator-wide kopf settings: annotations (not status) for kopf's own bookkeeping, peering, scanning.

    ``scanning=False`` (namespaced mode, explicit namespaces) keeps kopf from listing
    namespaces and CRDs, which a Role in each namespace does not allow.
    """
    settings.scanning.disabled = not scanning
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="coserve.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="coserve.dev")
    settings.posting.level = logging.WARNING  # kopf's own log lines are not Events; ours are
    settings.watching.server_timeout = 300
    if peering is None:
        settings.peering.standalone = True
    else:
        settings.peering.name = peering
        settings.peering.mandatory = True
        settings.peering.standalone = False


def build_registry(
    access: Callable[[], ClusterAccess] = ClusterAccess.from_environment,
    *,
    registry: kopf.OperatorRegistry | None = None,
    peering: str | None = None,
    scanning: bool = True,
    resync_s: float = DEFAULT_RESYNC_S,
    image_tag: str | None = None,
) -> kopf.OperatorRegistry:
    """Register coserve's handlers; ``access`` says how to reach the API server (called at start-up)."""
    registry = registry or kopf.OperatorRegistry()
    state: dict[str, Any] = {}
    tag = image_tag if image_tag is not None else os.environ.get("COSERVE_IMAGE_TAG", __version__)

    known: set[tuple[str, str]] = set()  # (namespace, name) of every pool seen and not deleted

    async def resync_forever() -> None:
        # NOTE: a plain task rather than a kopf timer: kopf puts a finalizer on every object with a timer,
        # and a finalizer would make deleting a pool wait for the operator.
        while True:
            await asyncio.sleep(resync_s)
            for namespace, name in sorted(known):
                try:
                    await run(namespace, name)
                except kopf.TemporaryError as error:
                    logger.warning("%s/%s: resync failed: %s", namespace, name, error)
                except Exception:  # one bad pool must not stop the resync of the others
                    logger.exception("%s/%s: resync failed", namespace, name)

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure(settings, peering=peering, scanning=scanning)
        cluster = access()
        state["access"] = cluster
        state["reconciler"] = PoolReconciler(KubeClient(cluster), image_tag=tag)
        state["resync"] = asyncio.create_task(resync_forever())

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        task = state.pop("resync", None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        reconciler = state.pop("reconciler", None)
        if reconciler is not None:
            await reconciler.kube.close()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        cluster: ClusterAccess = state.get("access") or access()
        return kopf.ConnectionInfo(
            server=cluster.server,
            token=cluster.token,
            ca_path=cluster.ca_file,
            insecure=not cluster.verify,
            certificate_path=cluster.client_cert[0] if cluster.client_cert else None,
            private_key_path=cluster.client_cert[1] if cluster.client_cert else None,
        )

    async def run(namespace: str | None, name: str | None) -> None:
        reconciler: PoolReconciler | None = state.get("reconciler")
        if reconciler is None or namespace is None or name is None:
            return
        try:
            await reconciler.reconcile(namespace, name)
        except KubeError as error:
            raise kopf.TemporaryError(f"the API server refused a change: {error}", delay=5) from error

    @kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.update(GROUP, VERSION, PLURAL, field="spec", registry=registry)
    async def pool_changed(namespace: str | None, name: str | None, **_: Any) -> None:
        await run(namespace, name)

    @kopf.on.event(GROUP, VERSION, PLURAL, id="pool-seen", registry=registry)
    async def pool_seen(type: str | None, namespace: str | None, name: str | None, **_: Any) -> None:
        if namespace is None or name is None:
            return
        if type == "DELETED":
            known.discard((namespace, name))
        else:
            known.add((namespace, name))
        POOLS.set(len(known))

    labels = {MANAGED_BY_LABEL: MANAGED_BY}
    for group, plural in (("apps", "deployments"), ("", "services"), ("", "configmaps")):

        @kopf.on.event(group=group, version="v1", plural=plural, labels=labels, id=f"child-{plural}", registry=registry)
        async def child_changed(body: Mapping[str, Any], namespace: str | None, **_: Any) -> None:
            for owner in (body.get("metadata") or {}).get("ownerReferences") or []:
                if owner.get("kind") == KIND and owner.get("apiVersion", "").startswith(GROUP + "/"):
                    await run(namespace, owner.get("name"))

    return registry
