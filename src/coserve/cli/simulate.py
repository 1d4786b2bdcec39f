"""``coserve simulate``: a CoServePool on a simulated clock, with coserve's own policies deciding.

    coserve simulate POOL.yaml [--profile FILE] [--workload agentic|mooncake|azure] [--trace FILE]
                     [--prefillers N --decoders N] [--policy conversation|per-turn|per-request]
                     [--class NAME] [-o table|json]

Who calls it: ``coserve.cli.main`` registers it with ``add_simulate_command``.
The pool's sizes default to its plan (``coserve plan``); its classes, KV
capacity and step budget come from the spec; the step cost model from the
profile (``--profile``, a file ``coserve profile`` wrote, or one in
``examples/``). The simulation itself is ``coserve.sim``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from coserve.api.problems import InvalidInput, Problem
from coserve.cli.bench import add_workload_arguments, check_workload, workload_from

__all__ = ["add_simulate_command"]


def add_simulate_command(commands: Any, add_profile_option: Any) -> None:
    simulate = commands.add_parser(
        "simulate",
        help="simulate a pool on a workload with coserve's own policies; per-class latency, TTFET, attainment",
        description="Run a CoServePool on a simulated clock: every engine step is decided by SlideBatching and "
        "timed by the step cost model, the router places, pins and polls as the real one does, KV moves between "
        "prefillers and decoders over a link of --kv-bandwidth. Prints per-class TTFT/TPOT, TTFET, SLO "
        "attainment and TDG gain. Sizes default to the pool's plan.",
    )
    simulate.add_argument("file", metavar="POOL", help="the CoServePool manifest")
    add_profile_option(simulate)
    add_workload_arguments(simulate, conversations=100)
    simulate.add_argument("--prefillers", type=int, help="prefiller replicas (default: the plan's)")
    simulate.add_argument("--decoders", type=int, help="decoder replicas (default: the plan's)")
    simulate.add_argument(
        "--policy",
        choices=("conversation", "per-turn", "per-request"),
        default="conversation",
        help="placement: coserve's conversation-level P/D (default), per-turn P/D, or a per-request balancer",
    )
    simulate.add_argument("--class", dest="cls", help="the priority class of every request (default: the top one)")
    simulate.add_argument("--max-num-seqs", type=int, default=256, help="running requests per engine (default 256)")
    simulate.add_argument(
        "--kv-bandwidth", type=float, default=25.0, help="prefiller-to-decoder KV link, GB/s (default 25)"
    )
    simulate.add_argument(
        "--kv-bytes-per-token", type=float, default=131072, help="KV bytes per token (default: an 8B Llama, bf16)"
    )
    simulate.add_argument("-o", "--output", choices=("table", "json"), default="table")
    simulate.set_defaults(handler=_cmd_simulate)


def _cmd_simulate(args: argparse.Namespace) -> int:
    from coserve.cli.main import _load  # the same pool + profile + plan loading as `coserve plan`
    from coserve.scheduling import SlideConfig
    from coserve.scheduling.requests import ClassRegistry
    from coserve.sim import PoolSim, SimConfig

    problems = check_workload(args)
    for flag, value in (("--prefillers", args.prefillers), ("--decoders", args.decoders),
                        ("--max-num-seqs", args.max_num_seqs)):  # fmt: skip
        if value is not None and value < 1:
            problems.append(Problem(flag, f"must be at least 1, got {value}"))
    for flag, value in (("--kv-bandwidth", args.kv_bandwidth), ("--kv-bytes-per-token", args.kv_bytes_per_token)):
        if not value > 0:
            problems.append(Problem(flag, f"must be a positive number, got {value}"))
    if problems:
        raise InvalidInput(problems, source="coserve simulate")
    pool, measured, plan = _load(args)
    spec = pool.spec
    classes = ClassRegistry([c.model_dump(by_alias=True, exclude_none=True) for c in spec.priority_classes])
    name = args.cls or min((classes.get(n) for n in classes.names), key=lambda c: c.rank).name
    if name not in classes.names:
        raise InvalidInput([Problem("--class", f"unknown class {name!r}; the pool has {', '.join(classes.names)}")])
    cost, note = _cost_model(measured, spec)
    kv_capacity = (measured.kv_capacity_tokens if measured and measured.kv_capacity_tokens else None) or (
        spec.profile.kv_capacity_tokens if spec.profile else None
    )
    if not kv_capacity:
        raise InvalidInput([Problem("spec.profile.kvCapacityTokens", "the simulator needs the engines' KV capacity")])
    prefillers = args.prefillers or plan.prefillers
    decoders = args.decoders or plan.decoders
    curve = spec.profile.prefill_latency if spec.profile else None
    config = SimConfig(
        prefillers=prefillers,
        decoders=decoders,
        cost_model=cost,
        kv_capacity_tokens=int(kv_capacity),
        placement=args.policy,
        max_num_seqs=args.max_num_seqs,
        slide=SlideConfig(),
        kv_bytes_per_token=args.kv_bytes_per_token,
        kv_bandwidth_bytes_per_s=args.kv_bandwidth * 1e9,
        prefill_latency=(curve.constant_s, curve.per_token_s, curve.per_token_squared_s) if curve else None,
    )
    conversations = workload_from(args)
    if not conversations:
        raise InvalidInput([Problem("--trace", "the workload has no conversation")], source="coserve simulate")
    turns = sum(len(c.turns) for c in conversations)
    print(
        f"coserve simulate: {len(conversations)} {args.workload} conversations ({turns} requests), class {name!r}, "
        f"{prefillers} prefillers + {decoders} decoders, {args.policy} placement; {note}",
        file=sys.stderr,
    )
    started = time.perf_counter()
    cls = classes.get(name)
    result = PoolSim(config, conversations, {c.conversation_id: cls for c in conversations}).run()
    report = summarize(result, time.perf_counter() - started)
    report["setup"] = {"prefillers": prefillers, "decoders": decoders, "policy": args.policy, "class": name,
                       "cost_model": cost.to_dict(), "cost_model_source": note,
                       "kv_capacity_tokens": int(kv_capacity)}  # fmt: skip
    if args.output == "json":
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_table(report)
    return 0


def _cost_model(measured: Any, spec: Any) -> tuple[Any, str]:
    """The profile's step cost model, or one built from the spec's prefill curve (said so in the output)."""
    from coserve.scheduling import StepCostModel

    if measured is not None and measured.cost_model:
        try:
            return StepCostModel.from_dict(measured.cost_model), "step cost model from the profile"
        except ValueError as error:
            raise InvalidInput([Problem("--profile", str(error))]) from None
    curve = spec.profile.prefill_latency if spec.profile else None
    if curve is None:
        raise InvalidInput([Problem("--profile", "no step cost model: pass a profile from `coserve profile`")])
    model = StepCostModel(k1=curve.per_token_s, k2=curve.per_token_squared_s, k3=0.0, k4=0.0, k5=curve.constant_s)
    return model, "step cost model from spec.profile.prefillLatency (context cost unknown: pass --profile)"


def summarize(result: Any, wall_s: float) -> dict[str, Any]:
    """Per class and per conversation figures of a run, percentiles only from enough samples."""
    from coserve.bench.workload import percentile

    def pct(values: list[float], q: int, minimum: int) -> float | None:
        return percentile(sorted(values), q) if len(values) >= minimum else None

    classes = {}
    for name, row in result.per_class().items():
        classes[name] = {
            "requests": row["requests"],
            "finished": row["finished"],
            "slo_attainment": row["attained"] / row["requests"] if row["requests"] else None,
            "gain": row["gain"],
            "possible_gain": row["possible_gain"],
            **{f"ttft_p{q}_s": pct(row["ttft_s"], q, n) for q, n in ((50, 10), (95, 100), (99, 200))},
            **{f"tpot_p{q}_s": pct(row["tpot_s"], q, n) for q, n in ((50, 10), (95, 100), (99, 200))},
        }
    ttfet = result.ttfet_s()
    return {
        "classes": classes,
        "ttfet": {"n": len(ttfet), **{f"p{q}_s": pct(ttfet, q, n) for q, n in ((50, 10), (95, 100), (99, 200))}},
        "simulated_s": result.duration_s,
        "wall_s": wall_s,
        "busy_fraction": {k: v / result.duration_s for k, v in result.busy_s.items()} if result.duration_s else {},
    }


def print_table(report: dict[str, Any]) -> None:
    def s(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    print(f"{'class':14}{'requests':>9}{'attained':>10}{'TTFT p50':>10}{'TTFT p95':>10}{'TPOT p50':>10}{'gain':>10}")
    for name, row in report["classes"].items():
        attained = row["slo_attainment"]
        print(
            f"{name:14}{row['requests']:>9}{'-' if attained is None else f'{attained:.1%}':>10}"
            f"{s(row['ttft_p50_s']):>10}{s(row['ttft_p95_s']):>10}{s(row['tpot_p50_s']):>10}{row['gain']:>10.0f}"
        )
    ttfet = report["ttfet"]
    print(f"TTFET over {ttfet['n']} conversations: p50 {s(ttfet['p50_s'])} s, p95 {s(ttfet['p95_s'])} s")
    busy = report["busy_fraction"]
    if busy:
        print("busy: " + ", ".join(f"{k} {v:.0%}" for k, v in sorted(busy.items())))
    print(f"simulated {report['simulated_s']:.0f} s in {report['wall_s']:.1f} s")
