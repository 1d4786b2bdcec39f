"""The provisioning model: the paper's checks, table-driven and as properties."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import sanity_document
from coserve.api import Bottleneck, InvalidInput, parse_pool
from coserve.api.status import Plan
from coserve.provisioning import make_plan, plan_for, resolve_profile


def plan_of(document: dict[str, Any]) -> Plan:
    return plan_for(parse_pool(document).spec)


def raw_plan(document: dict[str, Any]) -> Plan:
    """The model alone, without the replica-count sanity limit (properties range past it)."""
    spec = parse_pool(document).spec
    return make_plan(spec, resolve_profile(spec))


def with_changes(document: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """Set dotted spec paths, e.g. ``workload__lifetimeS=600``."""
    out = copy.deepcopy(document)
    for dotted, value in changes.items():
        node = out["spec"]
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return out


# Objectives loose enough that only saturation sizes the pool: the paper's closed form, with queues kept stable.
LOOSE = [{"name": "standard", "weight": 1.0, "ttftSloMs": 3_600_000, "tpotSloMs": 60_000}]


def loose(document: dict[str, Any]) -> dict[str, Any]:
    return with_changes(document, priorityClasses=LOOSE)


def test_published_sanity_case() -> None:
    """At R = R* one prefiller would run saturated, its queue unbounded: the default classes' 1 s TTFT needs
    three (M/G/c: two leave a p95 wait of 1.1 s over the 0.6 s prefill). Decoders: ceil(1.667) at headroom 1."""
    plan = plan_of(sanity_document())
    assert plan.saturation_rate_per_s == pytest.approx(1.667, abs=1e-3)
    assert plan.prefill_throughput_tokens_per_s == pytest.approx(25_000)
    assert plan.decoders_per_prefiller == pytest.approx(1.667, abs=1e-3)
    assert plan.prefillers == 3
    assert plan.decoders == 2
    assert plan.binding_constraint is Bottleneck.DECODER_THROUGHPUT
    assert plan.kv_slots_per_decoder == 300_000 // 16_000
    assert plan.shapes is not None
    option = plan.shapes.disaggregated
    assert option.prefillers_limit == "TTFT" and option.ttft_p95_s <= 1.0


def test_paper_deployment_of_three_decoders_at_headroom_1_5() -> None:
    plan = plan_of(loose(with_changes(sanity_document(), headroom=1.5)))
    assert (plan.prefillers, plan.decoders) == (2, 3)  # 2.5 conversations/s: 1.5 prefillers' work, 2.5 decoders'
    assert plan.bottleneck is Bottleneck.DECODER_THROUGHPUT


def test_long_lifetime_makes_memory_bind() -> None:
    plan = plan_of(loose(sanity_document(lifetimeS=600.0)))
    # R*·W / B = 1.667·600/18 = 55.6 decoders against 1.667 for throughput.
    assert plan.binding_constraint is Bottleneck.DECODER_MEMORY
    assert plan.decoders == math.ceil((25_000 / 15_000) * 600 / 18)


@pytest.mark.parametrize(
    ("rate", "prefillers", "decoders"),
    [
        (0.0, 1, 1),
        (1e-6, 1, 1),
        (0.3, 1, 1),  # sized for headroom·R = 0.3 -> ceil(0.3) = 1
        (0.999, 1, 1),  # 0.999 decoders' work: float noise must not round it up to 2
        (1.0, 1, 2),  # a decoder busy all the time decodes with no bound on its time per token
        (25_000 / 15_000, 2, 2),  # one prefiller would run at its saturation rate: its queue has no bound
        (2.0, 2, 3),
        (10 * 25_000 / 15_000, 11, 17),
    ],
)
def test_replicas_table(rate: float, prefillers: int, decoders: int) -> None:
    """With objectives that never bind, the fewest prefillers whose queue is stable at the design rate, and the
    decoders the paper's two inequalities ask for there."""
    plan = plan_of(loose(sanity_document(arrivalRatePerS=rate)))
    assert (plan.prefillers, plan.decoders) == (prefillers, decoders)


def test_zero_rate_gives_one_replica_per_role_and_says_why() -> None:
    plan = plan_of(sanity_document(arrivalRatePerS=0.0))
    assert (plan.prefillers, plan.decoders) == (1, 1)
    assert plan.utilization.prefiller == 0
    assert any("headroom · R = 1 · 0 = 0 conversations/s" in line for line in plan.explanation)


def test_explanation_names_every_number() -> None:
    plan = plan_of(sanity_document())
    text = "\n".join(plan.explanation)
    for needle in (
        "T_p = 15000",
        "R* = T_p / L_in",
        "headroom · R = 1 · 1.667 = 1.667",
        "B = floor",
        "prefillers M = 3: the fewest whose turn-1 queue (M/G/c",
        "decoders N = 2: the fewest",
        "DecoderThroughput binds",
        "predicted p95 TTFET",
        "saturates first",
        "alternative (aggregated, not taken)",
    ):
        assert needle in text


def test_decoders_saturating_first_is_said() -> None:
    plan = plan_of(sanity_document(arrivalRatePerS=0.3, lifetimeS=600.0))
    assert plan.bottleneck is Bottleneck.DECODER_MEMORY
    assert any(line.startswith("as load rises, DecoderMemory saturates first") for line in plan.explanation)


def test_autoscaling_bounds_clamp_and_warn() -> None:
    document = with_changes(
        sanity_document(arrivalRatePerS=20.0),
        autoscaling={
            "enabled": True,
            "prometheusUrl": "http://prom:9090",
            "prefillers": {"minReplicas": 1, "maxReplicas": 4},
            "decoders": {"minReplicas": 3, "maxReplicas": 5},
        },
    )
    plan = plan_of(document)
    assert (plan.prefillers, plan.decoders) == (4, 5)
    assert any("maxReplicas is 4" in w for w in plan.warnings)
    low = plan_of(with_changes(document, workload__arrivalRatePerS=0.0))
    assert low.decoders == 3  # minReplicas lifts the model's 1


def test_inline_fields_override_measured_profile() -> None:
    from coserve.api.profile import EngineProfile

    document = sanity_document()
    document["spec"]["profile"] = {"configMapRef": {"name": "measured"}, "kvCapacityTokens": 600_000}
    measured = EngineProfile.model_validate(
        {"prefillLatency": {"perTokenS": 1 / 25_000}, "decodeThroughputTokensPerS": 1_000.0, "kvCapacityTokens": 10},
        strict=False,
    )
    plan = plan_for(parse_pool(document).spec, measured)
    assert plan.kv_slots_per_decoder == 600_000 // 16_000
    assert "from ConfigMap measured" in plan.explanation[0]


def test_a_measured_cost_model_prices_the_decoder_at_its_own_batch_and_context() -> None:
    """T_d = B / step(B requests at the live context each), from the profile's per-request cost model."""
    from coserve.api.profile import EngineProfile
    from coserve.scheduling import StepCostModel

    cost = {"k1": 1.83e-5, "k2": 1.04e-9, "k3": 0.0, "k4": 2.61e-8, "k5": 0.00444}  # the H200 profile
    measured_fields = {
        "prefillLatency": {"perTokenS": 1 / 25_000},
        "decodeThroughputTokensPerS": 1_000.0,
        "kvCapacityTokens": 960_000,
    }
    document = sanity_document()
    document["spec"]["profile"] = {"configMapRef": {"name": "measured"}}
    spec = parse_pool(document).spec
    live = spec.workload.input_tokens + spec.workload.output_tokens
    slots = 960_000 // live
    with_model = EngineProfile.model_validate({**measured_fields, "costModel": cost}, strict=False)
    resolved = resolve_profile(spec, with_model)
    step_s = StepCostModel.from_dict(cost).step_latency_s([(1, live)] * slots)
    assert resolved.decode_throughput_tokens_per_s == pytest.approx(slots / step_s, rel=1e-9)
    assert "costModel" in resolved.source
    assert any("(profile.costModel)" in line for line in plan_for(spec, with_model).explanation)
    # without a cost model, the measured figure; set inline, the inline figure wins over both
    assert (
        resolve_profile(
            spec, EngineProfile.model_validate(measured_fields, strict=False)
        ).decode_throughput_tokens_per_s
        == 1_000.0
    )
    document["spec"]["profile"]["decodeThroughputTokensPerS"] = 700.0
    inline = resolve_profile(parse_pool(document).spec, with_model)
    assert inline.decode_throughput_tokens_per_s == 700.0 and inline.decode_basis == ""


def test_missing_profile_names_each_field() -> None:
    document = sanity_document()
    document["spec"]["profile"] = {"configMapRef": {"name": "measured"}}
    with pytest.raises(InvalidInput) as caught:
        plan_of(document)
    assert {p.path for p in caught.value.problems} == {
        "spec.profile.prefillLatency",
        "spec.profile.decodeThroughputTokensPerS",
        "spec.profile.kvCapacityTokens",
    }


# --- properties ---------------------------------------------------------------

rates = st.floats(min_value=0.0, max_value=50.0, allow_nan=False)
positive = st.floats(min_value=200.0, max_value=1e5, allow_nan=False)
lifetimes = st.floats(min_value=0.5, max_value=3_600.0, allow_nan=False)
headrooms = st.floats(min_value=1.0, max_value=3.0, allow_nan=False)


def general_document(
    rate: float,
    decode_tps: float,
    kv_tokens: int,
    lifetime: float,
    headroom: float,
    input_tokens: int = 4_000,
    output_tokens: int = 500,
) -> dict[str, Any]:
    document = sanity_document(
        arrivalRatePerS=rate, lifetimeS=lifetime, inputTokens=input_tokens, outputTokens=output_tokens
    )
    document["spec"]["headroom"] = headroom
    profile = document["spec"]["profile"]
    profile["decodeThroughputTokensPerS"] = decode_tps
    profile["kvCapacityTokens"] = kv_tokens
    profile["prefillLatency"] = {"constantS": 0.01, "perTokenS": 3e-5, "perTokenSquaredS": 1e-10}
    return document


@settings(max_examples=150, deadline=None)
@given(
    rate=rates,
    decode_tps=positive,
    kv=st.integers(5_000, 2_000_000),
    lifetime=lifetimes,
    headroom=headrooms,
    factor=st.floats(min_value=1.0, max_value=10.0),
)
def test_more_decoder_throughput_or_kv_never_raises_decoders(
    rate: float, decode_tps: float, kv: int, lifetime: float, headroom: float, factor: float
) -> None:
    base = raw_plan(general_document(rate, decode_tps, kv, lifetime, headroom))
    faster = raw_plan(general_document(rate, decode_tps * factor, kv, lifetime, headroom))
    bigger = raw_plan(general_document(rate, decode_tps, int(kv * factor), lifetime, headroom))
    assert faster.decoders <= base.decoders
    assert bigger.decoders <= base.decoders


@settings(max_examples=150, deadline=None)
@given(
    rate=rates,
    decode_tps=positive,
    kv=st.integers(5_000, 2_000_000),
    lifetime=lifetimes,
    headroom=headrooms,
    extra=st.floats(min_value=0.0, max_value=20.0),
)
def test_replicas_are_monotone_in_rate_and_decoders_cover_the_design_rate(
    rate: float, decode_tps: float, kv: int, lifetime: float, headroom: float, extra: float
) -> None:
    low = raw_plan(general_document(rate, decode_tps, kv, lifetime, headroom))
    high = raw_plan(general_document(rate + extra, decode_tps, kv, lifetime, headroom))
    assert high.prefillers >= low.prefillers
    assert high.decoders >= low.decoders
    for plan in (low, high):
        # Both decoder constraints hold at the design rate: N·T_d >= R·L_d and N·B >= R·W.
        assert plan.decoders * decode_tps >= plan.design_rate_per_s * 500 * (1 - 1e-9)
        assert plan.decoders * plan.kv_slots_per_decoder >= plan.design_rate_per_s * lifetime * (1 - 1e-9)
        assert plan.prefillers * plan.saturation_rate_per_s >= (rate if plan is low else rate + extra) * (1 - 1e-9)


@settings(max_examples=100, deadline=None)
@given(k=st.integers(min_value=1, max_value=200), headroom=headrooms)
def test_decoders_grow_linearly_in_rate(k: int, headroom: float) -> None:
    """At k times the saturation rate, N is k times the per-prefiller need (up to rounding), and the prefillers
    the fewest whose queue is stable at headroom times it."""
    document = loose(sanity_document(arrivalRatePerS=k * 25_000 / 15_000))
    document["spec"]["headroom"] = headroom
    plan = raw_plan(document)
    exact = headroom * k * plan.decoders_per_prefiller
    assert plan.prefillers == math.floor(headroom * k * (1 + 1e-12)) + 1
    # the ceiling (forgiving float noise), and one more where it would leave each decoder busy nearly all its time:
    # its time per token then exceeds even a loose objective
    assert exact - 1e-6 <= plan.decoders < exact + 2 + 1e-6


@settings(max_examples=50, deadline=None)
@given(input_tokens=st.integers(min_value=1_000, max_value=1_000_000))
def test_long_prompts_drive_saturation_rate_toward_zero(input_tokens: int) -> None:
    document = general_document(0.1, 1_000.0, 10**9, 10.0, 1.0, input_tokens=input_tokens)
    longer = general_document(0.1, 1_000.0, 10**9, 10.0, 1.0, input_tokens=input_tokens * 10)
    assert raw_plan(longer).saturation_rate_per_s < raw_plan(document).saturation_rate_per_s
    assert (
        raw_plan(general_document(0.1, 1_000.0, 10**12, 10.0, 1.0, input_tokens=10_000_000)).saturation_rate_per_s
        < 1e-3
    )


def test_replica_limit_is_a_problem_not_a_plan() -> None:
    with pytest.raises(InvalidInput) as caught:
        plan_of(sanity_document(arrivalRatePerS=90_000.0))
    assert caught.value.problems[0].path == "spec.workload.arrivalRatePerS"
    assert "more than the 10000" in caught.value.problems[0].reason
