"""The closed-form provisioning model: how many prefillers and decoders a pool needs.

Symbols (from the conversation-level disaggregation paper) and their names here:

    R     target conversation arrival rate   -> workload.arrival_rate_per_s
    L_in  turn-1 input tokens                -> workload.input_tokens
    L_d   output tokens per conversation     -> workload.output_tokens
    W     conversation lifetime (s)          -> workload.lifetime_s
    T_p   prefiller throughput at L_in       -> L_in / prefill_latency(L_in)
    T_d   decoder throughput (tokens/s)      -> profile.decode_throughput_tokens_per_s, or the step
                                                cost model at B requests of live context each
    B     KV slots per decoder               -> floor(kv_capacity_tokens / live_context_tokens)
    A, w  decoder prefill per conversation and its cost in decode tokens  (``coserve.provisioning.decoders``)
    W_kv  seconds a conversation's KV is held on its decoder              (``coserve.provisioning.decoders``)

One prefiller saturates at ``R* = T_p / L_in`` conversations/s, so M prefillers
serve a target rate R when ``M = ceil(R / R*)``. Decoders must satisfy both
``N·T_d >= R·(L_d + w·A)`` (throughput: decoding, and prefilling later turns)
and ``N·B >= R·W_kv`` (KV memory, held as vLLM holds it; ``decoders`` says how
idle conversations count). Evaluating them at the prefillers' saturation rate
``M·R*``, with ``headroom`` on top, makes the prefiller pool (whose load the
router observes) the first thing to saturate.

NOTE: the rate the decoders are sized for is ``min(M·R*, headroom·R)``. A pool
whose target is far below one prefiller's saturation point would otherwise get
decoders for traffic it was never asked to take (R -> 0 would still need several
decoders); the plan then says honestly which resource saturates first, and the
autoscaler re-plans from the measured rate.

Who calls it: ``coserve plan`` and ``coserve render`` (CLI), the operator on
every reconcile, and the autoscaler with measured workload numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from coserve.api.spec import PoolShape, SpecModel, WorkloadSpec
from coserve.api.status import Bottleneck, Plan, PlanUtilization, ShapeComparison, ShapeOption
from coserve.provisioning.decoders import DecoderLoad, decoder_loads, later_turn_context_tokens
from coserve.provisioning.profile import ResolvedProfile
from coserve.provisioning.shape import compare_shapes, seconds_text

__all__ = ["MAX_REPLICAS_PER_ROLE", "Capacities", "make_plan"]

# Above this a plan is a typo, not a pool (and Deployment replicas are int32).
MAX_REPLICAS_PER_ROLE = 10_000

_EPS = 1e-9


@dataclass(frozen=True)
class Capacities:
    """The arrival rate (conversations/s) at which each resource of a pool saturates."""

    prefiller_per_s: float
    decoder_throughput_per_s: float
    decoder_memory_per_s: float

    def first_bottleneck(self) -> Bottleneck:
        """The resource with the lowest saturation rate; ties go to the prefiller, then throughput."""
        ranked = [
            (self.prefiller_per_s, 0, Bottleneck.PREFILLER),
            (self.decoder_throughput_per_s, 1, Bottleneck.DECODER_THROUGHPUT),
            (self.decoder_memory_per_s, 2, Bottleneck.DECODER_MEMORY),
        ]
        return min(ranked, key=lambda item: (item[0], item[1]))[2]


@dataclass(frozen=True)
class _Sizing:
    """Every number ``make_plan`` derives, in the order it derives them (``_size``); the plan and its
    explanation are read from it."""

    prefill_latency_s: float  # the mean over prompts at L_in
    prefill_tps: float  # T_p
    saturation_rate: float  # R*
    kept: DecoderLoad  # the decoder load with idle conversations' KV kept
    evicted: DecoderLoad  # ... and with it evicted or offloaded
    load: DecoderLoad  # the cheaper of the two
    design_rate: float  # headroom·R
    throughput_need: float  # decoders for throughput at the design rate
    memory_need: float  # decoders for KV memory at the design rate
    binding: Bottleneck
    shapes: ShapeComparison  # P/D and aggregated engines, each sized for the objectives
    turn1_prefill_s: float  # p_1: turn 1's prefill inside an aggregated engine's steps


def make_plan(spec: SpecModel, profile: ResolvedProfile, kept_shape: PoolShape | None = None) -> Plan:
    """Size the pool described by ``spec`` with the engine speeds in ``profile`` (``kept_shape``: the shape a
    running pool keeps under ``spec.shape: Auto``, ``coserve.provisioning.shape.compare_shapes``).

    Pure and deterministic. The caller has already run
    ``coserve.provisioning.validation.check_spec`` (a zero prefill latency or a KV
    cache smaller than one conversation would make this divide by zero).
    """
    sized = _size(spec, profile, kept_shape)
    if sized.shapes.shape is PoolShape.AGGREGATED:
        return _aggregated_plan(spec, profile, sized)
    load, rate = sized.load, spec.workload.arrival_rate_per_s
    option = sized.shapes.disaggregated
    warnings = _unmet_warnings(sized.shapes, option, "P/D")
    prefillers, decoders = option.prefillers, option.decoders
    scaling = spec.autoscaling
    if scaling.enabled:
        prefillers = _clamp("prefillers", prefillers, scaling.prefillers.min_replicas,
                            scaling.prefillers.max_replicas, warnings)  # fmt: skip
        decoders = _clamp("decoders", decoders, scaling.decoders.min_replicas, scaling.decoders.max_replicas, warnings)
    capacities = Capacities(
        prefiller_per_s=prefillers * sized.saturation_rate,
        decoder_throughput_per_s=decoders / load.work_s,
        decoder_memory_per_s=decoders / load.slot_s if load.slot_s > 0 else math.inf,
    )
    bottleneck = capacities.first_bottleneck()
    return Plan(
        prefillers=prefillers,
        decoders=decoders,
        prefill_throughput_tokens_per_s=sized.prefill_tps,
        saturation_rate_per_s=sized.saturation_rate,
        pool_saturation_rate_per_s=min(
            capacities.prefiller_per_s, capacities.decoder_throughput_per_s, capacities.decoder_memory_per_s
        ),
        design_rate_per_s=sized.design_rate,
        **_load_figures(profile, sized),
        binding_constraint=sized.binding,
        bottleneck=bottleneck,
        utilization=PlanUtilization(
            prefiller=rate / capacities.prefiller_per_s,
            decoder_throughput=rate * load.work_s / decoders,
            decoder_memory=rate * load.slot_s / decoders,
        ),
        shapes=sized.shapes,
        explanation=[
            *_explanation(spec, profile, sized),
            f"decoders N = {option.decoders}: the fewest that decode at {_rate(sized.design_rate)} conversations/s "
            f"within the objectives ({_limit_words(option.limit)}); predicted mean TPOT {_ms(option.tpot_s)}",
            f"prefillers M = {option.prefillers}: the fewest whose turn-1 queue (M/G/c at "
            f"{_rate(sized.design_rate)}/s, service {sized.prefill_latency_s:.4g} s, utilisation "
            f"{sized.design_rate / (option.prefillers * sized.saturation_rate):.0%}) keeps turn 1's p95 TTFT within "
            f"{_ms(sized.shapes.ttft_objective_s)} ({_limit_words(option.prefillers_limit)}): predicted "
            f"{_s(option.ttft_p95_s)}",
            f"predicted p95 TTFET (arrival to the last turn's first token) {_s(option.ttfet_p95_s)}",
            _saturation_line(bottleneck, capacities),
            _shape_line(sized.shapes),
            _alternative_line(sized.shapes, PoolShape.AGGREGATED),
        ],
        warnings=warnings,
    )


def _aggregated_plan(spec: SpecModel, profile: ResolvedProfile, sized: _Sizing) -> Plan:
    """The plan for aggregated engines: no prefillers; the fewest engines that prefill their own turns and meet the
    objectives at the design rate (and autoscaling's decoder bounds)."""
    load, rate, shapes = sized.load, spec.workload.arrival_rate_per_s, sized.shapes
    option = shapes.aggregated
    warnings = _unmet_warnings(shapes, option, "aggregated engines")
    engines = option.decoders
    scaling = spec.autoscaling
    if scaling.enabled:
        engines = _clamp("decoders", engines, scaling.decoders.min_replicas, scaling.decoders.max_replicas, warnings)
        warnings.append(
            "spec.autoscaling.prefillers does not apply: the pool runs aggregated engines (no prefillers); "
            "spec.autoscaling.decoders bounds them"
        )
    per_conversation_s = sized.turn1_prefill_s + load.work_s
    throughput = engines / per_conversation_s
    memory = engines / load.slot_s if load.slot_s > 0 else math.inf
    limit = Bottleneck.DECODER_MEMORY if memory < throughput else Bottleneck.DECODER_THROUGHPUT
    return Plan(
        prefillers=0,
        decoders=engines,
        prefill_throughput_tokens_per_s=sized.prefill_tps,
        saturation_rate_per_s=sized.saturation_rate,
        pool_saturation_rate_per_s=min(throughput, memory),
        design_rate_per_s=sized.design_rate,
        **_load_figures(profile, sized),
        binding_constraint=limit,
        bottleneck=limit,
        utilization=PlanUtilization(
            prefiller=0.0,
            decoder_throughput=rate * per_conversation_s / engines,
            decoder_memory=rate * load.slot_s / engines,
        ),
        shapes=shapes,
        explanation=[
            *_explanation(spec, profile, sized),
            f"each aggregated engine also prefills its conversations' first turns, p_1 = "
            f"{sized.turn1_prefill_s:.4g} s each, so a conversation costs {per_conversation_s:.4g} engine-s",
            f"engines = {option.engines}: the fewest that prefill and decode at {_rate(sized.design_rate)} "
            f"conversations/s within the objectives ({_limit_words(option.limit)}), and no prefillers; predicted "
            f"p95 TTFT {_s(option.ttft_p95_s)}, mean TPOT {_ms(option.tpot_s)}",
            f"predicted p95 TTFET (arrival to the last turn's first token) {_s(option.ttfet_p95_s)}",
            f"as load rises, {limit.value} saturates first: engine throughput at {_rate(throughput)}, KV memory at "
            f"{_rate(memory)} conversations/s",
            _shape_line(shapes),
            _alternative_line(shapes, PoolShape.DISAGGREGATED),
        ],
        warnings=warnings,
    )


def _load_figures(profile: ResolvedProfile, sized: _Sizing) -> dict[str, Any]:
    """The plan's fields on one conversation's decoder load, the same in either shape."""
    load = sized.load
    return {
        "kv_slots_per_decoder": load.kv_slots,
        "decoders_per_prefiller": sized.saturation_rate * load.per_rate,
        "decoder_prefill_tokens": load.prefill_tokens,
        "prefill_weight": load.weight(profile.decode_throughput_tokens_per_s),
        "kv_held_s": load.kv_held_s,
        "idle_kv": load.idle_kv,
    }


def _shape_line(shapes: ShapeComparison) -> str:
    return f"shape {shapes.shape.value}: {shapes.reason}"


def _alternative_line(shapes: ShapeComparison, other: PoolShape) -> str:
    option = shapes.option(other)
    counts = (f"{option.prefillers} prefillers and {option.decoders} decoders" if option.prefillers
              else f"{option.engines} aggregated engines")  # fmt: skip
    unmet = f", and cannot meet {', '.join(option.unmet)}" if option.unmet else ""
    return (f"alternative ({'P/D' if other is PoolShape.DISAGGREGATED else 'aggregated'}, not taken): {counts} "
            f"({_limit_words(option.limit)}{unmet}); predicted p95 TTFT {_s(option.ttft_p95_s)}, p95 TTFET "
            f"{_s(option.ttfet_p95_s)}, mean TPOT {_ms(option.tpot_s)}")  # fmt: skip


def _saturation_line(bottleneck: Bottleneck, capacities: Capacities) -> str:
    return (f"as load rises, {bottleneck.value} saturates first: prefillers at {_rate(capacities.prefiller_per_s)}, "
            f"decoder throughput at {_rate(capacities.decoder_throughput_per_s)}, decoder memory at "
            f"{_rate(capacities.decoder_memory_per_s)} conversations/s")  # fmt: skip


_LIMIT_WORDS = {
    "Prefiller": "the prefillers' saturation sets the count",
    "DecoderThroughput": "the engines' work sets the count",
    "DecoderMemory": "KV memory sets the count",
    "TTFT": "the TTFT objective sets the count",
    "TPOT": "the TPOT objective sets the count",
    "Minimum": "one engine suffices",
}


def _limit_words(limit: str) -> str:
    return _LIMIT_WORDS.get(limit, limit)


def _unmet_warnings(shapes: ShapeComparison, option: ShapeOption, name: str) -> list[str]:
    words = {"TTFT": f"the TTFT objective ({_ms(shapes.ttft_objective_s)})",
             "TPOT": f"the TPOT objective ({_ms(shapes.tpot_objective_s)})"}  # fmt: skip
    return [
        f"{name} cannot meet {words.get(goal, goal)} at any size: one request's own prefill or step is longer; "
        "the pool is sized without it (loosen the class's objective, or use faster engines)"
        for goal in option.unmet
    ]


def _size(spec: SpecModel, profile: ResolvedProfile, kept_shape: PoolShape | None = None) -> _Sizing:
    """The model's arithmetic: T_p and R*, the decoder load, the design rate, and both shapes sized."""
    workload = spec.workload
    # the mean of latency(L) over the prompts: the curve at the mean plus its quadratic term times the variance
    prefill_latency_s = profile.prefill_latency.latency_s(workload.input_tokens) + (
        profile.prefill_latency.per_token_squared_s * workload.input_tokens_std_dev**2
    )
    prefill_tps = workload.input_tokens / prefill_latency_s
    saturation_rate = prefill_tps / workload.input_tokens
    kept, evicted = decoder_loads(workload, profile)
    # the assumption about idle KV that needs fewer engines in the shape the pool takes (Kept on a tie)
    sized = [(compare_shapes(spec, profile, load, kept_shape), load) for load in (kept, evicted)]
    shapes, load = min(sized, key=lambda pair: _cost(pair[0]))
    design_rate = shapes.design_rate_per_s
    throughput_need = design_rate * load.work_s
    memory_need = design_rate * load.slot_s
    binding = Bottleneck.DECODER_THROUGHPUT if throughput_need >= memory_need else Bottleneck.DECODER_MEMORY
    turn1_prefill_s = profile.prefill_s(workload.input_tokens, 0.0) + profile.spread_s(workload.input_tokens_std_dev**2)
    return _Sizing(prefill_latency_s, prefill_tps, saturation_rate, kept, evicted, load, design_rate,
                   throughput_need, memory_need, binding, shapes, turn1_prefill_s)  # fmt: skip


def _cost(shapes: ShapeComparison) -> tuple[int, int, float]:
    option = shapes.option()
    return (len(option.unmet), option.engines, option.ttfet_p95_s)


def _explanation(spec: SpecModel, profile: ResolvedProfile, sized: _Sizing) -> list[str]:
    """The plan's arithmetic in words up to the sizing, one line per step, with the numbers that went in."""
    workload, load, shapes = spec.workload, sized.load, sized.shapes
    rate, input_tokens, spread = workload.arrival_rate_per_s, workload.input_tokens, workload.input_tokens_std_dev
    return [
        f"prefill latency at L_in={input_tokens} tokens is {sized.prefill_latency_s:.4g} s "
        + (
            f"(the mean over prompts of σ={spread:,.0f} tokens: latency(L_in) + perTokenSquaredS·σ²; "
            if spread > 0
            else "("
        )
        + f"profile.prefillLatency, {profile.source}), so one prefiller processes "
        f"T_p = {input_tokens} / {sized.prefill_latency_s:.4g} = {sized.prefill_tps:,.0f} tokens/s",
        f"one prefiller saturates at R* = T_p / L_in = {_rate(sized.saturation_rate)} conversations/s",
        f"the design rate is headroom · R = {spec.headroom:g} · {_rate(rate)} = {_rate(sized.design_rate)} "
        f"conversations/s; both shapes are sized to meet TTFT {_ms(shapes.ttft_objective_s)} and TPOT "
        f"{_ms(shapes.tpot_objective_s)} (the tightest online class's objectives) there",
        f"one decoder holds B = floor({profile.kv_capacity_tokens} KV tokens / {profile.live_context_tokens} "
        f"live tokens per conversation) = {load.kv_slots} conversations",
        *([profile.decode_basis] if profile.decode_basis else []),
        *explain_decoder_work(workload, profile, sized.kept, sized.evicted, load),
        f"at the design rate, decode throughput needs λ·(L_d + w·A) / T_d = {_rate(sized.design_rate)}·"
        f"({workload.output_tokens} + {load.weight(profile.decode_throughput_tokens_per_s):.3g}·"
        f"{load.prefill_tokens:,.0f}) / {profile.decode_throughput_tokens_per_s:g} = {sized.throughput_need:.3f} "
        f"decoders and memory λ·W_kv / B = {_rate(sized.design_rate)}·{load.kv_held_s:.4g} / {load.kv_slots} = "
        f"{sized.memory_need:.3f} decoders ({sized.binding.value} binds)",
    ]


def explain_decoder_work(
    workload: WorkloadSpec, profile: ResolvedProfile, kept: DecoderLoad, evicted: DecoderLoad, chosen: DecoderLoad
) -> list[str]:
    """The explanation's lines for A, w and the idle-KV choice; none for single-turn conversations."""
    later = workload.turns - 1
    if later <= 0:
        return []
    decode_tps = profile.decode_throughput_tokens_per_s
    context = later_turn_context_tokens(workload)
    basis = (
        "profile.costModel: k1·a + k2·a·(a + c) + k4·(a + c) for a tokens over c of context, the step's k5 "
        "paid by the decode batch the chunk rides in"
        if profile.cost_model is not None
        else "profile.prefillLatency: latency(c + a) - latency(c) for a tokens over c of context"
    )
    lines = [
        f"every later turn runs on the conversation's decoder, which prefills what it appends: "
        f"A = (n - 1)·a = {later:.3g}·{workload.appended_tokens} = {kept.prefill_tokens:,.0f} tokens per "
        f"conversation over a mean context of c = {context:,.0f} tokens; one costs "
        f"w = T_d·prefill(a over c)/a = {kept.weight(decode_tps):.3g} decode tokens ({basis})",
        f"vLLM keeps KV for running requests only: an idle conversation's KV is prefix cache until newer work "
        f"evicts it. Kept (N·B >= R·W, W = {workload.lifetime_s:.4g} s): {kept.work_s:.4g} s of decoder work "
        f"and {kept.slot_s:.4g} decoder-s of KV per conversation. Evicted (N·B >= R·W_run, W_run = W - (n - 1)·g "
        f"= {workload.lifetime_s:.4g} - {later:.3g}·{workload.idle_s:.4g} = {evicted.kv_held_s:.4g} s; every "
        f"later turn recomputes its c + a tokens, w = {evicted.weight(decode_tps):.3g}): {evicted.work_s:.4g} s "
        f"of work and {evicted.slot_s:.4g} decoder-s of KV; {chosen.idle_kv.value} needs fewer decoders",
    ]
    return lines


def _ceil(value: float) -> int:
    """ceil that does not turn 3.0000000000000004 (float noise) into 4."""
    return math.ceil(value - _EPS * max(1.0, abs(value)))


def _clamp(role: str, wanted: int, low: int, high: int, warnings: list[str]) -> int:
    if wanted > high:
        warnings.append(
            f"the model wants {wanted} {role} but spec.autoscaling.{role}.maxReplicas is {high}: the pool is "
            "under-provisioned for the target rate"
        )
        return high
    return max(wanted, low)


def _rate(value: float) -> str:
    return f"{value:.4g}"


def _s(seconds: float) -> str:
    return seconds_text(seconds)


def _ms(seconds: float) -> str:
    return seconds_text(seconds, "ms")
