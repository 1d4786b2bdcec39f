"""The simulated pool: engine steps timed by the cost model, slots and KV as vLLM has them, placements."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from coserve.bench.workload import Conversation, Turn, agentic
from coserve.scheduling import SlideConfig, StepCostModel
from coserve.scheduling.requests import ClassRegistry
from coserve.sim import PoolSim, SimConfig

ROOT = Path(__file__).resolve().parents[2]
COST = StepCostModel(k1=1e-4, k2=0.0, k3=0.0, k4=1e-6, k5=0.01)
CLASSES = ClassRegistry([{"name": "chat", "weight": 1, "ttftSloMs": 5000, "tpotSloMs": 500}])
CHAT = CLASSES.get("chat")


def conversation(name: str, start: float, prompts: list[int], answer: int, gap: float = 0.0) -> Conversation:
    tokens: list[int] = []
    turns = []
    for length in prompts:
        tokens += [20] * (length - len(tokens))
        turns.append(Turn(tuple(tokens), answer, gap_s=gap))
    return Conversation(name, start, tuple(turns))


def run(conversations: list[Conversation], **config: object) -> PoolSim:
    settings = {"prefillers": 1, "decoders": 1, "cost_model": COST, "kv_capacity_tokens": 100_000,
                "slide": SlideConfig(max_tokens_per_step=512), **config}  # fmt: skip
    sim = PoolSim(SimConfig(**settings), conversations, {c.conversation_id: CHAT for c in conversations})  # type: ignore[arg-type]
    sim.result = sim.run()  # type: ignore[attr-defined]
    return sim


def test_a_lone_request_takes_the_cost_models_steps() -> None:
    """Per-request placement: 100 prompt tokens in one step, then one step per token over a growing context."""
    sim = run([conversation("c", 0.0, [100], 3)], placement="per-request")
    times = sim.result.records[0].request.token_times  # type: ignore[attr-defined]
    first = COST.latency_s(100, 0)
    assert times[0] == pytest.approx(first)
    assert times[1] - times[0] == pytest.approx(COST.latency_s(1, 100))
    assert times[2] - times[1] == pytest.approx(COST.latency_s(1, 101))


def test_a_prompt_longer_than_the_step_budget_prefills_in_chunks() -> None:
    sim = run([conversation("c", 0.0, [1200], 1)], placement="per-request")
    ttft = sim.result.records[0].request.token_times[0]  # type: ignore[attr-defined]
    chunks = COST.latency_s(512, 0) + COST.latency_s(512, 512) + COST.latency_s(176, 1024)
    assert ttft == pytest.approx(chunks)


def test_with_one_slot_requests_run_one_after_another() -> None:
    both = [conversation("a", 0.0, [50], 4), conversation("b", 0.0, [50], 4)]
    together = run(both, placement="per-request").result  # type: ignore[attr-defined]
    alone = run(both, placement="per-request", max_num_seqs=1).result  # type: ignore[attr-defined]
    first, second = sorted(r.request.token_times[0] for r in alone.records)
    assert second >= max(r.request.token_times[-1] for r in alone.records if r.request.token_times[0] == first)
    assert max(r.request.token_times[0] for r in together.records) < second


def test_a_request_waits_for_kv_room() -> None:
    """KV for 600 tokens: the second request (300 + 10) fits only once the first (300 + 10) has finished."""
    both = [conversation("a", 0.0, [300], 10), conversation("b", 0.001, [300], 10)]
    result = run(both, placement="per-request", kv_capacity_tokens=600).result  # type: ignore[attr-defined]
    a, b = (r.request for r in result.records)
    assert b.token_times[0] > a.token_times[-1]


def test_conversation_placement_keeps_turns_on_one_decoder_which_computes_only_what_is_new() -> None:
    turns = [conversation(f"c{i}", i * 0.3, [400, 500, 600], 8, gap=0.2) for i in range(6)]
    pinned = run(turns, decoders=3)
    records = pinned.result.records  # type: ignore[attr-defined]
    for name in {r.conversation_id for r in records}:
        decoders = {r.decoder for r in records if r.conversation_id == name}
        assert len(decoders) == 1, f"{name} moved between decoders: {decoders}"
    # turn 1 prefills on the prefiller; later turns compute their 100 new prompt tokens (and a few answer ones)
    prefilled = pinned.by_name["prefiller-0"].tokens_computed
    assert prefilled == 6 * 400
    per_turn = run(turns, decoders=3, placement="per-turn")
    assert per_turn.by_name["prefiller-0"].tokens_computed > prefilled  # every turn prefills there


def test_a_run_is_deterministic() -> None:
    workload = agentic(20, 2.0, turns=3, first_tokens=800, appended_tokens=100, answer_tokens=20, gap_s=0.5)
    first = [r.request.token_times for r in run(workload, decoders=2).result.records]  # type: ignore[attr-defined]
    again = [r.request.token_times for r in run(workload, decoders=2).result.records]  # type: ignore[attr-defined]
    assert first == again


def test_the_command_prints_a_table_and_json() -> None:
    profile = str(ROOT / "examples/profile-h100-published.yaml")
    command = [sys.executable, "-m", "coserve", "simulate", str(ROOT / "examples/pool.yaml"), "--profile", profile,
               "--conversations", "12", "--first", "2000"]  # fmt: skip
    table = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
    assert "TTFET over 12 conversations" in table.stdout
    report = json.loads(subprocess.run([*command, "-o", "json"], capture_output=True, text=True, check=True).stdout)
    assert report["classes"]["interactive"]["requests"] == 36
    assert report["ttfet"]["n"] == 12 and report["ttfet"]["p95_s"] is None  # 12 conversations support no p95
    bad = subprocess.run([*command, "--decoders", "0"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "--decoders: must be at least 1" in bad.stderr


@pytest.mark.parametrize("placement", ["conversation", "per-request"])
def test_fast_forwarded_decoding_emits_every_token_when_the_step_by_step_run_does(placement: str) -> None:
    """The steady-decode fast-forward is exact: the same token times as asking the policy every step."""
    workload = agentic(12, 2.0, turns=3, first_tokens=300, appended_tokens=40, answer_tokens=30, gap_s=0.2, seed=3)
    exact = run(workload, placement=placement, fast_forward=False)
    fast = run(workload, placement=placement)
    skipped = sum(e.fast_forwarded for e in fast.decoders)
    assert skipped > 100  # the workload has long steady decode runs, so the test exercises the fast path
    assert sum(e.steps for e in fast.decoders) == sum(e.steps for e in exact.decoders)
    for a, b in zip(exact.result.records, fast.result.records, strict=True):  # type: ignore[attr-defined]
        assert b.request.token_times == pytest.approx(a.request.token_times, abs=1e-9)
        assert a.decoder == b.decoder
