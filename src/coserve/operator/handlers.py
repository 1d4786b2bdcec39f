"""The kopf operator: module-level handlers that feed ``coserve.operator.reconciler`` and keep its cache warm.

Who calls it: ``coserve operator`` (``kopf.run`` with ``build_registry()``), and
``kopf run operator/main.py``, which registers the same handlers in kopf's
default registry. Tests build one registry per operator they run against
kmock's Kubernetes emulator.

How the module is laid out, and why:

- the handlers (``startup``, ``cleanup``, ``login``, ``pool_event``,
  ``child_event``) are plain module-level ``async def``s that take the kwargs
  they need plus ``**_``, as in kopf's examples;
- ``build_registry`` registers them into a given ``kopf.OperatorRegistry``
  (kopf's ``registry=`` on its decorators) rather than decorating them at import
  time: every test runs its own operator, each with its own registry and
  options, and importing this module registers nothing anywhere;
- the options from the command line (``OperatorOptions``) reach ``startup`` as
  kopf's ``param=``, so ``kopf.run``/``kopf.operator`` need no ``memo=``;
  ``startup`` puts everything the handlers share in kopf's ``memo`` (below), and
  kopf gives every handler that memo, or a shallow copy of it;
- the one child handler is registered once per child kind, with the kind as
  its ``param``.

What ``startup`` puts in ``memo`` (it is set before any watch starts):

- ``options``: the ``OperatorOptions``; ``config``: where the API server is and
  how to log in (``options.cluster()``, called once);
- ``cache``: the watch-fed ``ObjectCache``; ``wake``: an ``asyncio.Event`` set
  when this replica starts leading (resync at once);
- ``elector``: the ``LeaderElector``, or ``None`` for a single replica;
- ``reconciler``: the ``PoolReconciler``; ``autoscaler``: the ``Autoscaler``;
- ``tasks``: the background tasks ``cleanup`` cancels, latest first.

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

What one reconcile reads and writes is ``coserve.operator.reconciler``'s to say.
Pools with ``spec.autoscaling.enabled`` are also evaluated by the autoscaler
(``coserve.operator.autoscaler``) every ``evaluationIntervalS``, under the same
per-pool lock as reconciles.

Two operator replicas never both act: they elect one through a
``coordination.k8s.io`` Lease (``coserve.operator.leader``; ``--lease NAME``, the
default). Every replica watches and keeps its cache warm; only the Lease holder
reconciles, resyncs, autoscales and posts Events. ``--standalone`` skips the
election for a single replica. ``@leader_only`` is the one gate for the
handlers' side (``reconcile_pool``, ``resync``); the autoscaler asks the same
``acting(memo)`` every tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import logging
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec

import kopf
from lightkube.config.kubeconfig import SingleConfig

from coserve import __version__
from coserve.api.resource import GROUP, KIND, PLURAL, VERSION
from coserve.operator.autoscaler import Autoscaler
from coserve.operator.cache import ObjectCache
from coserve.operator.kube import KubeClient, KubeError, NotLeading, describe, fetch_credential
from coserve.operator.leader import LeaderElector, LeaseSettings
from coserve.operator.metrics import POOLS, keep_pools
from coserve.operator.reconciler import PoolReconciler
from coserve.operator.resources import CHILDREN, GATEWAY_API_KINDS, MANAGED_BY, MANAGED_BY_LABEL

__all__ = [
    "CHILD_RESOURCES",
    "DEFAULT_RESYNC_S",
    "OperatorOptions",
    "PoolReconciler",
    "build_registry",
    "configure",
    "leader_only",
]

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
    "InferencePool": ("inference.networking.k8s.io", "inferencepools"),
    "HTTPRoute": ("gateway.networking.k8s.io", "httproutes"),
}
CHILD_KINDS = tuple(dict.fromkeys(kind for kind, _ in CHILDREN))  # the kinds a pool has children of, in order
MANAGED_LABELS = {MANAGED_BY_LABEL: MANAGED_BY}  # the label selector of the children's watches and lists

ClusterLoader = Callable[[], SingleConfig]
P = ParamSpec("P")


@dataclass(frozen=True)
class OperatorOptions:
    """How this operator runs, fixed when its registry is built (``build_registry``'s arguments).

    ``startup`` gets it as kopf's ``param`` and keeps it in ``memo.options``.
    ``namespaces``: the ones kopf watches and the resync lists (``None``: every namespace).
    """

    cluster: ClusterLoader
    lease: LeaseSettings | None = None
    scanning: bool = True
    namespaces: frozenset[str] | None = None
    resync_s: float = DEFAULT_RESYNC_S
    image_tag: str = __version__
    autoscale_tick_s: float = 1.0


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
    """Register coserve's handlers in ``registry`` (a new one by default); ``cluster`` says where the API server is.

    Called once per operator, before ``kopf.run``/``kopf.operator`` starts it.
    ``cluster`` is called at start-up; kopf's login handler and the operator's own
    client both authenticate from what it returns (client certificates, token
    files, exec plugins), and both fetch a fresh credential after a 401.
    ``lease``: act only while holding this Lease (``None``: a single replica that
    always acts). ``namespaces`` are the ones kopf watches (``None``: every
    namespace); the resync lists pools and children there. ``image_tag`` defaults
    to ``$COSERVE_IMAGE_TAG``, read now, else coserve's version.
    """
    registry = registry or kopf.OperatorRegistry()
    options = OperatorOptions(
        cluster=cluster,
        lease=lease,
        scanning=scanning,
        namespaces=frozenset(namespaces) if namespaces else None,
        resync_s=resync_s,
        image_tag=image_tag if image_tag is not None else os.environ.get("COSERVE_IMAGE_TAG", __version__),
        autoscale_tick_s=autoscale_tick_s,
    )
    kopf.on.startup(param=options, registry=registry)(startup)
    kopf.on.cleanup(registry=registry)(cleanup)
    kopf.on.login(registry=registry)(login)
    kopf.on.event(GROUP, VERSION, PLURAL, id="pool", registry=registry)(pool_event)
    for kind in CHILD_KINDS:
        group, plural = CHILD_RESOURCES[kind]
        kopf.on.event(
            group=group,
            version="v1",
            plural=plural,
            labels=MANAGED_LABELS,
            id=f"child-{plural}",
            param=kind,
            registry=registry,
        )(child_event)
    return registry


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


def acting(memo: kopf.Memo) -> bool:
    """This replica acts: it holds the Lease, or it is the only replica (no elector)."""
    elector: LeaderElector | None = memo.get("elector")
    return elector is None or elector.is_leader


def leader_only(
    fn: Callable[Concatenate[kopf.Memo, P], Awaitable[None]],
) -> Callable[Concatenate[kopf.Memo, P], Awaitable[None]]:
    """Run ``fn(memo, ...)`` only on the replica that acts; elsewhere it returns at once.

    The one leader gate of this module: the kopf handlers call gated functions on
    every replica (every replica keeps its cache warm), and only the Lease holder
    gets past it. A write refused by the Lease fence (``NotLeading``: the Lease may
    expire before it lands) ends ``fn`` quietly; the next leader acts.
    """

    @functools.wraps(fn)
    async def gated(memo: kopf.Memo, /, *args: P.args, **kwargs: P.kwargs) -> None:
        if not acting(memo):
            return
        try:
            await fn(memo, *args, **kwargs)
        except NotLeading as error:
            logger.info("%s: not leading, %s skipped: %s", "/".join(map(str, args)), fn.__name__, error)

    return gated


# --- kopf handlers --------------------------------------------------------------------------------------------


async def startup(
    settings: kopf.OperatorSettings, memo: kopf.Memo, param: OperatorOptions | None = None, **_: Any
) -> None:
    """kopf calls it once, before any watch: configure kopf, build the clients, start the background tasks.

    With a Lease, every call gets a timeout shorter than the margin between the renew deadline and the lease
    duration, and every write by the reconciler, the autoscaler and the event recorder is fenced: it is sent
    only while the Lease outlives the write's timeout (``coserve.operator.leader``).
    """
    if param is None:  # kopf's type for handlers makes param optional; build_registry always passes it
        raise kopf.PermanentError("startup needs its OperatorOptions as param: register it with build_registry")
    configure(settings, scanning=param.scanning)
    memo.options = param
    if "config" not in memo:  # loaded once per operator, even when kopf retries a failed start-up
        memo.config = param.cluster()
    logger.info("API server: %s", describe(memo.config))
    memo.cache, memo.wake, memo.tasks = ObjectCache(), asyncio.Event(), []
    lease = param.lease
    kube = KubeClient(memo.config, timeout_s=lease.call_timeout) if lease is not None else KubeClient(memo.config)
    writer = kube
    memo.elector = None
    if lease is not None:
        memo.elector = LeaderElector(kube, lease, on_started_leading=memo.wake.set)
        writer = kube.fenced(memo.elector.fence)
    memo.reconciler = PoolReconciler(writer, cache=memo.cache, image_tag=param.image_tag)
    if memo.elector is not None:
        memo.tasks.append(asyncio.create_task(memo.elector.run()))
    else:
        memo.wake.set()
    memo.tasks.append(asyncio.create_task(resync_forever(memo)))
    memo.autoscaler = Autoscaler(
        writer,
        memo.cache,
        read_profile=memo.reconciler.read_profile,
        post_event=memo.reconciler.post_event,
        lock_for=memo.reconciler.lock_for,
        acting=functools.partial(acting, memo),
    )
    memo.tasks.append(asyncio.create_task(memo.autoscaler.run_forever(param.autoscale_tick_s)))


async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    """kopf calls it once, after every watch and handler has stopped: stop the tasks, release the Lease, close."""
    for task in reversed(memo.pop("tasks", [])):  # autoscaling, resync, then the Lease's renewals
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    elector: LeaderElector | None = memo.pop("elector", None)
    if elector is not None:
        await elector.release()
    autoscaler: Autoscaler | None = memo.pop("autoscaler", None)
    if autoscaler is not None:
        await autoscaler.close()
    reconciler: PoolReconciler | None = memo.pop("reconciler", None)
    if reconciler is not None:
        await reconciler.kube.close()


async def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    """kopf calls it after start-up, and again after a 401 or at the credential's expiration: read it afresh."""
    credential = await fetch_credential(memo.config)
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


async def pool_event(
    type: str | None, body: Mapping[str, Any], namespace: str | None, name: str | None, memo: kopf.Memo, **_: Any
) -> None:
    """kopf calls it for every watch event of a pool, on every replica: cache it, reconcile if it is news.

    An echo of the operator's own status write changes nothing the reconcile reads but the status it wrote,
    so it decides nothing new.
    """
    cache: ObjectCache = memo.cache
    changed = cache.observe(KIND, type, copy.deepcopy(dict(body)))
    POOLS.set(len(cache.names(KIND)))
    keep_pools(cache.names(KIND))  # a deleted pool loses its series
    if changed and type != "DELETED" and not (body.get("metadata") or {}).get("deletionTimestamp"):
        await reconcile_pool(memo, namespace, name)


async def child_event(
    type: str | None,
    body: Mapping[str, Any],
    namespace: str | None,
    memo: kopf.Memo,
    param: str | None = None,
    **_: Any,
) -> None:
    """kopf calls it for every watch event of a managed child of kind ``param``: cache it, reconcile its pool.

    An echo of the operator's own write changes nothing in the cache, and triggers nothing.
    """
    if param is None:  # kopf's type for handlers makes param optional; build_registry always passes it
        raise kopf.PermanentError("child_event needs its child kind as param: register it with build_registry")
    cache: ObjectCache = memo.cache
    if not cache.observe(param, type, copy.deepcopy(dict(body))):
        return
    for owner in (body.get("metadata") or {}).get("ownerReferences") or []:
        if owner.get("kind") == KIND and owner.get("apiVersion", "").startswith(GROUP + "/"):
            await reconcile_pool(memo, namespace, owner.get("name"))


# --- what the handlers and the resync task run on the leader --------------------------------------------------


@leader_only
async def reconcile_pool(memo: kopf.Memo, namespace: str | None, name: str | None) -> None:
    """Reconcile one pool (``PoolReconciler.reconcile``); a refused change is retried by kopf."""
    reconciler: PoolReconciler | None = memo.get("reconciler")
    if reconciler is None or namespace is None or name is None:
        return
    try:
        await reconciler.reconcile(namespace, name)
    except KubeError as error:
        raise kopf.TemporaryError(f"the API server refused a change: {error}", delay=5) from error


async def resync_forever(memo: kopf.Memo) -> None:
    """``startup``'s task, cancelled by ``cleanup``: a resync every ``resync_s``, and one when this replica leads.

    NOTE: a plain task rather than a kopf timer: kopf puts a finalizer on every object with a timer,
    and a finalizer would make deleting a pool wait for the operator.
    """
    wake: asyncio.Event = memo.wake
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), memo.options.resync_s)
        wake.clear()
        await resync(memo)


@leader_only
async def resync(memo: kopf.Memo) -> None:
    """List every pool and managed child afresh, then reconcile every pool, one at a time."""
    cache: ObjectCache = memo.cache
    try:
        await refresh(cache, memo.reconciler.kube, memo.options.namespaces, memo.reconciler.unserved)
    except KubeError as error:
        logger.warning("resync: could not list pools and children (using the watch's view): %s", error)
    for namespace, name in cache.names(KIND):
        try:
            await reconcile_pool(memo, namespace, name)
        except kopf.TemporaryError as error:
            logger.warning("%s/%s: resync failed: %s", namespace, name, error)
        except Exception:  # one bad pool must not stop the resync of the others
            logger.exception("%s/%s: resync failed", namespace, name)


async def refresh(
    cache: ObjectCache, kube: KubeClient, scope: frozenset[str] | None, unserved: set[str] | None = None
) -> None:
    """List every pool and managed child: what a lost watch event hid (a deletion above all) shows up.

    A gateway-mode kind the API server does not serve (its CRD is not installed: 404) lists as empty and is put
    in ``unserved``, which the reconciler reads; one that lists again is taken out of it.
    """
    for kind in (KIND, *CHILD_KINDS):
        since = cache.mark()
        selector = None if kind == KIND else f"{MANAGED_BY_LABEL}={MANAGED_BY}"
        listed: list[dict[str, Any]] = []
        try:
            for namespace in sorted(scope) if scope else [None]:
                listed += await kube.list(kind, namespace, selector)
        except KubeError as error:
            if error.status != 404 or kind not in GATEWAY_API_KINDS:
                raise
            if unserved is not None and kind not in unserved:
                logger.info("resync: the API server serves no %s (%s): %s", kind, GATEWAY_API_KINDS[kind][0], error)
                unserved.add(kind)
        else:
            if unserved is not None:
                unserved.discard(kind)
        ghosts = cache.replace(kind, [b for b in listed if kind == KIND or _managed(b)], since, scope)
        if ghosts:
            logger.info("resync: %d %s(s) gone without a watch event", ghosts, kind)
    POOLS.set(len(cache.names(KIND)))
    keep_pools(cache.names(KIND))  # pools deleted without a watch event lose their series


def _managed(body: Mapping[str, Any]) -> bool:
    return ((body.get("metadata") or {}).get("labels") or {}).get(MANAGED_BY_LABEL) == MANAGED_BY
