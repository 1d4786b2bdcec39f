"""The pool reconciler: reads a pool's world from the watch-fed cache, asks ``reconcile`` what to do, applies it.

Who calls it: the kopf handlers in ``coserve.operator.handlers`` build one
``PoolReconciler`` at operator start-up and call ``PoolReconciler.reconcile``
for every trigger (a watch event that is news, a resync, taking the Lease over);
the autoscaler borrows its per-pool lock, profile reader and Event poster.
Tests call it directly against kmock's Kubernetes emulator.

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
"""

from __future__ import annotations

import asyncio
import base64
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import yaml

from coserve.api.parse import parse_profile
from coserve.api.problems import InvalidInput, Problem
from coserve.api.profile import EngineProfile
from coserve.api.resource import KIND
from coserve.operator.cache import ObjectCache
from coserve.operator.events import EventRecorder
from coserve.operator.kube import KubeClient, KubeError, NotLeading, version_of
from coserve.operator.metrics import CHILD_CHANGES, RECONCILE_SECONDS, RECONCILES, forget_pool, observe_pool
from coserve.operator.reconcile import ChildKey, PoolEvent, Reconciliation, reconcile
from coserve.operator.resources import GATEWAY_API_KINDS, TOKEN_KEY, child_keys

__all__ = ["PoolReconciler"]

logger = logging.getLogger("coserve.operator")


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
        # gateway-mode kinds the API server does not serve (no CRD): the resync keeps it, a refused create adds
        self.unserved: set[str] = set()
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
        """Read (cache), decide, write; again from the top when a create shows the cache was behind, or a
        write's ``resourceVersion`` precondition shows that what it was decided from has changed (409).

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
                unserved=frozenset(self.unserved),
            )
            if not fresh and any(action.verb == "create" for action in result.actions):
                fresh = True
                if await self._read_pool(namespace, name) != body:
                    continue  # the pool changed (or is gone): decide on what the API server holds
            current, refusals = await self._apply(namespace, name, result, observed)
            if not current:
                continue
            stored = body.get("status") == result.status or await self._write_status(
                namespace, name, result.status, version_of(body)
            )
            for event in (*result.events, *refusals):  # the children's writes landed: say so either way
                await self._post_event(namespace, body, event)
            if not stored:  # the pool changed since it was read: read it again and decide again
                await self._read_pool(namespace, name)
                fresh = True
                continue
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

    async def _apply(
        self,
        namespace: str,
        name: str,
        result: Reconciliation,
        observed: Mapping[ChildKey, Mapping[str, Any] | None],
    ) -> tuple[bool, list[PoolEvent]]:
        """Create, patch or delete the children.

        Each patch and delete carries the ``resourceVersion`` of the child it was decided from (``observed``),
        so the API server refuses it (409) if anyone wrote the child since: a deposed replica's late write
        never lands over the new leader's. ``False`` when the cache was behind or a child changed (it is
        refreshed: decide again); with Warning events for the changes the API server refused by policy (a
        PersistentVolumeClaim it cannot expand).
        """
        current = True
        refusals: list[PoolEvent] = []
        for action in result.actions:
            try:
                if action.verb == "create":
                    written = await self.kube.create(action.kind, namespace, _with_generated(action.body))
                elif action.verb == "delete":
                    uid = (action.body.get("metadata") or {}).get("uid")
                    seen = version_of(observed.get((action.kind, action.name)))
                    await self._delete(namespace, action.kind, action.name, uid if isinstance(uid, str) else None, seen)
                    CHILD_CHANGES.labels(action.verb, action.kind).inc()
                    logger.info("%s/%s: delete %s %s (%s)", namespace, name, action.kind, action.name, action.reason)
                    continue
                else:
                    body = _with_generated(action.body) if action.kind == "Secret" else action.body
                    decided_from = version_of(observed.get((action.kind, action.name)))
                    written = await self.kube.merge_patch(
                        action.kind, namespace, action.name, body, resource_version=decided_from
                    )
            except KubeError as error:
                if action.kind == "PersistentVolumeClaim" and action.verb == "patch" and error.status in (403, 422):
                    # NOTE: e.g. a storage class without allowVolumeExpansion; retrying at once would fail again
                    message = f"{action.kind} {action.name} was not patched ({action.reason}): {error}"
                    logger.warning("%s/%s: %s", namespace, name, message)
                    refusals.append(PoolEvent("Warning", "ChildRefused", message))
                    continue
                if error.status not in (404, 409):
                    raise
                if action.verb == "create" and error.status == 404 and action.kind in GATEWAY_API_KINDS:
                    # the API server serves no such kind (its CRD is not installed): decide again without it
                    logger.warning("%s/%s: %s %s not created: %s", namespace, name, action.kind, action.name, error)
                    self.unserved.add(action.kind)
                    current = False
                    continue
                # 409 on create: it exists after all; on patch or delete: it changed since it was read;
                # 404 on patch: it is gone. Learn which, decide again.
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

    async def _delete(self, namespace: str, kind: str, name: str, uid: str | None, version: str | None) -> None:
        """Delete the child seen with ``uid`` at ``version``; already gone is done (a 409: another object took the
        name, or the child changed since it was read)."""
        try:
            await self.kube.delete(kind, namespace, name, uid=uid, resource_version=version)
        except KubeError as error:
            if error.status != 404:
                raise
        self.cache.forget(kind, namespace, name)

    async def _post_event(self, namespace: str, pool: Mapping[str, Any], event: PoolEvent) -> None:
        await self.events.post(namespace, pool, event)

    async def _write_status(self, namespace: str, name: str, status: dict[str, Any], version: str | None) -> bool:
        """Write the status decided from the pool at ``version``; ``False`` when the pool changed since (409).

        A merge patch replaces lists (conditions) whole; the status subresource keeps spec untouched.
        """
        try:
            written = await self.kube.merge_patch(
                KIND, namespace, name, {"status": status}, subresource="status", resource_version=version
            )
            self.cache.put(KIND, written)
        except KubeError as error:
            if error.status == 409:
                logger.info("%s/%s: the pool changed since it was read; deciding again", namespace, name)
                return False
            if error.status != 404:  # 404: the pool was deleted meanwhile; nothing to report on
                raise
        return True

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
