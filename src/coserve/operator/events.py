"""Kubernetes Events on CoServePools, aggregated the way Kubernetes' own controllers aggregate them.

Who calls it: ``coserve.operator.reconciler`` (the reconciler's decisions) and
``coserve.operator.autoscaler`` (scaling and Prometheus trouble), through
``EventRecorder.post``.

A repeated identical Event (same pool, type, reason and message) does not make
a new object: the existing one gets ``count + 1`` and a new ``lastTimestamp``,
as client-go's EventCorrelator does, so ``kubectl describe csp`` shows
"x5 over 10m" instead of five lines. The Event's name is derived from that key,
so a restarted operator finds the Event its predecessor posted (a create answered
409 becomes an increment) and two replicas never post twins. An Event the API
server has expired (its TTL, an hour by default) is created afresh.

The count is never taken from memory: each increment reads the Event and writes
``count + 1`` conditioned on the ``resourceVersion`` it read, so a write by another
replica meanwhile (a failover) makes the API server answer 409, and the Event is
read again and counted on what it holds (``attempts`` times at most). Counts only go up.

Posting never raises: a failure is logged, since an Event is a report, not state.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from coserve.api.conditions import rfc3339
from coserve.api.resource import KIND
from coserve.operator.kube import KubeClient, KubeError
from coserve.operator.reconcile import PoolEvent
from coserve.operator.resources import MANAGED_BY

__all__ = ["EventRecorder", "event_name"]

logger = logging.getLogger("coserve.operator.events")


def event_name(pool_name: str, pool_uid: str | None, event: PoolEvent) -> str:
    """``<pool>.<16 hex digits of the aggregation key>``: the same Event for the same report."""
    key = "\x00".join((pool_uid or "", event.type, event.reason, event.message))
    return f"{pool_name}.{hashlib.sha256(key.encode()).hexdigest()[:16]}"


class EventRecorder:
    """One per operator; posts and counts Events on the API server's view, never on a remembered count."""

    def __init__(
        self,
        kube: KubeClient,
        *,
        instance: str | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        capacity: int = 4096,
        attempts: int = 5,
    ) -> None:
        self.kube = kube
        self.instance = instance or os.environ.get("HOSTNAME", MANAGED_BY)
        self.clock = clock
        self.attempts = attempts
        self.capacity = capacity
        # the last ``capacity`` Events this recorder saw exist: for them the first request is the read
        self._posted: OrderedDict[tuple[str, str], None] = OrderedDict()

    async def post(self, namespace: str, pool: Mapping[str, Any], event: PoolEvent) -> None:
        """Post ``event`` on ``pool``, or count it again when the same Event exists."""
        metadata = pool.get("metadata") or {}
        pool_name = str(metadata.get("name"))
        name = event_name(pool_name, metadata.get("uid"), event)
        now = rfc3339(self.clock())
        try:
            for _ in range(self.attempts):
                if await self._once(namespace, name, pool, event, now):
                    return
            logger.warning("%s/%s: event %s kept changing during %d attempts; not counted",
                           namespace, pool_name, event.reason, self.attempts)  # fmt: skip
        except KubeError as error:
            logger.warning("%s/%s: could not post event %s: %s", namespace, pool_name, event.reason, error)

    async def _once(self, namespace: str, name: str, pool: Mapping[str, Any], event: PoolEvent, now: str) -> bool:
        """One attempt: read, then increment with the read's resourceVersion (or create); ``False``: again."""
        key = (namespace, name)
        existing = await self.kube.get("Event", namespace, name) if key in self._posted else None
        if existing is None:
            try:
                await self.kube.create("Event", namespace, self._body(namespace, name, pool, event, now))
            except KubeError as error:
                if error.status != 409:
                    raise
                self._remember(key)  # a predecessor (or another replica) posted it: count on it
                return False
            self._remember(key)
            return True
        patch: dict[str, Any] = {"count": int(existing.get("count") or 1) + 1, "lastTimestamp": now}
        version = (existing.get("metadata") or {}).get("resourceVersion")
        if version:
            patch["metadata"] = {"resourceVersion": version}  # 409 if anyone wrote it since the read
        try:
            await self.kube.merge_patch("Event", namespace, name, patch)
        except KubeError as error:
            if error.status == 404:  # expired meanwhile: create it afresh
                self._posted.pop(key, None)
                return False
            if error.status == 409:
                return False
            raise
        self._remember(key)
        return True

    def _remember(self, key: tuple[str, str]) -> None:
        self._posted[key] = None
        self._posted.move_to_end(key)
        while len(self._posted) > self.capacity:
            self._posted.popitem(last=False)

    def _body(self, namespace: str, name: str, pool: Mapping[str, Any], event: PoolEvent, now: str) -> dict[str, Any]:
        metadata = pool.get("metadata") or {}
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": namespace},
            "involvedObject": {
                "apiVersion": pool.get("apiVersion") or "coserve.dev/v1alpha1",
                "kind": KIND,
                "name": metadata.get("name"),
                "namespace": namespace,
                "uid": metadata.get("uid"),
            },
            "type": event.type,
            "reason": event.reason,
            "message": event.message[:1024],
            "source": {"component": MANAGED_BY},
            "reportingComponent": f"coserve.dev/{MANAGED_BY}",
            "reportingInstance": self.instance,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
