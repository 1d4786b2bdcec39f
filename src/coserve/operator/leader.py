"""One actor among operator replicas: leader election on a ``coordination.k8s.io/v1`` Lease.

Who calls it: ``coserve.operator.handlers`` starts ``LeaderElector.run`` at
operator start-up and asks ``is_leader`` before every reconcile, resync and
autoscaler evaluation; the kopf handlers keep feeding the cache on every replica,
so a replica that takes over acts on a warm view at once (it resyncs every pool
as soon as it leads).

The rules are client-go's (``k8s.io/client-go/tools/leaderelection``):

- a replica takes the Lease when nobody holds it, or when the holder has not
  renewed it for ``lease_duration_s`` as measured on this replica's own clock
  (from when it last saw the record change, so clock skew between nodes does
  not matter);
- the holder renews every ``retry_period_s``; if it cannot renew for
  ``renew_deadline_s`` it stops acting before anyone else may take over
  (``renew_deadline_s < lease_duration_s``);
- every write carries the Lease's ``resourceVersion``, so of two replicas that
  race for an expired Lease the API server lets exactly one win (409 for the other);
- a replica that stops cleanly empties ``holderIdentity`` so the next one takes
  over within ``retry_period_s`` instead of ``lease_duration_s``.

Beyond client-go:

- writes are fenced (``fence``, installed on the writers' client with
  ``KubeClient.fenced``): a write goes out only while this replica's Lease stays
  valid for longer than the write's timeout, measured on the monotonic clock from
  the start of its last successful renewal, so a write delayed by a slow
  Prometheus query or API call is dropped (``NotLeading``) rather than sent by a
  replica that may no longer lead;
- the fence is a clock check on this side of the wire, so the API server holds
  the last line: every child patch or delete, scale and status write carries the
  ``resourceVersion`` it was decided from (``KubeClient.merge_patch``), and a
  write that lands after another replica wrote the same object gets 409 and is
  decided again, never re-sent (a paused or partitioned leader's late write
  cannot overwrite the new leader's);
- the margin between the renew deadline and the lease duration is longer than
  any API call (``call_timeout_s``, derived from it unless set), so the leader
  stops acting before its Lease can expire even when its last call hangs;
- a Lease that is deleted under the leader (404 on renewal, or gone at the next
  read) ends its leadership at once; it is a candidate again from the next round.
  A replica that saw another holder's record before the deletion keeps off for a
  lease duration from when it last saw it change, as if the record were still
  there, so the old leader has stopped before the new one starts.

Take-over after the leader dies without releasing: at most
``lease_duration_s + retry_period_s`` after its last renewal (17 s with the
defaults 15 s and 2 s).

``next_record`` is the pure decision; ``LeaderElector`` is the loop around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from coserve.operator.kube import KubeClient, KubeError, NotLeading

__all__ = ["LeaderElector", "LeaseSettings", "next_record"]

logger = logging.getLogger("coserve.operator.leader")


@dataclass(frozen=True)
class LeaseSettings:
    """Which Lease, who this replica is, and the timing (client-go's defaults)."""

    name: str
    namespace: str
    identity: str
    lease_duration_s: float = 15.0
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0
    # The timeout of every API call the operator makes while leading (``None``: 4/5 of the margin
    # ``lease_duration_s - renew_deadline_s``, 4 s with the defaults); it must stay below that margin.
    call_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.retry_period_s < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError(
                "lease timing must satisfy 0 < retry period < renew deadline < lease duration, got "
                f"{self.retry_period_s}, {self.renew_deadline_s}, {self.lease_duration_s}"
            )
        margin = self.lease_duration_s - self.renew_deadline_s
        if self.call_timeout_s is not None and not 0 < self.call_timeout_s < margin:
            raise ValueError(
                f"call_timeout_s must be positive and shorter than lease_duration_s - renew_deadline_s "
                f"({self.lease_duration_s} - {self.renew_deadline_s} = {margin} s), got {self.call_timeout_s}: "
                "a call that outlasts the margin could still be in flight when another replica takes over"
            )
        if not self.identity:
            raise ValueError("identity must not be empty")

    @property
    def call_timeout(self) -> float:
        """The timeout for the operator's API calls: ``call_timeout_s``, or 4/5 of the renew margin."""
        if self.call_timeout_s is not None:
            return self.call_timeout_s
        return (self.lease_duration_s - self.renew_deadline_s) * 0.8


def micro_time(moment: datetime) -> str:
    """metav1.MicroTime, as Lease times are serialised: ``2026-12-03T16:00:00.123456Z``."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def next_record(
    spec: Mapping[str, Any] | None, identity: str, expired: bool, now: datetime, lease_duration_s: float
) -> dict[str, Any] | None:
    """The Lease spec to write for ``identity``, or ``None`` when another live replica holds it.

    ``expired``: the holder's record has not changed for a lease duration on this
    replica's clock. An empty holder is free.
    """
    spec = spec or {}
    holder = spec.get("holderIdentity") or ""
    mine = holder == identity
    if holder and not mine and not expired:
        return None
    stamp = micro_time(now)
    transitions = int(spec.get("leaseTransitions") or 0)
    return {
        "holderIdentity": identity,
        "leaseDurationSeconds": max(1, round(lease_duration_s)),
        "acquireTime": spec.get("acquireTime") if mine and spec.get("acquireTime") else stamp,
        "renewTime": stamp,
        # as client-go: every change of holder counts, a release in between included; a new Lease starts at 0
        "leaseTransitions": transitions if mine or not spec else transitions + 1,
    }


class LeaderElector:
    """Holds (or waits for) the Lease; ``is_leader`` says whether this replica may act now."""

    def __init__(
        self,
        kube: KubeClient,
        settings: LeaseSettings,
        *,
        on_started_leading: Callable[[], Any] | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube = kube
        self.settings = settings
        self.on_started_leading = on_started_leading
        self.clock = clock
        self.monotonic = monotonic
        self._observed: dict[str, Any] | None = None  # the last Lease spec seen
        self._observed_at = 0.0  # monotonic time it last changed
        self._renewed_at: float | None = None  # monotonic time of our last successful write while leading
        self.leading = asyncio.Event()

    @property
    def is_leader(self) -> bool:
        """Leading, and renewed within the renew deadline (a partitioned leader stops acting on its own)."""
        if self._renewed_at is None:
            return False
        return self.monotonic() - self._renewed_at < self.settings.renew_deadline_s

    def fence(self, verb: str, kind: str, name: str, timeout_s: float) -> None:
        """Let a write go out only if the Lease is valid for longer than its timeout (``KubeClient.fenced``).

        Valid until ``lease_duration_s`` after the start of the last successful renewal, on this
        replica's monotonic clock (the other replicas count from when they saw that renewal, later).
        Raises ``NotLeading`` otherwise: the write is not sent.
        """
        if self._renewed_at is not None:
            # the duration written to the Lease is whole seconds: the others wait the shorter of the two
            duration = min(self.settings.lease_duration_s, float(max(1, round(self.settings.lease_duration_s))))
            left = self._renewed_at + duration - self.monotonic()
            if timeout_s < left:
                return
            reason = f"the lease is valid for {max(left, 0.0):.3f} s, the call may take {timeout_s} s"
        else:
            reason = "this replica does not hold the lease"
        logger.info("lease %s: %s %s %s not sent: %s", self.settings.name, verb, kind, name, reason)
        raise NotLeading(f"{verb} {kind} {name} not sent: {reason}")

    def _lost(self, why: str) -> None:
        """Stop leading at once (the Lease is gone): no more writes, a candidate again from the next round."""
        if self._renewed_at is not None or self.leading.is_set():
            logger.warning("lease %s: %s stops leading: %s", self.settings.name, self.settings.identity, why)
        self._renewed_at = None
        self.leading.clear()

    async def run(self) -> None:
        """Try to acquire, then renew, every retry period, until cancelled."""
        while True:
            try:
                acquired = await self.try_acquire_or_renew()
            except KubeError as error:
                logger.warning("lease %s: %s", self.settings.name, error)
                acquired = False
            if acquired and not self.leading.is_set():
                logger.info("lease %s: %s leads", self.settings.name, self.settings.identity)
                self.leading.set()
                if self.on_started_leading is not None:
                    result = self.on_started_leading()
                    if asyncio.iscoroutine(result):
                        await result
            elif self.leading.is_set() and not self.is_leader:
                logger.warning("lease %s: %s lost the lease; standing by", self.settings.name, self.settings.identity)
                self.leading.clear()
            await asyncio.sleep(self.settings.retry_period_s)

    async def try_acquire_or_renew(self) -> bool:
        """One round: ``True`` when this replica holds the Lease after it."""
        name, namespace = self.settings.name, self.settings.namespace
        lease = await self.kube.get("Lease", namespace, name)
        now = self.monotonic()
        if lease is None:
            if self._renewed_at is not None:
                self._lost("the Lease was deleted")
                return False  # a candidate again from the next round
            seen = self._observed or {}
            holder = seen.get("holderIdentity")
            duration = float(seen.get("leaseDurationSeconds") or self.settings.lease_duration_s)
            if holder and holder != self.settings.identity and now - self._observed_at < duration:
                return False  # deleted under a live holder: it may still act until its record would expire
            spec = next_record(None, self.settings.identity, False, self.clock(), self.settings.lease_duration_s)
            if spec is None:  # cannot happen: nobody holds a Lease that does not exist
                return False
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": name, "namespace": namespace}, "spec": spec}  # fmt: skip
            try:
                await self.kube.create("Lease", namespace, body)
            except KubeError as error:
                if error.status == 409:  # another replica created it first
                    return False
                raise
            return self._won(spec, now)
        spec = lease.get("spec") or {}
        if spec != self._observed:
            self._observed, self._observed_at = dict(spec), now
        duration = float(spec.get("leaseDurationSeconds") or self.settings.lease_duration_s)
        expired = now - self._observed_at >= duration
        wanted = next_record(spec, self.settings.identity, expired, self.clock(), self.settings.lease_duration_s)
        if wanted is None:
            self._renewed_at = None
            return False
        patch: dict[str, Any] = {"spec": wanted}
        version = (lease.get("metadata") or {}).get("resourceVersion")
        if version:
            patch["metadata"] = {"resourceVersion": version}  # optimistic lock: 409 if someone wrote meanwhile
        try:
            await self.kube.merge_patch("Lease", namespace, name, patch)
        except KubeError as error:
            if error.status == 404:  # deleted since the read: whoever held it, nobody does now
                self._lost("the Lease was deleted (404 on renewal)")
                return False
            if error.status == 409:
                return False
            raise
        return self._won(wanted, now)

    def _won(self, spec: dict[str, Any], now: float) -> bool:
        self._observed, self._observed_at, self._renewed_at = dict(spec), now, now
        return True

    async def release(self) -> None:
        """Give the Lease up so another replica takes over at its next retry (called on clean shutdown).

        Only while this replica still leads, and only if the Lease still names it: a
        replica that lost the Lease while partitioned must not erase its successor's.
        """
        leading = self.is_leader
        self._renewed_at = None
        self.leading.clear()
        if not leading:
            return
        name, namespace = self.settings.name, self.settings.namespace
        with contextlib.suppress(KubeError):
            lease = await self.kube.get("Lease", namespace, name)
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.settings.identity:
                return
            patch: dict[str, Any] = {"spec": {"holderIdentity": None, "renewTime": micro_time(self.clock())}}
            version = (lease.get("metadata") or {}).get("resourceVersion")
            if version:
                patch["metadata"] = {"resourceVersion": version}
            await self.kube.merge_patch("Lease", namespace, name, patch)
            logger.info("lease %s: released by %s", name, self.settings.identity)
