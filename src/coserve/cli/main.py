"""The ``coserve`` command line.

    coserve plan FILE [-o table|json|yaml] [--profile FILE]
    coserve render FILE [-o yaml|json] [--profile FILE]
    coserve crd [-o yaml|json]
    coserve profile [--model PATH | --tiny-layers N] [--out FILE] [--max-model-len N] [--repeats N] [--quick]
    coserve up FILE [--prefillers N] [--decoders N] [--port N] [--once]
    coserve router --config FILE
    coserve bench --url URL [--workload agentic|mooncake|azure] [...]
    coserve simulate FILE [--profile FILE] [--workload ...] [--policy conversation|per-turn|per-request]

Exit codes: 0 success, 2 invalid input or usage (one ``FILE: path: reason`` line
per problem on stderr), 1 an internal error (one line, no traceback unless
``COSERVE_DEBUG=1``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import yaml

from coserve import __version__
from coserve.api.crd import crd_manifest
from coserve.api.problems import InvalidInput, Problem
from coserve.api.resource import CoServePool
from coserve.api.spec import PoolShape
from coserve.api.status import Plan, ShapeComparison
from coserve.cli.bench import add_bench_command
from coserve.cli.manifest import load_planned
from coserve.cli.simulate import add_simulate_command
from coserve.gaie import CERT_FILE, HEALTH_PORT, KEY_FILE

if TYPE_CHECKING:
    from coserve.engine.profiler import EngineDtype
    from coserve.scheduling.profile_fit import ProfileGrid

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
        description="Print every object the operator creates for a CoServePool manifest (the ConfigMap, "
        "Deployments, Services, PodDisruptionBudgets, the router token Secret, the router's ServiceAccount, Role "
        "and RoleBinding, and the NetworkPolicy), from the same code the operator runs.",
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

    _add_profile_command(commands)
    _add_operator_command(commands)
    _add_router_command(commands)
    _add_epp_command(commands)
    _add_up_command(commands)
    add_bench_command(commands)
    add_simulate_command(commands, _add_profile_option)
    return parser


def _add_up_command(commands: Any) -> None:
    up = commands.add_parser(
        "up",
        help="run a pool on this machine: prefiller and decoder engines and the router, no Kubernetes",
        description="Print the pool's plan, start its shape scaled to this machine (P/D: one prefiller and one "
        "decoder; aggregated: two engines that prefill their own turns; --prefillers and --decoders change the "
        "counts) as vLLM engines "
        "(the manifest's model when it is a local folder, else a tiny random-weight model) and the router, and "
        "print the OpenAI base URL. Ctrl-C or SIGTERM stops every process. --once sends one two-turn "
        "conversation through the router and stops.",
    )
    up.add_argument("file", help="CoServePool manifest (YAML or JSON)")
    _add_profile_option(up)
    up.add_argument("--model", metavar="PATH", help="a local model folder (overrides spec.model.name)")
    up.add_argument(
        "--prefillers",
        type=int,
        default=None,
        help="prefiller engines on this machine (default: 1 for a P/D plan, 0 for aggregated engines)",
    )
    up.add_argument(
        "--decoders", type=int, default=None, help="decoder engines on this machine (default: 1 for P/D, 2 aggregated)"
    )
    up.add_argument("--port", type=int, default=8080, help="the router's port (default 8080; 0: any free port)")
    up.add_argument("--once", action="store_true", help="send one two-turn conversation, print it, stop")
    up.set_defaults(handler=_cmd_up)


def _cmd_up(args: argparse.Namespace) -> int:
    problems = []
    pool, _, plan = load_planned(args.file, args.profile)
    # the plan's shape on this machine's two cores: P/D as one prefiller and one decoder, aggregated as two engines
    if args.prefillers is None:
        args.prefillers = 0 if plan.aggregated else 1
    if args.decoders is None:
        args.decoders = 2 if plan.aggregated else 1
    if not 0 <= args.prefillers <= 8:
        problems.append(Problem("--prefillers", f"must be 0 to 8 on one machine, got {args.prefillers}"))
    if not 1 <= args.decoders <= 8:
        problems.append(Problem("--decoders", f"must be 1 to 8 on one machine, got {args.decoders}"))
    if not 0 <= args.port <= 65535:
        problems.append(Problem("--port", f"must be a port number, got {args.port}"))
    if args.model is not None and not Path(args.model).is_dir():
        problems.append(Problem("--model", f"{args.model} is not a model folder"))
    if problems:
        raise InvalidInput(problems, source="coserve up")
    _print_table(pool, plan, sys.stdout)
    from coserve.local import run_local_pool

    return run_local_pool(
        pool,
        plan,
        model=Path(args.model) if args.model else None,
        prefillers=args.prefillers,
        decoders=args.decoders,
        port=args.port,
        once=args.once,
    )


def _add_router_command(commands: Any) -> None:
    router = commands.add_parser(
        "router",
        help="run the OpenAI-compatible router in front of a pool's engines",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics, placing "
        "conversations (turn 1 via a prefiller onto the decoder with the lowest KV occupancy, later turns on "
        "that decoder) and capping each request's class at its tenant's. The config is the router.json the "
        "operator renders (see coserve.router.config).",
    )
    _add_serving_arguments(router, 8080, "port")
    router.set_defaults(handler=_cmd_router)


def _add_serving_arguments(parser: Any, port: int, what: str) -> None:
    """What ``coserve router`` and ``coserve epp`` both take: the router.json, where to listen, the log level."""
    parser.add_argument("--config", required=True, metavar="FILE", help="router.json")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: 0.0.0.0)")  # noqa: S104
    parser.add_argument("--port", type=int, default=port, help=f"{what} (default: {port})")
    parser.add_argument(
        "--log-level", choices=("debug", "info", "warning", "error"), default="info", help="log level (default: info)"
    )


def _add_epp_command(commands: Any) -> None:
    epp = commands.add_parser(
        "epp",
        help="run the pool's placement as a Gateway API Inference Extension endpoint picker",
        description="Serve Envoy's external-processing gRPC API (ext_proc) as GAIE's endpoint picker protocol "
        "specifies: each completion request is admitted and placed as the router places it (the conversation's "
        "decoder; turn 1 prefilled where its first token comes soonest), and the gateway forwards it to the "
        "picked engine itself. The config is the router.json the operator renders. With --envoy-config, write "
        "an Envoy bootstrap that uses this picker and exit.",
    )
    _add_serving_arguments(epp, 9002, "ext_proc gRPC port")
    epp.add_argument("--metrics-port", type=int, default=9090, help="/metrics port; 0: none (default: 9090)")
    epp.add_argument(
        "--health-port",
        type=int,
        default=HEALTH_PORT,
        help=f"gRPC health in cleartext, for the kubelet's probes; 0: none (default: {HEALTH_PORT})",
    )
    epp.add_argument(
        "--secure-serving",
        action="store_true",
        help="serve ext_proc over TLS, as GAIE's endpoint pickers do (the certificate from --cert-path, else a "
        "self-signed one); gateways that follow GAIE's charts connect to a picker over TLS",
    )
    epp.add_argument(
        "--cert-path",
        metavar="DIR",
        type=Path,
        help=f"with --secure-serving: serve DIR/{CERT_FILE} and DIR/{KEY_FILE} (a kubernetes.io/tls Secret's "
        "mount), read again on each new connection, so a rotated Secret is served without a restart",
    )
    epp.add_argument(
        "--envoy-config", metavar="FILE", help="write an Envoy bootstrap (JSON) for a gateway on --gateway-port"
    )
    epp.add_argument("--gateway-port", type=int, default=8080, help="the Envoy listener's port (default: 8080)")
    epp.add_argument(
        "--body-mode",
        choices=("full-duplex", "buffered"),
        default="full-duplex",
        help="how the written Envoy sends bodies to the picker: full-duplex (as GAIE's gateways: the tokens pass "
        "the picker) or buffered (the request body whole, the response body never: cheaper) (default: full-duplex)",
    )
    epp.set_defaults(handler=_cmd_epp)


def _cmd_epp(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import logging
    from pathlib import Path

    config = _router_config(args)
    ports = (("--metrics-port", args.metrics_port), ("--gateway-port", args.gateway_port),
             ("--health-port", args.health_port))  # fmt: skip
    for flag, port in ports:
        if port and not 1 <= port <= 65535:
            raise InvalidInput([Problem(flag, f"must be a port number, got {port}")])
    if args.cert_path is not None and not args.secure_serving:
        raise InvalidInput([Problem("--cert-path", "serves a certificate only with --secure-serving")])
    from coserve.epp.envoy import envoy_bootstrap

    if args.envoy_config:
        picker_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host  # noqa: S104
        ca = str(args.cert_path.resolve() / CERT_FILE) if args.cert_path is not None else None
        bootstrap = envoy_bootstrap(listen_port=args.gateway_port, picker_host=picker_host, picker_port=args.port,
                                    max_request_bytes=config.max_body_bytes, body_mode=args.body_mode,
                                    picker_tls=args.secure_serving, picker_ca=ca)  # fmt: skip
        Path(args.envoy_config).write_text(json.dumps(bootstrap, indent=2) + "\n")
        print(f"wrote {args.envoy_config}: run `envoy -c {args.envoy_config}` beside `coserve epp`")
        return EXIT_OK
    from coserve.epp.server import serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvloop

    # NOTE: on uvloop the picker spends a fifth less CPU per request than on asyncio's own loop (profiled at
    # 200 requests/s behind Envoy); most of the rest is gRPC's own machinery.
    from coserve.epp.tls import CertificateError

    serving = {"health_port": args.health_port or None, "secure": args.secure_serving, "cert_dir": args.cert_path}
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        try:
            runner.run(serve(config, args.host, args.port, args.metrics_port or None, **serving))
        except CertificateError as error:
            raise InvalidInput([Problem("--cert-path", str(error))]) from None
    return EXIT_OK


def _router_config(args: argparse.Namespace) -> Any:
    """``--config``'s router.json, parsed, and ``--port`` checked (``coserve router`` and ``coserve epp``)."""
    import json
    from pathlib import Path

    from coserve.router.config import parse_router_config

    path = Path(args.config)
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise InvalidInput([Problem("--config", f"cannot read {path}: {error.strerror or error}")]) from None
    except json.JSONDecodeError as error:
        raise InvalidInput([Problem("--config", f"{path} is not JSON: {error}")]) from None
    if not isinstance(data, dict):
        raise InvalidInput([Problem("--config", f"{path} must hold a JSON object")])
    if not 1 <= args.port <= 65535:
        raise InvalidInput([Problem("--port", f"must be a port number, got {args.port}")])
    return parse_router_config(data)


def _cmd_router(args: argparse.Namespace) -> int:
    config = _router_config(args)

    import uvicorn

    from coserve.router.app import build_app

    app = build_app(config)
    import gc

    # NOTE: every request allocates a few hundred objects; the default gen-0 threshold (700) ran a
    # collection every couple of requests, and full collections showed up in the p99 latency.
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    # the router reads no client address (no X-Forwarded-For to parse) and names no server in its answers
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                proxy_headers=False, server_header=False)  # fmt: skip
    return EXIT_OK


def _add_operator_command(commands: Any) -> None:
    operator = commands.add_parser(
        "operator",
        help="run the CoServePool operator (kopf) against the current cluster",
        description="Reconcile CoServePool objects into prefiller, decoder and router workloads. In a pod it "
        "uses the service account; elsewhere the current kubeconfig context.",
    )
    scope = operator.add_mutually_exclusive_group()
    scope.add_argument(
        "-n", "--namespace", action="append", metavar="NS", help="watch only NS (repeatable; namespaced mode)"
    )
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace (the default)")
    operator.add_argument("--kubeconfig", metavar="FILE", help="kubeconfig file (default: in a pod the service "
                          "account, else $KUBECONFIG or ~/.kube/config)")  # fmt: skip
    operator.add_argument("--context", metavar="NAME", help="kubeconfig context (default: the current one)")
    peers = operator.add_mutually_exclusive_group()
    peers.add_argument(
        "--lease",
        metavar="NAME",
        default="coserve-operator",
        help="coordination.k8s.io Lease that elects the one replica that acts (default: coserve-operator)",
    )
    peers.add_argument("--standalone", action="store_true", help="no leader election: only for a single replica")
    operator.add_argument(
        "--lease-namespace",
        metavar="NS",
        default=os.environ.get("POD_NAMESPACE"),
        help="namespace of the Lease (default: $POD_NAMESPACE, else the first --namespace, else the "
        "context's namespace)",
    )
    operator.add_argument(
        "--identity", metavar="ID", default=None, help="this replica's name in the Lease (default: $HOSTNAME-PID)"
    )
    operator.add_argument(
        "--lease-duration-s",
        type=float,
        default=15.0,
        metavar="S",
        help="a silent leader is replaced after S seconds (default: 15; renew deadline 2/3 of it, retry 2/15 of it)",
    )
    operator.add_argument(
        "--resync-s", type=float, default=30.0, metavar="S", help="re-check every pool every S seconds (default: 30)"
    )
    operator.add_argument("--liveness", metavar="URL", help="kopf liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    operator.add_argument(
        "--metrics-port", type=int, default=0, metavar="PORT", help="serve Prometheus metrics on PORT (default: off)"
    )
    operator.add_argument(
        "--log-level",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        default=os.environ.get("COSERVE_LOG_LEVEL", "INFO"),
        help="log level (default: $COSERVE_LOG_LEVEL or INFO)",
    )
    operator.set_defaults(handler=_cmd_operator)


def _cmd_operator(args: argparse.Namespace) -> int:
    problems = []
    if args.resync_s <= 0:
        problems.append(Problem("--resync-s", f"must be positive, got {args.resync_s}"))
    if not 0 <= args.metrics_port <= 65535:
        problems.append(Problem("--metrics-port", f"must be a port number (0 = off), got {args.metrics_port}"))
    if args.lease_duration_s < 1.5:
        problems.append(Problem("--lease-duration-s", f"must be at least 1.5 seconds, got {args.lease_duration_s}"))
    if problems:
        raise InvalidInput(problems, source="coserve operator")
    import logging
    import socket

    import kopf
    import prometheus_client

    from coserve.operator.handlers import build_registry
    from coserve.operator.kube import KubeError, load_cluster
    from coserve.operator.leader import LeaseSettings

    try:
        cluster = load_cluster(args.kubeconfig, args.context)
    except KubeError as error:
        raise InvalidInput([Problem("--kubeconfig", error.message)], source="coserve operator") from None
    lease = None
    if not args.standalone:
        namespace = args.lease_namespace or (args.namespace[0] if args.namespace else cluster.namespace) or "default"
        identity = args.identity or f"{os.environ.get('HOSTNAME') or socket.gethostname()}-{os.getpid()}"
        duration = args.lease_duration_s
        lease = LeaseSettings(
            name=args.lease,
            namespace=namespace,
            identity=identity,
            lease_duration_s=duration,
            renew_deadline_s=duration * 2 / 3,
            retry_period_s=duration * 2 / 15,
        )
    # Namespaced mode: kopf must not list namespaces or CRDs (the chart's Roles do not allow it).
    registry = build_registry(
        lambda: cluster,
        lease=lease,
        scanning=not args.namespace,
        namespaces=args.namespace,
        resync_s=args.resync_s,
    )
    kopf.configure(debug=args.log_level == "DEBUG", verbose=False)  # kopf's log format and handler
    logging.getLogger().setLevel(args.log_level)
    if args.log_level != "DEBUG":
        for noisy in ("httpx", "httpx2"):
            logging.getLogger(noisy).setLevel(logging.WARNING)  # one line per API request otherwise
    if args.metrics_port:
        prometheus_client.start_http_server(args.metrics_port)
    kopf.run(
        registry=registry,
        standalone=True,  # kopf peering off: the Lease elects the replica that acts
        namespaces=args.namespace or (),
        clusterwide=not args.namespace,
        liveness_endpoint=args.liveness,
    )
    return EXIT_OK


def _add_profile_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile",
        metavar="PROFILE",
        help="engine profile file from `coserve profile`, standing in for spec.profile.configMapRef",
    )


def _cmd_plan(args: argparse.Namespace) -> int:
    pool, _, plan = load_planned(args.file, args.profile)
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

    pool, _, plan = load_planned(args.file, args.profile)
    objects = build_children(pool, plan)
    if args.output == "json":
        _dump({"apiVersion": "v1", "kind": "List", "items": objects}, "json", sys.stdout)
    else:
        yaml.safe_dump_all(objects, sys.stdout, sort_keys=False, explicit_start=True)
    return EXIT_OK


def _cmd_crd(args: argparse.Namespace) -> int:
    _dump(crd_manifest(), args.output, sys.stdout)
    return EXIT_OK


_PROFILE = "coserve profile"
_TINY_MODEL_MAX_LEN = 8192  # TinyModelSpec.max_position_embeddings
# "org/name" as the Hugging Face hub spells a model; anything else must be a local folder.
_HUB_MODEL_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _add_profile_command(commands: Any) -> None:
    profile = commands.add_parser(
        "profile",
        help="measure a real vLLM engine on this machine and write a CoServeProfile",
        description="Start vLLM in this process, time prefill steps over a grid of new (P) and cached (C) "
        "tokens, fit the step cost model and the prefill curve, measure decode throughput and KV capacity, "
        "and write the profile that `coserve plan --profile` and spec.profile.configMapRef read. Without "
        "--model it builds a random-weight tiny Llama (no download). Progress goes to stderr.",
    )
    which = profile.add_mutually_exclusive_group()
    which.add_argument("--model", metavar="PATH", help="model folder (or hub id) to profile; default: the tiny model")
    which.add_argument(
        "--tiny-layers", type=int, metavar="N", help="layers of the tiny model (default 4; 16 for benchmark-sized)"
    )
    profile.add_argument("--out", metavar="FILE", help="write the profile to FILE (default: stdout)")
    profile.add_argument(
        "--max-model-len", type=int, default=4096, metavar="N", help="engine context length (default: 4096)"
    )
    profile.add_argument("--repeats", type=int, default=3, metavar="N", help="timings per grid point (default: 3)")
    profile.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="engine dtype (default: float32 for the tiny model, auto for --model)",
    )
    profile.add_argument("--quick", action="store_true", help="a small grid and decode batch (about 10 s of timing)")
    profile.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    profile.set_defaults(handler=_cmd_profile)


def _cmd_profile(args: argparse.Namespace) -> int:
    # Imported here: `coserve plan` must stay fast and work where vLLM is not installed.
    from coserve.engine.profiler import ProfilerConfig, default_model_cache, run_profile
    from coserve.scheduling.profile_fit import ProfileGrid

    grid = ProfileGrid.quick() if args.quick else ProfileGrid.default()
    problems = _profile_problems(args, grid)
    if problems:
        raise InvalidInput(problems, source=_PROFILE)
    # NOTE: the tiny model runs in float32 as the engine tests serve it; bfloat16 is ~6x slower on AVX2-only CPUs.
    dtype: EngineDtype = args.dtype or ("float32" if args.model is None else "auto")
    if args.model is None:
        from coserve.engine.tiny_model import TinyModelSpec, build_tiny_model

        folder = build_tiny_model(default_model_cache(), TinyModelSpec(num_layers=args.tiny_layers or 4))
        model, model_name = str(folder), folder.name
    else:
        model, model_name = args.model, args.model
    config = ProfilerConfig(
        model=model,
        model_name=model_name,
        grid=grid,
        max_model_len=args.max_model_len,
        repeats=args.repeats,
        dtype=dtype,
        quiet=args.quiet,
        decode_requests=8 if args.quick else 16,
        decode_output_tokens=32 if args.quick else 64,
    )
    with _stdout_to_stderr():
        result = run_profile(config)
    document = result.profile.to_wire()
    if args.out is None:
        _dump(document, "yaml", sys.stdout)
        return EXIT_OK
    with open(args.out, "w", encoding="utf-8") as handle:
        handle.write("# Measured by `coserve profile`; use it with: coserve plan POOL --profile THIS_FILE\n")
        _dump(document, "yaml", handle)
    if not args.quiet:
        print(f"wrote {args.out}", file=sys.stderr)
    return EXIT_OK


def _profile_problems(args: argparse.Namespace, grid: ProfileGrid) -> list[Problem]:
    """Everything wrong with the arguments, found before a minute of engine start-up is spent."""
    problems = []
    if importlib.util.find_spec("vllm") is None:
        problems.append(Problem("", "needs vLLM: pip install 'coserve[engine-cpu]' (or 'coserve[engine]' on GPUs)"))
    if not 1 <= args.repeats <= 100:
        problems.append(Problem("--repeats", f"must be between 1 and 100, got {args.repeats}"))
    if args.tiny_layers is not None and not 1 <= args.tiny_layers <= 128:
        problems.append(Problem("--tiny-layers", f"must be between 1 and 128, got {args.tiny_layers}"))
    if args.model is None and args.max_model_len > _TINY_MODEL_MAX_LEN:
        problems.append(
            Problem(
                "--max-model-len",
                f"the tiny model holds at most {_TINY_MODEL_MAX_LEN} tokens, got {args.max_model_len}",
            )
        )
    else:
        try:
            grid.fitting(args.max_model_len - 1)
        except ValueError as error:
            problems.append(Problem("--max-model-len", f"{args.max_model_len} is too small: {error}"))
    if args.model is not None:
        folder = Path(args.model)
        if folder.exists() and not (folder / "config.json").is_file():
            problems.append(Problem("--model", f"{args.model} is not a model folder (it has no config.json)"))
        elif not folder.exists() and not _HUB_MODEL_ID.match(args.model):
            problems.append(Problem("--model", f"{args.model}: no such folder"))
    if args.out is not None:
        out = Path(args.out)
        if out.is_dir():
            problems.append(Problem("--out", f"{args.out} is a directory"))
        elif not out.parent.is_dir():
            problems.append(Problem("--out", f"folder {str(out.parent)!r} does not exist"))
    return problems


@contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send file descriptor 1 to stderr meanwhile, so the profile owns stdout.

    NOTE: vLLM logs to stdout, and its engine-core process inherits the descriptor,
    so swapping ``sys.stdout`` alone would not keep the YAML clean.
    """
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _dump(document: Any, output: str, stream: TextIO) -> None:
    if output == "json":
        json.dump(document, stream, indent=2)
        stream.write("\n")
    else:
        yaml.safe_dump(document, stream, sort_keys=False, width=100)


def _print_table(pool: CoServePool, plan: Plan, stream: TextIO) -> None:
    spec = pool.spec
    namespace = pool.metadata.namespace or "default"
    out = [
        f"CoServePool {namespace}/{pool.metadata.name}: model {spec.model.name}, "
        f"target {spec.workload.arrival_rate_per_s:g} conversations/s, headroom {spec.headroom:g}: "
        f"sized for {plan.design_rate_per_s:.4g} conversations/s",
    ]
    if plan.shapes is not None:
        out += ["", *_shape_table(plan.shapes)]
    rows = [
        (
            "prefillers",
            str(plan.prefillers),
            "none: every engine prefills its own conversations"
            if plan.aggregated
            else f"one saturates at R* = {plan.saturation_rate_per_s:.4g} conv/s",
        ),
        (
            "engines" if plan.aggregated else "decoders",
            str(plan.decoders),
            "each prefills its conversations' turns and decodes them"
            if plan.aggregated
            else f"{plan.binding_constraint.value} binds among the decoders' needs",
        ),
        (
            "bottleneck",
            plan.bottleneck.value,
            f"saturates first as load rises, at {plan.pool_saturation_rate_per_s:.4g} conv/s",
        ),
        (
            "prefill throughput",
            f"{plan.prefill_throughput_tokens_per_s:,.0f}",
            "tokens/s of one engine prefilling (T_p)",
        ),
        ("KV slots", str(plan.kv_slots_per_decoder), "conversations per decoder (B)"),
        (
            "decoder prefill",
            f"{plan.decoder_prefill_tokens:,.0f}",
            f"tokens per conversation (A), each worth w = {plan.prefill_weight:.3g} decode tokens",
        ),
        (
            "idle KV",
            plan.idle_kv.value,
            "KV held " + (f"{plan.kv_held_s:.4g} s per conversation (W_kv)" if plan.kv_held_s is not None else "for W"),
        ),
    ]
    utilization = plan.utilization
    width = max(len(name) for name, _, _ in rows)
    value_width = max(len(value) for _, value, _ in rows)
    out += ["", f"The {'aggregated' if plan.aggregated else 'P/D'} pool:"]
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


def _shape_table(shapes: ShapeComparison) -> list[str]:
    """Both shapes sized for the objectives, side by side, the chosen one marked."""
    options = [("P/D", shapes.disaggregated, PoolShape.DISAGGREGATED),
               ("aggregated", shapes.aggregated, PoolShape.AGGREGATED)]  # fmt: skip

    from coserve.provisioning.shape import rate_text
    from coserve.provisioning.shape import seconds_text as seconds

    rows = [
        ("", [f"{name}{' (chosen)' if shape is shapes.shape else ''}" for name, _, shape in options]),
        ("prefillers", [str(option.prefillers) for _, option, _ in options]),
        ("decoders", [str(option.decoders) for _, option, _ in options]),
        ("engines", [str(option.engines) for _, option, _ in options]),
        ("p95 TTFT", [seconds(option.ttft_p95_s) for _, option, _ in options]),
        ("p95 TTFET", [seconds(option.ttfet_p95_s) for _, option, _ in options]),
        ("mean TPOT", [seconds(option.tpot_s) for _, option, _ in options]),
        ("count set by", [option.limit for _, option, _ in options]),
        ("saturates at", [rate_text(option.saturation_rate_per_s) for _, option, _ in options]),
        ("cannot meet", [", ".join(option.unmet) or "-" for _, option, _ in options]),
    ]
    width = max(len(name) for name, _ in rows)
    column = max(len(cell) for _, cells in rows for cell in cells)
    lines = [
        f"Objectives: TTFT {shapes.ttft_objective_s * 1000:g} ms, TPOT {shapes.tpot_objective_s * 1000:g} ms "
        f"(the tightest online class), predicted at {shapes.design_rate_per_s:.4g} conversations/s:",
    ]
    lines += [f"  {name:<{width}}  " + "  ".join(f"{cell:>{column}}" for cell in cells) for name, cells in rows]
    lines += ["", f"Shape: {shapes.shape.value}: {shapes.reason}"]
    return lines


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
