"""``coserve simulate``: a CoServePool on a simulated clock, with coserve's own policies deciding.

    coserve simulate POOL.yaml [--profile FILE] [--workload agentic|mooncake|azure] [--trace FILE]
                     [--prefillers N --decoders N | --autoscale] [--policy conversation|per-turn|per-request]
                     [--routing goroute|round-robin|least-loaded] [--class NAME | --class-mix NAME=SHARE,...]
                     [--offline-concurrency N] [--seed S] [-o table|json] [--plot FILE]

Who calls it: ``coserve.cli.main`` registers it with ``add_simulate_command``.
The pool's sizes default to its plan (``coserve plan``); its classes, KV
capacity, offline class and autoscaling bounds come from the spec; the step
cost model from the profile (``--profile``, a file ``coserve profile`` wrote,
or one in ``examples/``). The simulation itself is ``coserve.sim``; the report
(``summarize``) adds the plan's first bottleneck beside the one observed.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coserve.api.problems import InvalidInput, Problem
from coserve.cli.bench import add_workload_arguments, check_workload, workload_from
from coserve.cli.manifest import load_planned

if TYPE_CHECKING:
    from coserve.api.profile import EngineProfile
    from coserve.api.spec import SpecModel
    from coserve.api.status import Plan
    from coserve.provisioning.profile import ResolvedProfile
    from coserve.scheduling import StepCostModel
    from coserve.scheduling.requests import ClassRegistry
    from coserve.sim import SimConfig

__all__ = ["add_simulate_command"]


# --class-mix's example in --help: examples/pool.yaml's classes (tests/sim/test_pool_sim.py runs it)
CLASS_MIX_EXAMPLE = "interactive=1,standard=3"


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
    simulate.add_argument(
        "--routing",
        choices=("goroute", "round-robin", "least-loaded"),
        help="how a new request picks its prefiller (or engine, per-request): GoRouting (the router's, default "
        "for prefillers), round-robin or least-loaded (default for per-request: the lowest KV occupancy)",
    )
    simulate.add_argument(
        "--autoscale",
        action="store_true",
        help="let coserve's autoscaler resize the pool every spec.autoscaling.evaluationIntervalS, within its bounds",
    )
    simulate.add_argument(
        "--startup", type=float, default=60.0, help="seconds a new replica takes to serve (default 60)"
    )
    simulate.add_argument("--class", dest="cls", help="the priority class of every request (default: the top one)")
    simulate.add_argument(
        "--class-mix",
        metavar="NAME=SHARE,...",
        help="conversations drawn at random (--seed) from these classes in these shares, e.g. "
        f"{CLASS_MIX_EXAMPLE} (examples/pool.yaml's classes)",
    )
    simulate.add_argument(
        "--offline-concurrency",
        type=int,
        default=0,
        help="offline batch lines in flight at the spec's offline class (default 0: no offline work)",
    )
    simulate.add_argument("--offline-prompt", type=int, default=512, help="offline prompt tokens (default 512)")
    simulate.add_argument("--offline-output", type=int, default=64, help="offline output tokens (default 64)")
    simulate.add_argument("--max-num-seqs", type=int, default=256, help="running requests per engine (default 256)")
    simulate.add_argument(
        "--kv-bandwidth", type=float, default=25.0, help="prefiller-to-decoder KV link, GB/s (default 25)"
    )
    simulate.add_argument(
        "--kv-bytes-per-token", type=float, default=131072, help="KV bytes per token (default: an 8B Llama, bf16)"
    )
    simulate.add_argument(
        "--kv-block-tokens", type=int, default=16, help="vLLM's KV block size (default 16, vLLM's on GPUs; 128 on CPUs)"
    )
    simulate.add_argument(
        "--plot",
        metavar="FILE",
        default="coserve-simulate.png",
        help="the PNG of TTFET, KV occupancy and replicas over time (default coserve-simulate.png)",
    )
    simulate.add_argument("--no-plot", action="store_true", help="draw no PNG")
    simulate.add_argument("-o", "--output", choices=("table", "json"), default="table")
    simulate.set_defaults(handler=_cmd_simulate)


def _cmd_simulate(args: argparse.Namespace) -> int:
    """``coserve simulate``: check the flags, build the simulated pool from the manifest's plan, run it, report."""
    from coserve.autoscaling.policy import thresholds_for
    from coserve.scheduling.requests import ClassRegistry
    from coserve.sim import PoolSim, coserve_scaler

    problems = _flag_problems(args)
    if problems:
        raise InvalidInput(problems, source="coserve simulate")
    pool, measured, plan = load_planned(args.file, args.profile)
    spec = pool.spec
    classes = ClassRegistry([c.model_dump(by_alias=True, exclude_none=True) for c in spec.priority_classes])
    mix = _class_mix(args, classes)
    cost, note = _cost_model(measured, spec)
    config, profile = _sim_config(args, spec, measured, plan, cost, classes)
    conversations = workload_from(args, lengths_only=True)
    if not conversations:
        raise InvalidInput([Problem("--trace", "the workload has no conversation")], source="coserve simulate")
    rng = random.Random(args.seed)  # noqa: S311 - a reproducible class draw, not a secret
    names, shares = zip(*mix.items(), strict=True)
    class_of = {c.conversation_id: classes.get(rng.choices(names, shares)[0]) for c in conversations}
    turns = sum(len(c.turns) for c in conversations)
    sizing = "autoscaled from " if args.autoscale else ""
    print(
        f"coserve simulate: {len(conversations)} {args.workload} conversations ({turns} requests), classes "
        f"{', '.join(f'{n} {v:.0%}' for n, v in mix.items())}; {sizing}{config.prefillers} prefillers + "
        f"{config.decoders} decoders, {args.policy} placement; {note}",
        file=sys.stderr,
    )
    scaler = coserve_scaler(spec, thresholds_for(spec), measured) if args.autoscale else None
    started = time.perf_counter()
    result = PoolSim(config, conversations, class_of, scaler=scaler).run()
    report = summarize(result, time.perf_counter() - started, profile.decode_throughput_tokens_per_s)
    report["plan"] = {"prefillers": plan.prefillers, "decoders": plan.decoders, "bottleneck": str(plan.bottleneck),
                      "shape": plan.shapes.shape.value if plan.shapes else None}  # fmt: skip
    report["setup"] = {"prefillers": config.prefillers, "decoders": config.decoders, "autoscale": args.autoscale,
                       "policy": args.policy, "routing": args.routing, "classes": mix,
                       "offline_concurrency": args.offline_concurrency, "cost_model": cost.to_dict(),
                       "cost_model_source": note, "kv_capacity_tokens": int(profile.kv_capacity_tokens)}  # fmt: skip
    if args.output == "json":
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_table(report)
    if args.plot and not args.no_plot:
        plot(Path(args.plot), result, report)
    return 0


def _flag_problems(args: argparse.Namespace) -> list[Problem]:
    """Every flag of ``coserve simulate`` that is out of range or contradicts another (the workload's own
    flags by ``check_workload``), each with its flag and a reason."""
    problems = check_workload(args)
    for flag, value in (("--prefillers", args.prefillers), ("--decoders", args.decoders),
                        ("--max-num-seqs", args.max_num_seqs), ("--offline-prompt", args.offline_prompt),
                        ("--kv-block-tokens", args.kv_block_tokens),
                        ("--offline-output", args.offline_output)):  # fmt: skip
        if value is not None and value < 1:
            problems.append(Problem(flag, f"must be at least 1, got {value}"))
    if args.offline_concurrency < 0:
        problems.append(Problem("--offline-concurrency", f"must not be negative, got {args.offline_concurrency}"))
    for flag, value in (("--kv-bandwidth", args.kv_bandwidth), ("--kv-bytes-per-token", args.kv_bytes_per_token)):
        if not value > 0:
            problems.append(Problem(flag, f"must be a positive number, got {value}"))
    if args.startup < 0:
        problems.append(Problem("--startup", f"must not be negative, got {args.startup}"))
    if args.cls and args.class_mix:
        problems.append(Problem("--class-mix", "give --class or --class-mix, not both"))
    return problems


def _sim_config(
    args: argparse.Namespace,
    spec: SpecModel,
    measured: EngineProfile | None,
    plan: Plan,
    cost: StepCostModel,
    classes: ClassRegistry,
) -> tuple[SimConfig, ResolvedProfile]:
    """(the simulated pool's ``SimConfig``, the resolved profile): the plan's replicas unless the flags give
    them, the profile's KV and prefill curve, the offline work the flags ask for."""
    from coserve.provisioning.profile import resolve_profile
    from coserve.scheduling import SlideConfig
    from coserve.sim import OfflineWork, SimConfig

    profile = resolve_profile(spec, measured)
    curve = profile.prefill_latency
    offline = None
    if args.offline_concurrency:
        if spec.offline.class_name not in classes.names:
            raise InvalidInput([Problem("spec.offline.className", f"{spec.offline.class_name!r} is not a class")])
        offline = OfflineWork(classes.get(spec.offline.class_name), args.offline_prompt, args.offline_output,
                              args.offline_concurrency)  # fmt: skip
    config = SimConfig(
        prefillers=args.prefillers or plan.prefillers,
        decoders=args.decoders or plan.decoders,
        cost_model=cost,
        kv_capacity_tokens=int(profile.kv_capacity_tokens),
        placement=args.policy,
        routing=args.routing,
        max_num_seqs=args.max_num_seqs,
        slide=SlideConfig(),
        kv_bytes_per_token=args.kv_bytes_per_token,
        kv_bandwidth_bytes_per_s=args.kv_bandwidth * 1e9,
        kv_block_tokens=args.kv_block_tokens,
        prefill_latency=(curve.constant_s, curve.per_token_s, curve.per_token_squared_s),
        offline=offline,
        startup_s=args.startup,
        scale_interval_s=float(spec.autoscaling.evaluation_interval_s),
    )
    return config, profile


def _class_mix(args: argparse.Namespace, classes: Any) -> dict[str, float]:
    """Class name -> share of conversations: ``--class-mix``, ``--class``, or the top class."""

    def refuse(flag: str, reason: str) -> InvalidInput:
        return InvalidInput([Problem(flag, reason)], source="coserve simulate")

    known = ", ".join(classes.names)
    if not args.class_mix:
        name = args.cls or min((classes.get(n) for n in classes.names), key=lambda c: c.rank).name
        if name not in classes.names:
            raise refuse("--class", f"unknown class {name!r}; the pool has {known}")
        return {name: 1.0}
    mix: dict[str, float] = {}
    for item in args.class_mix.split(","):
        name, _, share = item.partition("=")
        name = name.strip()
        if name not in classes.names:
            raise refuse("--class-mix", f"unknown class {name!r}; the pool has {known}")
        try:
            value = float(share)
        except ValueError:
            raise refuse("--class-mix", f"{item!r}: expected NAME=SHARE with a number") from None
        if not (value > 0 and math.isfinite(value)):
            raise refuse("--class-mix", f"{item!r}: a share must be a positive number")
        mix[name] = value
    total = sum(mix.values())
    return {name: value / total for name, value in mix.items()}


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


def summarize(result: Any, wall_s: float, decode_tokens_per_s: float | None = None) -> dict[str, Any]:
    """Per class and per conversation figures of a run (percentiles only from enough samples), the engines'
    utilisation, KV occupancy, replicas over time, offline throughput and the first bottleneck observed."""
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
    duration = result.duration_s
    kv = {name: [u for _, u in series] for name, series in result.kv_occupancy.items() if series}
    counts = [(p, d) for _, p, d in result.replicas]
    return {
        "classes": classes,
        "ttfet": {"n": len(ttfet), **{f"p{q}_s": pct(ttfet, q, n) for q, n in ((50, 10), (95, 100), (99, 200))}},
        "simulated_s": duration,
        "wall_s": wall_s,
        "busy_fraction": {k: v / duration for k, v in result.busy_s.items()} if duration else {},
        "utilisation": result.utilisation(decode_tokens_per_s),
        "first_bottleneck": result.first_bottleneck(decode_tokens_per_s),
        "decoder_kv_occupancy": {n: {"mean": sum(v) / len(v), "peak": max(v)} for n, v in kv.items()},
        "replicas": {
            "prefillers": {"min": min(p for p, _ in counts), "max": max(p for p, _ in counts)} if counts else None,
            "decoders": {"min": min(d for _, d in counts), "max": max(d for _, d in counts)} if counts else None,
            "replica_hours": {k: v / 3600 for k, v in result.replica_seconds.items()},
            "series": [[round(t, 3), p, d] for t, p, d in result.replicas],
        },
        "offline_tokens_per_s": result.offline_tokens / duration if duration else 0.0,
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
    if report["offline_tokens_per_s"]:
        print(f"offline: {report['offline_tokens_per_s']:,.0f} tokens/s harvested")
    use = report["utilisation"]
    print("utilisation: " + ", ".join(f"{k.replace('_', ' ')} {v:.0%}" for k, v in use.items()))
    kv = report["decoder_kv_occupancy"]
    if kv:
        peak = max(v["peak"] for v in kv.values())
        print(f"decoder KV occupancy: mean {sum(v['mean'] for v in kv.values()) / len(kv):.0%}, peak {peak:.0%}")
    replicas = report["replicas"]
    if replicas["decoders"]:
        hours = replicas["replica_hours"]
        print(
            f"replicas: prefillers {replicas['prefillers']['min']}-{replicas['prefillers']['max']}, decoders "
            f"{replicas['decoders']['min']}-{replicas['decoders']['max']} "
            f"({hours['prefiller'] + hours['decoder']:.2f} replica-hours)"
        )
    plan = report.get("plan")
    if plan:
        print(f"first bottleneck: observed {report['first_bottleneck']}, the plan's {plan['bottleneck']}")
    print(f"simulated {report['simulated_s']:.0f} s in {report['wall_s']:.1f} s")


def plot(path: Path, result: Any, report: dict[str, Any]) -> None:
    """TTFET's distribution, each decoder's KV occupancy and the replica counts over simulated time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'coserve[bench]')", file=sys.stderr)
        return
    figure, (ttfet_axis, kv_axis, replica_axis) = plt.subplots(1, 3, figsize=(14, 3.6))
    ttfet = sorted(result.ttfet_s())
    if ttfet:
        ttfet_axis.plot(ttfet, [(i + 1) / len(ttfet) for i in range(len(ttfet))])
    ttfet_axis.set_xlabel("TTFET (s)")
    ttfet_axis.set_ylabel("fraction of conversations")
    for name, series in sorted(result.kv_occupancy.items()):
        if series:
            kv_axis.plot([t for t, _ in series], [u for _, u in series], linewidth=0.8, label=name)
    kv_axis.set_xlabel("simulated time (s)")
    kv_axis.set_ylabel("decoder KV occupancy")
    if len(result.kv_occupancy) <= 8:
        kv_axis.legend(fontsize=7)
    times = [t for t, _, _ in result.replicas]
    replica_axis.step(times, [p for _, p, _ in result.replicas], where="post", label="prefillers")
    replica_axis.step(times, [d for _, _, d in result.replicas], where="post", label="decoders")
    replica_axis.set_xlabel("simulated time (s)")
    replica_axis.set_ylabel("replicas asked for")
    replica_axis.yaxis.set_major_locator(MaxNLocator(integer=True))
    replica_axis.legend(fontsize=7)
    for axis in (ttfet_axis, kv_axis, replica_axis):
        axis.grid(alpha=0.3)
    setup = report["setup"]
    figure.suptitle(f"coserve simulate: {setup['policy']} placement, first bottleneck {report['first_bottleneck']}")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    print(f"plot: {path}", file=sys.stderr)
