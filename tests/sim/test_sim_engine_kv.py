"""One simulated engine's KV as vLLM keeps it: blocks allocated as requests grow, admission of the whole
sequence, and recompute preemption of the lowest-ranked running request when a running one cannot grow."""

from __future__ import annotations

import simpy

from coserve.scheduling import SlideBatching, SlideConfig, StepCostModel
from coserve.scheduling.requests import ClassRegistry
from coserve.sim import SimEngine, SimRequest

COST = StepCostModel(k1=1e-4, k2=0.0, k3=0.0, k4=1e-6, k5=0.01)
CLASSES = ClassRegistry([
    {"name": "urgent", "weight": 10, "ttftSloMs": 1000, "tpotSloMs": 200},
    {"name": "bulk", "weight": 1, "ttftSloMs": 600000, "tpotSloMs": 10000},
])  # fmt: skip


def serve(requests: list[SimRequest], kv_tokens: int, block: int = 16) -> SimEngine:
    env = simpy.Environment()
    policy = SlideBatching(COST, SlideConfig(max_tokens_per_step=512))
    engine = SimEngine(env, "e", COST, policy, kv_tokens, max_num_seqs=8, kv_block_tokens=block)

    def arrive() -> simpy.events.ProcessGenerator:
        for request in sorted(requests, key=lambda r: r.arrival_s):
            yield env.timeout(max(request.arrival_s - env.now, 0.0))
            engine.submit(request)

    env.process(arrive())
    env.run(until=600)
    return engine


def test_a_request_holds_whole_blocks_of_what_it_has_computed() -> None:
    """17 prompt tokens take two 16-token blocks; the blocks grow one at a time as the answer is written."""
    held: list[int] = []
    request = SimRequest("a", "a", CLASSES.get("bulk"), 0.0, 17, 20)
    engine = serve([request], kv_tokens=1024)
    assert len(request.token_times) == 20 and engine.preemptions == 0
    # finished: its 17 + 20 tokens' full blocks (two of 16) stay cached for the conversation
    assert engine.cached_tokens("a") == 32 and engine.kv_usage() == 0.0
    env = simpy.Environment()
    probe = SimEngine(env, "p", COST, SlideBatching(COST, SlideConfig()), 1024, kv_block_tokens=16)
    probe.submit(SimRequest("b", "b", CLASSES.get("bulk"), 0.0, 17, 1))
    scheduled, _ = probe._schedule()
    held.append(probe._running_kv)
    assert held == [32] and list(scheduled.values()) == [17]


def test_the_lowest_ranked_running_request_is_preempted_and_recomputes() -> None:
    """Two requests start in 6 blocks (3 each) and both grow: when the urgent one needs a fourth block the
    bulk one (ranked last) loses its KV, waits, recomputes its prompt and the tokens it had, and finishes."""
    urgent = SimRequest("u", "u", CLASSES.get("urgent"), 0.0, 40, 30)
    bulk = SimRequest("b", "b", CLASSES.get("bulk"), 0.0, 40, 30)
    engine = serve([urgent, bulk], kv_tokens=6 * 16)
    assert engine.preemptions >= 1 and bulk.preemptions >= 1 and urgent.preemptions == 0
    assert len(urgent.token_times) == 30 and len(bulk.token_times) == 30  # nothing lost, nothing doubled
    assert urgent.token_times[-1] < bulk.token_times[-1]
    assert engine.tokens_computed > 2 * (40 + 30 - 1)  # the recompute is work the engine did again


def test_whole_answers_are_not_reserved_at_admission() -> None:
    """vLLM admits by the sequence so far: two 60-token prompts with 60-token answers both start in 10 blocks
    (8 for the prompts), where reserving their answers (15 blocks) would have run them one after the other."""
    first = SimRequest("x", "x", CLASSES.get("bulk"), 0.0, 60, 60)
    second = SimRequest("y", "y", CLASSES.get("bulk"), 0.0, 60, 60)
    engine = serve([first, second], kv_tokens=10 * 16)
    assert second.token_times[0] < first.token_times[-1]  # ran side by side
    assert engine.preemptions >= 1  # and, growing, one had to give its KV back


def test_a_waiting_request_whose_prompt_does_not_fit_waits_for_blocks() -> None:
    big = SimRequest("big", "big", CLASSES.get("bulk"), 0.0, 100, 5)
    late = SimRequest("late", "late", CLASSES.get("bulk"), 0.001, 90, 5)
    engine = serve([big, late], kv_tokens=8 * 16)
    assert late.token_times[0] > big.token_times[-1]  # 7 + 6 blocks never fit together in 8
    assert engine.preemptions == 0
