"""Who runs an offline batch: one holder at a time among router replicas, taken over when the holder dies.

Who calls it: ``coserve.router.batches.BatchRunner``. On every scan (each
``idle_s``) it calls ``try_acquire(batch_id)`` for each in-progress batch it
does not run yet; it keeps the ``BatchHold`` for as long as it runs the batch,
asks ``hold.valid`` before every append to the batch's output and every change
of its state, and calls ``release()`` when the batch ends or the runner stops.
``try_acquire`` never waits for another holder.

Two backends, chosen by name with ``batch_locks`` (``batch_locks_from_env``
reads ``COSERVE_BATCH_LOCK``):

- ``file`` (the default): ``fcntl.flock(LOCK_EX | LOCK_NB)`` on
  ``batches/<id>.lock`` under ``batchDir``, held on an open descriptor for as
  long as the batch runs. The kernel grants it to one open file at a time, so
  two live holders are impossible, and drops it when the holder's process dies,
  however it dies (``kill -9`` included): another replica takes over at its next
  scan. Right for one machine, and for a shared filesystem whose locks are
  coherent across clients (the Linux NFS client turns ``flock`` into byte-range
  locks kept by the server; CephFS keeps them too).
  NOTE: an NFS client cut off from its server for longer than the server's lease
  can lose the lock while its process lives on; in Kubernetes use ``lease``.
- ``lease``: a ``coordination.k8s.io/v1`` Lease ``coserve-<batch id>`` per
  batch, in ``POD_NAMESPACE`` (else the ServiceAccount's namespace), run by
  ``coserve.operator.leader.LeaderElector`` with client-go's rules: of two
  replicas racing for a free or expired Lease the API server lets one win
  (``resourceVersion``); the holder renews every ``retry_period_s`` and stops
  acting (``valid`` turns ``False``) ``renew_deadline_s`` after its last renewal,
  before anyone may take over (``lease_duration_s`` without a change, on the
  taker's clock). Takeover after a death: at most ``lease_duration_s +
  retry_period_s`` (17 s with the defaults). The ServiceAccount needs ``get``,
  ``create`` and ``patch`` on ``leases`` in that namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import re
import socket
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coserve.operator.kube import KubeClient
    from coserve.operator.leader import LeaderElector, LeaseSettings

__all__ = [
    "LOCK_KINDS",
    "BatchHold",
    "BatchLocks",
    "FileLocks",
    "LeaseLocks",
    "batch_locks",
    "batch_locks_from_env",
    "lease_name",
]

logger = logging.getLogger("coserve.router.batch_lock")

LOCK_KINDS = ("file", "lease")


def holder_identity() -> str:
    """``host/pid/random``: unique per runner, readable in a Lease or lock file (the host is the pod's name)."""
    return f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"


class BatchHold(ABC):
    """The right to run one batch, from ``BatchLocks.try_acquire`` until ``release``."""

    batch_id: str

    @property
    @abstractmethod
    def valid(self) -> bool:
        """May the holder still act? ``False`` once the hold lapsed: stop, write nothing more."""

    @abstractmethod
    async def release(self) -> None:
        """Let another runner take the batch at once; idempotent."""


class BatchLocks(ABC):
    """One lock per batch id, shared by every runner that sees the same ``batchDir``."""

    @abstractmethod
    async def try_acquire(self, batch_id: str) -> BatchHold | None:
        """Hold ``batch_id`` now, or ``None`` while another runner holds it (never waits for it)."""

    async def close(self) -> None:  # noqa: B027 - most backends have nothing to free
        """Free this backend's resources (holds are released by their owners, before)."""


# --- one machine, or a filesystem with coherent locks ---------------------------------------------------------


class _FileHold(BatchHold):
    def __init__(self, batch_id: str, fd: int) -> None:
        self.batch_id = batch_id
        self._fd: int | None = fd

    @property
    def valid(self) -> bool:
        return self._fd is not None

    async def release(self) -> None:
        self.release_now()

    def release_now(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the only descriptor of the open file drops its flock


def _let_go(attempt: asyncio.Future[BatchHold | None]) -> None:
    if not attempt.cancelled() and attempt.exception() is None:
        hold = attempt.result()
        if isinstance(hold, _FileHold):
            hold.release_now()


class FileLocks(BatchLocks):
    """``flock`` on ``<directory>/<batch id>.lock`` (module docstring).

    NOTE: lock files are never removed: unlinking a lock file that another
    runner has open lets two runners lock two different files of one name.
    """

    def __init__(self, directory: Path, identity: str | None = None) -> None:
        self.directory = directory
        self.identity = identity or holder_identity()
        directory.mkdir(parents=True, exist_ok=True)

    async def try_acquire(self, batch_id: str) -> BatchHold | None:
        # a network filesystem answers flock over the network: off the event loop
        attempt = asyncio.ensure_future(asyncio.to_thread(self._try_acquire_now, batch_id))
        try:
            return await asyncio.shield(attempt)
        except asyncio.CancelledError:  # the thread may still win the lock: let go of it then, or it is held for good
            attempt.add_done_callback(_let_go)
            raise

    def _try_acquire_now(self, batch_id: str) -> BatchHold | None:
        path = self.directory / f"{Path(batch_id).name}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        with contextlib.suppress(OSError):  # who holds it, for a person looking; the lock does not depend on it
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{self.identity}\n".encode(), 0)
        return _FileHold(batch_id, fd)


# --- a cluster: one Lease per batch -----------------------------------------------------------------------


def lease_name(batch_id: str) -> str:
    """``coserve-<batch id>`` as a DNS subdomain name: ``batch_0a1b`` -> ``coserve-batch-0a1b``."""
    name = re.sub(r"[^a-z0-9.-]", "-", f"coserve-{batch_id}".lower())[:253]
    return name.rstrip("-.")


class _LeaseHold(BatchHold):
    def __init__(self, batch_id: str, elector: LeaderElector, retry_period_s: float) -> None:
        self.batch_id = batch_id
        self.elector = elector
        self._renewer: asyncio.Task[None] | None = asyncio.create_task(self._renew(retry_period_s))

    @property
    def valid(self) -> bool:
        return self._renewer is not None and self.elector.is_leader

    async def _renew(self, retry_period_s: float) -> None:
        from coserve.operator.kube import KubeError

        while True:
            await asyncio.sleep(retry_period_s)
            try:
                if not await self.elector.try_acquire_or_renew():
                    logger.warning("lease %s: lost to another runner", self.elector.settings.name)
            except KubeError as error:  # is_leader lapses by itself after the renew deadline
                logger.warning("lease %s: cannot renew: %s", self.elector.settings.name, error)

    async def release(self) -> None:
        renewer, self._renewer = self._renewer, None
        if renewer is None:
            return
        renewer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await renewer
        await self.elector.release()  # only while it still leads: never erases a successor's record


@dataclass
class _Contender:
    elector: LeaderElector
    tried_at: float  # monotonic time of the last attempt


class LeaseLocks(BatchLocks):
    """A ``coordination.k8s.io/v1`` Lease per batch (module docstring).

    An elector is kept per contended batch between scans, so "expired" is
    measured from when this runner first saw the holder's record unchanged, and
    each Lease is read at most once per ``retry_period_s``.
    """

    def __init__(
        self,
        kube: KubeClient,
        namespace: str,
        identity: str | None = None,
        *,
        lease_duration_s: float = 15.0,
        renew_deadline_s: float = 10.0,
        retry_period_s: float = 2.0,
        owns_kube: bool = False,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        # NOTE: imported here so a router that uses file locks never needs lightkube installed
        from coserve.operator.leader import LeaseSettings

        self.kube = kube
        self.settings: LeaseSettings = LeaseSettings(  # raises on inconsistent timing, here at build time
            name="coserve-batch",
            namespace=namespace,
            identity=identity or holder_identity(),
            lease_duration_s=lease_duration_s,
            renew_deadline_s=renew_deadline_s,
            retry_period_s=retry_period_s,
        )
        self.owns_kube = owns_kube
        self.clock = clock
        self.monotonic = monotonic
        self._contenders: dict[str, _Contender] = {}  # batch id -> its elector while another runner holds it

    async def try_acquire(self, batch_id: str) -> BatchHold | None:
        from coserve.operator.kube import KubeError
        from coserve.operator.leader import LeaderElector

        now = self.monotonic()
        self._forget_stale(now)
        contender = self._contenders.get(batch_id)
        if contender is not None and now - contender.tried_at < self.settings.retry_period_s:
            return None
        if contender is None:
            settings = replace(self.settings, name=lease_name(batch_id))
            elector = LeaderElector(self.kube, settings, clock=self.clock, monotonic=self.monotonic)
            contender = self._contenders[batch_id] = _Contender(elector, now)
        contender.tried_at = now
        try:
            won = await contender.elector.try_acquire_or_renew()
        except KubeError as error:
            logger.warning("lease %s: %s", contender.elector.settings.name, error)
            return None
        if not won:
            return None
        del self._contenders[batch_id]
        return _LeaseHold(batch_id, contender.elector, self.settings.retry_period_s)

    def _forget_stale(self, now: float) -> None:
        """Drop electors of batches nobody asked about for a while (they ended elsewhere)."""
        horizon = 10 * self.settings.lease_duration_s
        for batch_id in [b for b, c in self._contenders.items() if now - c.tried_at > horizon]:
            del self._contenders[batch_id]

    async def close(self) -> None:
        self._contenders.clear()
        if self.owns_kube:
            await self.kube.close()


# --- choosing one ------------------------------------------------------------------------------------------


def batch_locks(kind: str, lock_dir: Path, *, namespace: str | None = None) -> BatchLocks:
    """The backend called ``kind`` (one of ``LOCK_KINDS``); ``ValueError`` for any other name.

    ``lock_dir``: where ``file`` keeps its lock files. ``lease`` reads
    credentials as kubectl does (in a pod, its ServiceAccount) and puts its
    Leases in ``namespace``, else the credentials' namespace.
    """
    if kind == "file":
        return FileLocks(lock_dir)
    if kind == "lease":
        from coserve.operator.kube import KubeClient, load_cluster

        cluster = load_cluster()
        return LeaseLocks(KubeClient(cluster), namespace or cluster.namespace or "default", owns_kube=True)
    raise ValueError(f"unknown batch lock {kind!r}; known: {', '.join(LOCK_KINDS)}")


def batch_locks_from_env(lock_dir: Path, environ: Mapping[str, str] | None = None) -> BatchLocks:
    """``COSERVE_BATCH_LOCK`` (``file`` when unset) and ``POD_NAMESPACE`` for ``lease``."""
    env = os.environ if environ is None else environ
    kind = env.get("COSERVE_BATCH_LOCK") or "file"
    if kind not in LOCK_KINDS:
        raise ValueError(f"COSERVE_BATCH_LOCK: must be one of {', '.join(LOCK_KINDS)}, got {kind!r}")
    return batch_locks(kind, lock_dir, namespace=env.get("POD_NAMESPACE") or None)
