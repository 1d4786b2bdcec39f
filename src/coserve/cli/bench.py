"""``coserve bench``: the command-line face of ``coserve.bench`` (arguments, checks, the printed table).

    coserve bench --url URL [--workload agentic|mooncake|azure] [--trace FILE] [--conversations N] ...

Who calls it: ``coserve.cli.main`` registers it with ``add_bench_command``.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import sys
from pathlib import Path
from typing import Any

from coserve.api.problems import InvalidInput, Problem

__all__ = ["add_bench_command", "add_workload_arguments", "check_workload", "workload_from"]

# The real traces in a checkout of the coserve repository (data/traces/README.md), found from this file
# (src/coserve/cli/bench.py), so from any folder with an editable install. A wheel carries none: --trace.
TRACES_DIR = Path(__file__).resolve().parents[3] / "data" / "traces"
DEFAULT_TRACES = {
    "mooncake": TRACES_DIR / "mooncake_conversation.jsonl",
    "azure": TRACES_DIR / "azure_llm_2023_conv.csv",
}


def add_workload_arguments(parser: argparse.ArgumentParser, conversations: int) -> None:
    """The workload flags ``coserve bench`` and ``coserve simulate`` share (read by ``workload_from``)."""
    parser.add_argument("--workload", choices=("agentic", "mooncake", "azure"), default="agentic")
    parser.add_argument(
        "--trace", metavar="FILE", help="the trace file (default: data/traces/<the trace> of a coserve checkout)"
    )
    parser.add_argument(
        "--conversations", type=int, default=conversations, help=f"conversations (default {conversations})"
    )
    parser.add_argument("--rate", type=float, default=0.5, help="agentic: conversations per second (default 0.5)")
    parser.add_argument("--turns", type=int, default=3, help="agentic: turns per conversation (default 3)")
    parser.add_argument("--first", type=int, default=512, help="agentic: tokens of turn 1 (default 512)")
    parser.add_argument("--appended", type=int, default=64, help="agentic: tool-result tokens per turn (default 64)")
    parser.add_argument("--answer", type=int, default=16, help="agentic: tokens per answer (default 16)")
    parser.add_argument("--gap", type=float, default=1.0, help="agentic: tool-call gap, seconds (default 1)")
    parser.add_argument("--speedup", type=float, default=1.0, help="traces: replay this many times faster")
    parser.add_argument("--scale", type=float, default=1.0, help="traces: multiply every length by this")
    parser.add_argument("--max-input", type=int, help="traces: cap each prompt at this many tokens")
    parser.add_argument("--max-output", type=int, help="traces: cap each answer at this many tokens")
    parser.add_argument("--seed", type=int, default=0, help="random seed of generated tokens (default 0)")


def add_bench_command(commands: Any) -> None:
    bench = commands.add_parser(
        "bench",
        help="replay a trace or an agentic workload against an OpenAI endpoint; JSON report and PNG",
        description="Send a workload to any OpenAI-compatible endpoint (coserve's router, vLLM, ...) as streamed "
        "/v1/completions requests with token-id prompts, show progress, print TTFT/TBT/TTFET percentiles and "
        "write bench.json and bench.png to --output. Workloads: 'agentic' (generated: a long first turn, short "
        "appended turns after tool-call gaps), 'mooncake' (the Mooncake conversation trace) or 'azure' (the "
        "Azure LLM trace), the traces sped up by --speedup and their lengths scaled by --scale.",
    )
    bench.add_argument("--url", required=True, help="the endpoint, e.g. http://127.0.0.1:8080 (with or without /v1)")
    bench.add_argument("--model", help="model name (default: the first one /v1/models lists)")
    bench.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' (a tenant key on coserve's router)")
    add_workload_arguments(bench, conversations=8)
    bench.add_argument("--wait", type=float, default=0.0, help="wait up to this many seconds for the endpoint")
    bench.add_argument("--timeout", type=float, default=1800.0, help="per-request timeout, seconds (default 1800)")
    bench.add_argument("--ttft-p95-target", type=float, help="report met=false when p95 TTFT exceeds this (s)")
    bench.add_argument("--output", default="coserve-bench", help="folder for bench.json and bench.png")
    bench.set_defaults(handler=_cmd_bench)


def check_workload(args: argparse.Namespace) -> list[Problem]:
    """The shared workload flags' problems, each naming its flag."""
    problems = []
    for flag, value in (("--conversations", args.conversations), ("--turns", args.turns), ("--first", args.first),
                        ("--answer", args.answer), ("--max-input", args.max_input),
                        ("--max-output", args.max_output)):  # fmt: skip
        if value is not None and value < 1:
            problems.append(Problem(flag, f"must be at least 1, got {value}"))
    for flag, value in (("--rate", args.rate), ("--speedup", args.speedup), ("--scale", args.scale)):
        if not (value > 0 and math.isfinite(value)):
            problems.append(Problem(flag, f"must be a positive number, got {value}"))
    for flag, value in (("--appended", args.appended), ("--gap", args.gap)):
        if value < 0:
            problems.append(Problem(flag, f"must not be negative, got {value}"))
    return problems


def _check(args: argparse.Namespace) -> list[Problem]:
    problems = check_workload(args)
    if not args.url.startswith(("http://", "https://")):
        problems.insert(0, Problem("--url", f"must be an http(s) URL, got {args.url!r}"))
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        problems.append(Problem("--timeout", f"must be a positive number, got {args.timeout}"))
    if args.wait < 0:
        problems.append(Problem("--wait", f"must not be negative, got {args.wait}"))
    return problems


def workload_from(args: argparse.Namespace, lengths_only: bool = False) -> list[Any]:
    """The conversations the shared workload flags describe; ``InvalidInput`` for an unreadable trace.

    ``lengths_only`` (the simulator): trace prompts carry their length, not their tokens."""
    from coserve.bench import workload

    if args.workload == "agentic":
        return workload.agentic(args.conversations, args.rate, args.turns, args.first, args.appended, args.answer,
                                args.gap, args.seed)  # fmt: skip
    path = Path(args.trace) if args.trace else DEFAULT_TRACES[args.workload]
    if not args.trace and not path.is_file():
        raise InvalidInput([Problem("--trace", f"no {args.workload} trace at {path}, the default: the traces come "
                                    "with a checkout of the coserve repository (data/traces), not with an installed "
                                    "package; pass --trace FILE")])  # fmt: skip
    replay = {"speedup": args.speedup, "scale": args.scale, "max_conversations": args.conversations,
              "max_input_tokens": args.max_input, "max_output_tokens": args.max_output,
              "lengths_only": lengths_only}  # fmt: skip
    try:
        with path.open(newline="") as handle:
            if args.workload == "mooncake":
                rows = (json.loads(line) for line in handle if line.strip())
                return workload.from_mooncake(rows, **replay)
            return workload.from_azure(csv.DictReader(handle), seed=args.seed, **replay)
    except OSError as error:
        raise InvalidInput([Problem("--trace", f"cannot read {path}: {error.strerror or error}")]) from None
    except (ValueError, KeyError) as error:
        raise InvalidInput([Problem("--trace", f"{path} is not a {args.workload} trace: {error}")]) from None


def _cmd_bench(args: argparse.Namespace) -> int:
    problems = _check(args)
    if problems:
        raise InvalidInput(problems, source="coserve bench")
    from coserve.bench.run import BenchError, Progress, discover_model, replay, write_report

    conversations = workload_from(args)
    if not conversations:
        raise InvalidInput([Problem("--trace", "the workload has no conversation")], source="coserve bench")
    turns = sum(len(c.turns) for c in conversations)
    try:
        model = args.model or asyncio.run(discover_model(args.url, args.api_key, args.wait))
    except BenchError as error:
        print(f"coserve bench: {error}", file=sys.stderr)
        return 1
    print(f"coserve bench: {len(conversations)} {args.workload} conversations, {turns} requests, model {model!r}, "
          f"against {args.url}", file=sys.stderr)  # fmt: skip
    records, duration = asyncio.run(
        replay(args.url, model, conversations, api_key=args.api_key, timeout_s=args.timeout, progress=Progress(turns))
    )
    setup = {key: getattr(args, key) for key in ("url", "workload", "trace", "conversations", "rate", "turns", "first",
                                                  "appended", "answer", "gap", "speedup", "scale", "seed")}  # fmt: skip
    setup["model"] = model
    report = write_report(Path(args.output), records, duration, setup, args.ttft_p95_target)
    _print_summary(report, Path(args.output))
    return 0 if report["errors"] == 0 else 1


def _print_summary(report: dict[str, Any], folder: Path) -> None:
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    print(f"{'':14}{'p50':>9}{'p90':>9}{'p95':>9}{'p99':>9}")
    for label, key in (("TTFT (s)", "ttft_s"), ("TBT (s)", "tbt_s"), ("TTFET (s)", "ttfet_s"), ("e2e (s)", "e2e_s")):
        row = report[key]
        print(f"{label:14}" + "".join(f"{seconds(row[p]):>9}" for p in ("p50", "p90", "p95", "p99")))
    rate = report["output_tokens_per_s"]
    print(f"{report['requests']} requests, {report['errors']} errors in {report['duration_s']:.1f} s; "
          f"{0.0 if rate is None else rate:.1f} output tokens/s")  # fmt: skip
    print(f"report: {folder / 'bench.json'} and {folder / 'bench.png'}")
    errors = [r["error"] for r in report["records"] if r.get("error")]
    if errors:
        print(f"first error: {errors[0]}", file=sys.stderr)
