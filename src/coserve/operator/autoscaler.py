"""The operator's autoscaler: Prometheus in, ``coserve.autoscaling.policy`` decides, Deployments and status out.

Who calls it: ``coserve.operator.handlers`` starts ``Autoscaler.run_forever`` at
operator start-up; it wakes every ``tick_s`` and evaluates each pool with
``spec.autoscaling.enabled`` whose ``evaluationIntervalS`` has passed. Tests call
``evaluate`` directly.

One evaluation of one pool, under the pool's reconcile lock (so status writes
never interleave with a reconcile's):

1. run the pool's PromQL (``coserve.autoscaling.queries``) against
   ``spec.autoscaling.prometheusUrl``'s HTTP API;
2. if Prometheus cannot be reached, a query fails, or there is no arrival
   rate: replicas are held where they are, AutoscalingActive=False with reason
   PrometheusUnreachable, QueryFailed or NoData, and a Warning event when that
   changes. Every query runs to its end, and the message names every one that
   failed, sorted by name (queries failing alike share one sentence), so it
   does not depend on which failed first;
3. else ``decide`` with the Deployments' current replicas and the pool's
   decision memory; changed counts are merge-patched onto the prefiller and
   decoder Deployments (a Normal ``Scaled`` event says why);
   ``status.autoscaling`` records the signals, the recommendation, the replicas
   chosen and the reason, and AutoscalingActive=True.

Status is written only when it changes: the new ``status.autoscaling`` and
AutoscalingActive condition are compared with the stored ones, ignoring
``lastEvaluationTime`` (so it is the time of the last evaluation that changed
something, not a heartbeat), an unchanged condition's ``lastTransitionTime``,
signals within ``SIGNAL_TOLERANCE`` (5 %) of the stored ones (Prometheus'
answers jitter), and which network error an unreachable Prometheus gave this
time (refused or timed out: the same failure). A steady pool, with Prometheus
up or down, writes nothing after its first evaluation.

The decision memory (the stabilization window's past recommendations, the
KV guard's count of high evaluations, the last prefiller queue) lives in the
acting replica's memory, per pool, as the HorizontalPodAutoscaler keeps its
own; it changes at every evaluation, so it is not status. A replica that takes
over the Lease (or regains it) starts with none: it scales up at once as
always, but scales down only after one full stabilization window of its own
evaluations (the policy needs a recommendation older than the window to call
it covered), and the KV guard counts its two high evaluations again. Rebuilding
it from Prometheus range queries was not chosen: the window holds the model's
recommendations, not raw signals, and replaying the model over past samples
would need every signal at every past evaluation time. A status written by an
earlier operator version still carries ``history``, ``kvHighEvaluations`` and
``prefillerQueue``: they seed the memory once, and the next write removes them.

Before the decoder Deployment is scaled down, each decoder pod gets the
``controller.kubernetes.io/pod-deletion-cost`` annotation set to the live
conversations pinned to it (``coserve.operator.deletion_cost``; the router's
``coserve_router_pinned_conversations`` through Prometheus, matched to pods by
``status.podIP``), so the ReplicaSet controller removes the least-loaded decoders
first. If that query or the pod listing fails, the scale-down goes ahead with the
costs the pods already carry (a warning is logged, nothing new is written): the
removed decoders' drain hook still lets their conversations finish or move.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from coserve.api.conditions import rfc3339, set_condition
from coserve.api.parse import parse_pool
from coserve.api.problems import InvalidInput, Problem
from coserve.api.profile import EngineProfile
from coserve.api.resource import KIND, CoServePool
from coserve.api.spec import PoolShape, SpecModel
from coserve.api.status import (
    DEPRECATED_AUTOSCALING_FIELDS,
    AutoscalingSignals,
    AutoscalingStatus,
    Condition,
    ConditionStatus,
    ConditionType,
    RoleCounts,
    StatusModel,
)
from coserve.autoscaling.policy import Decision, Recommendation, Replicas, Signals, decide, hold_reason, thresholds_for
from coserve.autoscaling.queries import SIGNALS, queries_for
from coserve.operator.cache import ObjectCache
from coserve.operator.deletion_cost import (
    DECODER_LABEL,
    DELETION_COST_ANNOTATION,
    DecoderPod,
    deletion_costs,
    pinned_conversations_query,
)
from coserve.operator.kube import KubeClient, KubeError, NotLeading, version_of
from coserve.operator.metrics import AUTOSCALER_EVALUATIONS
from coserve.operator.reconcile import PoolEvent
from coserve.operator.resources import child_name, selector_for

__all__ = ["Autoscaler", "PrometheusError", "query_prometheus", "query_prometheus_by"]

logger = logging.getLogger("coserve.operator.autoscaler")


class PrometheusError(RuntimeError):
    """A query could not be answered; ``reason`` is the AutoscalingActive condition's reason.

    The message goes into the pool's status and a Warning event, which anyone who can read the pool sees,
    while ``prometheusUrl`` may point anywhere in the cluster: so it is built from fixed words, the query's
    name, the HTTP status code with its standard phrase and Prometheus' documented ``errorType`` only, never
    from what the server sent (body, ``error`` string, reason phrase) nor the URL's userinfo.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _failures(failed: Sequence[tuple[str, PrometheusError]]) -> tuple[str, str]:
    """(reason, message) for every failed query: the same words whichever failed first.

    ``failed`` is sorted by query name; queries that failed alike share one sentence ("Prometheus queries
    a, b: ..."), in the order of their first name. PrometheusUnreachable wins over QueryFailed.
    """
    groups: dict[str, list[str]] = {}  # what follows the query's name -> the queries that failed so
    for name, error in failed:
        text, prefix = str(error), f"Prometheus query {name}"
        groups.setdefault(text.removeprefix(prefix) if text.startswith(prefix) else f": {text}", []).append(name)
    sentences = []
    for tail, names in groups.items():
        if len(names) == 1:
            sentences.append(f"Prometheus query {names[0]}{tail}")
        else:
            plural = " return " + tail.removeprefix(" returns ") if tail.startswith(" returns ") else tail
            sentences.append(f"Prometheus queries {', '.join(names)}{plural}")
    reasons = {error.reason for _, error in failed}
    reason = "PrometheusUnreachable" if "PrometheusUnreachable" in reasons else sorted(reasons)[0]
    return reason, "; ".join(sentences)


# the Prometheus HTTP API's documented errorType values (https://prometheus.io/docs/prometheus/latest/querying/api/)
_PROMETHEUS_ERROR_TYPES = frozenset(
    {"bad_data", "timeout", "canceled", "execution", "internal", "unavailable", "not_found", "not_acceptable"}
)
_RESULT_TYPES = frozenset({"matrix", "vector", "scalar", "string"})


def _without_userinfo(url: str) -> str:
    """``url`` without ``user:password@``, query or fragment: what may be shown in status."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "the configured prometheusUrl"
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


def _http_status(code: int) -> str:
    """``HTTP 503 Service Unavailable``: the standard phrase, never the server's own."""
    try:
        return f"HTTP {code} {HTTPStatus(code).phrase}"
    except ValueError:
        return f"HTTP {code}"


def _unreachable_phrase(error: Exception) -> str:
    if isinstance(error, httpx.TimeoutException):
        return "timed out"
    if isinstance(error, httpx.ConnectError):
        return "connection failed"
    if isinstance(error, httpx.InvalidURL | httpx.UnsupportedProtocol):
        return "invalid URL"
    return "request failed"


async def query_prometheus(client: httpx.AsyncClient, base_url: str, promql: str, *, name: str) -> float | None:
    """One instant query, ``name`` (e.g. ``arrivalRate``) in errors; its single number, ``None`` for no data.

    No data is an empty vector, NaN or ±Inf. Errors are ``PrometheusError``s whose messages never quote the
    server's answer (see the class).
    """
    result_type, result = await _instant_query(client, base_url, promql, name=name)
    try:
        if result_type == "scalar" and isinstance(result, list):
            value = float(result[1])
        elif result_type == "vector" and isinstance(result, list):
            if not result:
                return None
            if len(result) > 1:
                raise PrometheusError(
                    "QueryFailed",
                    f"Prometheus query {name} returns {len(result)} series; aggregate it to one (sum, avg)",
                )
            value = float(result[0]["value"][1])
        else:
            raise PrometheusError("QueryFailed", f"Prometheus query {name} returns {_shown(result_type)}, not a number")
    except (LookupError, TypeError, ValueError) as error:  # a malformed sample; its text is not shown
        raise PrometheusError(
            "QueryFailed", f"Prometheus query {name} returns a sample that is not a number"
        ) from error
    return None if math.isnan(value) or math.isinf(value) else value


async def query_prometheus_by(
    client: httpx.AsyncClient, base_url: str, promql: str, *, name: str, label: str
) -> dict[str, float]:
    """One instant query returning an instant vector: ``label``'s value -> the sample's number.

    Samples without ``label`` or whose value is NaN are left out; an empty vector is an empty dict.
    Errors are ``PrometheusError``s, as ``query_prometheus``'s.
    """
    result_type, result = await _instant_query(client, base_url, promql, name=name)
    if result_type != "vector" or not isinstance(result, list):
        raise PrometheusError("QueryFailed", f"Prometheus query {name} returns {_shown(result_type)}, not a vector")
    out: dict[str, float] = {}  # label value -> sample value
    try:
        for sample in result:
            key = sample["metric"].get(label)
            value = float(sample["value"][1])
            if isinstance(key, str) and not math.isnan(value):
                out[key] = value
    except (LookupError, TypeError, ValueError, AttributeError) as error:
        raise PrometheusError("QueryFailed", f"Prometheus query {name} returns a malformed sample") from error
    return out


def _shown(result_type: object) -> str:
    """A result type for a message: only the documented ones are named."""
    known = isinstance(result_type, str) and result_type in _RESULT_TYPES
    return f"a {result_type}" if known else "an unknown result type"


async def _instant_query(client: httpx.AsyncClient, base_url: str, promql: str, *, name: str) -> tuple[Any, Any]:
    """``(resultType, result)`` of a successful instant query; anything else is a ``PrometheusError``."""
    url = base_url.rstrip("/") + "/api/v1/query"
    try:
        response = await client.get(url, params={"query": promql})
    except (httpx.HTTPError, httpx.InvalidURL) as error:
        raise PrometheusError(
            "PrometheusUnreachable",
            f"Prometheus query {name}: {_without_userinfo(url)} is unreachable, {_unreachable_phrase(error)} "
            f"({type(error).__name__})",
        ) from error
    try:
        document = response.json()
    except (ValueError, RecursionError):  # not JSON (UnicodeDecodeError is a ValueError), or nested too deep
        document = None
    if response.status_code != 200 or not isinstance(document, dict) or document.get("status") != "success":
        problem = f"Prometheus query {name} failed: {_http_status(response.status_code)}"
        error_type = document.get("errorType") if isinstance(document, dict) else None
        if isinstance(error_type, str) and error_type in _PROMETHEUS_ERROR_TYPES:
            problem += f" ({error_type})"
        elif response.status_code == 200:
            problem += " but the answer is not JSON" if document is None else " but not a Prometheus success response"
        raise PrometheusError("QueryFailed", problem)
    data = document.get("data")
    data = data if isinstance(data, dict) else {}
    return data.get("resultType"), data.get("result")


@dataclass
class _Memory:
    """What ``decide`` needs from one pool's past evaluations (module docstring): the acting replica's only."""

    uid: str | None
    history: tuple[Recommendation, ...] = field(default_factory=tuple)
    kv_high_evaluations: int = 0
    prefiller_queue: float | None = None
    arrival: tuple[float, float] | None = None  # the last evaluation's time and measured arrival rate


class _Changed(Exception):
    """A write's ``resourceVersion`` precondition failed (409): the object changed after the decision was made."""


@dataclass(frozen=True)
class _Outcome:
    active: bool
    reason: str
    message: str
    decision: Decision | None = None


ProfileReader = Callable[[str, Mapping[str, Any]], Awaitable[tuple[EngineProfile | None, Problem | None]]]


class Autoscaler:
    """Evaluates autoscaled pools on their intervals (module docstring)."""

    def __init__(
        self,
        kube: KubeClient,
        cache: ObjectCache,
        *,
        read_profile: ProfileReader,
        post_event: Callable[[str, Mapping[str, Any], PoolEvent], Awaitable[None]],
        lock_for: Callable[[str, str], asyncio.Lock],
        acting: Callable[[], bool] = lambda: True,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        timeout_s: float = 10.0,
    ) -> None:
        self.kube = kube
        self.cache = cache
        self.read_profile = read_profile
        self.post_event = post_event
        self.lock_for = lock_for
        self.acting = acting  # False on a replica that does not hold the Lease: evaluate nothing
        self.clock = clock
        self.http = httpx.AsyncClient(timeout=timeout_s)
        self._due: dict[tuple[str, str], float] = {}  # (namespace, name) -> monotonic time of the next evaluation
        self._memory: dict[tuple[str, str], _Memory] = {}  # (namespace, name) -> the pool's decision memory

    async def close(self) -> None:
        await self.http.aclose()

    async def run_forever(self, tick_s: float = 1.0) -> None:
        """Evaluate every due pool each tick, concurrently: one pool's slow Prometheus delays no other."""
        while True:
            await asyncio.sleep(tick_s)
            if not self.acting():
                self._due.clear()  # on taking over, evaluate every pool at once
                self._memory.clear()  # another replica decided meanwhile: its history is not ours
                continue
            pools = self.cache.names(KIND)
            for gone in set(self._due) - set(pools):  # deleted pools
                del self._due[gone]
            for gone in set(self._memory) - set(pools):
                del self._memory[gone]
            due = []
            for namespace, name in pools:
                body = self.cache.get(KIND, namespace, name) or {}
                scaling = ((body.get("spec") or {}).get("autoscaling")) or {}
                if not scaling.get("enabled") or time.monotonic() < self._due.get((namespace, name), 0.0):
                    continue
                self._due[(namespace, name)] = time.monotonic() + float(scaling.get("evaluationIntervalS", 30))
                due.append((namespace, name))
            await asyncio.gather(*(self._evaluate_logged(namespace, name) for namespace, name in due))

    async def _evaluate_logged(self, namespace: str, name: str) -> None:
        try:
            await self.evaluate(namespace, name)
        except NotLeading as error:  # the Lease may expire before the write lands: skip
            logger.info("%s/%s: not leading, autoscaling skipped: %s", namespace, name, error)
        except Exception:  # one pool's failure must not stop the others' autoscaling
            logger.exception("%s/%s: autoscaling evaluation failed", namespace, name)

    async def evaluate(self, namespace: str, name: str) -> Decision | None:
        """One evaluation (module docstring); the decision, or ``None`` when replicas were held."""
        async with self.lock_for(namespace, name):
            body = self.cache.get(KIND, namespace, name)
            if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
                return None
            try:
                pool = parse_pool({k: v for k, v in body.items() if k != "status"})
            except InvalidInput:
                return None  # the reconcile reports PlanValid=False
            if not pool.spec.autoscaling.enabled or pool.spec.autoscaling.prometheus_url is None:
                return None
            current = self._current(namespace, name)
            if current is None:
                return None  # the Deployments are not created yet
            previous = _previous(body)
            memory = self._memory_of(namespace, name, body, previous)
            outcome, signals = await self._decide(namespace, body, pool, current, memory)
            AUTOSCALER_EVALUATIONS.labels(outcome.reason).inc()
            if outcome.decision is not None:
                decision = outcome.decision
                memory.history, memory.kv_high_evaluations = decision.history, decision.kv_high_evaluations
                memory.prefiller_queue, memory.arrival = decision.prefiller_queue, decision.arrival
            try:
                if outcome.decision is not None and outcome.decision.replicas != current:
                    await self._scale(namespace, pool, current, outcome.decision.replicas)
                    await self.post_event(namespace, body, PoolEvent("Normal", "Scaled", _scaled_message(
                        current, outcome.decision)))  # fmt: skip
                await self._write_status(namespace, name, body, previous, outcome, signals)
            except _Changed as changed:  # decided from what is no longer there: the next evaluation reads again
                logger.info("%s/%s: %s changed since it was read; evaluating again next time", namespace, name,
                            changed)  # fmt: skip
                return None
            return outcome.decision

    def _memory_of(self, namespace: str, name: str, body: Mapping[str, Any], previous: AutoscalingStatus) -> _Memory:
        """The pool's decision memory: empty for a pool new to this replica (or recreated under its name), seeded
        from the deprecated status fields an earlier operator version wrote, if the stored status has them."""
        uid = (body.get("metadata") or {}).get("uid")
        memory = self._memory.get((namespace, name))
        if memory is None or memory.uid != uid:
            memory = _Memory(
                uid,
                tuple(Recommendation(h.at, h.prefillers, h.decoders) for h in previous.history or ()),
                previous.kv_high_evaluations or 0,
                previous.prefiller_queue,
            )
            self._memory[(namespace, name)] = memory
        return memory

    def _current(self, namespace: str, name: str) -> Replicas | None:
        counts = []
        for role in ("prefiller", "decoder"):
            deployment = self.cache.get("Deployment", namespace, child_name(name, role))
            replicas = ((deployment or {}).get("spec") or {}).get("replicas")
            if not isinstance(replicas, int):
                return None
            counts.append(replicas)
        return Replicas(*counts)

    async def _decide(
        self, namespace: str, body: Mapping[str, Any], pool: CoServePool, current: Replicas, memory: _Memory,
    ) -> tuple[_Outcome, AutoscalingSignals]:  # fmt: skip
        scaling = pool.spec.autoscaling
        overrides: dict[str, str] = scaling.queries.model_dump(by_alias=True, exclude_none=True)
        queries = queries_for(namespace, pool.metadata.name, overrides, scaling.selector)
        held = f"replicas held at {current.prefillers} prefillers, {current.decoders} decoders"
        # every query runs to its end, so the message can name every failure, not the first one to arrive
        answers = await asyncio.gather(
            *(query_prometheus(self.http, str(scaling.prometheus_url), q, name=query) for query, q in queries.items()),
            return_exceptions=True,
        )
        failed = sorted(
            (
                (query, answer)
                for query, answer in zip(queries, answers, strict=True)
                if isinstance(answer, BaseException)
            ),
            key=lambda pair: pair[0],
        )
        for _, answer in failed:
            if not isinstance(answer, PrometheusError):
                raise answer  # a bug or a cancellation, not Prometheus' answer
        if failed:
            reason, message = _failures(
                [(query, error) for query, error in failed if isinstance(error, PrometheusError)]
            )
            return _Outcome(False, reason, f"{message}; {held}"), AutoscalingSignals()
        results = [answer for answer in answers if not isinstance(answer, BaseException)]
        # signal field -> value; a negative result (a mistaken query) is read as zero, as status requires
        values = {
            SIGNALS[name]: max(0.0, value) if value is not None else None
            for name, value in zip(queries, results, strict=True)
        }
        seen = AutoscalingSignals(**values)
        if values["arrival_rate_per_s"] is None:
            message = f"Prometheus has no sample for arrivalRate ({queries['arrivalRate']}); {held}"
            return _Outcome(False, "NoData", message), seen
        profile, problem = await self.read_profile(namespace, body)
        if problem is not None:
            return _Outcome(False, "ProfileUnavailable", f"{problem}; {held}"), seen
        thresholds = thresholds_for(pool.spec)
        try:
            decision = decide(
                _in_planned_shape(pool.spec, body),
                Signals(**values),
                current,
                self.clock().timestamp(),
                profile=profile,
                thresholds=thresholds,
                history=memory.history,
                kv_high_evaluations=memory.kv_high_evaluations,
                last_prefiller_queue=memory.prefiller_queue,
                last_arrival=memory.arrival,
            )
        except InvalidInput as error:
            return _Outcome(False, "WorkloadNotPlannable", f"{hold_reason(error)}; {held}"), seen
        reason = "Scaled" if decision.replicas != current else "Evaluated"
        return _Outcome(True, reason, decision.reason, decision), seen

    async def _scale(self, namespace: str, pool: CoServePool, current: Replicas, wanted: Replicas) -> None:
        name = pool.metadata.name
        for role, have, want in (("prefiller", current.prefillers, wanted.prefillers),
                                 ("decoder", current.decoders, wanted.decoders)):  # fmt: skip
            if have == want:
                continue
            if role == "decoder" and want < have:
                await self._set_deletion_costs(namespace, pool)
            deployment = child_name(name, role)
            seen = version_of(self.cache.get("Deployment", namespace, deployment))
            written = await self._fenced_patch("Deployment", namespace, deployment, {"spec": {"replicas": want}}, seen)
            self.cache.put("Deployment", written)
            logger.info("%s/%s: %s %d -> %d replicas", namespace, name, deployment, have, want)

    async def _fenced_patch(
        self, kind: str, namespace: str, name: str, body: Mapping[str, Any], seen: str | None,
        subresource: str | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Merge-patch what was decided from the object at version ``seen``; ``_Changed`` when it has changed since
        (409: another replica, a user or a controller wrote it), after the cache has learnt the object as it is."""
        try:
            return await self.kube.merge_patch(kind, namespace, name, body, subresource, resource_version=seen)
        except KubeError as error:
            if error.status != 409:
                raise
            found = await self.kube.get(kind, namespace, name)
            if found is not None:
                self.cache.put(kind, found)
            raise _Changed(f"{kind} {name}") from None

    async def _set_deletion_costs(self, namespace: str, pool: CoServePool) -> None:
        """Annotate each decoder pod with the conversations pinned to it (module docstring); never raises.

        Best effort: if Prometheus or the pod listing fails, a warning is logged and nothing is written, and the
        scale-down goes ahead; a decoder the ReplicaSet controller then removes still drains its conversations.
        """
        name, scaling = pool.metadata.name, pool.spec.autoscaling
        labels = selector_for(name, "decoder")
        query = pinned_conversations_query(namespace, name, scaling.selector)
        try:
            pins = await query_prometheus_by(
                self.http, str(scaling.prometheus_url), query, name="pinnedConversations", label=DECODER_LABEL
            )
            listed = await self.kube.list("Pod", namespace, ",".join(f"{k}={v}" for k, v in labels.items()))
        except (PrometheusError, KubeError) as error:
            logger.warning("%s/%s: scaling decoders down without fresh pod deletion costs: %s", namespace, name, error)
            return
        pods = [_decoder_pod(pod) for pod in listed if _selected(pod, labels) and not _terminating(pod)]
        versions = {(pod.get("metadata") or {}).get("name"): version_of(pod) for pod in listed}
        for patch in deletion_costs(pods, pins):
            try:
                await self.kube.merge_patch(
                    "Pod", namespace, patch.pod, {"metadata": {"annotations": patch.annotations()}},
                    resource_version=versions.get(patch.pod),
                )  # fmt: skip
            except KubeError as error:  # e.g. the pod is gone meanwhile
                logger.warning(
                    "%s/%s: could not set the deletion cost of pod %s: %s", namespace, name, patch.pod, error
                )
                continue
            logger.info("%s/%s: pod %s deletion cost %d", namespace, name, patch.pod, patch.cost)

    async def _write_status(
        self, namespace: str, name: str, body: Mapping[str, Any], previous: AutoscalingStatus, outcome: _Outcome,
        signals: AutoscalingSignals,
    ) -> None:  # fmt: skip
        status = _status_of(body)
        now = self.clock()
        decision = outcome.decision
        autoscaling = AutoscalingStatus(
            last_evaluation_time=rfc3339(now),
            signals=signals,
            recommended=RoleCounts(prefillers=decision.recommended.prefillers, decoders=decision.recommended.decoders)
            if decision else previous.recommended,
            desired=RoleCounts(prefillers=decision.replicas.prefillers, decoders=decision.replicas.decoders)
            if decision else previous.desired,
            reason=outcome.message[:4096],
        )  # fmt: skip
        was = next((c for c in status.conditions if c.type == ConditionType.AUTOSCALING_ACTIVE), None)
        conditions = set_condition(
            status.conditions,
            ConditionType.AUTOSCALING_ACTIVE,
            ConditionStatus.TRUE if outcome.active else ConditionStatus.FALSE,
            outcome.reason,
            outcome.message[:32768],
            now,
            (body.get("metadata") or {}).get("generation"),
        )
        # An earlier version's decision memory is removed (a merge patch removes a key only when told to), but
        # not the values that version's CRD defaults: where that CRD is still installed (helm upgrades no CRD),
        # the API server puts them back on every read, and removing them again would write at every evaluation.
        stored = previous.to_wire()
        leftover = [
            key for key in DEPRECATED_AUTOSCALING_FIELDS if key in stored and stored[key] != _OLD_DEFAULTS.get(key)
        ]
        if not leftover and _unchanged(autoscaling, previous, conditions, status.conditions):
            return  # NOTE: an evaluation that changes nothing but the time writes nothing (a steady pool stays quiet)
        wire: dict[str, Any] = {**autoscaling.to_wire(), **dict.fromkeys(leftover)}
        patch = {"autoscaling": wire, "conditions": [c.to_wire() for c in conditions]}
        try:
            written = await self._fenced_patch(KIND, namespace, name, {"status": patch}, version_of(body), "status")
            self.cache.put(KIND, written)
        except KubeError as error:
            if error.status != 404:
                raise
        if not outcome.active and (was is None or was.status == ConditionStatus.TRUE or was.reason != outcome.reason):
            await self.post_event(namespace, body, PoolEvent("Warning", outcome.reason, outcome.message))


# a signal within this fraction of the stored one is the same signal (Prometheus' answers jitter)
SIGNAL_TOLERANCE = 0.05
# the part of an unreachable query's message that changes from one failure to the next (refused, timed out)
_TRANSIENT = re.compile(r" is unreachable, [a-z ]+ \(\w+\)")
_TIMELESS = {"last_evaluation_time": None, "history": None, "kv_high_evaluations": None, "prefiller_queue": None}


_NUMBER = re.compile(r"\d+(?:[.,]\d+)*(?:e[-+]?\d+)?")


def _stable(text: str) -> str:
    """``text`` without what varies between failures of the same kind (which network error it was), and
    without its numbers: ``_unchanged`` compares the signals and counts they come from on their own."""
    return _NUMBER.sub("#", _TRANSIENT.sub(" is unreachable", text))


def _close(new: float | None, old: float | None) -> bool:
    if new is None or old is None:
        return new is old
    return abs(new - old) <= SIGNAL_TOLERANCE * max(abs(new), abs(old)) + 1e-12


def _unchanged(
    new: AutoscalingStatus, old: AutoscalingStatus, conditions: Sequence[Condition], stored: Sequence[Condition]
) -> bool:
    """Whether a status write would say nothing new: the same decision and condition (the same kind of
    failure, whatever network error it was this time), and each signal within ``SIGNAL_TOLERANCE`` of the
    stored one. The time of the evaluation is not news."""
    if len(conditions) != len(stored):
        return False
    for a, b in zip(conditions, stored, strict=True):
        if a.model_copy(update={"message": _stable(a.message)}) != b.model_copy(update={"message": _stable(b.message)}):
            return False
    fields = type(new.signals).model_fields
    if not all(_close(getattr(new.signals, f), getattr(old.signals, f)) for f in fields):
        return False
    same = {**_TIMELESS, "signals": None}
    return new.model_copy(update={**same, "reason": _stable(new.reason)}) == old.model_copy(
        update={**same, "reason": _stable(old.reason)}
    )


# what the CRD of the version that kept the decision memory in status defaulted those fields to
_OLD_DEFAULTS: dict[str, object] = {"history": [], "kvHighEvaluations": 0}


def _selected(pod: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """The pod carries ``labels`` (checked again: not every API server applies a list's label selector)."""
    have = (pod.get("metadata") or {}).get("labels") or {}
    return all(have.get(key) == value for key, value in labels.items())


def _terminating(pod: Mapping[str, Any]) -> bool:
    return bool((pod.get("metadata") or {}).get("deletionTimestamp"))


def _decoder_pod(pod: Mapping[str, Any]) -> DecoderPod:
    metadata = pod.get("metadata") or {}
    ip = (pod.get("status") or {}).get("podIP")
    cost = (metadata.get("annotations") or {}).get(DELETION_COST_ANNOTATION)
    return DecoderPod(
        name=str(metadata.get("name")),
        ip=ip if isinstance(ip, str) and ip else None,
        cost=cost if isinstance(cost, str) else None,
    )


def _in_planned_shape(spec: SpecModel, body: Mapping[str, Any]) -> SpecModel:
    """``spec`` in the shape the reconciler planned (status.plan), which ``spec.shape: Auto`` leaves to it
    (``coserve.operator.reconcile.kept_shape``): the autoscaler never scales a pool into the other shape."""
    plan = _status_of(body).plan
    if spec.shape is not PoolShape.AUTO or plan is None:
        return spec
    return spec.model_copy(update={"shape": plan.shapes.shape if plan.shapes else PoolShape.DISAGGREGATED})


def _status_of(body: Mapping[str, Any]) -> StatusModel:
    raw = body.get("status")
    if not isinstance(raw, Mapping):
        return StatusModel()
    with contextlib.suppress(ValueError):  # pydantic's ValidationError is a ValueError
        return StatusModel.model_validate_json(
            json.dumps({k: v for k, v in raw.items() if k in ("conditions", "autoscaling")})
        )
    return StatusModel()


def _previous(body: Mapping[str, Any]) -> AutoscalingStatus:
    return _status_of(body).autoscaling or AutoscalingStatus()


def _scaled_message(current: Replicas, decision: Decision) -> str:
    wanted = decision.replicas
    return (
        f"prefillers {current.prefillers} -> {wanted.prefillers}, decoders {current.decoders} -> {wanted.decoders}: "
        f"{decision.reason}"
    )
