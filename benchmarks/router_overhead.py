"""What the router adds on loopback: latency at a fixed request rate, and the highest sustained rate.

Processes on this 2-core machine: a fast fake upstream (a minimal ASGI app
answering a fixed completion and keeping a decoder's conversation record, the
engine's own ``ConversationLog``, standing in for an engine so that only the
router is measured), ``--replicas`` (2, the chart's default) ``coserve router``
processes in front of it (one decoder, no prefiller), and this load generator
(aiohttp), which sends each request to the next replica in turn, as a Service
spreads connections. The requests are the turns of four-turn chat
conversations, in order, so consecutive turns of a conversation reach
different replicas: turn 1 is placed and pinned, turn 2 reaches a replica
without the pin, which asks the decoder (the lookup every replica's first
sight of a conversation costs), turns 3 and 4 find pins.

By default the router runs on its own core and the load generator and upstream
share the other, in both arms: in a cluster the router's pod has its own CPU,
and on 2 cores three busy processes otherwise measure the machine's scheduler
(a request crosses four process wake-ups through the router, two directly).
``--shared-cores`` lets all three share both cores.

- Latency: an open-loop Poisson stream at ``--rate`` (500/s) for ``--seconds``,
  sent directly to the upstream (the baseline) and through the router, in the
  same run; added latency = router minus direct, at p50 and p99.
- Throughput: closed loop, ``--concurrency`` clients, non-streaming, through the
  router and directly; requests/s.

Target: at most 1 ms added at p99 at 500 requests/s; at least 2,000 requests/s
non-streaming. Writes benchmarks/results/router_overhead.json.

    .venv/bin/python benchmarks/router_overhead.py      # ~1 minute
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from _harness import percentile, say, write_result

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
CONVERSATIONS = ConversationLog()  # the fake decoder's record of the conversations it served


async def upstream_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A minimal engine: the fixed answer to any POST, a KV usage on /metrics, and the decoder's answer to
    the routers' conversation lookups (the same ConversationLog the engine plugin keeps)."""
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
    elif scope["path"] == "/coserve/v1/conversations:lookup":
        body = json.dumps({"found": CONVERSATIONS.lookup(json.loads(raw)["ids"], time.monotonic())}).encode()
    else:
        for key, value in scope["headers"]:
            if key == b"x-coserve-conversation":
                CONVERSATIONS.record(value.decode(), time.monotonic())
        body = ANSWER
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
    return {"model": "tiny", "messages": messages, "max_tokens": 1}


async def one(session: aiohttp.ClientSession, bases: list[str], index: int) -> float:
    base = bases[index % len(bases)]  # the next replica in turn: a conversation's turns alternate replicas
    started = time.perf_counter()
    async with session.post(f"{base}/v1/chat/completions", json=turn(index)) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}")
    return time.perf_counter() - started


async def open_loop(base: list[str], rate: float, seconds: float, seed: int, first: int = 0) -> list[float]:
    rng = random.Random(seed)
    latencies: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for index in range(10**7 + first, 10**7 + first + 50):  # warm up connections (conversations of their own)
            await one(session, base, index)
        tasks = []
        start = time.perf_counter()
        at = 0.0
        index = first
        while at < seconds:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(session, base, index)))
            index += 1
            at += rng.expovariate(rate)
        latencies = list(await asyncio.gather(*tasks))
    return latencies


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


async def measure(args: argparse.Namespace, upstream: str, routers: list[str]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        await wait_ready(session, f"{upstream}/metrics")
        for router in routers:
            await wait_ready(session, f"{router}/ready")
    say(f"latency: {args.rate:.0f} requests/s for {args.seconds:.0f} s, direct then through the router")
    direct = await open_loop([upstream], args.rate, args.seconds, 1)
    routed = await open_loop(routers, args.rate, args.seconds, 1)
    say(f"throughput: {args.concurrency} clients for {args.seconds:.0f} s, direct then through the router")
    direct_rps = await closed_loop([upstream], args.concurrency, args.seconds)
    routed_rps = await closed_loop(routers, args.concurrency, args.seconds)
    return {"direct": direct, "routed": routed, "direct_rps": direct_rps, "routed_rps": routed_rps}


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
    print(
        f"\n{'live pins':>10}{'idle CPU ms/s':>15}{'p50+ @100':>11}{'p99+ @100':>11}{'p50+ @500':>11}{'p99+ @500':>11}"
    )
    for row in rows:
        print(f"{row['pins']:>10}{row['idle_cpu_s_per_s'] * 1000:15.1f}"
              + "".join(f"{row[k] * 1000:11.2f}" for k in ("added_p50_s_at_100", "added_p99_s_at_100",
                                                           "added_p50_s_at_500", "added_p99_s_at_500")))  # fmt: skip
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--replicas", type=int, default=2, help="router replicas (default 2, the chart's)")
    parser.add_argument("--turns", type=int, default=TURNS, help=f"turns per conversation (default {TURNS})")
    parser.add_argument(
        "--pins", type=int, nargs="+", help="instead: idle CPU and added latency at these live pin counts (one replica)"
    )
    parser.add_argument(
        "--shared-cores",
        action="store_true",
        help="let the three processes share every core (default: the router on its own core)",
    )
    parser.add_argument("--serve-upstream", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pins:
        args.replicas, args.turns = 1, 1
    globals()["TURNS"] = args.turns
    cores = sorted(os.sched_getaffinity(0))
    pinned = not args.shared_cores and len(cores) >= 2
    client_cores, router_cores = ({cores[0]}, set(cores[1:])) if pinned else (set(cores), set(cores))
    if args.serve_upstream:
        import uvicorn

        uvicorn.run(upstream_app, host="127.0.0.1", port=args.serve_upstream, log_level="error", access_log=False)
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="coserve-router-bench-"))
    up_port = free_port()
    router_ports = [free_port() for _ in range(args.replicas)]
    upstream = f"http://127.0.0.1:{up_port}"
    routers = [f"http://127.0.0.1:{port}" for port in router_ports]
    config = workdir / "router.json"
    config.write_text(json.dumps({"model": "tiny", "decoders": [upstream], "pollS": 1.0, "maxPins": 200_000}))
    processes = [
        subprocess.Popen(  # noqa: S603 - this script
            [sys.executable, __file__, "--serve-upstream", str(up_port)],
            preexec_fn=lambda: os.sched_setaffinity(0, client_cores),
        ),
    ]
    for port in router_ports:
        processes.append(
            subprocess.Popen(  # noqa: S603 - our own CLI
                [
                    str(Path(sys.executable).with_name("coserve")),
                    "router",
                    "--config",
                    str(config),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--log-level",
                    "warning",
                ],
                env={**os.environ},
                preexec_fn=lambda: os.sched_setaffinity(0, router_cores),
            )
        )
    os.sched_setaffinity(0, client_cores)
    try:
        if args.pins:
            write_pins(asyncio.run(measure_pins(args, upstream, routers[0], processes[1].pid)), args)
            return 0
        measured = asyncio.run(measure(args, upstream, routers))
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=30)
    d50, d99 = percentile(measured["direct"], 50), percentile(measured["direct"], 99)
    r50, r99 = percentile(measured["routed"], 50), percentile(measured["routed"], 99)
    added50, added99 = r50 - d50, r99 - d99
    latency_met = added99 <= 0.001
    throughput_met = measured["routed_rps"] >= 2000
    print(f"\n{'':28}{'direct':>10}{'router':>10}{'added':>10}")
    print(f"{'p50 latency (ms)':28}{d50 * 1000:10.2f}{r50 * 1000:10.2f}{added50 * 1000:10.2f}")
    print(f"{'p99 latency (ms)':28}{d99 * 1000:10.2f}{r99 * 1000:10.2f}{added99 * 1000:10.2f}")
    print(f"{'requests/s (closed loop)':28}{measured['direct_rps']:10.0f}{measured['routed_rps']:10.0f}")
    print(f"target: <= 1 ms added at p99 {'met' if latency_met else 'NOT met'}; "
          f">= 2000 requests/s {'met' if throughput_met else 'NOT met'}")  # fmt: skip
    write_result(
        "router_overhead",
        {
            "benchmark": "router_overhead",
            "target": "<= 1 ms added latency at p99 at 500 requests/s; >= 2,000 requests/s non-streaming",
            "met": bool(latency_met and throughput_met),
            "latency_met": bool(latency_met),
            "throughput_met": bool(throughput_met),
            "added_p50_s": added50,
            "added_p99_s": added99,
            "router": {"p50_s": r50, "p99_s": r99, "requests_per_s": measured["routed_rps"]},
            "baseline": {
                "name": "direct to the upstream",
                "p50_s": d50,
                "p99_s": d99,
                "requests_per_s": measured["direct_rps"],
            },
            "setup": {
                "rate_per_s": args.rate,
                "seconds": args.seconds,
                "concurrency": args.concurrency,
                "router_replicas": args.replicas,
                "workload": f"chat conversations of {args.turns} turns, each turn to the next replica in turn",
                "machine": (
                    f"{len(cores)} cores, loopback; "
                    + (
                        f"the router replicas on core(s) {sorted(router_cores)}, load generator and upstream on "
                        f"core {sorted(client_cores)} in both arms (as the router's own pod would have its CPU)"
                        if pinned
                        else "upstream, router and load generator share them"
                    )
                ),
            },
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
