"""The autoscaling benchmark's simulated world behaves like engines: overload queues, ample replicas serve,
a full KV cache makes requests wait, and decode steps slow down as the batch grows.

No engine starts here: the world is the benchmark's request-level simulation (pure Python, milliseconds).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from coserve.api.parse import parse_pool
from coserve.autoscaling.policy import Replicas

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def world() -> Iterator[ModuleType]:
    """benchmarks/autoscaling.py, imported as it runs (its folder first on sys.path, for ``_harness``)."""
    saved = list(sys.path)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import autoscaling

        yield autoscaling
    finally:
        sys.path[:] = saved


def steady(world: ModuleType, rate_per_s: float, seconds: int, prompt: int = 1000, output: int = 200):  # type: ignore[no-untyped-def]
    """A constant-rate load of identical requests, evenly spaced."""
    count = int(rate_per_s * seconds)
    times = [i / rate_per_s for i in range(count)]
    rows = [world.TraceRow(t, prompt, output) for t in times]
    arrivals = world.Arrivals("steady", times, [prompt] * count, [output] * count, 1.0, 1.0)
    spec = parse_pool(world.pool_spec(rows, 1.0, world.ENGINE)).spec
    return spec, arrivals


def fixed_run(world: ModuleType, spec, arrivals, prefillers: int, decoders: int):  # type: ignore[no-untyped-def]
    args = argparse.Namespace(startup=60.0, interval=15)
    return world.simulate("fixed", spec, arrivals, lambda *_: None, args, fixed=Replicas(prefillers, decoders))


def test_a_pool_too_small_for_the_load_queues_and_misses_the_slo(world: ModuleType) -> None:
    # one prefill of 1,000 tokens takes ~78 ms, so one prefiller serves ~13 requests/s; offer 30
    spec, arrivals = steady(world, rate_per_s=30, seconds=120)
    run = fixed_run(world, spec, arrivals, prefillers=1, decoders=4)
    summary = world.summarize(run)
    early, late = run.ttft_s[:100], run.ttft_s[-100:]
    assert sum(late) / len(late) > 10 * sum(early) / len(early)  # the queue grows
    assert summary["slo_violation_minutes"] == summary["minutes"]
    assert summary["requests_missing_slo_pct"] > 30


def test_ample_replicas_meet_the_slo(world: ModuleType) -> None:
    spec, arrivals = steady(world, rate_per_s=30, seconds=120)
    summary = world.summarize(fixed_run(world, spec, arrivals, prefillers=6, decoders=4))
    assert summary["slo_violation_minutes"] == 0
    assert summary["requests_missing_slo_pct"] == 0
    assert summary["ttft_p99_s"] < 0.5


def test_a_decoder_at_kv_capacity_makes_requests_wait(world: ModuleType) -> None:
    engine = world.Engine(kv_capacity_tokens=3000)
    decoder = world.Decoder(ready_at=0.0)
    first, second = world.Request(0.0, 1000, 1000), world.Request(0.0, 1000, 1000)  # 2,000 KV tokens each
    for request in (first, second):
        request.done, request.first_token_s = request.prompt, 0.0
        decoder.enqueue(request, engine)
    finished: list = []  # type: ignore[type-arg]
    decoder.advance(1.0, engine, finished)
    assert decoder.num_running == 1 and len(decoder.waiting) == 1  # the second does not fit beside the first
    decoder.advance(100.0, engine, finished)
    assert finished == [first, second]
    assert second.finish_s > 1.9 * first.finish_s  # it started when the first one left


def test_decode_steps_slow_down_as_the_batch_grows(world: ModuleType) -> None:
    def tpot(batch: int) -> float:
        decoder = world.Decoder(ready_at=0.0)
        requests = [world.Request(0.0, 2000, 100) for _ in range(batch)]
        for request in requests:
            request.done, request.first_token_s = request.prompt, 0.0
            decoder.enqueue(request, world.ENGINE)
        finished: list = []  # type: ignore[type-arg]
        decoder.advance(1000.0, world.ENGINE, finished)
        assert len(finished) == batch
        return requests[0].finish_s / 99

    assert tpot(128) > 2 * tpot(1)
    assert tpot(1) == pytest.approx(world.ENGINE.k5, rel=0.1)


def test_the_prefiller_batches_a_queue_into_chunked_steps(world: ModuleType) -> None:
    engine = world.ENGINE
    prefiller = world.Prefiller(ready_at=0.0)
    for _ in range(3):
        prefiller.enqueue(world.Request(0.0, 5000, 10))
    out: list = []  # type: ignore[type-arg]
    prefiller.advance(10.0, engine, out)
    assert len(out) == 3
    # 15,000 tokens in chunks of 8,192: two steps, the second finishing both remaining prompts
    assert out[1].first_token_s == out[2].first_token_s > out[0].first_token_s
    assert prefiller.processed_tokens == 15000
