"""The pool's shape: conversation-level P/D (prefillers and decoders) or aggregated engines, whichever meets the
pool's objectives at its design rate on fewer engines.

The design rate is ``λ = headroom · R``. For each shape the plan finds the fewest engines at which, at ``λ``,

- no resource is saturated: the prefillers (``λ < M·R*``), the engines' work (decode, and the prefill they do)
  and their KV memory (``N·B >= λ·W_kv``, ``coserve.provisioning.decoders``);
- the tightest online class's ``ttftSloMs`` holds for the predicted p95 TTFT of turn 1 and of later turns;
- its ``tpotSloMs`` holds for the predicted mean time per output token, and for a step that carries a prefill
  chunk (``tpot_rate``: the rule the router applies before it lets a decoder prefill turn 1).

It takes the shape that needs fewer engines; on a tie, the lower predicted p95 TTFET (first arrival to the final
turn's first token); on a tie again, P/D. A shape that cannot meet an objective at any size (one prefill alone
is longer than the TTFT objective, say) is sized without it, listed as ``unmet``, and loses to one that can.

The predictions, per shape (``queueing`` has the two queue formulas):

- **An engine's steps.** A decode step lasts ``c0 + s / T_d`` for ``s`` streams: ``c0`` the step's fixed cost
  (the cost model's k5, else the prefill curve's constant), each stream's token at the decoder's throughput.
  Prefill chunks add their compute to the steps they ride in; with ``ρ_p`` of the engine's time prefilling and
  ``s = λ_e·L_d·TPOT`` streams (Little), the mean time per output token is ``TPOT = c0 / (1 - ρ_p - λ_e·L_d / T_d)``.
- **An engine's prefill lane** (every prefill it runs: aggregated engines' turn 1 and every later turn; a P/D
  decoder's later turns) is one M/G/1 queue, served with the share of the engine that decoding leaves,
  ``1 - λ_e·L_d / T_d``.
- **P/D's prefillers** are one M/G/c queue of turn-1 prompts (the router sends turn 1 to the prefiller that
  starts it soonest), service time the prefill latency curve at ``L_in`` with the spread of prompt lengths.
- **TTFT** (p95) of turn 1 = the queue's p95 wait + the prefill of a p95-long prompt + one decode step; the KV
  transfer of P/D is left out, and a sum of p95s bounds the p95 of the sum from above.
- **TTFET** (p95) = turn 1's p95 TTFT + (n - 1)·(idle time + a later turn's mean TTFT) + the decode of the
  n - 1 answers before the last turn, ``(n - 1)/n · L_d · TPOT``.

``spec.shape`` Auto takes the winner; Disaggregated or Aggregated keeps that shape and the comparison is still
reported. Who calls it: ``make_plan``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from coserve.api.spec import PoolShape, SpecModel, WorkloadSpec
from coserve.api.status import ShapeComparison, ShapeOption
from coserve.provisioning.decoders import DecoderLoad, later_turn_context_tokens
from coserve.provisioning.profile import ResolvedProfile
from coserve.provisioning.queueing import Wait, mg1_wait, mgc_wait
from coserve.scheduling.steps import STEP_TOKENS, chunked_step_s

__all__ = ["Objectives", "ShapePredictions", "compare_shapes", "objectives", "tpot_rate"]

Z95 = 1.645  # a p95-long prompt is L_in + 1.645·σ (a normal spread of lengths)
Q95 = 0.95
MAX_ENGINES = 10_000  # coserve.provisioning.model.MAX_REPLICAS_PER_ROLE: a search stops here


@dataclass(frozen=True)
class Objectives:
    """The tightest online class's objectives: every class's traffic shares the engines' queues, and the plan
    does not know the mix, so each class's objective must hold for all of it."""

    ttft_s: float
    ttft_class: str
    tpot_s: float
    tpot_class: str


def objectives(spec: SpecModel) -> Objectives:
    """The tightest TTFT and TPOT over the pool's classes, the offline class left out when offline is on."""
    online = [c for c in spec.priority_classes if not (spec.offline.enabled and c.name == spec.offline.class_name)]
    classes = online or list(spec.priority_classes)
    ttft = min(classes, key=lambda c: c.ttft_slo_ms)
    tpot = min(classes, key=lambda c: c.tpot_slo_ms)
    return Objectives(ttft.ttft_slo_ms / 1000.0, ttft.name, tpot.tpot_slo_ms / 1000.0, tpot.name)


def tpot_rate(
    engines: int, curve: tuple[float, float, float], chunk_tokens: float, output_tokens: float, tpot_s: float
) -> float:
    """Conversations/s ``engines`` sustain while each step with a ``chunk_tokens`` prefill chunk in it stays within
    ``tpot_s``: at ``r`` conversations/s an engine decodes ``r·L_d·TPOT`` streams (Little), and the step lasts
    ``step(chunk, 0) + b·streams``, ``b`` the curve's per-token seconds. 0 when the chunk alone exceeds it,
    infinite when streams cost nothing or no chunk rides in the steps."""
    if chunk_tokens <= 0:
        return math.inf
    spare = tpot_s - chunked_step_s(curve, chunk_tokens, 0.0)
    if spare <= 0:
        return 0.0
    per_rate = curve[1] * output_tokens * tpot_s  # seconds the decoding streams add to a step, per conversation/s
    return math.inf if per_rate <= 0 else engines * spare / per_rate


@dataclass(frozen=True)
class _Steps:
    """An engine's decode step, ``constant_s + per_stream_s · streams`` (module docstring)."""

    constant_s: float
    per_stream_s: float

    @staticmethod
    def of(profile: ResolvedProfile, workload: WorkloadSpec) -> _Steps:
        """With a cost model: k5, and one decode token's own cost at the mean context a stream attends to;
        without: the prefill curve's constant, and 1 / T_d (T_d measured at a full batch: an upper bound)."""
        model = profile.cost_model
        if model is None:
            return _Steps(max(profile.prefill_latency.constant_s, 0.0), 1.0 / profile.decode_throughput_tokens_per_s)
        context = later_turn_context_tokens(workload)
        return _Steps(max(model.k5, 0.0), max(model.latency_s(1, context) - model.k5, 0.0))


@dataclass(frozen=True)
class _Engine:
    """What one engine serving conversations at ``rate`` per second sees: its TPOT, its prefill lane's wait."""

    tpot_s: float
    lane: Wait

    @property
    def saturated(self) -> bool:
        return math.isinf(self.tpot_s) or self.lane.saturated


@dataclass(frozen=True)
class _Work:
    """One conversation's work on the engine that decodes it: compute seconds, and the prompt tokens behind them."""

    turn1_s: float  # turn 1's prefill when the engine does it (aggregated), else 0
    turn1_tokens: float  # its prompt tokens (0 when it does not)
    turn1_scv: float  # its squared coefficient of variation (the spread of prompt lengths)
    later_s: float  # one later turn's prefill
    later_tokens: float  # ... its tokens
    later_turns: float  # n - 1
    output_tokens: float  # L_d

    def wall_s(self, tokens: float, compute_s: float, tpot_s: float) -> float:
        """A prefill's time in an engine's steps: the steps it rides (STEP_TOKENS a step, ``tpot_s`` each: they
        also decode) plus its own compute. Fractional for a prompt shorter than a step: others share it."""
        return tokens / STEP_TOKENS * tpot_s + compute_s

    def engine(self, rate: float, steps: _Steps) -> _Engine:
        prefill_share = rate * (self.turn1_s + self.later_turns * self.later_s)
        free = 1.0 - prefill_share - rate * self.output_tokens * steps.per_stream_s
        if free <= 0:
            return _Engine(math.inf, Wait(1.0, math.inf))
        tpot = (steps.constant_s + steps.per_stream_s) / free  # a step holds at least the stream itself
        jobs = (1.0 if self.turn1_s > 0 else 0.0) + self.later_turns
        if jobs <= 0:
            return _Engine(tpot, Wait(0.0, 0.0))
        first = self.wall_s(self.turn1_tokens, self.turn1_s, tpot) if self.turn1_s > 0 else 0.0
        later = self.wall_s(self.later_tokens, self.later_s, tpot)
        mean = (first + self.later_turns * later) / jobs
        second = (first**2 * (1.0 + self.turn1_scv) + self.later_turns * later**2) / jobs
        return _Engine(tpot, mg1_wait(rate * jobs, mean, second))


@dataclass(frozen=True)
class ShapePredictions:
    """One shape's predictions at the design rate on a given count of engines."""

    ttft_p95_s: float  # turn 1
    later_ttft_p95_s: float
    later_ttft_mean_s: float
    ttfet_p95_s: float
    tpot_s: float
    saturated: str = ""  # the resource at or past saturation, "" when none
    failing: list[str] = field(default_factory=list)  # the objectives it misses


@dataclass(frozen=True)
class _Shape:
    """Everything both shapes share: the design rate, the objectives, one conversation's work."""

    rate: float
    goals: Objectives
    steps: _Steps
    load: DecoderLoad
    profile: ResolvedProfile
    spec: SpecModel
    turn1_s: float  # p_1: turn 1's prefill compute inside an engine's steps (mean over prompt lengths)
    turn1_hi_s: float  # ... of a p95-long prompt
    prefill_s: float  # a prefiller's latency at L_in (mean over prompt lengths): 1 / R*
    prefill_hi_s: float  # ... of a p95-long prompt
    prefill_scv: float

    @property
    def later_turns(self) -> float:
        return max(self.spec.workload.turns - 1.0, 0.0)

    def work(self, aggregated: bool) -> _Work:
        later = self.later_turns
        workload = self.spec.workload
        return _Work(
            turn1_s=self.turn1_s if aggregated else 0.0,
            turn1_tokens=float(workload.input_tokens) if aggregated else 0.0,
            turn1_scv=self.prefill_scv,
            later_s=self.load.prefill_s / later if later > 0 else 0.0,
            later_tokens=self.load.prefill_tokens / later if later > 0 else 0.0,
            later_turns=later,
            output_tokens=float(workload.output_tokens),
        )

    def ttfet(self, ttft_p95: float, later_mean: float, tpot: float) -> float:
        workload = self.spec.workload
        later = self.later_turns
        if later <= 0:
            return ttft_p95
        answers = later / workload.turns * workload.output_tokens * tpot
        return ttft_p95 + later * (workload.idle_s + later_mean) + answers

    def decoders_side(self, engines: int, aggregated: bool) -> tuple[_Engine, ShapePredictions]:
        """The engines that decode, ``engines`` of them, at the design rate; turn 1's TTFT only when they
        prefill it themselves (aggregated)."""
        work = self.work(aggregated)
        per_engine = self.rate / engines
        engine = work.engine(per_engine, self.steps)
        later_prefill = math.ceil(work.later_tokens / STEP_TOKENS) * engine.tpot_s + work.later_s
        later_mean = engine.lane.mean_s + later_prefill
        later_p95 = engine.lane.quantile_s(Q95) + later_prefill if work.later_turns > 0 else 0.0
        if aggregated:
            long_prompt = self.spec.workload.input_tokens + Z95 * self.spec.workload.input_tokens_std_dev
            ttft = engine.lane.quantile_s(Q95) + math.ceil(long_prompt / STEP_TOKENS) * engine.tpot_s
            ttft += self.turn1_hi_s
        else:
            ttft = 0.0
        saturated = ""
        if per_engine * self.load.work_s + (per_engine * self.turn1_s if aggregated else 0.0) >= 1.0:
            saturated = "DecoderThroughput"
        elif per_engine * self.load.slot_s > 1.0:
            saturated = "DecoderMemory"
        elif engine.saturated:
            saturated = "DecoderThroughput"
        failing = []
        if ttft > self.goals.ttft_s or later_p95 > self.goals.ttft_s:
            failing.append("TTFT")
        chunk = self.spec.workload.input_tokens if aggregated else self._later_chunk()
        worst = tpot_rate(engines, self._curve(), chunk, self.spec.workload.output_tokens, self.goals.tpot_s)
        if engine.tpot_s > self.goals.tpot_s or worst < self.rate:
            failing.append("TPOT")
        ttfet = self.ttfet(ttft, later_mean, engine.tpot_s)
        return engine, ShapePredictions(ttft, later_p95, later_mean, ttfet, engine.tpot_s, saturated, failing)

    def prefillers_side(self, prefillers: int, first_step_s: float) -> tuple[Wait, float]:
        """The prefillers' queue and turn 1's p95 TTFT through it (its first token from a decoder's step)."""
        wait = mgc_wait(prefillers, self.rate, self.prefill_s, self.prefill_scv)
        return wait, wait.quantile_s(Q95) + self.prefill_hi_s + first_step_s

    def _later_chunk(self) -> float:
        workload = self.spec.workload
        return float(workload.appended_tokens) if workload.turns > 1 else 0.0

    def _curve(self) -> tuple[float, float, float]:
        curve = self.profile.prefill_latency
        return (curve.constant_s, curve.per_token_s, curve.per_token_squared_s)


def compare_shapes(
    spec: SpecModel, profile: ResolvedProfile, load: DecoderLoad, kept: PoolShape | None = None
) -> ShapeComparison:
    """Size both shapes for the spec's objectives at ``headroom · R`` and pick one (module docstring).

    ``kept``: the shape a running pool has, which ``Auto`` keeps (a pool changes shape when its spec changes,
    not when the operator is upgraded: ``coserve.operator.reconcile``)."""
    shape = _shape(spec, profile, load)
    split = _size_disaggregated(shape)
    aggregated = _size_aggregated(shape)
    better = _key(aggregated) < _key(split)
    if spec.shape is PoolShape.AUTO and kept is not None:
        chosen = kept
        reason = (f"kept {kept.value}: the spec has not changed since the pool took that shape (edit it, or set "
                  f"spec.shape, to change; {'aggregated engines' if better else 'P/D'} would win now)")  # fmt: skip
    elif spec.shape is PoolShape.AUTO:
        chosen = PoolShape.AGGREGATED if better else PoolShape.DISAGGREGATED
        reason = _why(chosen, split, aggregated)
    else:
        chosen = spec.shape
        reason = f"spec.shape asks for {chosen.value}"
    goals = shape.goals
    return ShapeComparison(
        shape=chosen,
        design_rate_per_s=shape.rate,
        ttft_objective_s=goals.ttft_s,
        tpot_objective_s=goals.tpot_s,
        disaggregated=split,
        aggregated=aggregated,
        reason=f"{reason}; objectives: TTFT {_ms(goals.ttft_s)} ({goals.ttft_class}), TPOT {_ms(goals.tpot_s)} "
        f"({goals.tpot_class}) at {_rate(shape.rate)} conversations/s",
    )


def _shape(spec: SpecModel, profile: ResolvedProfile, load: DecoderLoad) -> _Shape:
    workload = spec.workload
    curve = profile.prefill_latency
    spread = workload.input_tokens_std_dev
    prefill_s = curve.latency_s(workload.input_tokens) + curve.per_token_squared_s * spread**2
    slope = curve.per_token_s + 2.0 * curve.per_token_squared_s * workload.input_tokens
    long_prompt = workload.input_tokens + Z95 * spread
    return _Shape(
        rate=spec.headroom * workload.arrival_rate_per_s,
        goals=objectives(spec),
        steps=_Steps.of(profile, workload),
        load=load,
        profile=profile,
        spec=spec,
        turn1_s=profile.prefill_s(workload.input_tokens, 0.0) + profile.spread_s(spread**2),
        turn1_hi_s=profile.prefill_s(long_prompt, 0.0),
        prefill_s=prefill_s,
        prefill_hi_s=curve.latency_s(long_prompt),
        prefill_scv=(slope * spread / prefill_s) ** 2 if prefill_s > 0 else 0.0,
    )


def _fewest(meets: Callable[[int], bool], low: int) -> int:
    """The smallest count in [low, MAX_ENGINES] for which ``meets`` holds (it holds for every larger count once it
    holds for one); ``low`` past MAX_ENGINES, or MAX_ENGINES + 1 when none does (validation refuses either)."""
    low = max(1, low)
    if low > MAX_ENGINES:
        return low
    if meets(low):
        return low
    high = low
    while not meets(high):
        if high >= MAX_ENGINES:
            return MAX_ENGINES + 1
        low, high = high, min(2 * high, MAX_ENGINES)
    while high - low > 1:  # meets(high), not meets(low)
        middle = (low + high) // 2
        if meets(middle):
            high = middle
        else:
            low = middle
    return high


def _size_disaggregated(shape: _Shape) -> ShapeOption:
    """The fewest decoders that meet the objectives, then the fewest prefillers (turn 1's TTFT depends on the
    decoders' first step, the decoders on nothing the prefillers do)."""
    unmet = _unreachable(shape, aggregated=False)
    low = math.ceil(shape.rate * max(shape.load.work_s, shape.load.slot_s) - 1e-9)

    def decoders_meet(count: int) -> bool:
        _, seen = shape.decoders_side(count, aggregated=False)
        return not seen.saturated and not set(seen.failing) - unmet

    decoders = _fewest(decoders_meet, low)
    engine, predicted = shape.decoders_side(decoders, aggregated=False)
    first_step = engine.tpot_s

    def prefillers_meet(count: int) -> bool:
        wait, ttft = shape.prefillers_side(count, first_step)
        if wait.saturated:
            return False
        if "TTFT" in unmet:
            return wait.quantile_s(Q95) <= shape.prefill_s  # no objective to meet: wait no longer than a prefill
        return ttft <= shape.goals.ttft_s

    prefillers = _fewest(prefillers_meet, math.floor(shape.rate * shape.prefill_s) + 1)
    _, ttft = shape.prefillers_side(prefillers, first_step)
    prefillers_limit = _limit(
        [("Prefiller", not _prefillers_stable(shape, prefillers - 1)),
         ("TTFT", prefillers > 1 and not prefillers_meet(prefillers - 1))]
    )  # fmt: skip
    capacity = min(prefillers / shape.prefill_s, *_decoder_capacity(shape, decoders, aggregated=False))
    return ShapeOption(
        prefillers=prefillers,
        decoders=decoders,
        engines=prefillers + decoders,
        limit=_limit(_decoder_limits(shape, decoders, aggregated=False)),
        prefillers_limit=prefillers_limit,
        ttft_p95_s=_finite(ttft),
        ttfet_p95_s=_finite(shape.ttfet(ttft, predicted.later_ttft_mean_s, predicted.tpot_s)),
        tpot_s=_finite(predicted.tpot_s),
        saturation_rate_per_s=_finite(capacity),
        unmet=sorted(unmet),
    )


def _size_aggregated(shape: _Shape) -> ShapeOption:
    """The fewest engines that prefill their own turns and meet the objectives."""
    unmet = _unreachable(shape, aggregated=True)
    low = math.ceil(shape.rate * max(shape.turn1_s + shape.load.work_s, shape.load.slot_s) - 1e-9)

    def meets(count: int) -> bool:
        _, seen = shape.decoders_side(count, aggregated=True)
        return not seen.saturated and not set(seen.failing) - unmet

    engines = _fewest(meets, low)
    _, predicted = shape.decoders_side(engines, aggregated=True)
    return ShapeOption(
        prefillers=0,
        decoders=engines,
        engines=engines,
        limit=_limit(_decoder_limits(shape, engines, aggregated=True)),
        ttft_p95_s=_finite(predicted.ttft_p95_s),
        ttfet_p95_s=_finite(predicted.ttfet_p95_s),
        tpot_s=_finite(predicted.tpot_s),
        saturation_rate_per_s=_finite(min(_decoder_capacity(shape, engines, aggregated=True))),
        unmet=sorted(unmet),
    )


def _unreachable(shape: _Shape, aggregated: bool) -> set[str]:
    """The objectives no count of engines meets: those missed even with no queue and no load."""
    goals, steps, workload = shape.goals, shape.steps, shape.spec.workload
    unmet: set[str] = set()
    idle_step = steps.constant_s + steps.per_stream_s
    work = shape.work(aggregated)
    later = math.ceil(work.later_tokens / STEP_TOKENS) * idle_step + work.later_s if shape.later_turns > 0 else 0.0
    if aggregated:
        long_prompt = workload.input_tokens + Z95 * workload.input_tokens_std_dev
        first = math.ceil(long_prompt / STEP_TOKENS) * idle_step + shape.turn1_hi_s
    else:
        first = shape.prefill_hi_s + idle_step
    if max(first, later) > goals.ttft_s:
        unmet.add("TTFT")
    chunk = workload.input_tokens if aggregated else shape._later_chunk()
    if idle_step > goals.tpot_s or (chunk > 0 and chunked_step_s(shape._curve(), chunk, 0.0) > goals.tpot_s):
        unmet.add("TPOT")
    return unmet


def _prefillers_stable(shape: _Shape, count: int) -> bool:
    return count >= 1 and shape.rate * shape.prefill_s < count


def _decoder_limits(shape: _Shape, count: int, aggregated: bool) -> list[tuple[str, bool]]:
    """Which constraints one engine fewer would break, in the order the limit is named."""
    if count <= 1:
        return []
    _, fewer = shape.decoders_side(count - 1, aggregated)
    return [
        ("DecoderMemory", fewer.saturated == "DecoderMemory"),
        ("DecoderThroughput", fewer.saturated == "DecoderThroughput"),
        ("TTFT", "TTFT" in fewer.failing),
        ("TPOT", "TPOT" in fewer.failing),
    ]


def _decoder_capacity(shape: _Shape, count: int, aggregated: bool) -> tuple[float, float]:
    work = shape.load.work_s + (shape.turn1_s if aggregated else 0.0)
    memory = count / shape.load.slot_s if shape.load.slot_s > 0 else math.inf
    return (count / work if work > 0 else math.inf, memory)


def _limit(candidates: list[tuple[str, bool]]) -> str:
    """The first constraint that one engine fewer would break: what sets the count ("Minimum": one engine)."""
    return next((name for name, broken in candidates if broken), "Minimum")


def _key(option: ShapeOption) -> tuple[int, int, float]:
    return (len(option.unmet), option.engines, option.ttfet_p95_s)


def _why(chosen: PoolShape, split: ShapeOption, aggregated: ShapeOption) -> str:
    win, lose = (aggregated, split) if chosen is PoolShape.AGGREGATED else (split, aggregated)
    name, verb = ("aggregated engines", "") if win is aggregated else ("P/D", "s")
    other = "P/D" if win is aggregated else "aggregated engines"
    if len(win.unmet) < len(lose.unmet) and not win.unmet:
        return f"{name} meet{verb} every objective and {other} cannot ({', '.join(lose.unmet)})"
    if len(win.unmet) < len(lose.unmet):
        return (f"{name} miss{'es' if verb else ''} fewer objectives ({', '.join(win.unmet)}, against "
                f"{', '.join(lose.unmet)})")  # fmt: skip
    if win.engines < lose.engines:
        return f"{name} need{verb} fewer engines ({win.engines} against {lose.engines})"
    if win.ttfet_p95_s < lose.ttfet_p95_s:
        return (f"both need {win.engines} engines and {name} predict{verb} the lower p95 TTFET "
                f"({win.ttfet_p95_s:.3g} s against {lose.ttfet_p95_s:.3g} s)")  # fmt: skip
    return f"both need {win.engines} engines with the same p95 TTFET (P/D kept on a tie)"


UNBOUNDED = 1e12  # a figure no limit bounds, as a number status can hold (JSON has no infinity)


def seconds_text(seconds: float, unit: str = "s") -> str:
    """A predicted time as the plan's text and ``coserve plan`` print it: "unbounded" at ``UNBOUNDED``."""
    if seconds >= UNBOUNDED:
        return "unbounded"
    return f"{_digits(seconds * 1000, 4)} ms" if unit == "ms" else f"{_digits(seconds, 3)} s"


def rate_text(per_s: float) -> str:
    """A saturation rate as printed: "unbounded" at ``UNBOUNDED``."""
    return "unbounded" if per_s >= UNBOUNDED else f"{_digits(per_s, 4)}/s"


def _digits(value: float, significant: int) -> str:
    """``value`` to ``significant`` digits, but whole and never in exponent form once it has more digits than
    that: a 10 s objective reads "10000 ms", not "1e+04 ms"."""
    return f"{value:.0f}" if abs(value) >= 10**significant else f"{value:.{significant}g}"


def _finite(value: float) -> float:
    return UNBOUNDED if math.isnan(value) else min(value, UNBOUNDED)


def _rate(value: float) -> str:
    return _digits(value, 4)


def _ms(seconds: float) -> str:
    return seconds_text(seconds, "ms")
