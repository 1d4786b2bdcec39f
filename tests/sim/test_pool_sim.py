"""The simulated pool: engine steps timed by the cost model, slots and KV as vLLM has them, placements."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TRACES
from coserve.autoscaling.policy import Replicas
from coserve.bench.workload import Conversation, Turn, agentic, from_mooncake
from coserve.cli.simulate import CLASS_MIX_EXAMPLE
from coserve.scheduling import SlideConfig, StepCostModel
from coserve.scheduling.requests import ClassRegistry
from coserve.sim import Observation, OfflineWork, PoolSim, SimConfig

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


def run(conversations: list[Conversation], scaler: object = None, **config: object) -> PoolSim:
    settings = {"prefillers": 1, "decoders": 1, "cost_model": COST, "kv_capacity_tokens": 100_000,
                "slide": SlideConfig(max_tokens_per_step=512), **config}  # fmt: skip
    classes = {c.conversation_id: CHAT for c in conversations}
    sim = PoolSim(SimConfig(**settings), conversations, classes, scaler=scaler)  # type: ignore[arg-type]
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
               "--conversations", "12", "--first", "2000", "--no-plot"]  # fmt: skip
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


OFFLINE = ClassRegistry(
    [{"name": "chat", "weight": 4, "ttftSloMs": 5000, "tpotSloMs": 500},
     {"name": "offline", "weight": 1, "ttftSloMs": 3_600_000, "tpotSloMs": 10_000}]
)  # fmt: skip


def test_offline_work_keeps_its_concurrency_and_waits_for_spare_kv() -> None:
    """The batch runner's rules: at most ``concurrency`` lines in flight, none while no decoder has spare KV."""
    online = [conversation(f"c{i}", i * 0.5, [300, 400], 20, gap=0.5) for i in range(10)]
    work = OfflineWork(OFFLINE.get("offline"), prompt_tokens=200, output_tokens=30, concurrency=3)
    sim = run(online, offline=work)
    done = [r.request for r in sim.offline_records if len(r.request.token_times) == r.request.max_output_tokens]
    assert len(done) >= 10 and sim.result.offline_tokens == 230 * len(done)  # type: ignore[attr-defined]
    spans = [(r.arrival_s, r.token_times[-1]) for r in done]
    assert max(sum(1 for a, b in spans if a <= t < b) for t, _ in spans) <= 3
    gated = run(online, offline=OfflineWork(OFFLINE.get("offline"), concurrency=3, spare=0.0))
    assert gated.offline_records == [] and gated.result.offline_tokens == 0  # type: ignore[attr-defined]
    served = {r.request.request_id for r in sim.records if len(r.request.token_times) == r.request.max_output_tokens}
    assert len(served) == 20  # every online turn still finished


def test_round_robin_spreads_requests_over_the_engines() -> None:
    singles = [conversation(f"c{i}", i * 0.01, [200], 5) for i in range(8)]
    spread = run(singles, placement="per-request", decoders=4, routing="round-robin").result  # type: ignore[attr-defined]
    assert sorted(r.decoder for r in spread.records) == sorted([f"decoder-{i}" for i in range(4)] * 2)


def test_a_replica_the_scaler_adds_takes_work_only_after_start_up_and_a_removed_one_drains() -> None:
    """Scale 1 -> 3 decoders at the first evaluation, then back to 1: nothing lands on a starting decoder,
    and every conversation still finishes (the removed decoders drain what they started)."""
    calls: list[float] = []

    def scaler(now: float, current: Replicas, seen: Observation) -> Replicas:
        calls.append(now)
        return Replicas(1, 3 if len(calls) == 1 else 1)

    workload = [conversation(f"c{i}", i * 0.25, [300, 350], 40, gap=0.3) for i in range(120)]
    sim = run(workload, scale_warmup_s=5.0, scale_interval_s=10.0, startup_s=4.0, scaler=scaler)
    result = sim.result  # type: ignore[attr-defined]
    assert calls[:2] == [5.0, 15.0]
    served = {r.decoder for r in result.records}
    assert {"decoder-1", "decoder-2"} <= served  # the new decoders served
    for name in ("decoder-1", "decoder-2"):  # asked for at 5 s, ready at 9 s: nothing reached them before
        assert min(r.request.token_times[0] for r in result.records if r.decoder == name) >= 9.0
    assert all(len(r.request.token_times) == r.request.max_output_tokens for r in result.records)
    assert [n for t, _, n in result.replicas if t >= 16.0][:1] == [1]
    assert result.replica_seconds["decoder"] > result.duration_s  # more than one decoder for a while


def test_the_observation_reads_the_arrival_rate_over_two_minutes() -> None:
    steady = [conversation(f"c{i}", i * 0.5, [100], 2) for i in range(400)]  # 2 conversations/s for 200 s
    seen: list[Observation] = []

    def scaler(now: float, current: Replicas, observed: Observation) -> Replicas:
        seen.append(observed)
        return current

    run(steady, decoders=2, scaler=scaler, scale_warmup_s=150.0, scale_interval_s=1000.0)
    assert seen[0].arrival_rate_per_s == pytest.approx(2.0, abs=0.02)
    assert seen[0].input_tokens == pytest.approx(100)
    assert seen[0].output_tokens == pytest.approx(2, abs=0.05)  # the latest arrivals are still answering


def test_the_command_mixes_classes_harvests_offline_work_autoscales_and_plots(tmp_path: Path) -> None:
    profile = str(ROOT / "examples/profile-h100-published.yaml")
    command = [sys.executable, "-m", "coserve", "simulate", str(ROOT / "examples/pool.yaml"), "--profile", profile,
               "--conversations", "40", "--first", "2000", "--class-mix", CLASS_MIX_EXAMPLE,
               "--offline-concurrency", "4", "--autoscale", "--startup", "5", "-o", "json",
               "--plot", str(tmp_path / "sim.png")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
    report = json.loads(done.stdout)
    assert set(report["classes"]) == {"interactive", "standard"}
    assert report["classes"]["standard"]["requests"] > report["classes"]["interactive"]["requests"]
    assert report["offline_tokens_per_s"] > 0
    assert report["setup"]["autoscale"] and report["replicas"]["series"]
    # examples/pool.yaml plans P/D (its 1 s TTFT objective with 15k-token first turns): the simulated pool has
    # the plan's prefillers
    assert report["plan"]["shape"] == "Disaggregated" and report["plan"]["prefillers"] == 3
    assert report["plan"]["bottleneck"] == "DecoderThroughput" and report["first_bottleneck"] is not None
    assert (tmp_path / "sim.png").stat().st_size > 10_000
    bad = subprocess.run([*command, "--class-mix", "gold=1"], capture_output=True, text=True, check=False, cwd=ROOT)
    assert bad.returncode == 2 and "--class-mix: unknown class 'gold'" in bad.stderr
    block = subprocess.run([*command, "--kv-block-tokens", "0"], capture_output=True, text=True, check=False, cwd=ROOT)
    assert block.returncode == 2 and "--kv-block-tokens: must be at least 1, got 0" in block.stderr


def test_a_trace_read_for_lengths_only_has_the_same_turns() -> None:
    """The simulator reads traces without drawing prompt tokens; lengths, answers and times are the same."""
    trace = TRACES / "mooncake_conversation.jsonl"
    rows = [json.loads(line) for line in trace.read_text().splitlines()[:300]]
    full = from_mooncake(rows, scale=0.1)
    light = from_mooncake(rows, scale=0.1, lengths_only=True)
    assert [(c.conversation_id, c.start_s) for c in full] == [(c.conversation_id, c.start_s) for c in light]
    for a, b in zip(full, light, strict=True):
        assert [(t.num_prompt_tokens, t.max_tokens, t.arrival_s) for t in a.turns] == [
            (t.num_prompt_tokens, t.max_tokens, t.arrival_s) for t in b.turns
        ]
        assert all(t.prompt == () for t in b.turns)


def test_a_batched_step_charges_each_request_attention_over_its_own_context_only() -> None:
    """Two 100-token requests decode together: the step's attention is k2·Σ 1·(1 + 100), not k2·2·(2 + 200)."""
    cost = StepCostModel(k1=1e-4, k2=1e-5, k3=0.0, k4=1e-6, k5=0.01)
    pair = [conversation("a", 0.0, [100], 3), conversation("b", 0.0, [100], 3)]
    sim = run(pair, placement="per-request", cost_model=cost)
    a, b = (r.request for r in sim.result.records)  # type: ignore[attr-defined]
    assert a.token_times == b.token_times
    decode = a.token_times[1] - a.token_times[0]
    per_request = 2 * 1e-4 + 1e-6 * (2 + 200) + 1e-5 * 2 * (1 + 100) + 0.01
    assert decode == pytest.approx(per_request)
    assert decode < cost.latency_s(2, 200) - 1e-3  # the totals' cross term would charge 2·202 instead of 202


def test_a_waiting_request_that_does_not_fit_blocks_later_ones_but_not_the_running() -> None:
    """vLLM's waiting loop stops at the first request it cannot start; the running ones keep decoding."""
    first = conversation("a", 0.0, [500], 60)
    big = conversation("b", 0.05, [900], 5)  # 900 + 5 does not fit beside a's 560 in 1,000 tokens of KV
    small = conversation("c", 0.06, [100], 5)
    result = run([first, big, small], placement="per-request", kv_capacity_tokens=1000).result  # type: ignore[attr-defined]
    a, b, c = (r.request for r in result.records)
    assert len(a.token_times) == 60 and a.token_times[-1] < b.token_times[0]
    assert c.token_times[0] > b.token_times[0]  # c waited behind b, as vLLM's queue does
    gaps = [later - earlier for earlier, later in zip(a.token_times[1:], a.token_times[2:], strict=False)]
    assert max(gaps) < 0.05  # a decoded every step meanwhile


@pytest.mark.parametrize(
    ("sizes", "prompt", "answer", "limits", "expected"),
    [
        ((1, 4), 2000, 5, {}, "Prefiller"),  # long prompts queue at the one prefiller
        ((4, 1), 100, 200, {"max_num_seqs": 8}, "DecoderThroughput"),  # slots full, KV nearly empty
        ((4, 1), 900, 100, {"kv_capacity_tokens": 2000}, "DecoderMemory"),  # two fit in the decoder's KV
    ],
)
def test_the_first_bottleneck_is_where_work_queues(
    sizes: tuple[int, int], prompt: int, answer: int, limits: dict[str, int], expected: str
) -> None:
    burst = [conversation(f"c{i}", i * 0.1, [prompt], answer) for i in range(40)]  # 4 s: 8 router polls
    result = run(burst, prefillers=sizes[0], decoders=sizes[1], **limits).result  # type: ignore[attr-defined]
    assert result.first_bottleneck() == expected, result.queued_fraction()


def _via_prefiller(sim: PoolSim) -> int:
    """Offline lines whose KV came from a prefiller (a decoder computing a line holds none of it first)."""
    return sum(1 for r in sim.offline_records if r.moved)


def _harvest(conversations: list[Conversation], until_s: float, **config: object) -> PoolSim:
    settings = {"prefillers": 1, "decoders": 2, "cost_model": COST, "kv_capacity_tokens": 100_000,
                "slide": SlideConfig(max_tokens_per_step=512), **config}  # fmt: skip
    classes = {c.conversation_id: OFFLINE.get("chat") for c in conversations}
    sim = PoolSim(SimConfig(**settings), conversations, classes)  # type: ignore[arg-type]
    sim.result = sim.run(until_s=until_s)  # type: ignore[attr-defined]
    return sim


def test_offline_lines_go_straight_to_decoders_while_the_prefiller_is_busy() -> None:
    """The router's offline placement: a decoder with spare KV prefills the line and the busy prefiller gets
    none, where the online placement sends every line through the prefiller (and harvests less)."""
    online = [conversation(f"c{i}", i * 0.2, [3000], 20) for i in range(40)]  # the prefiller's queue never empties
    lines = {"prompt_tokens": 200, "output_tokens": 30, "concurrency": 8}
    routed = _harvest(online, 8.0, offline=OfflineWork(OFFLINE.get("offline"), **lines))  # type: ignore[arg-type]
    before = _harvest(online, 8.0, offline=OfflineWork(OFFLINE.get("offline"), route="placement", **lines))  # type: ignore[arg-type]
    assert len(routed.offline_records) > 8 and _via_prefiller(routed) <= 1  # one before the first online turn
    # every line of the online placement went to the prefiller: still there, or moved on from it
    assert before.offline_records and all(not r.decoder or r.moved for r in before.offline_records)
    assert routed.result.offline_tokens > 2 * before.result.offline_tokens  # type: ignore[attr-defined]


def test_an_idle_prefiller_prefills_offline_lines_one_at_a_time() -> None:
    work = OfflineWork(OFFLINE.get("offline"), prompt_tokens=200, output_tokens=30, concurrency=8)
    sim = _harvest([], 5.0, offline=work)
    assert 1 <= _via_prefiller(sim) < len(sim.offline_records)
    prefiller = sim.prefillers[0]
    # one line a step: every prefiller step computed one 200-token prompt, never two side by side
    assert prefiller.steps >= _via_prefiller(sim) and prefiller.tokens_computed == 200 * prefiller.steps


def test_a_prefilled_turn_is_answered_by_its_decoder_after_the_handoff() -> None:
    """vLLM's P/D protocol, as the router and coserve's connector run it: the prefiller's one token goes
    nowhere; the handoff moves the prompt's whole blocks short of its last token (96 of 100 in 16-token
    blocks); the decoder computes the 4-token tail and answers every token, the first one included."""
    sim = run([conversation("c", 0.0, [100], 3)], kv_block_tokens=16, kv_bytes_per_token=1e6,
              kv_bandwidth_bytes_per_s=1e9)  # fmt: skip
    record = sim.result.records[0]  # type: ignore[attr-defined]
    request = record.request
    move = 96 * 1e6 / 1e9
    first = COST.latency_s(100, 0) + move + COST.step_latency_s([(4, 96)])
    assert record.moved and request.cached == 96
    assert len(request.token_times) == 3
    assert request.token_times[0] == pytest.approx(first)
    assert request.token_times[1] - request.token_times[0] == pytest.approx(COST.latency_s(1, 100))


def test_the_twin_prefills_turn_one_where_the_router_would() -> None:
    """Both engines idle: by the prefill curve the decoder gives the first token sooner (no KV move, no second
    step), so turn 1 is computed there and nothing is moved; ``prefill_site="prefiller"`` keeps it off the
    decoder, as the router's ``prefillSite`` does; without a curve the prefiller is taken."""
    one = [conversation("c", 0.0, [2000, 2100], 4, gap=0.1)]
    curve = (0.01, 1e-4, 0.0)

    local = run(one, prefill_latency=curve)
    remote = run(one, prefill_latency=curve, prefill_site="prefiller")
    unknown = run(one)

    assert local.prefill_sites == {"sooner_on_decoder": 1}
    assert not any(r.moved for r in local.result.records)  # type: ignore[attr-defined]
    assert remote.prefill_sites == {"prefiller_only": 1}
    assert unknown.prefill_sites == {"no_curve": 1}
    assert remote.result.records[0].moved and unknown.result.records[0].moved  # type: ignore[attr-defined]
    decoders = {r.decoder for r in local.result.records}  # type: ignore[attr-defined]
    assert len(decoders) == 1  # turn 2 stays where turn 1 was computed


def test_affinity_keeps_a_conversation_on_the_engine_its_hash_names_which_computes_what_it_lacks() -> None:
    """Aggregated engines under session affinity: no prefiller, every turn of a conversation on one engine, which
    finds the earlier turns in its prefix cache; conversations spread over the engines by their ids' hashes."""
    convs = [conversation(f"c{i}", i * 0.5, [400, 500, 600], 8, gap=0.2) for i in range(12)]
    sim = run(convs, prefillers=0, decoders=4, placement="affinity")
    records = sim.result.records  # type: ignore[attr-defined]

    by_conversation: dict[str, set[str | None]] = {}
    for r in records:
        by_conversation.setdefault(r.conversation_id, set()).add(r.decoder)
    assert all(len(engines) == 1 for engines in by_conversation.values())
    assert len({next(iter(e)) for e in by_conversation.values()}) > 1  # not every conversation on one engine
    later = [r for r in records if r.turn > 0]
    assert all(r.request.cached >= 400 and not r.moved for r in later)  # the earlier turn was in its cache
    with pytest.raises(ValueError, match="one prefiller unless"):
        SimConfig(prefillers=0, decoders=1, cost_model=COST, kv_capacity_tokens=1000, placement="per-turn")
    SimConfig(prefillers=0, decoders=1, cost_model=COST, kv_capacity_tokens=1000)  # aggregated: conversation placement
