"""The autoscaler's decision for one pool, as plain data: measured signals in, replica counts and the reason out.

Who calls it: the operator's autoscaler (``coserve.operator.autoscaler``) once
per pool per ``spec.autoscaling.evaluationIntervalS``, after reading the
signals from Prometheus; the ``autoscaling`` benchmark drives it through a
replayed trace. Nothing here does I/O or reads a clock (``now_s`` is an
argument), so every rule is tested table-driven and by properties.

Rules, in order:

1. **Proactive.** The provisioning model is re-run with the measured workload
   (L_in, L_d, W; turns, appended tokens and the decoders' running time per
   conversation, whose difference from W is the idle time between turns; any
   not measured falls back to ``spec.workload``) at the design rate
   ``rate_headroom`` times R, or R's forecast where that is higher and changes
   the count (the rate's rise since the last evaluation carried over its
   window's lag and ``startup_s``). The spec's headroom is the static
   plan's margin over a rate it could only guess; here the rate is measured, so
   ``rate_headroom`` takes its place. Its prefillers and decoders are the
   recommendation. No arrivals at all recommends each role's minimum.
2. **The backlog's candidates.** The queue-length rule an HPA would run
   (``rule_count``), the prefiller guard (mean queue at or above ``queue_high``
   and grown since the last evaluation: ``current + step``, a quarter of current,
   at least one) and busy prefillers measuring a lower T_p than the profile's.
   The model judges each (``_backlog_room``, at the arrival rate or its
   forecast, without the planning margin): nothing for a backlog the replicas
   clear before a new one would serve, else at most what clears it within a
   start-up. The KV guard (mean KV occupancy at or above ``kv_usage_high`` for
   two evaluations: ``current + step`` decoders) is a capacity signal and adds
   at once. The guards catch what the model misses.
3. **Bounds.** Each role within its ``[minReplicas, maxReplicas]``. The pool keeps the shape its spec's
   plan takes (``spec.shape``); an aggregated pool has no prefillers to scale.
4. **Stability.** Scale up at once, unless only the model asks and the
   current replicas cover its need within ``up_tolerance`` (10 %): the same
   model with its margin (``rate_headroom``) that much smaller wants no more.
   Scale down only to the highest recommendation of the
   last ``stabilization_window_s`` (so load must stay low for the whole
   window), only when that is more than ``down_tolerance`` (10 %) below
   current, and by at most a quarter of current (at least one) per evaluation.
   Load hovering at a boundary keeps the count it has, in either direction.

Missing data is never read as low load: the caller holds replicas where they
are (``hold``) when Prometheus cannot be read or has no arrival rate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from coserve.api.problems import InvalidInput
from coserve.api.spec import PoolShape
from coserve.autoscaling.queries import DEFAULT_QUERIES, range_s
from coserve.provisioning import plan_for

if TYPE_CHECKING:
    from coserve.api.profile import EngineProfile
    from coserve.api.spec import SpecModel, WorkloadSpec
    from coserve.api.status import Plan

__all__ = [
    "DEFAULT_PREFILLER_TARGET",
    "Decision",
    "Recommendation",
    "Replicas",
    "Signals",
    "Thresholds",
    "decide",
    "rate_lag_s",
    "rule_count",
    "thresholds_for",
]

ROLES = ("prefillers", "decoders")

# The queue-length rule's prefiller target when the spec sets none: running + waiting requests per prefiller.
DEFAULT_PREFILLER_TARGET = 2.0


@dataclass(frozen=True)
class Signals:
    """What Prometheus says of one pool. ``None``: no sample (an empty or NaN result)."""

    arrival_rate_per_s: float | None  # R, new conversations per second
    input_tokens: float | None = None  # L_in, mean turn-1 prompt tokens
    output_tokens: float | None = None  # L_d, mean output tokens per conversation
    lifetime_s: float | None = None  # W, mean conversation lifetime
    prefill_tokens_per_s: float | None = None  # prompt tokens one prefiller processes per second (mean over them)
    prefiller_queue: float | None = None  # mean requests waiting per prefiller
    decoder_kv_usage: float | None = None  # mean vllm:kv_cache_usage_perc over decoders (0..1)
    decoder_waiting: float | None = None  # requests waiting on decoders, summed
    turns: float | None = None  # n, mean requests per conversation
    appended_tokens: float | None = None  # a, mean tokens a later turn's decoder prefills
    decoder_run_s: float | None = None  # seconds a conversation's requests run on decoders (W less its idle time)
    prefiller_requests: float | None = None  # requests running and waiting on prefillers, summed
    decoder_requests: float | None = None  # requests running and waiting on decoders, summed


@dataclass(frozen=True)
class Replicas:
    prefillers: int
    decoders: int


@dataclass(frozen=True)
class Recommendation:
    """One evaluation's raw recommendation, kept for the stabilization window (in the operator's memory)."""

    at_s: float
    prefillers: int
    decoders: int


@dataclass(frozen=True)
class Thresholds:
    """The guard's and the stability rules' knobs (the spec's values; defaults for tests)."""

    min_replicas: Replicas = field(default_factory=lambda: Replicas(1, 1))
    max_replicas: Replicas = field(default_factory=lambda: Replicas(8, 32))
    stabilization_window_s: float = 300.0
    kv_usage_high: float = 0.85
    queue_high: float = 4.0
    down_step_fraction: float = 0.25
    rate_headroom: float = 1.2  # the model runs at this multiple of the measured rate
    down_tolerance: float = 0.1  # a role scales down only when the recommendation is this fraction below it
    up_tolerance: float = 0.1  # the model adds a replica only when its need is more than this fraction above it
    startup_s: float = 60.0  # a new replica serves this long after it is asked for
    rate_lag_s: float = 60.0  # how far back the measured arrival rate is centred (half its query's 2 m window)
    prefiller_target_requests: float | None = DEFAULT_PREFILLER_TARGET  # the rule's running + waiting per replica
    decoder_target_requests: float | None = None  # None: the plan's kv_slots_per_decoder


def thresholds_for(spec: SpecModel) -> Thresholds:
    """The pool's ``spec.autoscaling`` as ``Thresholds`` (the operator's autoscaler and the simulator)."""
    scaling = spec.autoscaling
    return Thresholds(
        min_replicas=Replicas(scaling.prefillers.min_replicas, scaling.decoders.min_replicas),
        max_replicas=Replicas(scaling.prefillers.max_replicas, scaling.decoders.max_replicas),
        stabilization_window_s=scaling.stabilization_window_s,
        kv_usage_high=scaling.kv_usage_high,
        queue_high=scaling.prefiller_queue_high,
        startup_s=scaling.replica_startup_s,
        rate_lag_s=rate_lag_s(scaling.queries.arrival_rate or DEFAULT_QUERIES["arrivalRate"]),
        prefiller_target_requests=scaling.prefillers.target_requests_per_replica or DEFAULT_PREFILLER_TARGET,
        decoder_target_requests=scaling.decoders.target_requests_per_replica,
    )


def rate_lag_s(arrival_rate_query: str) -> float:
    """How stale the measured arrival rate is: half the window of its query (``[2m]``: 60 s); 0 when the query's
    window cannot be read, so the forecast then uses the start-up alone."""
    window = range_s(arrival_rate_query)
    return window / 2 if window is not None else 0.0


@dataclass(frozen=True)
class Decision:
    """What to run now and why; ``history`` and the guard's memory go back into the next call."""

    replicas: Replicas
    recommended: Replicas  # before the stability rules
    reasons: tuple[str, ...]
    history: tuple[Recommendation, ...]
    kv_high_evaluations: int  # consecutive evaluations with KV occupancy at or above the threshold
    prefiller_queue: float | None  # this evaluation's, for the next one's "grew" test
    arrival: tuple[float, float] | None = None  # (now_s, the measured rate), for the next one's forecast

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)


def _step(current: int, fraction: float) -> int:
    return max(1, math.ceil(current * fraction))


@dataclass(frozen=True)
class _Capacity:
    """Conversations per second one replica of each role serves, by the plan at the measured workload."""

    prefiller_per_s: float
    decoder_per_s: float
    kv_slots: int  # conversations one decoder's KV cache holds (the rule's default decoder target)


def _proactive(
    spec: SpecModel, profile: EngineProfile | None, signals: Signals, thresholds: Thresholds, forecast: float
) -> tuple[Replicas, str, _Capacity | None, dict[str, tuple[int, str]]]:
    """The model's count for the measured workload at its design rate, the higher of ``rate_headroom`` times the
    measured rate and ``forecast``; why; each role's per-replica rate; and the prefillers a measured T_p asks
    for (a backlog candidate)."""
    measured_rate = signals.arrival_rate_per_s or 0.0
    if measured_rate <= 0:
        return thresholds.min_replicas, "no conversations arriving: each role's minimum", None, {}
    rate = measured_rate * thresholds.rate_headroom

    # NOTE: the spec's headroom is the static plan's margin over a rate it could only guess; here the rate is
    # measured, and ``rate_headroom`` over it (or over its forecast) is the margin. Both at once sized for 1.8x
    # the measured rate, which the plan's queueing model (it prices waiting at its design rate) does not need.
    def planned(workload: WorkloadSpec) -> Plan:
        return plan_for(spec.model_copy(update={"headroom": 1.0, "workload": workload}), profile)

    measured = _measured_workload(spec, signals, rate)
    plan = planned(measured)
    # NOTE: the forecast is planned for as it is, with no margin on top: a 2 m rate's noise makes a forecast at
    # many evaluations, and a margin on each held replicas for whole stabilization windows (measured in the
    # autoscaling benchmark: 1.55 and 1.23 replica-hours against 1.45 and 1.10)
    rising = forecast > rate
    if rising:  # named, and planned for, only where the forecast changes the count (a status write otherwise)
        ahead = _measured_workload(spec, signals, forecast)
        planned_ahead = planned(ahead)
        rising = (planned_ahead.prefillers, planned_ahead.decoders) != (plan.prefillers, plan.decoders)
        if rising:
            rate, measured, plan = forecast, ahead, planned_ahead
    why = (
        f"the model at R={measured_rate:.3g}/s (x{thresholds.rate_headroom:g} headroom"
        + (f", rising to {forecast:.3g}/s" if rising else "")
        + f"), L_in={measured.input_tokens}, "
        f"L_d={measured.output_tokens}, W={measured.lifetime_s:.3g}s"
        + (
            f", n={measured.turns:.3g} turns, a={measured.appended_tokens}, g={measured.idle_s:.3g}s"
            if measured.turns > 1
            else ""
        )
        + f" wants {plan.prefillers} prefillers and {plan.decoders} decoders"
    )
    corrected = {}
    # NOTE: prefillers with a queue are busy all the time, so their token rate is their real T_p; a profile
    # that promised more (another GPU, a longer prompt mix) is corrected here, not left to the queue guard.
    # Their queue is a backlog, so the correction is one of the backlog's candidates (``decide``): a 2 m
    # token rate is the prefillers' load, not their speed, unless they were busy for the whole window, and a
    # queue seen now says little of that; so the model caps it as it caps the rule and the queue guard.
    busy = signals.prefiller_queue is not None and signals.prefiller_queue >= 1
    if busy and signals.prefill_tokens_per_s:
        measured_tp = signals.prefill_tokens_per_s
        if measured_tp < 0.9 * plan.prefill_throughput_tokens_per_s:
            corrected["prefillers"] = (
                math.ceil(rate * measured.input_tokens / measured_tp),
                f"busy prefillers measure T_p = {measured_tp:,.0f} tokens/s against the profile's "
                f"{plan.prefill_throughput_tokens_per_s:,.0f}",
            )
    return Replicas(plan.prefillers, plan.decoders), why, _capacity(plan, rate), corrected


def _capacity(plan: Plan, rate: float) -> _Capacity:
    """Each role's per-replica rate in ``plan`` (made for ``rate``): a prefiller's R* = T_p / L_in; a decoder's
    from its tighter utilization (throughput or KV memory); an aggregated engine's from its sized option."""
    if plan.aggregated and plan.shapes is not None:
        option = plan.shapes.aggregated
        return _Capacity(0.0, option.saturation_rate_per_s / option.engines, plan.kv_slots_per_decoder)
    used = max(plan.utilization.decoder_throughput, plan.utilization.decoder_memory)
    per_decoder = rate / (plan.decoders * used) if used > 0 else math.inf
    return _Capacity(plan.saturation_rate_per_s, per_decoder, plan.kv_slots_per_decoder)


def rule_count(current: int, requests: float | None, target: float | None) -> int | None:
    """The queue-length rule for one role, as an HPA computes it on vLLM's running + waiting requests:
    ``ceil(current · per_replica / target)``, the current count within 10 % of the target. ``None`` without
    a sample, a target or replicas.

    Who calls it: ``decide`` (the rule is one of its candidates) and the ``autoscaling`` benchmark's
    baseline, so both compute the rule alike."""
    if requests is None or target is None or current <= 0:
        return None
    ratio = requests / current / target
    return current if abs(ratio - 1) <= 0.1 else math.ceil(current * ratio)


def _rule(
    signals: Signals, current: Replicas, limits: Thresholds, capacity: _Capacity | None
) -> dict[str, tuple[int, str]]:
    """The rule's count per role where it has a sample and a target, with how it got there."""
    targets = {
        "prefillers": (signals.prefiller_requests, limits.prefiller_target_requests),
        "decoders": (
            signals.decoder_requests,
            limits.decoder_target_requests or (capacity.kv_slots if capacity else None),
        ),
    }
    counts = {}
    for role, (requests, target) in targets.items():
        count = rule_count(getattr(current, role), requests, target)
        if count is not None and requests is not None and target:
            counts[role] = (count, f"the queue-length rule ({requests:.3g} running + waiting, target {target:g} each)")
    return counts


def _forecast(signals: Signals, limits: Thresholds, now_s: float, last: tuple[float, float] | None) -> float:
    """The arrival rate when a replica asked for now will serve: the measured rate (a window's mean, centred
    ``rate_lag_s`` ago) carried along its rise since the last evaluation (``last``: when, and the rate then)
    for ``rate_lag_s + startup_s``. 0 when it is not rising or there is no last evaluation."""
    rate = signals.arrival_rate_per_s
    if not rate or last is None or now_s <= last[0] or rate <= last[1]:
        return 0.0
    return rate + (rate - last[1]) / (now_s - last[0]) * (limits.rate_lag_s + limits.startup_s)


def _backlog_room(
    signals: Signals, limits: Thresholds, replicas: Replicas, capacity: _Capacity | None, rate: float, grew: bool
) -> dict[str, tuple[int | None, str]]:
    """What each role's backlog is worth, from ``replicas`` (what the role will have without it):

    - ``(None, why)``: nothing. They serve ``rate`` and clear what waits within ``startup_s``, before a
      replica asked for now would serve; the prefillers' only when their queue did not grow since the
      last evaluation (a queue that grows is not clearing, whatever the model predicts).
    - ``(count, why)``: at most ``count`` replicas, the ones that serve ``rate`` and clear, within one
      start-up once they serve, the backlog as it will have grown by then. A count no higher than the
      model's own still confirms it: ``decide`` then does not hold the model's count within its tolerance.
    """
    if capacity is None:
        return {}
    waiting = {
        "prefillers": (signals.prefiller_queue or 0.0) * replicas.prefillers,
        "decoders": signals.decoder_waiting or 0.0,
    }
    per_replica = {"prefillers": capacity.prefiller_per_s, "decoders": capacity.decoder_per_s}
    room: dict[str, tuple[int | None, str]] = {}
    for role, backlog in waiting.items():
        have, per = getattr(replicas, role), per_replica[role]
        spare = have * per - rate
        if spare > 0 and backlog / spare <= limits.startup_s and not (grew and role == "prefillers"):
            drain_s = backlog / spare
            room[role] = (None, f"its {have} serve {rate:.3g}/s with {spare:.3g}/s to spare and clear "
                                f"{backlog:.3g} waiting in {drain_s:.0f}s, before a new one serves "
                                f"({limits.startup_s:g}s)")  # fmt: skip
            continue
        grown = backlog + max(0.0, -spare) * limits.startup_s
        if per <= 0 or not math.isfinite(per):
            continue
        count = math.ceil((rate + grown / limits.startup_s) / per)
        room[role] = (count, f"{count} serve {rate:.3g}/s and clear the {grown:.3g} waiting by then within "
                             f"{limits.startup_s:g}s")  # fmt: skip
    return room


def _measured_workload(spec: SpecModel, signals: Signals, rate: float) -> WorkloadSpec:
    """``spec.workload`` with what was measured in its place (a missing sample keeps the spec's number).

    The idle time between turns is what the lifetime has beyond the decoders' running time, per gap:
    g = (W - W_run) / (n - 1); it stays below W / (n - 1), as the model requires.
    """
    workload = spec.workload
    lifetime_s = signals.lifetime_s if signals.lifetime_s else workload.lifetime_s
    turns = max(1.0, signals.turns) if signals.turns else workload.turns
    appended = max(0, round(signals.appended_tokens)) if signals.appended_tokens is not None else None
    idle_s = workload.idle_s
    if turns > 1 and signals.decoder_run_s is not None:
        idle_s = max(0.0, lifetime_s - signals.decoder_run_s) / (turns - 1)
    if turns > 1:
        idle_s = min(idle_s, 0.99 * lifetime_s / (turns - 1))
    return workload.model_copy(
        update={
            "arrival_rate_per_s": rate,
            "input_tokens": max(1, round(signals.input_tokens)) if signals.input_tokens else workload.input_tokens,
            "output_tokens": max(1, round(signals.output_tokens)) if signals.output_tokens else workload.output_tokens,
            "lifetime_s": lifetime_s,
            "turns": turns,
            "appended_tokens": appended if appended is not None else workload.appended_tokens,
            "idle_s": idle_s,
        }
    )


def decide(
    spec: SpecModel,
    signals: Signals,
    current: Replicas,
    now_s: float,
    *,
    profile: EngineProfile | None = None,
    thresholds: Thresholds | None = None,
    history: Sequence[Recommendation] = (),
    kv_high_evaluations: int = 0,
    last_prefiller_queue: float | None = None,
    last_arrival: tuple[float, float] | None = None,
) -> Decision:
    """One evaluation (module rules). ``InvalidInput`` when the model rejects the measured workload (a
    conversation larger than a decoder's KV cache, say); the caller holds and reports it."""
    limits = thresholds or Thresholds()
    spec, limits = _in_its_shape(spec, profile, limits)
    forecast = _forecast(signals, limits, now_s, last_arrival)
    recommended, why, capacity, corrected = _proactive(spec, profile, signals, limits, forecast)
    reasons = [why]
    tolerated = _covered_within_tolerance(spec, profile, signals, limits, current, recommended, forecast)
    # whether a backlog clears is a question of the arrivals, not of the planning margin
    rate = max(signals.arrival_rate_per_s or 0.0, forecast)
    kv_high = kv_high_evaluations + 1 if (signals.decoder_kv_usage or 0.0) >= limits.kv_usage_high else 0
    will_have = Replicas(*(max(getattr(current, role), getattr(recommended, role)) for role in ROLES))
    queue = signals.prefiller_queue
    grew = queue is not None and last_prefiller_queue is not None and queue > last_prefiller_queue
    room = _backlog_room(signals, limits, will_have, capacity, rate, grew)
    guards = _guards(signals, current, limits, kv_high, last_prefiller_queue)
    memory_full = {"decoders": guards.pop("decoders")} if "decoders" in guards else {}
    backlog = [*corrected.items(), *_rule(signals, current, limits, capacity).items(), *guards.items()]
    for role, (count, why) in [*backlog, *memory_full.items()]:
        have = getattr(current, role)
        if count <= have:
            continue
        # the KV guard is a capacity signal (the decoders' memory is full), not a backlog: never judged
        most, judged = (count, "") if why.startswith("decoder KV") else room.get(role, (count, ""))
        if most is None or most <= have:
            reasons.append(f"{why}: {count} {role}, not added: {judged}")
            continue
        if most < count:
            why, count = f"{why} asks for {count}; at most {judged}", most
        tolerated.discard(role)  # a need a guard or a lasting backlog confirms is not held by the tolerance
        if count > getattr(recommended, role):
            recommended = replace(recommended, **{role: count})
        reasons.append(f"{why}: {count} {role}")
    recommended = _bounded(recommended, limits)
    now = Recommendation(now_s, recommended.prefillers, recommended.decoders)
    covered = limits.stabilization_window_s <= 0 or any(
        now_s - h.at_s >= limits.stabilization_window_s for h in history
    )
    window = [h for h in history if now_s - h.at_s < limits.stabilization_window_s] + [now]

    chosen = {}
    for role in ("prefillers", "decoders"):
        have, want = getattr(current, role), getattr(recommended, role)
        if want > have and role in tolerated:
            chosen[role] = have
            reasons.append(f"{role} held at {have}: {want} recommended is within {limits.up_tolerance:.0%} of the need")
            continue
        if want >= have:
            chosen[role] = want
            if want > have:
                reasons.append(f"{role} {have} -> {want}: up at once")
            continue
        highest = max(getattr(h, role) for h in window)
        floor = have - _step(have, limits.down_step_fraction)
        worth_it = highest < have * (1 - limits.down_tolerance)
        chosen[role] = min(have, max(highest, floor, want)) if covered and worth_it else have
        if chosen[role] < have:
            reasons.append(f"{role} {have} -> {chosen[role]}: low for {limits.stabilization_window_s:g}s")
        elif not covered or highest >= have:
            reasons.append(f"{role} held at {have}: {want} recommended, waiting out the stabilization window")
        else:
            reasons.append(f"{role} held at {have}: {highest} recommended is within {limits.down_tolerance:.0%}")
    final = _bounded(Replicas(chosen["prefillers"], chosen["decoders"]), limits)
    arrival = None if signals.arrival_rate_per_s is None else (now_s, signals.arrival_rate_per_s)
    return Decision(final, recommended, tuple(reasons), _prune(history, now, limits.stabilization_window_s), kv_high,
                    queue, arrival)  # fmt: skip


def _guards(
    signals: Signals, current: Replicas, limits: Thresholds, kv_high: int, last_queue: float | None
) -> dict[str, tuple[int, str]]:
    """The reactive guards (module rule 2): each role's count when its guard fires, with why."""
    fired = {}
    if kv_high >= 2:
        fired["decoders"] = (
            current.decoders + _step(current.decoders, 0.25),
            f"decoder KV occupancy {signals.decoder_kv_usage:.0%} stayed >= {limits.kv_usage_high:.0%}",
        )
    queue = signals.prefiller_queue
    grew = queue is not None and last_queue is not None and queue > last_queue
    if queue is not None and queue >= limits.queue_high and grew:
        fired["prefillers"] = (
            current.prefillers + _step(current.prefillers, 0.25),
            f"prefiller queue {queue:.1f} per replica >= {limits.queue_high:g} and growing",
        )
    return fired


def _in_its_shape(spec: SpecModel, profile: EngineProfile | None, limits: Thresholds) -> tuple[SpecModel, Thresholds]:
    """The spec with the shape its own plan takes, kept while the model re-plans with measured numbers (a shape
    changes with the spec, not with a measurement); an aggregated pool's prefillers are held at 0."""
    shape = spec.shape
    if shape is PoolShape.AUTO:  # the operator passes the shape it planned; a bare spec asks its plan
        shapes = plan_for(spec, profile).shapes
        if shapes is None:
            return spec, limits
        shape = shapes.shape
    pinned = spec.model_copy(update={"shape": shape})
    if shape is not PoolShape.AGGREGATED:
        return pinned, limits
    none = {"prefillers": 0}
    return pinned, replace(limits, min_replicas=replace(limits.min_replicas, **none),
                           max_replicas=replace(limits.max_replicas, **none))  # fmt: skip


def _covered_within_tolerance(
    spec: SpecModel,
    profile: EngineProfile | None,
    signals: Signals,
    limits: Thresholds,
    current: Replicas,
    recommended: Replicas,
    forecast: float,
) -> set[str]:
    """The roles the model would add replicas to only for the last ``up_tolerance`` of its need (rule 4
    holds them where they are, unless a guard fires).

    The same model with its margin (``rate_headroom``) ``up_tolerance`` smaller says whether the current
    replicas cover the need within that tolerance.

    NOTE: measured numbers hovering at a replica boundary (the rate; or L_d and T_d, for decoders sized at
    the prefillers' saturation rate) would otherwise add a replica at their first upward flicker and, by
    the stabilization window, hold it for a whole window.
    """
    rising = {role for role in ("prefillers", "decoders") if getattr(recommended, role) > getattr(current, role)}
    if limits.up_tolerance <= 0 or not rising:
        return set()
    shrink = 1 + limits.up_tolerance
    smaller = replace(limits, rate_headroom=limits.rate_headroom / shrink)
    try:
        lower, *_ = _proactive(spec, profile, signals, smaller, forecast / shrink)
    except InvalidInput:
        return set()  # no tolerance where the smaller need cannot be planned: up at once
    return {role for role in rising if getattr(lower, role) <= getattr(current, role)}


def _bounded(replicas: Replicas, limits: Thresholds) -> Replicas:
    low, high = limits.min_replicas, limits.max_replicas
    return Replicas(
        min(max(replicas.prefillers, low.prefillers), high.prefillers),
        min(max(replicas.decoders, low.decoders), high.decoders),
    )


def _prune(history: Sequence[Recommendation], now: Recommendation, window_s: float) -> tuple[Recommendation, ...]:
    """What the next evaluations need of the history: the newest entry older than the window (proof that
    the window is covered), the oldest inside it (the next such proof) and, between, only entries above
    every newer one for some role (the window's maximum can only come from those), so the memory stays
    small whatever the interval."""
    older = [h for h in history if now.at_s - h.at_s >= window_s]
    recent = [h for h in history if now.at_s - h.at_s < window_s] + [now]
    kept: list[Recommendation] = []
    top_p = top_d = -1
    for entry in reversed(recent):
        # the oldest one stays too: when it ages out of the window, it proves the window is covered
        if entry is now or entry is recent[0] or entry.prefillers > top_p or entry.decoders > top_d:
            kept.append(entry)
        top_p, top_d = max(top_p, entry.prefillers), max(top_d, entry.decoders)
    return tuple(older[-1:]) + tuple(reversed(kept))


def hold_reason(error: InvalidInput) -> str:
    """Why a measured workload could not be planned, for the status message."""
    return "the measured workload cannot be planned: " + "; ".join(str(p) for p in error.problems)
