"""Kubernetes Events on CoServePools, aggregated the way Kubernetes' own controllers aggregate them.

Who calls it: ``coserve.operator.handlers`` (the reconciler's decisions) and
``coserve.operator.autoscaler`` (scaling and Prometheus trouble), through
``EventRecorder.post``.

A repeated identical Event (same pool, type, reason and message) does not make
a new object: the existing one gets ``count + 1`` and a new ``lastTimestamp``,
as client-go's EventCorrelator does, so ``kubectl describe csp`` shows
"x5 over 10m" instead of five lines. The Event's name is derived from that key,
so a restarted operator finds the Event its predecessor posted (a create answered
409 becomes an increment) and two replicas never post twins. An Event the API
server has expired (its TTL, an hour by default) is created afresh.

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
    """One per operator; remembers the counts of the last ``capacity`` Events it posted."""

    def __init__(
        self,
        kube: KubeClient,
        *,
        instance: str | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        capacity: int = 4096,
    ) -> None:
        self.kube = kube
        self.instance = instance or os.environ.get("HOSTNAME", MANAGED_BY)
        self.clock = clock
        self.capacity = capacity
        self._seen: OrderedDict[tuple[str, str], int] = OrderedDict()  # (namespace, event name) -> count

    async def post(self, namespace: str, pool: Mapping[str, Any], event: PoolEvent) -> None:
        """Post ``event`` on ``pool``, or count it again when the same Event exists."""
        metadata = pool.get("metadata") or {}
        pool_name = str(metadata.get("name"))
        name = event_name(pool_name, metadata.get("uid"), event)
        now = rfc3339(self.clock())
        try:
            seen = self._seen.get((namespace, name))
            if seen is not None and await self._increment(namespace, name, seen + 1, now):
                return
            try:
                await self.kube.create("Event", namespace, self._body(namespace, name, pool, event, now))
                self._remember(namespace, name, 1)
            except KubeError as error:
                if error.status != 409:
                    raise
                existing = await self.kube.get("Event", namespace, name)  # a predecessor posted it
                count = int((existing or {}).get("count") or 1)
                await self._increment(namespace, name, count + 1, now)
        except KubeError as error:
            logger.warning("%s/%s: could not post event %s: %s", namespace, pool_name, event.reason, error)

    async def _increment(self, namespace: str, name: str, count: int, now: str) -> bool:
        """``False`` when the Event is gone (expired): create it again."""
        try:
            await self.kube.merge_patch("Event", namespace, name, {"count": count, "lastTimestamp": now})
        except KubeError as error:
            if error.status == 404:
                self._seen.pop((namespace, name), None)
                return False
            raise
        self._remember(namespace, name, count)
        return True

    def _remember(self, namespace: str, name: str, count: int) -> None:
        self._seen[(namespace, name)] = count
        self._seen.move_to_end((namespace, name))
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

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
