"""What the router adds on loopback: latency at a fixed request rate, and the highest sustained rate.

Processes on this 2-core machine: a fast fake upstream (a minimal ASGI app
answering a fixed completion and keeping a decoder's conversation record, the
engine's own ``ConversationLog``, standing in for an engine so that only the
router is measured), the router under test and this load generator (aiohttp).
The requests are the turns of four-turn chat conversations, in order, each
sent to the next router process in turn, as a Service spreads connections.

Matched: every router arm is ``--replicas`` processes (1 by default; the same
count for coserve and vllm-router), fresh for each arm, on the router core; the
load generator and upstream share the other core, in every arm (in a cluster
the router's pod has its own CPU). ``--shared-cores`` lets all share both.
With two processes, a conversation's turns alternate between them: turn 2
reaches a coserve replica without the pin, which asks the decoder (the lookup
a replica's first sight of a conversation costs). vllm-router's replicas share
nothing: its ``consistent_hash`` needs no shared state, and ``cache_aware``
keeps a prefix tree per process.

Each repetition (``--repetitions``, 3) runs direct, coserve and every
vllm-router configuration once, the order reversed on odd repetitions; the
figures pool the repetitions.

- Latency: an open-loop Poisson stream at ``--rate`` (500/s) for ``--seconds``;
  added latency = router minus direct, at p50 and p99.
- Throughput: closed loop, ``--concurrency`` clients, non-streaming; requests/s.
- CPU per request: the router processes' CPU time (user + system, every
  thread, from /proc) over the latency window, divided by the requests served.
- Intervals: 95 % bootstrap intervals on the two ratios against vllm-router
  (the latencies of the three arms resampled for added p99; one-second CPU
  slices for CPU per request).
- Profile: a last pass samples one coserve router with py-spy at ``--rate``
  and reports its CPU by the library the innermost Python frame is in.

The peer: vLLM's own router (``vllm-router``, Rust, the bench extra pins it)
in front of the same upstream, the same requests (each carries
``x-session-id``, the header its ``consistent_hash`` reads first; coserve
ignores it and names conversations itself). What an operator would tune is
swept: its policy (round_robin, consistent_hash, cache_aware) x its tokio
worker threads (1 and 2: ``TOKIO_WORKER_THREADS``), with ``--log-level
error`` (warning logs three lines per request) and a health check interval
longer than the run; each figure is compared with its best configuration.

The gateway arms: one Envoy (one worker thread) with coserve's endpoint picker
(``coserve epp``), their CPU counted together, in front of the same upstream:
as the operator renders a gateway pool (ext_proc in full duplex, as GAIE's
gateways run it, over TLS to the picker), the same in cleartext (what TLS
costs), and coserve's buffered exchange over TLS (the streamed tokens skip the
picker). Each gateway arm's CPU is also reported by process (picker, Envoy):
Envoy's part alone against the target says whether any picker, however cheap,
could meet it. Beside them, Envoy alone: the same bootstrap less ext_proc,
straight to the upstream (the proxy's own cost). ``--no-gateway`` leaves them out.

Targets: at most 1 ms added at p99 at 500 requests/s; at least 2,000 requests/s
non-streaming; coserve's added p50 at most 2.5x vllm-router's best and its CPU
per request at most 2x vllm-router's best, in one run (the added p99 ratio is
reported); the gateway as rendered against vllm-router's best: CPU per request
at most 1.5x non-streaming and 1.0x streaming 256 tokens (``--stream-tokens
256``, router_overhead_stream.json), added p99 at most 1.5x; streaming, at most
0.5x coserve's router's CPU per request. Writes
benchmarks/results/router_overhead.json.

    .venv/bin/python benchmarks/router_overhead.py                  # ~10 minutes
    .venv/bin/python benchmarks/router_overhead.py --replicas 2     # two processes against two
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from harness.gateway import envoy_alone, gateway
from harness.peers import POLICIES, free_port, launched, vllm_router_command
from harness.results import Table, ratio, show, write_result
from harness.stats import percentile, say
from harness.sweep import best_of

from coserve.api.spec.gateway import GatewaySpec
from coserve.engine.conversations import ConversationLog

ANSWER = json.dumps(
    {
        "id": "x",
        "object": "text_completion",
        "choices": [{"index": 0, "text": "ok"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1},
    }
).encode()
METRICS = b'vllm:kv_cache_usage_perc{engine="0"} 0.1\nvllm:num_requests_waiting{engine="0"} 0\n'
TURNS = 4
SESSION_HEADER = "x-session-id"  # the first header vllm-router's consistent_hash reads; coserve ignores it
PEER_THREADS = (1, 2)  # TOKIO_WORKER_THREADS; vllm-router's default is one per core it may use
PEER_P50_RATIO = 2.5  # coserve's added p50 at most this times vllm-router's best
PEER_CPU_RATIO = 2.0  # coserve's CPU per request at most this times vllm-router's best
NOTES: list[str] = []  # why a target is missed, and what would close it (set after a run)
STREAM_TOKENS = 0  # --stream-tokens: the upstream streams this many tokens to a request that asks to stream
EVENTS_PER_WRITE = 16  # the upstream's SSE events per write (an engine's output reaches the socket in bursts)
TOKEN_EVENT = b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"tok"}}]}\n\n'
USAGE_EVENT = b'data: {"id":"x","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":3,' + (
    b'"completion_tokens":256}}\n\n'
)
# the gateway arms: Envoy + coserve's endpoint picker, as (ext_proc body mode, TLS to the picker)
RENDERED_TLS: bool = GatewaySpec.model_fields["secure_serving"].default  # what the operator renders by default
GATEWAY = "gateway"  # as the operator renders a gateway pool: full duplex (as GAIE's gateways run it), TLS
GATEWAY_CLEARTEXT = "gateway-cleartext"  # the same without TLS: what TLS to the picker costs
GATEWAY_BUFFERED = "gateway-buffered"  # coserve's buffered exchange (the tokens skip the picker), as rendered
GATEWAY_MODES = {GATEWAY: ("full-duplex", RENDERED_TLS), GATEWAY_CLEARTEXT: ("full-duplex", False),
                 GATEWAY_BUFFERED: ("buffered", RENDERED_TLS)}  # fmt: skip
ENVOY_ALONE = "envoy-alone"  # the same Envoy less ext_proc, straight to the upstream: the proxy before any picker
GATEWAY_CPU_RATIO = {False: 1.5, True: 1.0}  # Envoy + picker CPU per request against vllm-router's (by streaming)
GATEWAY_P99_RATIO = 1.5
GATEWAY_OVER_ROUTER_STREAMING = 0.5  # Envoy + picker CPU per request against coserve's router, streaming
CONVERSATIONS = ConversationLog()  # the fake decoder's record of the conversations it served


async def upstream_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A minimal engine: the fixed answer to any POST, a KV usage on /metrics, 200 on /health, and the
    decoder's answer to the routers' conversation lookups (the same ConversationLog the engine plugin keeps)."""
    if scope["type"] != "http":
        return
    raw = b""
    while True:
        message = await receive()
        raw += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/metrics":
        body = METRICS
    elif scope["path"] == "/health":  # vLLM's liveness route: vllm-router's worker health checks
        body = b""
    elif scope["path"] == "/coserve/v1/conversations:lookup":
        body = json.dumps({"found": CONVERSATIONS.lookup(json.loads(raw)["ids"], time.monotonic())}).encode()
    else:
        for key, value in scope["headers"]:
            if key == b"x-coserve-conversation":
                CONVERSATIONS.record(value.decode(), time.monotonic())
        if STREAM_TOKENS and b'"stream":true' in raw.replace(b" ", b""):
            await stream_answer(send, b"include_usage" in raw)
            return
        body = ANSWER
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


async def stream_answer(send: Any, usage: bool) -> None:
    """``STREAM_TOKENS`` tokens as vLLM streams them (one SSE event each), written ``EVENTS_PER_WRITE`` at a time,
    then the usage event when asked for and ``[DONE]``."""
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for start in range(0, STREAM_TOKENS, EVENTS_PER_WRITE):
        chunk = TOKEN_EVENT * min(EVENTS_PER_WRITE, STREAM_TOKENS - start)
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    tail = (USAGE_EVENT if usage else b"") + b"data: [DONE]\n\n"
    await send({"type": "http.response.body", "body": tail})


async def wait_ready(session: aiohttp.ClientSession, url: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            async with session.get(url) as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def turn(index: int) -> dict[str, Any]:
    """Request ``index``: turn ``index % TURNS + 1`` of conversation ``index // TURNS``, with its history."""
    conversation, number = divmod(index, TURNS)
    messages = [{"role": "user", "content": f"conversation {conversation}: task"}]
    for step in range(number):
        messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": f"step {step}"}]
    if STREAM_TOKENS:
        return {"model": "tiny", "messages": messages, "max_tokens": STREAM_TOKENS, "stream": True}
    return {"model": "tiny", "messages": messages, "max_tokens": 1}


async def one(session: aiohttp.ClientSession, bases: list[str], index: int) -> float:
    base = bases[index % len(bases)]  # the next replica in turn: a conversation's turns alternate replicas
    headers = {SESSION_HEADER: f"conversation-{index // TURNS}"}
    started = time.perf_counter()
    async with session.post(f"{base}/v1/chat/completions", json=turn(index), headers=headers) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}")
    return time.perf_counter() - started


async def open_loop(base: list[str], rate: float, seconds: float, seed: int, first: int = 0) -> list[float]:
    return (await timed_open_loop(base, rate, seconds, seed, first)).latencies


async def timed_open_loop(
    base: list[str], rate: float, seconds: float, seed: int, first: int = 0, pids: tuple[int, ...] = ()
) -> Arm:
    """A Poisson stream at ``rate`` for ``seconds`` (after a warm-up): its latencies, and the CPU seconds the
    processes ``pids`` spent from its first request until its last answer, in total and second by second (with
    the requests answered in each second: the samples the CPU ratio's interval is drawn from)."""
    rng = random.Random(seed)
    answered = 0

    async def counted(index: int) -> float:
        nonlocal answered
        latency = await one(session, base, index)
        answered += 1
        return latency

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for index in range(10**7 + first, 10**7 + first + 50):  # warm up connections (conversations of their own)
            await one(session, base, index)
        slices: list[tuple[float, int]] = []

        async def sample() -> None:
            last_cpu, last_answered = sum(cpu_seconds(pid) for pid in pids), answered
            while True:
                await asyncio.sleep(1.0)
                cpu = sum(cpu_seconds(pid) for pid in pids)
                slices.append((cpu - last_cpu, answered - last_answered))
                last_cpu, last_answered = cpu, answered

        tasks = []
        before = [cpu_seconds(pid) for pid in pids]
        sampler = asyncio.create_task(sample()) if pids else None
        start = time.perf_counter()
        at = 0.0
        index = first
        while at < seconds:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(counted(index)))
            index += 1
            at += rng.expovariate(rate)
        latencies = list(await asyncio.gather(*tasks))
        by_process = [cpu_seconds(pid) - cpu for pid, cpu in zip(pids, before, strict=True)]
        if sampler is not None:
            sampler.cancel()
    return Arm(latencies, sum(by_process), 0.0, [(c, n) for c, n in slices if n > 0], cpu_by_process=by_process)


async def closed_loop(base: list[str], concurrency: int, seconds: float) -> float:
    done = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        stop = time.perf_counter() + seconds

        async def client(worker: int) -> None:
            nonlocal done
            index = (10**8 + worker * 1_000_000) * TURNS  # each worker walks its own conversations
            while time.perf_counter() < stop:
                await one(session, base, index)
                index += 1
                done += 1

        started = time.perf_counter()
        await asyncio.gather(*(client(w) for w in range(concurrency)))
        return done / (time.perf_counter() - started)


async def measure_arm(args: argparse.Namespace, ready: list[str], bases: list[str], pids: tuple[int, ...]) -> Arm:
    """One arm (``bases``: the processes ``pids`` serve them; none: direct): latency and CPU at ``--rate``,
    then the closed loop's requests/s."""
    async with aiohttp.ClientSession() as session:
        for url in ready:
            await wait_ready(session, url)
    arm = await timed_open_loop(bases, args.rate, args.seconds, 1, pids=pids)
    arm.requests_per_s = await closed_loop(bases, args.concurrency, args.seconds)
    return arm


@dataclass
class Arm:
    """One arm's measurements: one repetition's, or several pooled (``pooled``)."""

    latencies: list[float]
    cpu_s: float  # the arm's router processes' CPU seconds over the latency window
    requests_per_s: float
    slices: list[tuple[float, int]] = field(default_factory=list)  # (CPU seconds, requests answered) per second
    repetitions: list[float] = field(default_factory=list)  # pooled: each repetition's requests/s
    cpu_by_process: list[float] = field(default_factory=list)  # cpu_s by process, in the order of the arm's pids

    def figures(self, direct: Arm) -> dict[str, float]:
        p50, p99 = percentile(self.latencies, 50), percentile(self.latencies, 99)
        return {
            "p50_s": p50,
            "p99_s": p99,
            "added_p50_s": p50 - percentile(direct.latencies, 50),
            "added_p99_s": p99 - percentile(direct.latencies, 99),
            "requests_per_s": self.requests_per_s,
            "cpu_s_per_request": self.cpu_s / len(self.latencies),
            "samples": len(self.latencies),
        }


def pooled(arms: list[Arm]) -> Arm:
    """The repetitions of one arm as one sample: latencies and CPU slices together, requests/s their median."""
    rates = [arm.requests_per_s for arm in arms]
    by_process = [sum(cpu) for cpu in zip(*(arm.cpu_by_process for arm in arms), strict=True)]
    return Arm([x for arm in arms for x in arm.latencies], sum(arm.cpu_s for arm in arms), statistics.median(rates),
               [x for arm in arms for x in arm.slices], rates, by_process)  # fmt: skip


def intervals(ours: Arm, theirs: Arm, direct: Arm, resamples: int = 2000, seed: int = 7) -> dict[str, list[float]]:
    """95 % bootstrap intervals of the two ratios: added p99 (latencies of all three arms resampled) and CPU per
    request (the arms' one-second CPU slices resampled). An interval is unbounded above when the peer's added
    p99 is not positive in more than 2.5 % of the resamples."""
    rng = np.random.default_rng(seed)
    lat = {name: np.asarray(arm.latencies) for name, arm in (("o", ours), ("t", theirs), ("d", direct))}
    p99 = {name: np.percentile(rng.choice(v, (resamples, len(v))), 99, axis=1) for name, v in lat.items()}
    added_o, added_t = p99["o"] - p99["d"], p99["t"] - p99["d"]
    safe = np.where(added_t > 0, added_t, np.nan)
    latency = np.where(added_t > 0, added_o / safe, np.inf)
    out = {"added_p99_ratio_ci95": [float(np.percentile(latency, 2.5)), float(np.percentile(latency, 97.5))]}
    if ours.slices and theirs.slices:
        cpu_o, cpu_t = np.asarray(ours.slices, dtype=float), np.asarray(theirs.slices, dtype=float)
        pick_o = rng.integers(0, len(cpu_o), (resamples, len(cpu_o)))
        pick_t = rng.integers(0, len(cpu_t), (resamples, len(cpu_t)))
        per_o = cpu_o[pick_o, 0].sum(axis=1) / cpu_o[pick_o, 1].sum(axis=1)
        per_t = cpu_t[pick_t, 0].sum(axis=1) / cpu_t[pick_t, 1].sum(axis=1)
        ratios = per_o / per_t
        out["cpu_per_request_ratio_ci95"] = [float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))]
    return out


def peer_comparison(ours: dict[str, float], sweep: list[dict[str, Any]]) -> dict[str, Any]:
    """coserve against vllm-router's best configuration for each figure: the ratios and the two targets (no
    ratio when vllm-router's figure is not positive: an added latency within the noise of direct)."""
    best = {
        "added_p50_s": best_of(sweep, "added_p50_s"),
        "added_p99_s": best_of(sweep, "added_p99_s"),
        "cpu_s_per_request": best_of(sweep, "cpu_s_per_request"),
        "requests_per_s": best_of(sweep, "requests_per_s", highest=True),
    }
    p50 = ratio(ours["added_p50_s"], best["added_p50_s"]["added_p50_s"])
    p99 = ratio(ours["added_p99_s"], best["added_p99_s"]["added_p99_s"])
    cpu = ratio(ours["cpu_s_per_request"], best["cpu_s_per_request"]["cpu_s_per_request"])
    return {
        "added_p50_ratio": p50,
        "added_p99_ratio": p99,  # reported: at 500 requests/s on a shared machine, p99 is the noise's
        "cpu_per_request_ratio": cpu,
        "requests_per_s_ratio": ratio(ours["requests_per_s"], best["requests_per_s"]["requests_per_s"]),
        "added_p50_met": p50 is not None and p50 <= PEER_P50_RATIO,
        "cpu_met": cpu is not None and cpu <= PEER_CPU_RATIO,
        "best": {
            key: {"policy": row["policy"], "worker_threads": row["worker_threads"], key: row[key]}
            for key, row in best.items()
        },
    }


async def preload(base: list[str], first: int, count: int, concurrency: int = 64) -> None:
    """``count`` new conversations (turn 1 each, so each leaves a pin), as fast as the router takes them."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        queue = iter(range(first, first + count))

        async def client() -> None:
            for index in queue:
                await one(session, base, index)

        await asyncio.gather(*(client() for _ in range(concurrency)))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure_pins(args: argparse.Namespace, upstream: str, router: str, router_pid: int) -> dict[str, Any]:
    """Idle CPU and added latency with 1k, 10k and 100k live pins in one router (each turn a new conversation)."""
    async with aiohttp.ClientSession() as session:
        await wait_ready(session, f"{upstream}/metrics")
        await wait_ready(session, f"{router}/ready")
    rates = (100.0, 500.0)
    direct = {rate: await open_loop([upstream], rate, args.seconds, 1, first=5 * 10**8) for rate in rates}
    rows, pinned, fresh = [], 0, 10**6
    for level in args.pins:
        say(f"pins: filling the router to {level} live conversations")
        await preload([router], fresh, level - pinned)
        fresh, pinned = fresh + level - pinned, level
        await asyncio.sleep(2)  # let a poll run with the full table
        before, started = cpu_seconds(router_pid), time.perf_counter()
        await asyncio.sleep(args.seconds)
        idle = (cpu_seconds(router_pid) - before) / (time.perf_counter() - started)
        row: dict[str, Any] = {"pins": level, "idle_cpu_s_per_s": idle}
        for rate in rates:
            routed = await open_loop([router], rate, args.seconds, 1, first=fresh)
            fresh += len(routed) + 50
            row[f"added_p50_s_at_{rate:.0f}"] = percentile(routed, 50) - percentile(direct[rate], 50)
            row[f"added_p99_s_at_{rate:.0f}"] = percentile(routed, 99) - percentile(direct[rate], 99)
            row[f"samples_at_{rate:.0f}"] = len(routed)
        rows.append(row)
        added = row["added_p99_s_at_500"] * 1000
        say(f"pins {level}: idle CPU {idle * 1000:.1f} ms/s; added p99 {added:.2f} ms at 500/s")
    return {"rows": rows, "direct_p99_s": {str(r): percentile(v, 99) for r, v in direct.items()}}


def write_pins(measured: dict[str, Any], args: argparse.Namespace) -> None:
    rows = measured["rows"]
    added = [(f"{q}+ @{rate}", 11) for rate in (100, 500) for q in ("p50", "p99")]
    table = Table(f"{'live pins':>10}", [("idle CPU ms/s", 15), *added], label_width=10)
    for row in rows:
        added = [row[f"added_{q}_s_at_{rate}"] * 1000 for rate in (100, 500) for q in ("p50", "p99")]
        table.row(f"{row['pins']:>10}", show(row["idle_cpu_s_per_s"] * 1000, "{:.1f}"), *added)
    low, high = rows[0], rows[-1]
    routed_p99 = {r: high[f"added_p99_s_at_{r}"] + measured["direct_p99_s"][f"{r}.0"] for r in ("100", "500")}
    base_p99 = {r: low[f"added_p99_s_at_{r}"] + measured["direct_p99_s"][f"{r}.0"] for r in ("100", "500")}
    ratio = {r: routed_p99[r] / base_p99[r] for r in routed_p99}
    path = write_result(
        "router_pins",
        {
            "benchmark": "router_pins",
            "target": f"router p99 at {high['pins']} live pins within 1.2x of its p99 at {low['pins']}, "
            "at 100 and 500 requests/s",
            "met": all(value <= 1.2 for value in ratio.values()),
            "p99_ratio_most_over_fewest_pins": ratio,
            "rows": rows,
            "baseline": {
                "name": "the same router at the fewest pins; direct to the upstream for added latency",
                "direct_p99_s": measured["direct_p99_s"],
            },
            "setup": {"seconds": args.seconds, "replicas": 1, "router_core": "its own", "workload": "new chats"},
        },
    )
    say(f"wrote {path}")


def coserve_command(config: Path, port: int) -> list[str]:
    coserve = str(Path(sys.executable).with_name("coserve"))
    return [coserve, "router", "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning"]  # fmt: skip


def peer_command(upstream: str, port: int, policy: str) -> list[str]:
    """vllm-router in front of ``upstream`` (no per-request logs), with no health check during the run (the
    first is an hour away)."""
    return vllm_router_command(port, policy, [upstream], "--health-check-interval-secs", "3600")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--repetitions", type=int, default=3, help="repetitions of every arm (default 3)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="processes per router, the same for coserve and vllm-router (default 1)")  # fmt: skip
    parser.add_argument("--turns", type=int, default=TURNS, help=f"turns per conversation (default {TURNS})")
    parser.add_argument(
        "--pins", type=int, nargs="+", help="instead: idle CPU and added latency at these live pin counts (one replica)"
    )
    parser.add_argument(
        "--shared-cores",
        action="store_true",
        help="let the three processes share every core (default: the router on its own core)",
    )
    parser.add_argument("--peer-policies", nargs="*", default=list(POLICIES), help="vllm-router policies swept")
    parser.add_argument("--peer-threads", type=int, nargs="*", default=list(PEER_THREADS),
                        help="vllm-router tokio worker thread counts swept")  # fmt: skip
    parser.add_argument("--profile-seconds", type=float, default=8.0,
                        help="then profile coserve's router with py-spy this long at --rate (0: none)")  # fmt: skip
    parser.add_argument("--stream-tokens", type=int, default=0,
                        help="tokens streamed per request (0: non-streaming; the targets name 256)")  # fmt: skip
    parser.add_argument("--no-gateway", action="store_true", help="leave out the Envoy + endpoint picker arms")
    parser.add_argument("--serve-upstream", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pins:
        args.replicas, args.turns = 1, 1
    globals()["TURNS"] = args.turns
    globals()["STREAM_TOKENS"] = args.stream_tokens
    cores = sorted(os.sched_getaffinity(0))
    pinned = not args.shared_cores and len(cores) >= 2
    client_cores, router_cores = ({cores[0]}, set(cores[1:])) if pinned else (set(cores), set(cores))
    if args.serve_upstream:
        import uvicorn

        uvicorn.run(upstream_app, host="127.0.0.1", port=args.serve_upstream, log_level="error", access_log=False)
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="coserve-router-bench-"))
    up_port = free_port()
    upstream = f"http://127.0.0.1:{up_port}"
    config = workdir / "router.json"
    config.write_text(json.dumps({"model": "tiny", "decoders": [upstream], "pollS": 1.0, "maxPins": 200_000}))
    os.sched_setaffinity(0, client_cores)
    bench = Bench(args, upstream, config, router_cores, workdir)
    upstream_command = [sys.executable, __file__, "--serve-upstream", str(up_port), "--stream-tokens",
                        str(args.stream_tokens)]  # fmt: skip
    with launched(upstream_command, client_cores):
        if args.pins:
            port = free_port()
            with launched(coserve_command(config, port), router_cores) as process:
                write_pins(asyncio.run(measure_pins(args, upstream, f"http://127.0.0.1:{port}", process.pid)), args)
            return 0
        runs = [bench.repetition(number) for number in range(args.repetitions)]
        profile = bench.profile(workdir) if args.profile_seconds > 0 else None
    report(args, runs, bench.peers, profile, cores, router_cores, client_cores, pinned)
    return 0


COSERVE = "coserve"


@dataclass
class Bench:
    """The arms, each run as fresh processes on the router cores in front of the one upstream."""

    args: argparse.Namespace
    upstream: str
    config: Path
    router_cores: set[int]
    workdir: Path

    @property
    def peers(self) -> list[tuple[str, int]]:
        return [(policy, threads) for policy in self.args.peer_policies for threads in self.args.peer_threads]

    def repetition(self, number: int) -> dict[Any, Arm]:
        """Every arm once: direct, then coserve and each vllm-router configuration (in reverse order on odd
        repetitions, so a drift of the machine does not fall on one side)."""
        args = self.args
        say(f"repetition {number + 1}/{args.repetitions}: {args.rate:.0f} requests/s for {args.seconds:.0f} s, then "
            f"{args.concurrency} clients for {args.seconds:.0f} s, per arm")  # fmt: skip
        arms: dict[Any, Arm] = {"direct": asyncio.run(measure_arm(args, [f"{self.upstream}/metrics"], [self.upstream],
                                                                  ()))}  # fmt: skip
        order: list[Any] = [COSERVE, *([] if args.no_gateway else [*GATEWAY_MODES, ENVOY_ALONE]), *self.peers]
        for arm in order if number % 2 == 0 else order[::-1]:
            if arm == COSERVE:
                arms[arm] = self.coserve()
            elif arm == ENVOY_ALONE:
                arms[arm] = self.envoy_alone()
            else:
                arms[arm] = self.gateway(arm) if arm in GATEWAY_MODES else self.peer(*arm)
        return arms

    def gateway(self, arm: str) -> Arm:
        """Envoy (one worker thread) with coserve's endpoint picker: one proxy and one picker, their CPU summed."""
        mode, secure = GATEWAY_MODES[arm]
        say(f"Envoy + coserve's endpoint picker (one of each), ext_proc {mode}{' over TLS' if secure else ''}")
        with gateway(self.config, self.workdir, self.router_cores, body_mode=mode, secure=secure) as (  # type: ignore[arg-type]
            url, ready, pids,
        ):  # fmt: skip
            return asyncio.run(measure_arm(self.args, ready, [url], pids))

    def envoy_alone(self) -> Arm:
        """The gateway's Envoy less ext_proc, straight to the upstream: what the proxy costs before any picker."""
        say("Envoy alone (one worker thread, no endpoint picker), straight to the upstream")
        with envoy_alone(self.upstream, self.workdir, self.router_cores) as (url, ready, pid):
            return asyncio.run(measure_arm(self.args, ready, [url], (pid,)))

    def coserve(self) -> Arm:
        say(f"coserve ({self.args.replicas} process(es))")
        ports = [free_port() for _ in range(self.args.replicas)]
        with contextlib.ExitStack() as stack:
            processes = [stack.enter_context(launched(coserve_command(self.config, p), self.router_cores))
                         for p in ports]  # fmt: skip
            bases = [f"http://127.0.0.1:{port}" for port in ports]
            return asyncio.run(measure_arm(self.args, [f"{b}/ready" for b in bases], bases,
                                           tuple(p.pid for p in processes)))  # fmt: skip

    def peer(self, policy: str, threads: int) -> Arm:
        say(f"vllm-router ({self.args.replicas} process(es)), {policy}, {threads} worker thread(s)")
        ports = [free_port() for _ in range(self.args.replicas)]
        env = {"TOKIO_WORKER_THREADS": str(threads)}
        with contextlib.ExitStack() as stack:
            processes = [stack.enter_context(launched(peer_command(self.upstream, p, policy), self.router_cores, env,
                                                      quiet=True)) for p in ports]  # fmt: skip
            bases = [f"http://127.0.0.1:{port}" for port in ports]
            return asyncio.run(measure_arm(self.args, [f"{b}/readiness" for b in bases], bases,
                                           tuple(p.pid for p in processes)))  # fmt: skip

    def profile(self, workdir: Path) -> dict[str, float]:
        """Where one coserve router process's CPU goes at ``--rate``: py-spy's samples, by the library the
        innermost Python frame is in (a separate pass: the sampler is not in the measured arms)."""
        say(f"profiling coserve's router at {self.args.rate:.0f} requests/s for {self.args.profile_seconds:.0f} s")
        port = free_port()
        out = workdir / "profile.txt"
        base = f"http://127.0.0.1:{port}"
        with launched(coserve_command(self.config, port), self.router_cores) as process:
            spy = [str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(process.pid), "--rate", "250",
                   "--duration", f"{self.args.profile_seconds:.0f}", "--format", "raw", "--output", str(out),
                   "--nonblocking"]  # fmt: skip

            async def load() -> None:
                async with aiohttp.ClientSession() as session:
                    await wait_ready(session, f"{base}/ready")
                await timed_open_loop([base], self.args.rate, 1.0, 2, first=7 * 10**8)  # warm
                with launched(spy, quiet=True) as sampler:
                    await timed_open_loop([base], self.args.rate, self.args.profile_seconds + 1, 3, first=8 * 10**8)
                    while sampler.poll() is None:
                        await asyncio.sleep(0.1)

            asyncio.run(load())
        return attribute(out.read_text())


# (where a frame's file is, the name its CPU is reported under); the first match wins
PLACES = (
    ("httptools", "HTTP server (uvicorn, httptools)"),
    ("uvicorn", "HTTP server (uvicorn, httptools)"),
    ("starlette", "ASGI framework (starlette)"),
    ("aiohttp", "HTTP client to the engines (aiohttp)"),
    ("multidict", "HTTP client to the engines (aiohttp)"),
    ("yarl", "HTTP client to the engines (aiohttp)"),
    ("prometheus_client", "metrics (prometheus_client)"),
    ("coserve/router/fastjson", "JSON (orjson)"),
    ("orjson", "JSON (orjson)"),
    ("json/", "JSON (orjson)"),
    ("coserve/", "coserve's routing (admission, placement, pins, forwarding)"),
    ("asyncio", "event loop (asyncio, uvloop)"),
    ("uvloop", "event loop (asyncio, uvloop)"),
)


def attribute(raw: str) -> dict[str, float]:
    """py-spy's raw (collapsed) stacks as shares of the samples, by where the innermost frame is (``PLACES``)."""
    counts: dict[str, int] = {}
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        leaf = stack.rsplit(";", 1)[-1]
        place = next((name for part, name in PLACES if part in leaf), "other (standard library, interpreter)")
        counts[place] = counts.get(place, 0) + int(count)
    total = sum(counts.values()) or 1
    return {place: count / total for place, count in sorted(counts.items(), key=lambda item: -item[1])}


def label(arm: Any) -> str:
    if arm == ENVOY_ALONE:
        return "Envoy alone (no picker)"
    if arm in GATEWAY_MODES:
        mode, secure = GATEWAY_MODES[arm]
        return f"Envoy + coserve picker, {mode}{', TLS' if secure else ''}"
    return arm if isinstance(arm, str) else f"vllm-router {arm[0]}, {arm[1]} thr"


def gateway_comparison(
    arms: dict[Any, Arm], sweep: list[dict[str, Any]], streaming: bool, arm: str = GATEWAY
) -> dict[str, Any]:
    """Envoy + coserve's endpoint picker (their CPU together, ext_proc in ``arm``'s body mode) against vllm-router's
    best configuration for each figure, and against coserve's own router: ratios, 95 % bootstrap intervals and the
    targets."""
    direct = arms["direct"]
    ours = {"body_mode": GATEWAY_MODES[arm][0], "picker_tls": GATEWAY_MODES[arm][1], **arms[arm].figures(direct)}
    served = len(arms[arm].latencies)
    ours["picker_cpu_s_per_request"], ours["envoy_cpu_s_per_request"] = (c / served for c in arms[arm].cpu_by_process)
    best_cpu = best_of(sweep, "cpu_s_per_request")
    best_p99 = best_of(sweep, "added_p99_s")
    key = {
        "cpu": (best_cpu["policy"], best_cpu["worker_threads"]),
        "p99": (best_p99["policy"], best_p99["worker_threads"]),
    }
    cpu = ratio(ours["cpu_s_per_request"], best_cpu["cpu_s_per_request"])
    p99 = ratio(ours["added_p99_s"], best_p99["added_p99_s"])
    router = arms[COSERVE].figures(direct)
    over_router = ratio(ours["cpu_s_per_request"], router["cpu_s_per_request"])
    cpu_target = GATEWAY_CPU_RATIO[streaming]
    envoy_share = ratio(ours["envoy_cpu_s_per_request"], best_cpu["cpu_s_per_request"])
    out: dict[str, Any] = {
        "figures": ours,
        "cpu_per_request_ratio": cpu,
        # Envoy's part of the exchange alone against vllm-router's best: over the target, no picker meets it
        "envoy_cpu_ratio": envoy_share,
        "cpu_target_within_reach": envoy_share is not None and envoy_share <= cpu_target,
        "cpu_per_request_ratio_ci95": intervals(arms[arm], arms[key["cpu"]], direct).get("cpu_per_request_ratio_ci95"),
        "cpu_target": cpu_target,
        "cpu_met": cpu is not None and cpu <= cpu_target,
        "added_p99_ratio": p99,
        "added_p99_ratio_ci95": intervals(arms[arm], arms[key["p99"]], direct)["added_p99_ratio_ci95"],
        "added_p99_target": GATEWAY_P99_RATIO,
        "added_p99_met": p99 is not None and p99 <= GATEWAY_P99_RATIO,
        "cpu_over_coserve_router": over_router,
        "cpu_over_coserve_router_ci95": intervals(arms[arm], arms[COSERVE], direct).get("cpu_per_request_ratio_ci95"),
        "best": {"cpu": list(key["cpu"]), "added_p99": list(key["p99"])},
    }
    if streaming:
        out["cpu_over_coserve_router_target"] = GATEWAY_OVER_ROUTER_STREAMING
        out["cpu_over_coserve_router_met"] = over_router is not None and over_router <= GATEWAY_OVER_ROUTER_STREAMING
    out["met"] = out["cpu_met"] and out["added_p99_met"] and out.get("cpu_over_coserve_router_met", True)
    return out


def envoy_alone_comparison(arms: dict[Any, Arm], sweep: list[dict[str, Any]]) -> dict[str, Any]:
    """The gateway's Envoy less ext_proc against vllm-router's best CPU per request: the proxy's own cost."""
    direct = arms["direct"]
    figures = arms[ENVOY_ALONE].figures(direct)
    best = best_of(sweep, "cpu_s_per_request")
    peer = arms[(best["policy"], best["worker_threads"])]
    return {
        "figures": figures,
        "cpu_per_request_ratio": ratio(figures["cpu_s_per_request"], best["cpu_s_per_request"]),
        "cpu_per_request_ratio_ci95": intervals(arms[ENVOY_ALONE], peer, direct).get("cpu_per_request_ratio_ci95"),
        "best": [best["policy"], best["worker_threads"]],
    }


def report(
    args: argparse.Namespace, runs: list[dict[Any, Arm]], peers: list[tuple[str, int]],
    profile: dict[str, float] | None, cores: list[int], router_cores: set[int], client_cores: set[int], pinned: bool,
) -> None:  # fmt: skip
    arms = {key: pooled([run[key] for run in runs]) for key in runs[0]}
    direct = arms["direct"]
    d50, d99 = percentile(direct.latencies, 50), percentile(direct.latencies, 99)
    ours = arms[COSERVE].figures(direct)
    sweep = [{"policy": p, "worker_threads": t, **arms[(p, t)].figures(direct)} for p, t in peers]
    latency_met = ours["added_p99_s"] <= 0.001
    throughput_met = ours["requests_per_s"] >= 2000
    peer = peer_comparison(ours, sweep) if sweep else None
    if peer is not None:
        best = {key: (row["policy"], row["worker_threads"]) for key, row in peer["best"].items()}
        peer["added_p99_ratio_ci95"] = intervals(arms[COSERVE], arms[best["added_p99_s"]], direct)[
            "added_p99_ratio_ci95"]  # fmt: skip
        peer["cpu_per_request_ratio_ci95"] = intervals(arms[COSERVE], arms[best["cpu_s_per_request"]], direct).get(
            "cpu_per_request_ratio_ci95")  # fmt: skip
    table = Table("", [("p50 ms", 9), ("p99 ms", 9), ("+p50 ms", 9), ("+p99 ms", 9), ("req/s", 8),
                       ("CPU ms/req", 12)], label_width=34, fmt="{:.3f}")  # fmt: skip
    table.row(f"direct (x{args.repetitions})", d50 * 1000, d99 * 1000, "", "", show(direct.requests_per_s, "{:.0f}"))
    streaming = args.stream_tokens > 0
    gates = {arm: gateway_comparison(arms, sweep, streaming, arm) for arm in GATEWAY_MODES if arm in arms and sweep}
    gate = gates.get(GATEWAY)  # judged as the operator renders it; cleartext and buffered are reported beside it
    alone = envoy_alone_comparison(arms, sweep) if ENVOY_ALONE in arms and sweep else None
    gated = [(label(arm), found["figures"]) for arm, found in gates.items()]
    gated += [(label(ENVOY_ALONE), alone["figures"])] if alone else []
    for name, row in [(f"coserve ({args.replicas} proc)", ours), *gated] + [
            (label((r["policy"], r["worker_threads"])), r) for r in sweep]:  # fmt: skip
        latencies = [row[k] * 1000 for k in ("p50_s", "p99_s", "added_p50_s", "added_p99_s")]
        table.row(name, *latencies, show(row["requests_per_s"], "{:.0f}"), row["cpu_s_per_request"] * 1000)
    repetitions = [{label(key): arm.figures(run["direct"]) for key, arm in run.items() if key != "direct"}
                   for run in runs]  # fmt: skip
    print(f"target: <= 1 ms added at p99 {'met' if latency_met else 'NOT met'}; "
          f">= 2000 requests/s {'met' if throughput_met else 'NOT met'}")  # fmt: skip
    if peer is not None:
        p99, cpu, rps = (show(peer[k]) for k in ("added_p99_ratio", "cpu_per_request_ratio", "requests_per_s_ratio"))
        keys = ("added_p99_ratio_ci95", "cpu_per_request_ratio_ci95")
        p99_ci, cpu_ci = (peer[k] or [math.nan, math.nan] for k in keys)
        print(f"vs vllm-router's best: added p50 {show(peer['added_p50_ratio'])}x (target <= {PEER_P50_RATIO}x: "
              f"{'met' if peer['added_p50_met'] else 'NOT met'}); added p99 {p99}x [{show(p99_ci[0])}, "
              f"{show(p99_ci[1])}]; CPU per request {cpu}x "
              f"[{show(cpu_ci[0])}, {show(cpu_ci[1])}] (target <= {PEER_CPU_RATIO}x: "
              f"{'met' if peer['cpu_met'] else 'NOT met'}); requests/s {rps}x")  # fmt: skip
    if profile:
        print("where coserve's router CPU goes (py-spy, innermost Python frame):")
        for place, share in profile.items():
            print(f"  {share:6.1%}  {place}")
    for arm, found in gates.items():
        print(f"{label(arm)} vs vllm-router's best: CPU per request {show(found['cpu_per_request_ratio'])}x "
              f"(target <= {found['cpu_target']}x), added p99 {show(found['added_p99_ratio'])}x (target <= "
              f"{GATEWAY_P99_RATIO}x); vs coserve's router: CPU per request {show(found['cpu_over_coserve_router'])}x; "
              f"{'met' if found['met'] else 'NOT met'}; Envoy's part alone "
              f"{show(found['figures']['envoy_cpu_s_per_request'] * 1000, '{:.3f}')} ms, "
              f"{show(found['envoy_cpu_ratio'])}x")  # fmt: skip
    if alone is not None:
        print(f"{label(ENVOY_ALONE)} vs vllm-router's best: CPU per request {show(alone['cpu_per_request_ratio'])}x")
    met = latency_met and throughput_met and (peer is None or (peer["added_p50_met"] and peer["cpu_met"]))
    met = met and (gate is None or gate["met"])
    if streaming:  # the router's own targets are set for non-streaming requests: a streaming run judges the gateway's
        met = gate is not None and gate["met"]
    name = "router_overhead_stream" if streaming else "router_overhead"
    write_result(
        name,
        {
            "benchmark": name,
            "target": (
                "<= 1 ms added latency at p99 at 500 requests/s; >= 2,000 requests/s non-streaming; against "
                f"vllm-router's best configuration, matched (the same number of processes on the same core): "
                f"added p50 <= {PEER_P50_RATIO}x, CPU per request <= {PEER_CPU_RATIO}x; Envoy + coserve's endpoint "
                f"picker (their CPU together) against vllm-router's best: CPU per request <= "
                f"{GATEWAY_CPU_RATIO[False]}x non-streaming and <= {GATEWAY_CPU_RATIO[True]}x streaming 256 tokens, "
                f"added p99 <= {GATEWAY_P99_RATIO}x; streaming, <= {GATEWAY_OVER_ROUTER_STREAMING}x coserve's "
                "router's CPU per request"
            ),
            "met": bool(met),
            "latency_met": bool(latency_met),
            "throughput_met": bool(throughput_met),
            "vs_vllm_router_p50_met": None if peer is None else peer["added_p50_met"],
            "vs_vllm_router_cpu_met": None if peer is None else peer["cpu_met"],
            "added_p50_s": ours["added_p50_s"],
            "added_p99_s": ours["added_p99_s"],
            "router": ours,
            "vs_vllm_router": peer,
            "gateway": gate,
            "gateway_cleartext": gates.get(GATEWAY_CLEARTEXT),
            "gateway_buffered": gates.get(GATEWAY_BUFFERED),
            "envoy_alone": alone,
            "stream_tokens": args.stream_tokens,
            "cpu_profile": profile,
            "repetitions": repetitions,
            "baseline": {
                "name": "direct to the upstream",
                "p50_s": d50,
                "p99_s": d99,
                "requests_per_s": direct.requests_per_s,
            },
            "vllm_router": {
                "name": f"vllm-router (vLLM's router, Rust): {args.replicas} process(es) on the router core, "
                "policy x tokio worker threads swept",
                "version": importlib.metadata.version("vllm-router"),
                "sweep": sweep,
            },
            "notes": NOTES,
            "setup": {
                "rate_per_s": args.rate,
                "seconds": args.seconds,
                "concurrency": args.concurrency,
                "repetitions": args.repetitions,
                "router_processes": args.replicas,
                "workload": f"chat conversations of {args.turns} turns, each turn to the next process in turn, "
                f"each with an {SESSION_HEADER} header",
                "cpu_per_request": "user + system CPU of the router processes (all threads, /proc) over the "
                f"{args.rate:.0f} requests/s window, divided by the requests it served; the interval resamples "
                "one-second slices of that window",
                "added_p99_interval": "bootstrap over the pooled latencies of coserve, the peer and direct",
                "machine": (
                    f"{len(cores)} cores, loopback; "
                    + (
                        f"the routers on core(s) {sorted(router_cores)}, load generator and upstream on "
                        f"core {sorted(client_cores)} in every arm (as the router's own pod would have its CPU)"
                        if pinned
                        else "upstream, router and load generator share them"
                    )
                ),
            },
        },
    )


if __name__ == "__main__":
    sys.exit(main())
