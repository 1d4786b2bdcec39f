"""What decoders really do: they prefill later turns, and they hold KV only for running conversations.

The plan's arithmetic is checked against a hand computation from the profile, on made-up workloads and on
the workload numbers of the recorded Mooncake trace.
"""

from __future__ import annotations

import json
import math
import statistics
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import EXAMPLES, TRACES, sanity_document
from coserve.api import IdleKV, InvalidInput, parse_pool
from coserve.api.parse import parse_profile
from coserve.api.profile import EngineProfile
from coserve.api.status import Plan
from coserve.bench.workload import from_mooncake
from coserve.provisioning import make_plan, plan_for, resolve_profile

H100 = EXAMPLES / "profile-h100-published.yaml"


def h100() -> EngineProfile:
    import yaml

    return parse_profile(yaml.safe_load(H100.read_text()))


def measured_document(**workload: Any) -> dict[str, Any]:
    """A pool whose engine numbers all come from the H100 profile (its cost model prices T_d and prefill)."""
    document = sanity_document(**workload)
    document["spec"]["profile"] = {"configMapRef": {"name": "h100"}}
    document["spec"]["headroom"] = 1.5
    # objectives that never bind: these tests check the decoders' work and KV arithmetic (the objectives' own
    # sizing is test_shape's)
    document["spec"]["priorityClasses"] = [{"name": "standard", "weight": 1.0, "ttftSloMs": 3_600_000,
                                            "tpotSloMs": 60_000}]  # fmt: skip
    return document


def plan_of(document: dict[str, Any], profile: EngineProfile | None = None) -> Plan:
    return plan_for(parse_pool(document).spec, profile)


def cost(profile: EngineProfile) -> dict[str, float]:
    assert profile.cost_model is not None
    return {k: float(v) for k, v in profile.cost_model.items()}


def chunk_s(k: dict[str, float], new: float, context: float) -> float:
    """The cost model's seconds for ``new`` tokens over ``context``, without the step's fixed k5."""
    return (k["k1"] + k["k3"]) * new + k["k2"] * new * (new + context) + k["k4"] * (new + context)


def test_defaults_are_the_single_turn_model() -> None:
    """No turns, appends or idle time: the plan is N·T_d >= R·L_d and N·B >= R·W, as before."""
    plan = plan_of(sanity_document(lifetimeS=600.0))
    assert plan.decoder_prefill_tokens == 0 and plan.prefill_weight == 0
    assert plan.idle_kv is IdleKV.KEPT and plan.kv_held_s == 600.0
    assert plan.decoders == math.ceil((25_000 / 15_000) * 600 / 18)


def test_later_turns_are_prefilled_on_the_decoder_at_the_cost_models_price() -> None:
    """N = ceil(headroom · R · (L_d + w·A) / T_d) with A = (n - 1)·a and w from the cost model."""
    profile = h100()
    k = cost(profile)
    document = measured_document(turns=4, appendedTokens=2_000, lifetimeS=20.0, arrivalRatePerS=1.0)
    plan = plan_of(document, profile)
    spec = parse_pool(document).spec
    resolved = resolve_profile(spec, profile)
    # live context defaults to the conversation's whole context at its end: L_in + L_d + (n - 1)·a
    assert resolved.live_context_tokens == 15_000 + 1_000 + 3 * 2_000
    t_d = resolved.decode_throughput_tokens_per_s
    context = 15_000 + (4 / 2) * (1_000 / 4) + (4 - 2) / 2 * 2_000  # mean context before a later turn's append
    prefill_s = 3 * chunk_s(k, 2_000, context)
    assert plan.idle_kv is IdleKV.KEPT
    assert plan.decoder_prefill_tokens == 6_000
    assert plan.prefill_weight == pytest.approx(t_d * prefill_s / 6_000, rel=1e-9)
    per_conversation_s = 1_000 / t_d + prefill_s
    assert plan.binding_constraint.value == "DecoderThroughput"
    assert plan.decoders == math.ceil(plan.design_rate_per_s * per_conversation_s - 1e-9)
    assert plan.utilization.decoder_throughput == pytest.approx(1.0 * per_conversation_s / plan.decoders)
    # the same pool counted as single-turn misses the decoders' prefill: fewer decoders than it needs
    single = plan_of(measured_document(lifetimeS=20.0, arrivalRatePerS=1.0, outputTokens=1_000), profile)
    assert plan.decoders > single.decoders
    assert any("w = T_d·prefill(a over c)/a" in line and "profile.costModel" in line for line in plan.explanation)


def test_without_a_cost_model_the_prefill_curve_prices_an_appended_token() -> None:
    """w = T_d · (latency(c + a) - latency(c)) / a: the curve's increment, its constant cancelling."""
    document = sanity_document(turns=3, appendedTokens=500, arrivalRatePerS=1.0)
    document["spec"]["profile"]["prefillLatency"] = {"constantS": 0.05, "perTokenS": 4e-5, "perTokenSquaredS": 2e-10}
    plan = plan_of(document)

    def latency(tokens: float) -> float:
        return 0.05 + 4e-5 * tokens + 2e-10 * tokens**2

    context = 15_000 + 1.5 * (1_000 / 3) + 0.5 * 500
    assert plan.prefill_weight == pytest.approx(1_000 * (latency(context + 500) - latency(context)) / 500)
    assert any("profile.prefillLatency: latency(c + a) - latency(c)" in line for line in plan.explanation)


def test_idle_conversations_are_evicted_when_keeping_them_costs_more_decoders() -> None:
    """Long tool calls: KV for the running time only, and every later turn recomputes its prompt."""
    profile = h100()
    k = cost(profile)
    document = measured_document(turns=3, appendedTokens=500, lifetimeS=300.0, idleS=140.0, arrivalRatePerS=1.0)
    plan = plan_of(document, profile)
    resolved = resolve_profile(parse_pool(document).spec, profile)
    slots = resolved.kv_capacity_tokens // resolved.live_context_tokens
    assert plan.idle_kv is IdleKV.EVICTED
    assert plan.kv_held_s == pytest.approx(300.0 - 2 * 140.0)
    context = 15_000 + 1.5 * (1_000 / 3) + 0.5 * 500
    recompute_s = 2 * chunk_s(k, context + 500, 0)
    assert plan.decoder_prefill_tokens == pytest.approx(2 * (context + 500))
    need = max(1_000 / resolved.decode_throughput_tokens_per_s + recompute_s, 20.0 / slots)
    assert plan.decoders == math.ceil(plan.design_rate_per_s * need - 1e-9)
    # counted as before (KV live for all 300 s), the pool would have many more decoders
    kept_all = plan_of(measured_document(lifetimeS=300.0, arrivalRatePerS=1.0), profile)
    assert kept_all.binding_constraint.value == "DecoderMemory"
    assert plan.decoders < kept_all.decoders
    assert any("Evicted needs fewer decoders" in line for line in plan.explanation)


def test_idle_time_must_fit_in_the_lifetime() -> None:
    with pytest.raises(InvalidInput) as caught:
        plan_of(sanity_document(turns=3, idleS=5.0, lifetimeS=10.0))
    assert [p.path for p in caught.value.problems] == ["spec.workload.idleS"]
    assert "not below lifetimeS 10 s" in caught.value.problems[0].reason


@pytest.mark.parametrize(
    ("field", "value"), [("turns", 0.5), ("appendedTokens", -1), ("idleS", -1.0), ("turns", "many")]
)
def test_new_workload_fields_are_validated_at_their_path(field: str, value: Any) -> None:
    with pytest.raises(InvalidInput) as caught:
        parse_pool(sanity_document(**{field: value}))
    assert any(p.path == f"spec.workload.{field}" for p in caught.value.problems)


def test_the_mooncake_traces_numbers_plan_as_counted() -> None:
    """The recorded Mooncake trace's own numbers: multi-turn, appends, long idle gaps between turns.

    n, a, L_in and L_d come from its conversations; W from its arrivals' spans plus a turn's decode, g as the
    arrivals' gap less that decode. The plan's decoders follow from the hand arithmetic, and the KV for the
    whole lifetime that the model used to count would have asked for several times more decoders.
    """
    with (TRACES / "mooncake_conversation.jsonl").open() as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    conversations = from_mooncake(rows, lengths_only=True)
    turns = statistics.fmean(len(c.turns) for c in conversations)
    pairs = [(a, b) for c in conversations for a, b in zip(c.turns, c.turns[1:], strict=False)]
    appended = round(statistics.fmean(max(0, b.num_prompt_tokens - a.num_prompt_tokens - a.max_tokens)
                                      for a, b in pairs))  # fmt: skip
    gap = statistics.fmean((b.arrival_s or 0.0) - (a.arrival_s or 0.0) for a, b in pairs)
    input_tokens = round(statistics.fmean(c.turns[0].num_prompt_tokens for c in conversations))
    output_tokens = round(statistics.fmean(sum(t.max_tokens for t in c.turns) for c in conversations))
    rate = len(conversations) / max(c.start_s for c in conversations)
    turn_decode_s = 10.0  # a turn's answer, generously: L_d / n tokens at 40 ms each is about 8.6 s
    lifetime = (turns - 1) * gap + turn_decode_s
    idle = gap - turn_decode_s
    assert 1.5 < turns < 1.8 and 500 < appended < 1_500 and gap > 100  # what this trace is
    workload = {
        "arrivalRatePerS": rate,
        "inputTokens": input_tokens,
        "outputTokens": output_tokens,
        "lifetimeS": lifetime,
        "turns": turns,
        "appendedTokens": appended,
        "idleS": idle,
    }
    profile = h100()
    plan = plan_of(measured_document(**workload), profile)
    spec = parse_pool(measured_document(**workload)).spec
    resolved = resolve_profile(spec, profile)
    slots = resolved.kv_capacity_tokens // resolved.live_context_tokens
    k = cost(profile)
    context = input_tokens + turns / 2 * (output_tokens / turns) + max(turns - 2, 0) / 2 * appended
    decode_s = output_tokens / resolved.decode_throughput_tokens_per_s
    kept = max(decode_s + (turns - 1) * chunk_s(k, appended, context), lifetime / slots)
    evicted = max(decode_s + (turns - 1) * chunk_s(k, context + appended, 0), (lifetime - (turns - 1) * idle) / slots)
    assert evicted < kept
    assert plan.idle_kv is IdleKV.EVICTED
    assert plan.decoders == math.ceil(plan.design_rate_per_s * evicted - 1e-9)
    assert plan.decoders_per_prefiller == pytest.approx(plan.saturation_rate_per_s * evicted)
    single = make_plan(spec.model_copy(update={"workload": spec.workload.model_copy(
        update={"turns": 1.0, "appended_tokens": 0, "idle_s": 0.0})}), resolved)  # fmt: skip
    assert single.binding_constraint.value == "DecoderMemory"
    assert single.decoders >= 3 * plan.decoders


# --- properties ---------------------------------------------------------------


@settings(max_examples=120, deadline=None)
@given(
    # just above 1 turn, idle_share·lifetime/(turns - 1) would exceed the API's bound on idleS (30 days)
    turns=st.one_of(st.just(1.0), st.floats(min_value=1.01, max_value=20.0)),
    appended=st.integers(0, 20_000),
    more_appended=st.integers(0, 20_000),
    idle_share=st.floats(min_value=0.0, max_value=0.95),
    rate=st.floats(min_value=0.0, max_value=20.0),
)
def test_more_prefill_never_lowers_decoders_and_more_idle_never_raises_them(
    turns: float, appended: int, more_appended: int, idle_share: float, rate: float
) -> None:
    profile = h100()
    lifetime = 60.0
    idle = idle_share * lifetime / (turns - 1) if turns > 1 else 0.0

    def decoders(**changes: Any) -> int:
        workload = {"turns": turns, "appendedTokens": appended, "idleS": idle, "lifetimeS": lifetime,
                    "arrivalRatePerS": rate, "liveContextTokens": None, **changes}  # fmt: skip
        document = measured_document(**{k: v for k, v in workload.items() if k != "liveContextTokens"})
        document["spec"]["profile"]["liveContextTokens"] = 40_000  # B fixed, so only the work changes
        spec = parse_pool(document).spec
        return make_plan(spec, resolve_profile(spec, profile)).decoders

    base = decoders()
    assert decoders(appendedTokens=appended + more_appended) >= base
    if turns > 1:
        assert decoders(idleS=idle / 2) >= base


def test_a_spread_of_prompt_lengths_slows_the_prefiller_by_the_curves_quadratic_term() -> None:
    """E[latency(L)] = latency(L_in) + c·σ²: prompts of mixed lengths saturate a prefiller sooner."""
    plain = plan_of(sanity_document(inputTokens=10_000))
    document = sanity_document(inputTokens=10_000, inputTokensStdDev=8_000.0)
    document["spec"]["profile"]["prefillLatency"]["perTokenSquaredS"] = 1e-9
    spread = plan_of(document)
    latency = 10_000 / 25_000 + 1e-9 * (10_000**2 + 8_000**2)
    assert spread.saturation_rate_per_s == pytest.approx(1 / latency)
    assert spread.saturation_rate_per_s < plain.saturation_rate_per_s
    assert "σ=8,000" in spread.explanation[0]
