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

- CPU per request: the routers' processes' CPU time (user + system, every
  thread, from /proc) over the latency window, divided by the requests served.

The peer: vLLM's own router (``vllm-router``, Rust, the bench extra pins it),
one process on the same core in front of the same upstream, in the same run,
the same requests (each carries ``x-session-id``, the header its
``consistent_hash`` reads first; coserve ignores it and names conversations
itself). What an operator would tune is swept: its policy (round_robin,
consistent_hash, cache_aware) x its tokio worker threads (1 and 2:
``TOKIO_WORKER_THREADS``; its default is one per core it may use, here 1), with
``--log-level error`` (warning logs three lines per request) and a health check
interval longer than the run; each figure is compared with its best
configuration for that figure.

Targets: at most 1 ms added at p99 at 500 requests/s; at least 2,000 requests/s
non-streaming; coserve's added p99 at most 2x vllm-router's; coserve's CPU per
request at most 1.5x vllm-router's. Writes benchmarks/results/router_overhead.json.

    .venv/bin/python benchmarks/router_overhead.py      # ~4 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from harness.peers import POLICIES, free_port, launched, vllm_router_command
from harness.results import Table, ratio, show, write_result
from harness.stats import percentile, say
from harness.sweep import best_of

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
PEER_P99_RATIO = 2.0  # coserve's added p99 at most this times vllm-router's
PEER_CPU_RATIO = 1.5  # coserve's CPU per request at most this times vllm-router's
NOTES: list[str] = []  # why a target is missed, and what would close it (set after a run)
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
        body = ANSWER
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


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
    headers = {SESSION_HEADER: f"conversation-{index // TURNS}"}
    started = time.perf_counter()
    async with session.post(f"{base}/v1/chat/completions", json=turn(index), headers=headers) as response:
        await response.read()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}")
    return time.perf_counter() - started


async def open_loop(base: list[str], rate: float, seconds: float, seed: int, first: int = 0) -> list[float]:
    return (await timed_open_loop(base, rate, seconds, seed, first))[0]


async def timed_open_loop(
    base: list[str], rate: float, seconds: float, seed: int, first: int = 0, pids: tuple[int, ...] = ()
) -> tuple[list[float], float]:
    """The latencies of a Poisson stream at ``rate`` for ``seconds``, and the CPU seconds the processes
    ``pids`` spent from its first request until its last answer (after the warm-up)."""
    rng = random.Random(seed)
    latencies: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for index in range(10**7 + first, 10**7 + first + 50):  # warm up connections (conversations of their own)
            await one(session, base, index)
        tasks = []
        cpu_before = sum(cpu_seconds(pid) for pid in pids)
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
        cpu = sum(cpu_seconds(pid) for pid in pids) - cpu_before
    return latencies, cpu


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
    latencies, cpu = await timed_open_loop(bases, args.rate, args.seconds, 1, pids=pids)
    rps = await closed_loop(bases, args.concurrency, args.seconds)
    return Arm(latencies, cpu, rps)


@dataclass
class Arm:
    latencies: list[float]
    cpu_s: float  # the arm's router processes' CPU seconds over the latency window
    requests_per_s: float

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


def peer_comparison(ours: dict[str, float], sweep: list[dict[str, Any]]) -> dict[str, Any]:
    """coserve against vllm-router's best configuration for each figure: the ratios and the two targets (no
    ratio when vllm-router's figure is not positive: an added latency within the noise of direct)."""
    best = {
        "added_p99_s": best_of(sweep, "added_p99_s"),
        "cpu_s_per_request": best_of(sweep, "cpu_s_per_request"),
        "requests_per_s": best_of(sweep, "requests_per_s", highest=True),
    }
    p99 = ratio(ours["added_p99_s"], best["added_p99_s"]["added_p99_s"])
    cpu = ratio(ours["cpu_s_per_request"], best["cpu_s_per_request"]["cpu_s_per_request"])
    return {
        "added_p99_ratio": p99,
        "cpu_per_request_ratio": cpu,
        "requests_per_s_ratio": ratio(ours["requests_per_s"], best["requests_per_s"]["requests_per_s"]),
        "added_p99_met": p99 is not None and p99 <= PEER_P99_RATIO,
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
    parser.add_argument("--peer-policies", nargs="*", default=list(POLICIES), help="vllm-router policies swept")
    parser.add_argument("--peer-threads", type=int, nargs="*", default=list(PEER_THREADS),
                        help="vllm-router tokio worker thread counts swept")  # fmt: skip
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
    os.sched_setaffinity(0, client_cores)
    sweep: list[dict[str, Any]] = []
    with launched([sys.executable, __file__, "--serve-upstream", str(up_port)], client_cores):
        with contextlib.ExitStack() as stack:
            processes = [stack.enter_context(launched(coserve_command(config, p), router_cores)) for p in router_ports]
            if args.pins:
                write_pins(asyncio.run(measure_pins(args, upstream, routers[0], processes[0].pid)), args)
                return 0
            say(f"direct, then coserve ({args.replicas} replicas): {args.rate:.0f} requests/s for "
                f"{args.seconds:.0f} s, then {args.concurrency} clients for {args.seconds:.0f} s")  # fmt: skip
            direct = asyncio.run(measure_arm(args, [f"{upstream}/metrics"], [upstream], ()))
            ready = [f"{router}/ready" for router in routers]
            ours = asyncio.run(measure_arm(args, ready, routers, tuple(p.pid for p in processes))).figures(direct)
        for policy in args.peer_policies:
            for threads in args.peer_threads:
                say(f"vllm-router, {policy}, {threads} worker thread(s)")
                port = free_port()
                peer = f"http://127.0.0.1:{port}"
                command, env = peer_command(upstream, port, policy), {"TOKIO_WORKER_THREADS": str(threads)}
                with launched(command, router_cores, env, quiet=True) as process:  # its start-up chatter
                    arm = asyncio.run(measure_arm(args, [f"{peer}/readiness"], [peer], (process.pid,)))
                sweep.append({"policy": policy, "worker_threads": threads, **arm.figures(direct)})
    report(args, direct, ours, sweep, cores, router_cores, client_cores, pinned)
    return 0


def report(
    args: argparse.Namespace, direct: Arm, ours: dict[str, float], sweep: list[dict[str, Any]], cores: list[int],
    router_cores: set[int], client_cores: set[int], pinned: bool,
) -> None:  # fmt: skip
    d50, d99 = percentile(direct.latencies, 50), percentile(direct.latencies, 99)
    latency_met = ours["added_p99_s"] <= 0.001
    throughput_met = ours["requests_per_s"] >= 2000
    peer = peer_comparison(ours, sweep) if sweep else None
    table = Table("", [("p50 ms", 9), ("p99 ms", 9), ("+p50 ms", 9), ("+p99 ms", 9), ("req/s", 8),
                       ("CPU ms/req", 12)], label_width=34, fmt="{:.3f}")  # fmt: skip
    table.row("direct", d50 * 1000, d99 * 1000, "", "", show(direct.requests_per_s, "{:.0f}"))
    for label, row in [(f"coserve ({args.replicas} replicas)", ours)] + [
        (f"vllm-router {r['policy']}, {r['worker_threads']} thr", r) for r in sweep
    ]:
        latencies = [row[k] * 1000 for k in ("p50_s", "p99_s", "added_p50_s", "added_p99_s")]
        table.row(label, *latencies, show(row["requests_per_s"], "{:.0f}"), row["cpu_s_per_request"] * 1000)
    print(f"target: <= 1 ms added at p99 {'met' if latency_met else 'NOT met'}; "
          f">= 2000 requests/s {'met' if throughput_met else 'NOT met'}")  # fmt: skip
    if peer is not None:
        p99, cpu, rps = (show(peer[k]) for k in ("added_p99_ratio", "cpu_per_request_ratio", "requests_per_s_ratio"))
        print(f"vs vllm-router's best: added p99 {p99}x (target <= {PEER_P99_RATIO}x: "
              f"{'met' if peer['added_p99_met'] else 'NOT met'}); CPU per request {cpu}x (target <= "
              f"{PEER_CPU_RATIO}x: {'met' if peer['cpu_met'] else 'NOT met'}); requests/s {rps}x")  # fmt: skip
    met = latency_met and throughput_met and (peer is None or (peer["added_p99_met"] and peer["cpu_met"]))
    write_result(
        "router_overhead",
        {
            "benchmark": "router_overhead",
            "target": (
                "<= 1 ms added latency at p99 at 500 requests/s; >= 2,000 requests/s non-streaming; against "
                f"vllm-router's best configuration: added p99 <= {PEER_P99_RATIO}x, CPU per request <= "
                f"{PEER_CPU_RATIO}x"
            ),
            "met": bool(met),
            "latency_met": bool(latency_met),
            "throughput_met": bool(throughput_met),
            "vs_vllm_router_p99_met": None if peer is None else peer["added_p99_met"],
            "vs_vllm_router_cpu_met": None if peer is None else peer["cpu_met"],
            "added_p50_s": ours["added_p50_s"],
            "added_p99_s": ours["added_p99_s"],
            "router": ours,
            "vs_vllm_router": peer,
            "baseline": {
                "name": "direct to the upstream",
                "p50_s": d50,
                "p99_s": d99,
                "requests_per_s": direct.requests_per_s,
            },
            "vllm_router": {
                "name": "vllm-router (vLLM's router, Rust): one process on the router core, policy x tokio "
                "worker threads swept",
                "version": importlib.metadata.version("vllm-router"),
                "sweep": sweep,
            },
            "notes": NOTES,
            "setup": {
                "rate_per_s": args.rate,
                "seconds": args.seconds,
                "concurrency": args.concurrency,
                "router_replicas": args.replicas,
                "workload": f"chat conversations of {args.turns} turns, each turn to the next replica in turn, "
                f"each with an {SESSION_HEADER} header",
                "cpu_per_request": "user + system CPU of the router processes (all threads, /proc) over the "
                f"{args.rate:.0f} requests/s window, divided by the requests it served",
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
