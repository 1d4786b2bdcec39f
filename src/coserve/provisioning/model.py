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
from coserve.api.status import Bottleneck, Plan, PlanUtilization, ShapeComparison
from coserve.provisioning.decoders import DecoderLoad, decoder_loads, later_turn_context_tokens
from coserve.provisioning.profile import ResolvedProfile
from coserve.provisioning.shape import compare_shapes

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
    prefillers: int  # M
    pool_saturation: float  # M·R*
    design_rate: float  # min(M·R*, headroom·R)
    throughput_need: float  # decoders for throughput, before headroom
    memory_need: float  # decoders for KV memory, before headroom
    binding: Bottleneck
    decoders: int  # N
    capacities: Capacities
    warnings: tuple[str, ...]
    shapes: ShapeComparison  # P/D against aggregated engines on M + N engines
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
    return Plan(
        prefillers=sized.prefillers,
        decoders=sized.decoders,
        prefill_throughput_tokens_per_s=sized.prefill_tps,
        saturation_rate_per_s=sized.saturation_rate,
        pool_saturation_rate_per_s=sized.pool_saturation,
        design_rate_per_s=sized.design_rate,
        **_load_figures(profile, sized),
        binding_constraint=sized.binding,
        bottleneck=sized.capacities.first_bottleneck(),
        utilization=PlanUtilization(
            prefiller=rate / sized.pool_saturation,
            decoder_throughput=rate * load.work_s / sized.decoders,
            decoder_memory=rate * load.slot_s / sized.decoders,
        ),
        shapes=sized.shapes,
        explanation=[*_explanation(spec, profile, sized), _shape_line(sized.shapes)],
        warnings=list(sized.warnings),
    )


def _aggregated_plan(spec: SpecModel, profile: ResolvedProfile, sized: _Sizing) -> Plan:
    """The plan for aggregated engines: no prefillers; engines for the target rate at the per-engine rate the
    shape comparison found, with the spec's headroom (and autoscaling's decoder bounds)."""
    load, rate, shapes = sized.load, spec.workload.arrival_rate_per_s, sized.shapes
    warnings: list[str] = []
    per_engine = shapes.aggregated_rate_per_s / shapes.engines  # the comparison's rate per aggregated engine
    engines = max(1, _ceil(spec.headroom * rate / per_engine)) if per_engine > 0 else shapes.engines
    scaling = spec.autoscaling
    if scaling.enabled:
        engines = _clamp("decoders", engines, scaling.decoders.min_replicas, scaling.decoders.max_replicas, warnings)
        warnings.append(
            "spec.autoscaling.prefillers does not apply: the pool runs aggregated engines (no prefillers); "
            "spec.autoscaling.decoders bounds them"
        )
    per_conversation_s = sized.turn1_prefill_s + load.work_s
    limit = Bottleneck.DECODER_MEMORY if shapes.aggregated_limit == "DecoderMemory" else Bottleneck.DECODER_THROUGHPUT
    return Plan(
        prefillers=0,
        decoders=engines,
        prefill_throughput_tokens_per_s=sized.prefill_tps,
        saturation_rate_per_s=sized.saturation_rate,
        pool_saturation_rate_per_s=per_engine * engines,
        design_rate_per_s=spec.headroom * rate,
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
            _shape_line(shapes),
            f"each aggregated engine also prefills its conversations' first turns, p_1 = "
            f"{sized.turn1_prefill_s:.4g} s each, so a conversation costs {per_conversation_s:.4g} engine-s; "
            f"engines = ceil(headroom · R / (rate per engine)) = ceil({spec.headroom:g} · {_rate(rate)} / "
            f"{_rate(per_engine)}) = {engines}, and no prefillers",
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


def _size(spec: SpecModel, profile: ResolvedProfile, kept_shape: PoolShape | None = None) -> _Sizing:
    """The model's arithmetic: T_p and R*, M, the decoder load, the design rate, N, and the clamps."""
    workload = spec.workload
    rate = workload.arrival_rate_per_s
    # the mean of latency(L) over the prompts: the curve at the mean plus its quadratic term times the variance
    prefill_latency_s = profile.prefill_latency.latency_s(workload.input_tokens) + (
        profile.prefill_latency.per_token_squared_s * workload.input_tokens_std_dev**2
    )
    prefill_tps = workload.input_tokens / prefill_latency_s
    saturation_rate = prefill_tps / workload.input_tokens
    kept, evicted = decoder_loads(workload, profile)
    # NOTE: both needs are linear in the rate, so the cheaper assumption about idle KV is the same at any rate
    load = evicted if evicted.per_rate < kept.per_rate else kept

    prefillers = max(1, _ceil(rate / saturation_rate))
    design_rate = min(prefillers * saturation_rate, spec.headroom * rate)
    throughput_need = design_rate * load.work_s
    memory_need = design_rate * load.slot_s
    binding = Bottleneck.DECODER_THROUGHPUT if throughput_need >= memory_need else Bottleneck.DECODER_MEMORY
    decoders = max(1, _ceil(spec.headroom * max(throughput_need, memory_need)))

    warnings: list[str] = []
    autoscaling = spec.autoscaling
    if autoscaling.enabled:
        prefillers = _clamp(
            "prefillers", prefillers, autoscaling.prefillers.min_replicas, autoscaling.prefillers.max_replicas, warnings
        )
        decoders = _clamp(
            "decoders", decoders, autoscaling.decoders.min_replicas, autoscaling.decoders.max_replicas, warnings
        )
    pool_saturation = prefillers * saturation_rate
    capacities = Capacities(
        prefiller_per_s=pool_saturation,
        decoder_throughput_per_s=decoders / load.work_s,
        decoder_memory_per_s=decoders / load.slot_s if load.slot_s > 0 else math.inf,
    )
    bottleneck = capacities.first_bottleneck()
    if bottleneck is not Bottleneck.PREFILLER:
        decoder_limit = min(capacities.decoder_throughput_per_s, capacities.decoder_memory_per_s)
        warnings.append(
            f"decoders saturate first ({_rate(decoder_limit)} conversations/s, {bottleneck.value}) before "
            f"the prefillers ({_rate(pool_saturation)}): traffic above "
            "that rate would queue where the router cannot see it; raise spec.headroom or enable autoscaling"
        )
    turn1_prefill_s = profile.prefill_s(workload.input_tokens, 0.0) + profile.spread_s(workload.input_tokens_std_dev**2)
    shapes = compare_shapes(spec, profile, load, prefillers, decoders, pool_saturation, turn1_prefill_s, kept_shape)
    return _Sizing(prefill_latency_s, prefill_tps, saturation_rate, kept, evicted, load, prefillers,
                   pool_saturation, design_rate, throughput_need, memory_need, binding, decoders, capacities,
                   tuple(warnings), shapes, turn1_prefill_s)  # fmt: skip


def _explanation(spec: SpecModel, profile: ResolvedProfile, sized: _Sizing) -> list[str]:
    """The plan's arithmetic in words, one line per step, with the numbers that went in."""
    workload, load = spec.workload, sized.load
    rate, input_tokens, spread = workload.arrival_rate_per_s, workload.input_tokens, workload.input_tokens_std_dev
    need = max(sized.throughput_need, sized.memory_need)
    capacities = sized.capacities
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
        f"prefillers M = ceil(R / R*) = ceil({_rate(rate)} / {_rate(sized.saturation_rate)}) = {sized.prefillers}"
        f", saturating at M·R* = {_rate(sized.pool_saturation)} conversations/s",
        f"one decoder holds B = floor({profile.kv_capacity_tokens} KV tokens / {profile.live_context_tokens} "
        f"live tokens per conversation) = {load.kv_slots} conversations",
        f"decoders are sized for min(M·R*, headroom·R) = min({_rate(sized.pool_saturation)}, "
        f"{spec.headroom:g}·{_rate(rate)}) = {_rate(sized.design_rate)} conversations/s",
        *([profile.decode_basis] if profile.decode_basis else []),
        *explain_decoder_work(workload, profile, sized.kept, sized.evicted, load),
        f"throughput needs R·(L_d + w·A) / T_d = {_rate(sized.design_rate)}·({workload.output_tokens} + "
        f"{load.weight(profile.decode_throughput_tokens_per_s):.3g}·{load.prefill_tokens:,.0f}) / "
        f"{profile.decode_throughput_tokens_per_s:g} = {sized.throughput_need:.3f} decoders; memory needs "
        f"R·W_kv / B = {_rate(sized.design_rate)}·{load.kv_held_s:.4g} / {load.kv_slots} = "
        f"{sized.memory_need:.3f} decoders; {sized.binding.value} binds",
        f"decoders N = ceil(headroom · {need:.3f}) = ceil({spec.headroom:g} · {need:.3f}) = {sized.decoders}"
        f" ({sized.saturation_rate * load.per_rate:.3f} decoders per saturated prefiller before headroom)",
        f"as load rises, {capacities.first_bottleneck().value} saturates first: prefillers at "
        f"{_rate(capacities.prefiller_per_s)}, decoder throughput at {_rate(capacities.decoder_throughput_per_s)}, "
        f"decoder memory at {_rate(capacities.decoder_memory_per_s)} conversations/s",
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
