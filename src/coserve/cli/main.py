"""The ``coserve`` command line.

    coserve plan FILE [-o table|json|yaml] [--profile FILE]
    coserve render FILE [-o yaml|json] [--profile FILE]
    coserve crd [-o yaml|json]

Exit codes: 0 success, 2 invalid input or usage (one ``FILE: path: reason`` line
per problem on stderr), 1 an internal error (one line, no traceback unless
``COSERVE_DEBUG=1``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import yaml

from coserve import __version__
from coserve.api.crd import crd_manifest
from coserve.api.problems import InvalidInput
from coserve.api.profile import EngineProfile
from coserve.api.resource import CoServePool
from coserve.api.status import Plan
from coserve.cli.manifest import load_pool, load_profile, read_file
from coserve.provisioning import plan_for

__all__ = ["main"]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_INVALID = 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``coserve`` console script; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "handler"):
        parser.print_help(sys.stderr)
        return EXIT_INVALID
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except InvalidInput as error:
        source = error.source or getattr(args, "file", None) or "input"
        for problem in error.problems:
            print(f"{source}: {problem}", file=sys.stderr)
        return EXIT_INVALID
    except BrokenPipeError:  # `coserve render x.yaml | head`
        sys.stderr.close()
        return EXIT_OK
    except Exception as error:  # noqa: BLE001 - the last line of defence: no traceback for users
        if os.environ.get("COSERVE_DEBUG") == "1":
            traceback.print_exc()
        print(
            f"coserve: internal error: {type(error).__name__}: {error} (set COSERVE_DEBUG=1 for details)",
            file=sys.stderr,
        )
        return EXIT_ERROR


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="coserve",
        description="coserve: size, render and run CoServePool LLM serving pools.",
    )
    parser.add_argument("--version", action="version", version=f"coserve {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    plan = commands.add_parser(
        "plan",
        help="validate a CoServePool manifest and print its provisioning plan",
        description="Validate a CoServePool manifest and print the replicas the provisioning model "
        "chooses, with the reasoning behind each number.",
    )
    plan.add_argument("file", metavar="FILE", help="CoServePool manifest (YAML or JSON); - reads stdin")
    plan.add_argument(
        "-o", "--output", choices=("table", "json", "yaml"), default="table", help="output format (default: table)"
    )
    _add_profile_option(plan)
    plan.set_defaults(handler=_cmd_plan)

    render = commands.add_parser(
        "render",
        help="print the Kubernetes objects the operator would create for a CoServePool",
        description="Print the ConfigMap, Deployments and Services the operator creates for a "
        "CoServePool manifest (the same code the operator runs).",
    )
    render.add_argument("file", metavar="FILE", help="CoServePool manifest (YAML or JSON); - reads stdin")
    render.add_argument(
        "-o", "--output", choices=("yaml", "json"), default="yaml", help="output format (default: yaml)"
    )
    _add_profile_option(render)
    render.set_defaults(handler=_cmd_render)

    crd = commands.add_parser(
        "crd",
        help="print the CoServePool CustomResourceDefinition",
        description="Print the CoServePool CRD generated from the API models (what crds/ holds).",
    )
    crd.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml", help="output format")
    crd.set_defaults(handler=_cmd_crd)
    return parser


def _add_profile_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile",
        metavar="PROFILE",
        help="engine profile file from `coserve profile`, standing in for spec.profile.configMapRef",
    )


def _load(args: argparse.Namespace) -> tuple[CoServePool, EngineProfile | None, Plan]:
    pool = load_pool(read_file(args.file))
    measured = None
    if args.profile is not None:
        try:
            measured = load_profile(read_file(args.profile))
        except InvalidInput as error:
            raise InvalidInput(error.problems, source=args.profile) from None
    return pool, measured, plan_for(pool.spec, measured)


def _cmd_plan(args: argparse.Namespace) -> int:
    pool, _, plan = _load(args)
    if args.output == "table":
        _print_table(pool, plan, sys.stdout)
    else:
        document = {
            "name": pool.metadata.name,
            "namespace": pool.metadata.namespace or "default",
            "plan": plan.to_wire(),
        }
        _dump(document, args.output, sys.stdout)
    return EXIT_OK


def _cmd_render(args: argparse.Namespace) -> int:
    from coserve.operator.resources import build_children  # the operator's own builder, same code path

    pool, _, plan = _load(args)
    objects = build_children(pool, plan)
    if args.output == "json":
        _dump({"apiVersion": "v1", "kind": "List", "items": objects}, "json", sys.stdout)
    else:
        yaml.safe_dump_all(objects, sys.stdout, sort_keys=False, explicit_start=True)
    return EXIT_OK


def _cmd_crd(args: argparse.Namespace) -> int:
    _dump(crd_manifest(), args.output, sys.stdout)
    return EXIT_OK


def _dump(document: Any, output: str, stream: TextIO) -> None:
    if output == "json":
        json.dump(document, stream, indent=2)
        stream.write("\n")
    else:
        yaml.safe_dump(document, stream, sort_keys=False, width=100)


def _print_table(pool: CoServePool, plan: Plan, stream: TextIO) -> None:
    spec = pool.spec
    namespace = pool.metadata.namespace or "default"
    rows = [
        (
            "prefillers",
            str(plan.prefillers),
            f"one saturates at R* = {plan.saturation_rate_per_s:.4g} conv/s; "
            f"the pool at {plan.pool_saturation_rate_per_s:.4g}",
        ),
        (
            "decoders",
            str(plan.decoders),
            f"{plan.binding_constraint.value} binds; "
            f"{plan.decoders_per_prefiller:.3g} per saturated prefiller before headroom",
        ),
        ("bottleneck", plan.bottleneck.value, "saturates first as load rises"),
        ("prefill throughput", f"{plan.prefill_throughput_tokens_per_s:,.0f}", "tokens/s per prefiller (T_p)"),
        ("KV slots", str(plan.kv_slots_per_decoder), "conversations per decoder (B)"),
        ("design rate", f"{plan.design_rate_per_s:.4g}", "conversations/s the decoders are sized for"),
    ]
    utilization = plan.utilization
    out = [
        f"CoServePool {namespace}/{pool.metadata.name}: model {spec.model.name}, "
        f"target {spec.workload.arrival_rate_per_s:g} conversations/s, headroom {spec.headroom:g}",
        "",
    ]
    width = max(len(name) for name, _, _ in rows)
    value_width = max(len(value) for _, value, _ in rows)
    out += [f"  {name:<{width}}  {value:>{value_width}}  {note}" for name, value, note in rows]
    out += [
        "",
        f"Utilization at the target rate: prefillers {utilization.prefiller:.0%}, decoder throughput "
        f"{utilization.decoder_throughput:.0%}, decoder KV memory {utilization.decoder_memory:.0%}",
        "",
        "Why:",
        *[f"  - {line}" for line in plan.explanation],
    ]
    if plan.warnings:
        out += ["", "Warnings:", *[f"  ! {line}" for line in plan.warnings]]
    stream.write("\n".join(out) + "\n")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
