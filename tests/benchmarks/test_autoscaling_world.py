"""The autoscaling benchmark's world (``coserve.sim`` on the benchmark's engine) behaves like engines: overload
queues, ample replicas serve, a full KV cache preempts a request, decode steps slow down as the batch grows, and
the queue-length rule reads what an HPA reads.

No engine starts here: the world is coserve's pool simulator (pure Python, seconds).
"""

from __future__ import annotations

import argparse
from types import ModuleType
from typing import Any

import pytest

from coserve.api.parse import parse_pool
from coserve.autoscaling.policy import Replicas, Thresholds
from coserve.sim import Observation

ARGS = argparse.Namespace(startup=60.0, interval=15)


def steady(world: ModuleType, rate_per_s: float, seconds: float, prompt: int = 1000, output: int = 200) -> Any:
    """A constant-rate load of identical requests, evenly spaced, and the pool spec an operator would write."""
    count = int(rate_per_s * seconds)
    times = [i / rate_per_s for i in range(count)]
    rows = [world.TraceRow(t, prompt, output) for t in times]
    arrivals = world.Arrivals("steady", times, [prompt] * count, [output] * count, 1.0, 1.0)
    spec = parse_pool(world.pool_spec(rows, 1.0, world.WORLD)).spec
    return spec, arrivals


def fixed_run(world: ModuleType, spec: Any, arrivals: Any, prefillers: int, decoders: int) -> Any:
    return world.simulate("fixed", spec, arrivals, None, ARGS, fixed=Replicas(prefillers, decoders))


def served(world: ModuleType, arrivals: Any, prefillers: int, decoders: int, **engine: Any) -> Any:
    """The simulated pool of ``World(**engine)``, fixed at ``prefillers`` + ``decoders``, after serving ``arrivals``."""
    spec = parse_pool(world.pool_spec([world.TraceRow(0.0, 1000, 100)], 1.0, world.WORLD)).spec
    sim = world.pool_sim(spec, arrivals, None, ARGS, world.World(**engine), fixed=Replicas(prefillers, decoders))
    sim.run()
    return sim


def token_times(world: ModuleType, arrivals: Any, prefillers: int, decoders: int, **engine: Any) -> list[list[float]]:
    """Each request's token times (from its arrival) on a fixed pool of ``World(**engine)``."""
    sim = served(world, arrivals, prefillers, decoders, **engine)
    return [[t - r.request.arrival_s for t in r.request.token_times] for r in sim.records]


def test_a_pool_too_small_for_the_load_queues_and_misses_the_slo(world: ModuleType) -> None:
    # one prefill of 1,000 tokens takes ~78 ms (batched ones no less), so one engine prefills ~13 requests/s:
    # the prefiller and the two decoders, which prefill turn 1 too when that is sooner, ~39 requests/s
    spec, arrivals = steady(world, rate_per_s=60, seconds=30)
    run = fixed_run(world, spec, arrivals, prefillers=1, decoders=2)
    summary = world.summarize(run)
    ttft_slo_s = spec.priority_classes[0].ttft_slo_ms / 1000
    assert run.ttft_s[0] < 0.1  # the first request finds the pool idle
    # the queue grows: what SlideBatching cannot serve in time waits until it has waited max_wait_s
    assert summary["ttft_p99_s"] > 10 * ttft_slo_s
    assert summary["slo_violation_minutes"] == summary["minutes"]
    assert summary["requests_missing_slo_pct"] > 30


def test_ample_replicas_meet_the_slo(world: ModuleType) -> None:
    spec, arrivals = steady(world, rate_per_s=20, seconds=30)
    run = fixed_run(world, spec, arrivals, prefillers=4, decoders=2)
    summary = world.summarize(run)
    assert summary["slo_violation_minutes"] == 0
    assert summary["requests_missing_slo_pct"] == 0
    assert summary["ttft_p99_s"] < 0.5
    # replica-hours: every replica asked for, each second with arrivals
    assert summary["replica_hours"] == pytest.approx(6 * 30 / 3600)


def test_a_decoder_at_kv_capacity_preempts_one_request_which_recomputes(world: ModuleType) -> None:
    """vLLM's KV: both requests start (their 1,000-token prompts fit in 3,000 tokens of KV), decode together
    until their blocks fill it, then the lower-ranked one is preempted and recomputes once there is room."""
    both = world.Arrivals("kv", [0.0, 0.0], [1000, 1000], [1000, 1000], 1.0, 1.0)  # 2,000 KV tokens each
    roomy = token_times(world, both, prefillers=2, decoders=1)
    assert max(times[1] for times in roomy) < min(times[-1] for times in roomy)  # they decode together
    sim = served(world, both, prefillers=2, decoders=1, kv_capacity_tokens=3000)
    first, second = sorted(([t - r.request.arrival_s for t in r.request.token_times] for r in sim.records),
                           key=lambda times: times[-1])  # fmt: skip
    assert second[1] < first[-1]  # no whole answer is reserved: the second starts beside the first
    assert sum(engine.preemptions for engine in sim.by_name.values()) >= 1
    assert len(first) == len(second) == 1000  # the preempted one loses no token
    assert second[-1] > 1.4 * first[-1]  # it waits for room and recomputes


def test_decode_steps_slow_down_as_the_batch_grows(world: ModuleType) -> None:
    def tpot(batch: int) -> float:
        # short prompts: one prefill step for the whole batch, which then decodes together
        arrivals = world.Arrivals("batch", [0.0] * batch, [64] * batch, [100] * batch, 1.0, 1.0)
        times = token_times(world, arrivals, prefillers=1, decoders=1)
        assert all(len(t) == 100 for t in times)
        return max((t[-1] - t[0]) / 99 for t in times)

    assert tpot(128) > 2 * tpot(1)
    assert tpot(1) == pytest.approx(world.WORLD.cost_model.k5, rel=0.1)


def step_s(world: ModuleType, pieces: list[tuple[int, int]]) -> float:
    """The world's physics: a step of requests computing p new tokens over c cached ones each."""
    model = world.WORLD.cost_model
    return model.k5 + sum((model.k1 + model.k3) * p + model.k2 * p * (p + c) + model.k4 * (p + c) for p, c in pieces)


def test_the_prefiller_batches_a_queue_into_chunked_steps_the_cost_model_times(world: ModuleType) -> None:
    """15,000 prompt tokens in prefill steps of at most 8,192: the second step finishes both remaining prompts.
    Each turn's KV then moves (its whole 16-token blocks short of the last token: 4,992 of 5,000) and the
    decoder computes the 8-token tail and answers. (Turn 1 kept on the prefiller: an idle decoder would give
    the first token sooner.)"""
    arrivals = world.Arrivals("chunks", [0.0] * 3, [5000] * 3, [10] * 3, 1.0, 1.0)
    times = token_times(world, arrivals, prefillers=1, decoders=1, prefill_site="prefiller")
    first, second, third = sorted(t[0] for t in times)
    config = world.WORLD.config(1, 1)
    move = 4992 * config.kv_bytes_per_token / config.kv_bandwidth_bytes_per_s
    prefilled = step_s(world, [(5000, 0), (3192, 0)])
    assert first == pytest.approx(prefilled + move + step_s(world, [(8, 4992)]))
    assert second == third  # they left the prefiller in the same step
    assert second > prefilled + step_s(world, [(1808, 3192), (5000, 0)]) + move


def test_the_spec_references_the_profile_of_the_worlds_engine(world: ModuleType) -> None:
    spec, _ = steady(world, rate_per_s=1, seconds=10)
    assert spec.profile.config_map_ref is not None
    assert spec.profile.decode_throughput_tokens_per_s is None  # so the plan's T_d comes from the cost model
    profile = world.engine_profile(world.WORLD)
    curve = profile.prefill_latency
    for tokens in (1, 1000, 30000):
        predicted = curve.constant_s + curve.per_token_s * tokens + curve.per_token_squared_s * tokens**2
        assert predicted == pytest.approx(step_s(world, [(tokens, 0)]))
    # the profiler's decode measurement: 16 prompts of 32 tokens prefilled together, then 63 decode steps
    elapsed = step_s(world, [(32, 0)] * 16) + sum(step_s(world, [(1, 32 + step - 1)] * 16) for step in range(1, 64))
    assert profile.decode_throughput_tokens_per_s == pytest.approx(16 * 64 / elapsed, abs=0.1)
    # the profile's cost model times the world's steps (a fit on them recovers it)
    decode = [(1, 1000)] * 64
    model = world.StepCostModel.from_dict(profile.cost_model)
    assert model.latency_s(64, 64 * 1000, requests=64) == pytest.approx(step_s(world, decode))


def observation(prefiller_requests: float, decoder_requests: float) -> Observation:
    return Observation(10.0, 1000.0, 200.0, 5.0, 1e4, 0.0, 0.5, 0.0, prefiller_requests, decoder_requests)


def test_the_queue_length_rule_reads_running_and_waiting_per_pod_asked_for(world: ModuleType) -> None:
    thresholds = Thresholds(min_replicas=Replicas(1, 1), max_replicas=Replicas(16, 64), stabilization_window_s=60)
    rule = world.threshold_scaler(thresholds, decoder_target=64, prefiller_target=4)
    # 4 prefillers asked for, 24 requests on those that serve: 6 per pod, 1.5x the target; decoders 96 per pod
    assert rule(120.0, Replicas(4, 2), observation(24, 192)) == Replicas(6, 3)
    assert rule(135.0, Replicas(6, 3), observation(25, 200)) == Replicas(6, 3)  # 4.2 and 66.7: within 10 %
    # less load: down only once a stabilization window of recommendations is held, to the window's highest
    assert rule(150.0, Replicas(6, 3), observation(12, 96)) == Replicas(6, 3)  # wants (3, 2)
    assert rule(165.0, Replicas(6, 3), observation(0, 0)) == Replicas(6, 3)  # wants (1, 1)
    assert rule(180.0, Replicas(6, 3), observation(0, 0)) == Replicas(6, 3)  # a window held; 135 wanted (6, 3)
    assert rule(195.0, Replicas(6, 3), observation(0, 0)) == Replicas(3, 2)  # 150 wanted (3, 2)
    assert rule(240.0, Replicas(3, 2), observation(0, 0)) == Replicas(1, 1)


def test_an_autoscaled_pool_grows_under_a_load_its_spec_underestimated(world: ModuleType) -> None:
    # 4,000-token prompts: ~0.3 s each, ~3.4 per second per prefiller; the operator wrote 1.5/s, 6/s come
    spec, _ = steady(world, rate_per_s=1.5, seconds=180, prompt=4000, output=50)
    _, arrivals = steady(world, rate_per_s=6, seconds=180, prompt=4000, output=50)
    thresholds = Thresholds(min_replicas=Replicas(1, 1), max_replicas=Replicas(16, 64), stabilization_window_s=300)
    args = argparse.Namespace(startup=10.0, interval=15)
    scaler = world.coserve_scaler(spec, thresholds, world.engine_profile(world.WORLD))
    run = world.simulate("coserve", spec, arrivals, scaler, args)
    assert set(run.replicas[: world.WARMUP_S]) == {(1, 1)}  # the plan, until the rate window is full
    assert max(p for p, _ in run.replicas) > 1
    missed_per_minute = [sum(run.missed[m * 60 : m * 60 + 60]) for m in range(3)]
    assert missed_per_minute[2] < missed_per_minute[1] / 2  # arrivals once the new prefillers serve
