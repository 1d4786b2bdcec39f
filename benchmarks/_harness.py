"""What the serving benchmarks share: the bench model, its profile, a streaming client, and the SLO arithmetic.

Who uses it: ``benchmarks/priority_scheduling.py`` and ``benchmarks/coserving.py``.
Every request goes over real HTTP to a real vLLM server (``coserve.engine.launch``);
token times are taken from the stream (``continuous_usage_stats`` says how many
tokens each chunk carries), so a request's gain and SLO attainment are judged from
what its client saw, with arrival = the moment the client sent it.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import yaml
from _stats import (  # noqa: F401 - re-exported: the benchmarks read them from here
    MIN_SAMPLES,
    PairedOverhead,
    finite,
    mean_interval,
    percentile,
    reportable_percentile,
    say,
)
from freshness import begin_run, stamp

from coserve.engine.profiler import default_model_cache
from coserve.engine.tiny_model import TinyModelSpec, build_tiny_model
from coserve.scheduling.gain import request_gain, slo_attained
from coserve.scheduling.requests import ClassRegistry

RESULTS = Path(__file__).resolve().parent / "results"
begin_run()  # the code this run measures is the code it starts with (freshness.stamp)
TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"  # the real traces in this checkout (README.md there)
AZURE_CONV = TRACES / "azure_llm_2023_conv.csv"
# Token ids below this are the tiny model's special tokens.
FIRST_PLAIN_ID = 16


def bench_model(layers: int, hidden_size: int) -> Path:
    """The benchmark-sized random-weight Llama (16 layers: one 256-token step takes >= 200 ms here)."""
    spec = TinyModelSpec(
        num_layers=layers,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_heads=8,
        num_kv_heads=4,
    )
    return build_tiny_model(default_model_cache(), spec)


# The cached profile's name says which grid it was fitted on: profiles from before the grid had decode
# batches (``coserve-profile.yaml``) fitted the attention term on single requests and are not reused.
PROFILE_FILE = "coserve-profile-batched.yaml"


def measured_cost_model(model: Path) -> dict[str, float]:
    """The model's step cost model, measured once with ``coserve profile --quick`` and cached beside it.

    This is the deployment workflow: profile the engine, then serve with the fitted model.
    """
    path = model / PROFILE_FILE
    if not path.exists():
        say(f"profiling {model.name} with `coserve profile --quick` (about a minute, once)")
        subprocess.run(  # noqa: S603 - our own CLI
            [
                sys.executable,
                "-m",
                "coserve",
                "profile",
                "--model",
                str(model),
                "--dtype",
                "float32",
                "--quick",
                "--out",
                str(path),
                "-q",
            ],
            check=True,
            # the same 1 GiB KV space the benchmark engines get (EngineServer): vLLM's CPU default reserves
            # 92% of the node's memory and refuses to start when anything else holds a little of it
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")},
        )
    document = yaml.safe_load(path.read_text())
    cost = document.get("costModel")
    if not isinstance(cost, dict):
        raise RuntimeError(f"{path} has no costModel")
    return {key: float(value) for key, value in cost.items() if key.startswith("k")}


@dataclass(frozen=True)
class TraceRow:
    offset_s: float
    context_tokens: int
    generated_tokens: int


TRACE_FORMATS = "an Azure LLM inference CSV (TIMESTAMP,ContextTokens,GeneratedTokens) or a Mooncake JSONL trace"


def load_trace(path: Path) -> list[TraceRow]:
    """Any trace in the formats of ``data/traces/README.md``: arrival offsets (s) and token counts.

    Azure CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``) or Mooncake JSONL
    (``timestamp`` in ms, ``input_length``, ``output_length``), told apart by content,
    sorted by arrival, offsets from the first arrival. A file that is neither is a clear error.
    """
    if not path.exists():
        raise SystemExit(f"trace not found: {path} (the benchmarks replay data/traces by default)")
    with path.open() as handle:
        first = handle.readline().strip()
        handle.seek(0)
        if first.startswith("{"):
            lines = enumerate(handle, 1)
            rows = [_mooncake_row(json.loads(line), path, number) for number, line in lines if line.strip()]
        elif first.replace(" ", "").startswith("TIMESTAMP,ContextTokens,GeneratedTokens"):
            rows = [_azure_row(row, path) for row in csv.DictReader(handle)]
        else:
            raise SystemExit(f"{path}: not a trace this harness reads; expected {TRACE_FORMATS}")
    if not rows:
        raise SystemExit(f"{path}: the trace has no requests")
    rows.sort(key=lambda row: row.offset_s)
    origin = rows[0].offset_s
    return [TraceRow(row.offset_s - origin, row.context_tokens, row.generated_tokens) for row in rows]


def _azure_row(row: dict[str, str], path: Path) -> TraceRow:
    try:
        stamp = datetime.fromisoformat(row["TIMESTAMP"].strip()[:26])  # "2023-11-16 18:15:46.6805900"
        return TraceRow(stamp.timestamp(), int(row["ContextTokens"]), int(row["GeneratedTokens"]))
    except (KeyError, ValueError) as error:
        raise SystemExit(f"{path}: bad Azure row {row!r}: {error}") from None


def _mooncake_row(row: dict[str, Any], path: Path, number: int) -> TraceRow:
    try:
        return TraceRow(float(row["timestamp"]) / 1000.0, int(row["input_length"]), int(row["output_length"]))
    except (KeyError, TypeError, ValueError) as error:
        raise SystemExit(f"{path}:{number}: bad Mooncake row: {error}") from None


def azure_conversation_trace() -> list[TraceRow]:
    """The Azure LLM inference trace (conversation), 2023: arrival offsets and token counts."""
    return load_trace(AZURE_CONV)


def add_trace_argument(parser: argparse.ArgumentParser, default: Path = AZURE_CONV) -> None:
    """``--trace FILE`` for a trace-driven benchmark (results name the trace they replayed)."""
    parser.add_argument(
        "--trace",
        type=Path,
        default=default,
        help=f"the trace to replay: {TRACE_FORMATS} (default: data/traces/{default.name})",
    )


def trace_label(path: Path) -> str:
    """How a result names its trace: the file name, and the path when it is not one of the traces in ``TRACES``."""
    return path.name if path.resolve().parent == TRACES.resolve() else str(path)


@dataclass
class BenchRequest:
    """One request to send ``at_s`` after the phase starts."""

    at_s: float
    prompt: list[int]
    max_tokens: int
    cls: str
    priority: int


@dataclass
class Outcome:
    request: BenchRequest
    sent_s: float = 0.0
    token_times: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.sent_s if self.token_times else None

    @property
    def tpot_s(self) -> float | None:
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


def random_prompt(rng: random.Random, length: int, vocab: int = 1024) -> list[int]:
    return [rng.randrange(FIRST_PLAIN_ID, vocab) for _ in range(length)]


def warm_up(base: str, lengths: tuple[int, ...] = (8, 200), timeout_s: float = 300.0) -> None:
    """One short completion per prompt length at ``base`` (an engine or the router), before anything is timed:
    vLLM's first steps of each shape, and a pool's first handoff, are slow."""
    for length in lengths:
        httpx.post(
            f"{base}/v1/completions",
            timeout=timeout_s,
            json={"model": "tiny", "prompt": list(range(20, 20 + length)), "max_tokens": 4},
        ).raise_for_status()


async def stream_one(
    client: httpx.AsyncClient, base: str, request: BenchRequest, outcome: Outcome | None = None
) -> Outcome:
    """Send one streaming completion and record when each output token arrived.

    Pass ``outcome`` to keep the tokens received so far if the task is cancelled.
    """
    outcome = outcome or Outcome(request)
    outcome.sent_s = time.time()
    payload = {
        "model": "tiny",
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "priority": request.priority,
        "vllm_xargs": {"coserve_class": request.cls},
    }
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=payload) as response:
            if response.status_code != 200:
                outcome.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return outcome
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.time()
                usage = json.loads(line[6:]).get("usage") or {}
                produced = int(usage.get("completion_tokens") or 0)
                outcome.token_times.extend([now] * (produced - len(outcome.token_times)))
    except httpx.HTTPError as error:
        outcome.error = f"{type(error).__name__}: {error}"
    if outcome.error is None and len(outcome.token_times) != request.max_tokens:
        outcome.error = f"got {len(outcome.token_times)} of {request.max_tokens} tokens"
    return outcome


async def replay(base: str, requests: Sequence[BenchRequest], label: str) -> list[Outcome]:
    """Send every request at its offset (open loop) and wait for all of them to finish."""
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:
        start = time.monotonic()
        done = 0

        async def at_offset(request: BenchRequest) -> Outcome:
            nonlocal done
            await asyncio.sleep(max(0.0, start + request.at_s - time.monotonic()))
            outcome = await stream_one(client, base, request)
            done += 1
            return outcome

        async def progress() -> None:
            while True:
                await asyncio.sleep(15)
                say(f"{label}: {done}/{len(requests)} finished, {time.monotonic() - start:.0f} s")

        reporter = asyncio.create_task(progress())
        try:
            return list(await asyncio.gather(*(at_offset(r) for r in requests)))
        finally:
            reporter.cancel()


def class_report(outcomes: Sequence[Outcome], classes: ClassRegistry) -> dict[str, dict[str, Any]]:
    """Per class: requests, failures, SLO attainment, TDG gain earned/possible, TTFT and TPOT percentiles."""
    report: dict[str, dict[str, Any]] = {}
    for name in classes.names:
        cls = classes.get(name)
        mine = [o for o in outcomes if o.request.cls == name]
        ok = [o for o in mine if o.error is None]
        earned = possible = 0.0
        attained = classic = 0
        for o in ok:
            gain = request_gain(cls, o.sent_s, cls.ttft_slo_s, cls.tpot_slo_s, o.token_times)
            earned += gain.earned
            possible += gain.possible
            attained += gain.all_on_time
            classic += slo_attained(o.sent_s, cls.ttft_slo_s, cls.tpot_slo_s, o.token_times)
        ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
        tpots = [o.tpot_s for o in ok if o.tpot_s is not None]
        report[name] = {
            "requests": len(mine),
            "failed": len(mine) - len(ok),
            # every token by its deadline (arrival + TTFT SLO + i * TPOT SLO), as the issue defines deadlines
            "slo_attainment": attained / len(mine) if mine else None,
            # the common alternative: TTFT within its SLO and mean time per output token within its SLO
            "ttft_and_mean_tpot_attainment": classic / len(mine) if mine else None,
            "gain": earned,
            "possible_gain": possible,
            "output_tokens": sum(len(o.token_times) for o in ok),
            "n": len(ok),
            # each percentile only from enough requests to support it (MIN_SAMPLES), else null
            "ttft_p50_s": reportable_percentile(ttfts, 50),
            "ttft_p95_s": reportable_percentile(ttfts, 95),
            "ttft_p99_s": reportable_percentile(ttfts, 99),
            "tpot_p50_s": reportable_percentile(tpots, 50),
            "tpot_p95_s": reportable_percentile(tpots, 95),
            "tpot_p99_s": reportable_percentile(tpots, 99),
        }
    return report


def dump_outcome(outcome: Outcome) -> dict[str, Any]:
    """One request's raw record (for ``--dump``): offsets from when it was sent."""
    request = outcome.request
    return {
        "at_s": request.at_s,
        "cls": request.cls,
        "prompt_tokens": len(request.prompt),
        "max_tokens": request.max_tokens,
        "sent_s": outcome.sent_s,
        "token_offsets_s": [t - outcome.sent_s for t in outcome.token_times],
        "error": outcome.error,
    }


def failures(outcomes: Sequence[Outcome]) -> list[str]:
    return [f"{o.request.cls}: {o.error}" for o in outcomes if o.error is not None]


# Two-sided 95% quantiles of Student's t by degrees of freedom (beyond 30: the normal's 1.96 is within 2%).
def write_result(name: str, document: dict[str, Any]) -> Path:
    """Write ``benchmarks/results/<name>.json``, stamped (``freshness.stamp``) with what it measured, the
    date and the machine's core count."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    stamped = {**document, **stamp(name)}
    path.write_text(json.dumps(finite(stamped), indent=2, allow_nan=False) + "\n")
    return path
