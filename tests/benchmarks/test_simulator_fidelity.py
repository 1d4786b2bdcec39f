"""The simulator-fidelity benchmark's pure parts: how pairs are judged, and that its workloads are the measured ones.

No engine and no simulation run here: the pairing arithmetic on hand-made values, the workloads rebuilt from the
measured results' set-ups (checked against the request counts those results recorded), and the per-class figures
on hand-made simulated requests.
"""

from __future__ import annotations

import inspect
import itertools
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from coserve.scheduling.requests import ClassRegistry
from coserve.sim import SimRequest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
RESULTS = BENCHMARKS / "results"


def measured(name: str) -> dict[str, Any]:
    return dict(json.loads((RESULTS / f"{name}.json").read_text()))


@pytest.mark.parametrize(
    ("measured_value", "simulated", "error", "within"),
    [
        (10.0, 10.5, 0.05, True),
        (10.0, 11.0, 0.10, True),  # the tolerance itself passes
        (10.0, 8.0, 0.20, False),
        (0.5, 1.0, 1.0, False),
        (0.0, 0.0, 0.0, True),
        (0.0, 1.0, None, False),  # undefined against a measured zero
        (10.0, None, None, False),  # no simulated value (too few simulated samples)
    ],
)
def test_a_pair_is_within_when_its_relative_error_is_at_most_ten_percent(
    fidelity: ModuleType, measured_value: float, simulated: float | None, error: float | None, within: bool
) -> None:
    pair = fidelity.compare("run", "arm", "ttft_p50_s", measured_value, simulated)
    assert pair["relative_error"] == (pytest.approx(error) if error is not None else None)
    assert pair["within"] is within


def test_met_needs_pairs_and_every_pair_within(fidelity: ModuleType) -> None:
    good = fidelity.compare("r", "a", "ttft_p50_s", 1.0, 1.05)
    bad = fidelity.compare("r", "a", "ttft_p95_s", 1.0, 2.0)
    assert fidelity.met([good, good])
    assert not fidelity.met([good, bad])
    assert not fidelity.met([])


def test_a_null_measurement_is_skipped_with_its_reason_never_judged(fidelity: ModuleType) -> None:
    out = fidelity.Comparison([], [], [])
    mine = {"ttft_p50_s": 0.3, "ttft_p95_s": None, "slo_attainment": None}
    simulated = {"ttft_p50_s": 0.31, "ttft_p95_s": 0.9, "slo_attainment": 1.0}
    out.judge("coserving", "online", ("ttft_p50_s", "ttft_p95_s", "slo_attainment"), mine, simulated)
    assert [p["figure"] for p in out.pairs] == ["ttft_p50_s"]
    assert out.pairs[0]["within"]
    assert out.skipped == [
        {"run": "coserving", "arm": "online", "figure": "ttft_p95_s", "why": "measured null: fewer than 100 samples"},
        {"run": "coserving", "arm": "online", "figure": "slo_attainment", "why": "measured null"},
    ]


def test_percentile_figures_are_read_from_their_names(fidelity: ModuleType) -> None:
    assert fidelity.percentile_figure("ttft_p95_s") == 95
    assert fidelity.percentile_figure("ttfet_p50_s") == 50
    assert fidelity.percentile_figure("slo_attainment") is None


def test_the_ttfet_workload_is_the_measured_runs(fidelity: ModuleType) -> None:
    setup = measured("ttfet")["setup"]
    conversations = fidelity.ttfet_conversations(setup)
    assert len(conversations) == setup["conversations"] == measured("ttfet")["conversation"]["n"]
    starts = [c.start_s for c in conversations]
    assert starts[0] == 0.0 and starts == sorted(starts)
    grown = fidelity.TTFET_ANSWER_TOKENS + setup["appended"]
    for conversation in conversations:
        turns = conversation.turns
        assert [len(t.prompt) for t in turns] == [setup["first"] + i * grown for i in range(setup["turns"])]
        assert all(t.max_tokens == fidelity.TTFET_ANSWER_TOKENS for t in turns)
        assert [t.gap_s for t in turns] == [0.0] + [setup["gap"]] * (setup["turns"] - 1)
        assert all(
            later.prompt[: len(earlier.prompt)] == earlier.prompt for earlier, later in itertools.pairwise(turns)
        )
    # what the rebuild takes from ttfet.py's code rather than its result: answer length, the stand-in answer, engines
    source = inspect.getsource(sys.modules["ttfet"])
    assert f'"max_tokens": {fidelity.TTFET_ANSWER_TOKENS}' in source
    assert f"{fidelity.TTFET_ANSWER_TOKENS} + args.appended" in source
    assert source.count('("decoder", ') == fidelity.TTFET_DECODERS


def test_the_single_engine_workloads_have_the_measured_request_counts(fidelity: ModuleType) -> None:
    priority = measured("priority_scheduling")["workload"]
    trace = fidelity.load_trace(fidelity.trace_path(priority["trace"]))
    requests = fidelity.priority_scheduling.workload(
        trace, priority["rate_per_s"], priority["duration_s"], priority["seed"]
    )
    assert len(fidelity.one_turn(requests, "req")) == priority["requests"]
    coserving = measured("coserving")["workload"]
    online = fidelity.coserving.online_workload(
        trace, coserving["online_rate_per_s"], coserving["duration_s"], coserving["seed"]
    )
    conversations = fidelity.one_turn(online, "online")
    assert len(conversations) == coserving["online_requests"]
    assert [c.start_s for c in conversations] == [r.at_s for r in online]
    assert all(c.turns[0].arrival_s == c.start_s and len(c.turns) == 1 for c in conversations)


def test_the_engines_knobs_are_the_measured_engines(fidelity: ModuleType) -> None:
    cost = {"k1": 1e-3, "k2": 1e-6, "k3": 0.0, "k4": 1e-5, "k5": 0.02}
    settings, config = fidelity.coserving_engine(256, cost)
    engine = fidelity.parse_engine_config(config, settings.max_num_batched_tokens)
    assert (engine.slide.max_tokens_per_step, engine.offline_class) == (256, "offline")
    assert engine.classes.get("online").first_token_weight == 20  # the engine's first-token factor, 2
    priority = fidelity.priority_engine(cost)
    engine = fidelity.parse_engine_config(priority.engine_config, priority.max_num_batched_tokens)
    assert engine.slide.max_tokens_per_step == priority.max_num_batched_tokens == 256
    assert engine.offline_class is None
    assert fidelity.ttfet_router("request").classes.default.name == "standard"


def test_kv_capacity_of_the_bench_model_is_what_its_engines_reported(fidelity: ModuleType) -> None:
    # the 16-layer, 512-hidden bench model: 8 heads, 4 KV heads of 64; vLLM reported 32,768 tokens in 1 GiB
    config = {"num_hidden_layers": 16, "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4}
    assert fidelity.kv_bytes_per_token(config) == 32768
    assert fidelity.KV_CACHE_BYTES // fidelity.kv_bytes_per_token(config) == 32768


def test_class_figures_judge_every_request_and_time_only_the_finished(fidelity: ModuleType) -> None:
    cls = ClassRegistry([{"name": "online", "weight": 10, "ttftSloMs": 1000, "tpotSloMs": 100}]).get("online")

    def request(token_times: list[float], output: int = 3) -> SimRequest:
        r = SimRequest("r", "c", cls, arrival_s=0.0, prompt_tokens=8, max_output_tokens=output)
        r.token_times = token_times
        return r

    on_time = request([0.5, 0.6, 0.7])
    slow_tail = request([0.5, 1.0, 1.5])  # tokens 1 and 2 miss their deadlines, mean TPOT 0.5 s
    unfinished = request([0.2])
    figures = fidelity.class_figures([on_time, slow_tail, unfinished], cls)
    assert (figures["requests"], figures["n"]) == (3, 2)
    assert figures["slo_attainment"] == pytest.approx(1 / 3)
    assert figures["ttft_and_mean_tpot_attainment"] == pytest.approx(1 / 3)
    assert figures["ttft_p50_s"] is None  # two finished requests support no percentile


def test_offline_tokens_count_prompts_once_their_first_token_came(fidelity: ModuleType) -> None:
    cls = ClassRegistry([{"name": "offline", "weight": 1, "ttftSloMs": 1000, "tpotSloMs": 100}]).get("offline")
    started = SimRequest("a", "a", cls, arrival_s=0.0, prompt_tokens=512, max_output_tokens=64)
    started.token_times = [1.0, 1.1, 1.2]
    queued = SimRequest("b", "b", cls, arrival_s=0.0, prompt_tokens=512, max_output_tokens=64)
    assert fidelity.offline_tokens_per_s([started, queued], 10.0) == pytest.approx(51.5)


def test_a_real_decoder_recomputes_past_the_previous_prompts_whole_blocks(fidelity: ModuleType) -> None:
    setup = {"first": 512, "appended": 64}
    assert fidelity.block_miss_tokens(setup, 1) == 80  # 592 tokens, 512 held in four whole 128-token blocks
    assert fidelity.block_miss_tokens(setup, 2) == 160  # 672 tokens, the 592 before them hold four whole blocks
