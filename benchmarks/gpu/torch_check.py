"""The GPU check that runs where a GPU is lent: coserve's own safepoint code on plain PyTorch, no vLLM.

The machine a session is lent has PyTorch with CUDA and nothing of the serving stack: ``check.sh``
(vLLM's engines) cannot run there. This check drives the worker's real safepoint object
(``coserve.engine.layer_safepoints.LayerSafepoints``, with the real shared-memory ``SafepointBoard``,
CUDA events for the run-ahead bound and the TP agreement's single-rank path, as ``CoServeConnector``
builds them on a GPU) from a Llama-3.1-8B-shaped model: 32 layers, hidden 4096, 32 query and 8 KV
heads of 128, MLP 14336, random bf16 weights, cuBLAS GEMMs and SDPA attention, with a safepoint before
and after each attention as vLLM calls the connector. The step is an offline prefill of 8 × 2048
tokens (16,384), eager, as vLLM runs steps larger than its CUDA-graph sizes.

What it writes (``--out``, default ``benchmarks/results``):

- ``torch_preemption_latency_cuda``: an urgent abort raised from another thread at a uniformly random
  moment of the step; exit = until the GPU is idle; in ms and in layers (the step's time / 32). Arms:
  the bounded check (K = 1, coserve's default), and the host-only check (no bound: what the connector did
  before) as the baseline. Target: p99 ≤ 1.5 layers with the bound.
- ``torch_safepoint_overhead_cuda``: step throughput with the bounded checks on vs no checks, in
  interleaved ABBA pairs until the 95 % interval's half-width is under 0.25 % or the row's share of the
  time budget ends, on a grid of steps (``grid``): mixed steps of a 256- and a 2048-token prefill chunk
  (over 2k of its context) with 64 decoding requests at 2k, the 16k-token offline prefill (``overhead``,
  as before), and a uniform decode step of 64 at 2k run as piecewise graphs with safepoints between the
  pieces. Target: upper bound ≤ 0.5 % on every row. ``events``: the bounded arm with blocking vs
  spinning CUDA events (``CudaEvents(blocking=True)``) on the prefill and decode rows, step time and
  process CPU time per step, and which is better.

- ``torch_decode_graphs_cuda``: a uniform decode step (1 to 256 requests at 2k of context) replayed
  as one full CUDA graph, with no safepoint, and as one graph per half-layer with the bounded safepoints
  between them (what vLLM's piecewise graphs cost a decode step), medians of interleaved rounds. It
  backs the choice to let vLLM run uniform decode steps as full graphs (``FULL_AND_PIECEWISE``).
- ``torch_kv_offload_cuda``: the host KV pool's GPU copy path (``coserve.engine.kv_copies.DeviceKVCopier``,
  what the connector's worker uses on CUDA) on an 8B-shaped KV cache in vLLM's layout (32 layers of
  ``(2, blocks, 16, 8, 128)`` bf16): copy-out and reload bandwidth into the pinned pool for 256 to 16k
  tokens, against the previous path (an index copy through pageable memory, ``.to("cpu")``); reloaded
  bytes equal what was saved; and the throughput cost of copying all of each 16k-token prefill step's KV
  out while the next step computes, in interleaved ABBA pairs against no copies. Target: upper 95 % bound
  of that cost <= 1 %.
- ``torch_cost_model_cuda``: a step-cost grid of this device (prefills of 128 to 16k tokens, chunks over
  2k and 8k of context, decode batches of 1 to 256 requests at 512 to 8k of context each, replayed as
  full CUDA graphs) and coserve's cost model fitted to it (``coserve.scheduling.cost_model``: the attention
  term per request), every other interior point of each sweep held out; the same fit with the attention
  over the batch's totals as the baseline. Target: held-out worst error <= 15 %.

The prefill part (the exits, then the overhead grid) ends about ``--budget-s`` (300 s) after the start; the
other parts add about 2 minutes on an H200 (``--only prefill|decode|offload|cost`` runs one).

``--smoke`` runs the same code on a CPU with a 16-layer toy model and a handful of trials (CI runs it): the
figures mean nothing there, the plumbing is what it checks. Its device is emulated (``EmulatedStream``: the
work the model queues runs later on a thread), so the run-ahead bound really waits there, and the overhead
result's ``setup.emulated_device`` says how far the host ever got ahead of it. Run on a GPU machine from
the project root:

    COSERVE_COMMIT=$(git rev-parse HEAD) python benchmarks/gpu/torch_check.py --out DIR

(``PYTHONPATH`` is set by the script itself: it needs only ``src/`` and ``benchmarks/`` of a checkout.)
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "benchmarks")]

from freshness import stamp  # noqa: E402
from harness.stats import PairedOverhead, finite, percentile, reportable_percentile, say  # noqa: E402

from coserve.engine.kv_copies import DeviceKVCopier  # noqa: E402
from coserve.engine.layer_safepoints import (  # noqa: E402
    DEFAULT_RUNAHEAD,
    CudaEvents,
    DeviceEvents,
    LayerSafepoints,
    RunAheadBound,
    StepPreempted,
)
from coserve.engine.safepoint import SafepointBoard  # noqa: E402
from coserve.scheduling.cost_model import CostSample, fit_cost_model, hold_out_interior  # noqa: E402


@dataclass(frozen=True)
class Shape:
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    mlp: int = 14336
    batch: int = 8  # sequences in the step
    tokens: int = 2048  # tokens per sequence


# NOTE: 16 layers, so that with K = 1 the device time after a step's last safepoint (about 2 half-layers) is a
# small part of a smoke step, as on the 32-layer model: an abort drawn over the step then nearly always preempts.
SMOKE = Shape(layers=16, hidden=128, heads=4, kv_heads=2, head_dim=32, mlp=256, batch=2, tokens=64)


class Model:
    """A Llama-shaped decoder stack; ``forward`` calls ``safepoints.check`` where vLLM calls the connector."""

    def __init__(
        self, shape: Shape, device: torch.device, dtype: torch.dtype, emulated: EmulatedStream | None = None
    ) -> None:
        self.shape = shape
        self.emulated = emulated  # the smoke run's device: each half-layer queues its work there
        generator = torch.Generator(device=device).manual_seed(0)
        qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim

        def weight(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, device=device, dtype=dtype, generator=generator) * 0.02

        self.layers = [
            (
                weight(shape.hidden, qkv),
                weight(shape.heads * shape.head_dim, shape.hidden),
                weight(shape.hidden, 2 * shape.mlp),
                weight(shape.mlp, shape.hidden),
            )
            for _ in range(shape.layers)
        ]

    def forward(
        self,
        x: torch.Tensor,
        safepoints: LayerSafepoints | None,
        context: tuple[torch.Tensor, torch.Tensor] | None = None,
        decodes: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One step over ``x``; ``context``, (K, V) of earlier tokens each layer also attends to (a prefill chunk:
        the new tokens attend to all of it, a non-causal approximation of the chunk's own causal mask);
        ``decodes``, (K, V) of ``R`` decoding requests whose new tokens are the last ``R`` of ``x`` (a mixed
        step: ``x`` is one sequence; each decode token attends to its own request's KV only)."""
        s = self.shape
        batch, tokens, _ = x.shape
        for index, (w_qkv, w_o, w_gate_up, w_down) in enumerate(self.layers):
            qkv = F.rms_norm(x, (s.hidden,)) @ w_qkv
            q, k, v = qkv.split([s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=-1)
            q = q.view(batch, tokens, s.heads, s.head_dim).transpose(1, 2)
            k = k.view(batch, tokens, s.kv_heads, s.head_dim).transpose(1, 2)
            v = v.view(batch, tokens, s.kv_heads, s.head_dim).transpose(1, 2)
            if safepoints is not None:
                safepoints.check(f"layers.{index}")  # wait_for_layer_load: before attention
            attention = attend(q, k, v, context) if decodes is None else attend_mixed(q, k, v, context, decodes)
            if self.emulated is not None:
                self.emulated.launch()
            if safepoints is not None:
                safepoints.check(f"layers.{index}")  # save_kv_layer: after attention
            x = x + attention.transpose(1, 2).reshape(batch, tokens, -1) @ w_o
            gate, up = (F.rms_norm(x, (s.hidden,)) @ w_gate_up).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ w_down
            if self.emulated is not None:
                self.emulated.launch()
        return x


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor] | None
) -> torch.Tensor:
    """A prefill's attention, (batch, heads, tokens, head_dim): causal, or over ``context`` and itself."""
    if context is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    keys, values = torch.cat([context[0], k], dim=2), torch.cat([context[1], v], dim=2)
    return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)


def attend_mixed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context: tuple[torch.Tensor, torch.Tensor] | None,
    decodes: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """A mixed step's attention: the chunk's tokens as a prefill, then each decode token over its own KV."""
    chunk = q.shape[2] - decodes[0].shape[0]
    prefill = attend(q[:, :, :chunk], k[:, :, :chunk], v[:, :, :chunk], context)
    single = q[:, :, chunk:].transpose(0, 2)  # (requests, heads, 1, head_dim): one query per request
    decoded = F.scaled_dot_product_attention(single, decodes[0], decodes[1], enable_gqa=True)
    return torch.cat([prefill, decoded.transpose(0, 2)], dim=2)


EMULATED_ITEM_S = 0.001  # the smoke run's device time per half-layer: ~4x the host's there, as on a GPU


class EmulatedStream:
    """The smoke run's device: the work the host queues runs later, in order, on a background thread.

    ``launch`` queues one item of ``item_s`` (the model queues one per half-layer, as a GPU stream gets its
    kernels); ``record`` marks the queue's end and returns a ticket, complete once the thread has run every
    item queued before it. So on a CPU the run-ahead bound has a device that lags the host to wait for, and
    ``max_lead`` checks that it did: the most recorded events still incomplete when the host recorded the
    next one, i.e. how many safepoints the host ever got ahead of the device (the bound promises K at most).
    """

    def __init__(self, item_s: float) -> None:
        self.item_s = item_s
        self.queued = 0  # items launched
        self.completed = 0  # items the thread has run
        self.records = 0
        self.max_lead = 0
        self._incomplete: deque[int] = deque()  # tickets of recorded events not yet seen complete, oldest first
        self._changed = threading.Condition()
        self._items: queue.SimpleQueue[float | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="emulated-device", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (seconds := self._items.get()) is not None:
            time.sleep(seconds)
            with self._changed:
                self.completed += 1
                self._changed.notify_all()

    def launch(self) -> None:
        self.queued += 1
        self._items.put(self.item_s)

    def record(self) -> int:
        while self._incomplete and self._incomplete[0] <= self.completed:
            self._incomplete.popleft()
        self.records += 1
        self.max_lead = max(self.max_lead, len(self._incomplete))
        self._incomplete.append(self.queued)
        return self.queued

    def wait(self, ticket: int, blocking: bool) -> None:
        if blocking:
            with self._changed:
                self._changed.wait_for(lambda: self.completed >= ticket)
            return
        while self.completed < ticket:  # spins on a core, as a CUDA event's synchronize does by default
            time.sleep(0)

    def synchronize(self) -> None:
        self.wait(self.queued, blocking=True)

    def close(self) -> None:
        self._items.put(None)
        self._thread.join()

    def facts(self) -> dict[str, Any]:
        return {"item_s": self.item_s, "items": self.queued, "records": self.records,
                "max_lead_safepoints": self.max_lead}  # fmt: skip


class EmulatedEvents:
    """``DeviceEvents`` on an ``EmulatedStream`` (the smoke run's ``CudaEvents``): a ring of its tickets."""

    def __init__(self, stream: EmulatedStream, count: int, blocking: bool = False) -> None:
        self.stream = stream
        self.blocking = blocking
        self._tickets = [0] * count

    def record(self, slot: int) -> None:
        self._tickets[slot] = self.stream.record()

    def wait(self, slot: int) -> None:
        self.stream.wait(self._tickets[slot], self.blocking)

    def capturing(self) -> bool:
        return False


class Check:
    """One model, one board, one input; runs steps with each arm's safepoints."""

    def __init__(self, shape: Shape, device: torch.device) -> None:
        self.device = device
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.emulated = EmulatedStream(EMULATED_ITEM_S) if device.type != "cuda" else None
        self.model = Model(shape, device, dtype, self.emulated)
        self.x = torch.randn(shape.batch, shape.tokens, shape.hidden, device=device, dtype=dtype) * 0.1
        self.board = SafepointBoard.create(f"coserve-sp-torchcheck{id(self) % 100000}")
        self.step_id = 0
        # one LayerSafepoints per arm, each made once, as a worker makes its own at start-up
        self.arms: dict[str, LayerSafepoints | None] = {
            "bounded": LayerSafepoints(RunAheadBound(DEFAULT_RUNAHEAD, self.events(blocking=False))),
            "blocking": LayerSafepoints(RunAheadBound(DEFAULT_RUNAHEAD, self.events(blocking=True))),
            "host": LayerSafepoints(None),
            "off": None,
        }

    def events(self, blocking: bool) -> Callable[[int], DeviceEvents]:
        emulated = self.emulated
        if emulated is None:
            return lambda count: CudaEvents(count, blocking=blocking)
        return lambda count: EmulatedEvents(emulated, count, blocking)

    def sync(self) -> None:
        if self.emulated is not None:
            self.emulated.synchronize()
        else:
            torch.cuda.synchronize(self.device)

    def step(
        self,
        arm: str,
        abort_after_s: float | None = None,
        work: Callable[[LayerSafepoints | None], object] | None = None,
    ) -> tuple[float, bool, float | None]:
        """One step (``work``, the offline prefill by default): (its seconds, whether it was preempted, seconds
        from the abort until the device was idle)."""
        self.step_id += 1
        step_id = self.step_id
        safepoints = self.arms[arm]
        if safepoints is not None:
            safepoints.begin(step_id, self.board, checking=True)
        raised: list[float] = []

        def abort() -> None:
            raised.append(time.perf_counter())
            self.board.request_abort(step_id)

        timer = threading.Timer(abort_after_s, abort) if abort_after_s is not None else None
        self.sync()
        started = time.perf_counter()
        if timer is not None:
            timer.start()
        preempted = False
        try:
            with torch.inference_mode():
                if work is None:
                    self.model.forward(self.x, safepoints)
                else:
                    work(safepoints)
        except StepPreempted:
            preempted = True
        self.sync()
        ended = time.perf_counter()
        if timer is not None:
            timer.join()
        exit_s = ended - raised[0] if raised and raised[0] <= ended else None
        return ended - started, preempted, exit_s

    def close(self) -> None:
        self.board.close()
        if self.emulated is not None:
            self.emulated.close()


def exit_arm(check: Check, arm: str, trials: int, step_s: float, layer_s: float, seed: int) -> dict[str, Any]:
    """``trials`` aborts that land inside a step, each raised from a timer thread at a random point of it.

    An abort whose timer fires after the step has ended (the thread started late, or this step ran faster
    than ``step_s``) preempts nothing and is drawn again, up to ``20 * trials`` attempts in all: on a busy
    CPU a short smoke step often ends before the timer thread runs."""
    rng = random.Random(seed)
    exits: list[float] = []
    preempted = 0
    attempts = 0
    while len(exits) < trials and attempts < 20 * trials:
        attempts += 1
        _, left, exit_s = check.step(arm, rng.uniform(0.02, 0.9) * step_s)
        if exit_s is None:
            continue  # the abort came after the step had ended: nothing to preempt
        exits.append(exit_s)
        preempted += left
        if len(exits) % 50 == 0:
            say(f"[{arm}] {len(exits)}/{trials} aborts, {preempted} preempted")
    layers = [e / layer_s for e in exits]
    return {
        "arm": arm,
        "aborts": len(exits),
        "attempts": attempts,
        "preempted": preempted,
        "exit_ms_p50": percentile(exits, 50) * 1e3 if exits else None,
        "exit_ms_p99": (p99 * 1e3) if (p99 := reportable_percentile(exits, 99)) is not None else None,
        "exit_layers_p50": percentile(layers, 50) if layers else None,
        "exit_layers_p99": reportable_percentile(layers, 99),
        "exit_layers_worst": max(layers, default=None),
        "exit_ms": [e * 1e3 for e in exits],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a toy model on the CPU, a few trials")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--only", choices=["prefill", "decode", "offload", "cost"], help="one part (default: all)")
    parser.add_argument("--trials", type=int, default=None, help="aborts in the bounded arm (default 240)")
    parser.add_argument("--budget-s", type=float, default=300.0, help="stop the overhead pairs by then")
    args = parser.parse_args(argv)
    began = time.monotonic()
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("torch_check: no CUDA device here (use --smoke on a CPU)")
    device = torch.device("cpu" if args.smoke else "cuda")
    shape = SMOKE if args.smoke else Shape()
    facts = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke: no figure counts)",
        "torch": torch.__version__,
        "shape": asdict(shape),
        "runahead_k": DEFAULT_RUNAHEAD,
        "vllm": "none: coserve's LayerSafepoints driven by a plain-PyTorch model (see the script's docstring)",
    }
    say(f"building the {shape.layers}-layer model on {facts['device']}")
    check = Check(shape, device)
    try:
        if args.only in (None, "prefill"):
            prefill(check, args, facts, began)
        if args.only in (None, "decode"):
            decode(check, args, facts)
        if args.only in (None, "offload"):
            offload(check, args, facts)
        if args.only in (None, "cost"):
            cost(check, args, facts)
    finally:
        check.close()
    return 0


def prefill(check: Check, args: argparse.Namespace, facts: dict[str, Any], began: float) -> None:
    """The offline prefill step: exits after an abort, and the bounded checks' cost."""
    shape = check.model.shape
    trials = args.trials or (6 if args.smoke else 240)
    facts = {**facts, "step_tokens": shape.batch * shape.tokens}
    for _ in range(3):  # warm-up: cuBLAS heuristics, SDPA kernels, the events' first use
        for arm in check.arms:
            check.step(arm)
    step_s = percentile([check.step("off")[0] for _ in range(5)], 50)
    layer_s = step_s / shape.layers
    say(f"a {facts['step_tokens']}-token step takes {step_s * 1e3:.1f} ms ({layer_s * 1e3:.2f} ms per layer)")

    bounded = exit_arm(check, "bounded", trials, step_s, layer_s, seed=1)
    host = exit_arm(check, "host", max(trials // 10, 6 if args.smoke else 24), step_s, layer_s, seed=2)
    p99 = bounded["exit_layers_p99"]
    every_abort_preempted = bounded["preempted"] == bounded["aborts"]
    latency = {
        "benchmark": "torch_preemption_latency_cuda",
        "target": "p99 exit <= 1.5 layers on a 16k-token offline prefill step, with the bounded check (K = 1)",
        "met": bool(not args.smoke and p99 is not None and p99 <= 1.5 and every_abort_preempted),
        "step_ms": step_s * 1e3,
        "layer_ms": layer_s * 1e3,
        "coserve": bounded,
        "baseline": host,
        "setup": facts,
    }
    write(args.out, latency)
    say(f"bounded: {bounded['preempted']}/{bounded['aborts']} preempted, p99 {p99} layers; "
        f"host only: {host['preempted']}/{host['aborts']} preempted")  # fmt: skip

    overhead(check, args, facts, step_s, deadline=began + args.budget_s)


@dataclass(frozen=True)
class Mix:
    """A mixed step: a prefill chunk of ``chunk`` tokens over ``context`` of its own, and ``decodes`` decoding
    requests at ``decode_context`` tokens of KV each."""

    chunk: int
    context: int
    decodes: int
    decode_context: int


MIXES = {"mixed_small": Mix(256, 2048, 64, 2048), "mixed_mid": Mix(2048, 2048, 64, 2048)}
SMOKE_MIXES = {"mixed_small": Mix(16, 64, 4, 64), "mixed_mid": Mix(64, 64, 4, 64)}
DECODE_PIECES = (64, 2048)  # (requests, context) of the piecewise decode row; the smoke run's: (8, 64)
MEASUREMENT_S = 0.05  # a measurement runs enough steps to last this long: a short step's noise averages out
TARGET = 0.005  # every row's 95 % upper bound on the loss
SPIN, BLOCK = "bounded", "blocking"  # the bounded arm with CudaEvents as coserve makes them, and blocking=True


@dataclass(frozen=True)
class Row:
    """A step of the overhead grid; ``run(arm)`` runs one with that arm's safepoints and returns its seconds."""

    name: str
    what: str
    new_tokens: int
    run: Callable[[str], float]


def mixed_row(check: Check, name: str, mix: Mix) -> Row:
    s, device, dtype = check.model.shape, check.device, check.x.dtype
    x = torch.randn(1, mix.chunk + mix.decodes, s.hidden, device=device, dtype=dtype) * 0.1

    def kv(requests: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (requests, s.kv_heads, tokens, s.head_dim)
        return torch.randn(shape, device=device, dtype=dtype), torch.randn(shape, device=device, dtype=dtype)

    context, decodes = kv(1, mix.context), kv(mix.decodes, mix.decode_context)

    def run(arm: str) -> float:
        return check.step(arm, work=lambda safepoints: check.model.forward(x, safepoints, context, decodes))[0]

    what = (f"a {mix.chunk}-token prefill chunk over {mix.context} of its context and {mix.decodes} decodes at "
            f"{mix.decode_context}, eager")  # fmt: skip
    return Row(name, what, mix.chunk + mix.decodes, run)


def grid_rows(check: Check, smoke: bool) -> dict[str, Row]:
    """The grid's steps: two mixed ones, the offline prefill, and a uniform decode as piecewise graphs."""
    s = check.model.shape
    rows = {name: mixed_row(check, name, mix) for name, mix in (SMOKE_MIXES if smoke else MIXES).items()}
    rows["prefill_large"] = Row("prefill_large", f"offline prefill of {s.batch} x {s.tokens} tokens, eager",
                                s.batch * s.tokens, lambda arm: check.step(arm)[0])  # fmt: skip
    batch, context = (8, 64) if smoke else DECODE_PIECES
    pieces = "pieces" if smoke else "CUDA graph pieces"
    rows["decode_pieces"] = Row("decode_pieces", f"uniform decode of {batch} at {context}, {2 * s.layers} {pieces}",
                                batch, DecodeStep(check, batch, context).run)  # fmt: skip
    return rows


def paired(row: Row, arms: tuple[str, str], seconds: float, smoke: bool) -> dict[str, Any]:
    """``arms``, (treatment, baseline), on ``row`` in interleaved pairs, as many as fit in ``seconds`` (8 to 200);
    each measurement runs enough steps for ``MEASUREMENT_S`` and takes the process CPU time per step too."""
    started = time.monotonic()
    treatment, baseline = arms
    for arm in (*arms, *arms):
        row.run(arm)  # warm-up: this shape's kernels, the arm's events
    step_s = statistics.median(row.run(baseline) for _ in range(3))
    steps = 1 if smoke else max(1, round(MEASUREMENT_S / step_s))
    left = seconds - (time.monotonic() - started)
    budget = 4 if smoke else max(8, min(200, int(left / (2.2 * steps * step_s))))
    cpu_s: dict[str, list[float]] = {arm: [] for arm in arms}

    def throughput(is_treatment: bool) -> float:
        arm = treatment if is_treatment else baseline
        cpu = time.process_time()
        wall = sum(row.run(arm) for _ in range(steps))
        cpu_s[arm].append((time.process_time() - cpu) / steps)
        return steps / wall

    label = f"{row.name}: {treatment} vs {baseline}"
    summary = PairedOverhead(TARGET / 2, min_pairs=min(30, budget), max_pairs=budget).run(throughput, label).summary()
    low, high = summary["loss_ci95"]
    return {
        "row": row.name, "what": row.what, "new_tokens": row.new_tokens, "treatment": treatment,
        "baseline": baseline, "step_ms": step_s * 1e3, "steps_per_measurement": steps, "pairs_budget": budget,
        "pairs": summary["n"], "seconds": time.monotonic() - started, "loss_mean": summary["loss_mean"],
        "loss_ci95": [low, high], "met": bool(not smoke and high <= TARGET),
        "cpu_ms_per_step": {arm: statistics.median(values) * 1e3 for arm, values in cpu_s.items()},
        "overhead": summary,
    }  # fmt: skip


def better_events(row: dict[str, Any]) -> str:
    """Blocking (treatment) vs spinning (baseline) events on one row: spinning when blocking costs measurable
    throughput, blocking when it costs none beyond the target and saves CPU, else undecided."""
    low, high = row["loss_ci95"]
    cpu = row["cpu_ms_per_step"]
    if low > 0:
        return "spinning"
    return "blocking" if high <= TARGET and cpu[BLOCK] < cpu[SPIN] else "undecided"


def overhead(check: Check, args: argparse.Namespace, facts: dict[str, Any], step_s: float, deadline: float) -> None:
    """The bounded checks' cost on every grid row, and blocking vs spinning events, by ``deadline``.

    Each run takes its share of the time left when it starts (shares below), so a row that resolves early
    leaves its time to the ones after it; the 16k-token prefill comes last and gets the largest shares."""
    rows = grid_rows(check, args.smoke)
    checks, events = (SPIN, "off"), (BLOCK, SPIN)
    plan = [(rows["mixed_small"], checks, 1.0), (rows["mixed_mid"], checks, 1.0), (rows["decode_pieces"], checks, 1.0),
            (rows["decode_pieces"], events, 1.0), (rows["prefill_large"], checks, 3.0),
            (rows["prefill_large"], events, 2.0)]  # fmt: skip
    runs = []
    for number, (row, arms, share) in enumerate(plan):
        seconds = max(0.0, deadline - time.monotonic()) * share / sum(part for *_, part in plan[number:])
        runs.append(paired(row, arms, seconds, args.smoke))
    grid = [run for run in runs if run["baseline"] == "off"]
    compared = [{**run, "better": better_events(run)} for run in runs if run["treatment"] == BLOCK]
    verdicts = {run["better"] for run in compared}
    large = next(run for run in grid if run["row"] == "prefill_large")
    setup = {**facts, "pairs": "each row's budget is its share of the time left when it starts (8 to 200 pairs); "
             "a pair's two measurements each run steps_per_measurement steps"}  # fmt: skip
    if check.emulated is not None:
        setup["emulated_device"] = {**check.emulated.facts(), "runahead_k": DEFAULT_RUNAHEAD}
    document = {
        "benchmark": "torch_safepoint_overhead_cuda",
        "target": "throughput loss of the bounded checks (K = 1) vs none: 95 % upper bound <= 0.5 % on every "
        "grid row (mixed steps, the 16k-token offline prefill, piecewise decode)",
        "met": bool(not args.smoke and all(run["met"] for run in grid)),
        "step_ms": step_s * 1e3,
        "overhead": large["overhead"],  # the 16k-token offline prefill row, as this result reported before the grid
        "grid": grid,
        "events": {
            "what": "the bounded arm with blocking (treatment) vs spinning (baseline, coserve's default) CUDA "
            "events; loss = blocking's throughput loss; cpu_ms_per_step = process CPU time per step",
            "better": "spinning" if "spinning" in verdicts else "blocking" if verdicts == {"blocking"} else "undecided",
            "rows": compared,
        },
        "setup": setup,
    }
    write(args.out, document)
    print_overhead(grid, compared)


def print_overhead(grid: list[dict[str, Any]], compared: list[dict[str, Any]]) -> None:
    print(f"\nsafepoint overhead: bounded checks (K = {DEFAULT_RUNAHEAD}) vs none; target: 95 % upper bound <= "
          f"{TARGET:.1%} on every row")  # fmt: skip
    print(f"{'row':<14} {'new tokens':>10} {'step ms':>9} {'pairs/budget':>12} {'loss':>8}  {'95 % interval':<20} met")
    for run in grid:
        low, high = run["loss_ci95"]
        print(f"{run['row']:<14} {run['new_tokens']:>10} {run['step_ms']:>9.2f} "
              f"{run['pairs']:>5}/{run['pairs_budget']:<6} {run['loss_mean']:>+8.2%}  "
              f"[{low:+.2%}, {high:+.2%}]{'':<4} {'yes' if run['met'] else 'no'}")  # fmt: skip
    print("\nrun-ahead events: blocking vs spinning, bounded arm")
    print(f"{'row':<14} {'pairs':>5} {'loss':>8}  {'95 % interval':<20} {'CPU ms/step spin':>16} {'block':>8}  better")
    for run in compared:
        low, high = run["loss_ci95"]
        cpu = run["cpu_ms_per_step"]
        print(f"{run['row']:<14} {run['pairs']:>5} {run['loss_mean']:>+8.2%}  [{low:+.2%}, {high:+.2%}]{'':<4} "
              f"{cpu[SPIN]:>16.2f} {cpu[BLOCK]:>8.2f}  {run['better']}")  # fmt: skip


class DecodeStep:
    """One uniform decode step (``batch`` requests, one new token each, ``context`` tokens of KV each), as
    one full CUDA graph or as one graph per half-layer with a safepoint between pieces (what piecewise
    graphs cost a decode step). The KV is one tensor pair every layer reads, as large as one layer's."""

    def __init__(self, check: Check, batch: int, context: int) -> None:
        model, s, device = check.model, check.model.shape, check.device
        dtype = check.x.dtype
        self.check = check
        self.model = model
        self.x = torch.randn(batch, 1, s.hidden, device=device, dtype=dtype) * 0.1
        self.attention = torch.zeros(batch, 1, s.heads * s.head_dim, device=device, dtype=dtype)
        self.k = torch.randn(batch, s.kv_heads, context, s.head_dim, device=device, dtype=dtype)
        self.v = torch.randn(batch, s.kv_heads, context, s.head_dim, device=device, dtype=dtype)
        halves = [(self._attention, index) for index in range(s.layers)]
        self.halves = [half for pair in zip(halves, [(self._mlp, i) for i in range(s.layers)], strict=True)
                       for half in pair]  # fmt: skip
        self.graphs = check.device.type == "cuda"
        if self.graphs:
            self._capture()

    def _attention(self, index: int) -> None:
        s = self.model.shape
        w_qkv = self.model.layers[index][0]
        batch = self.x.shape[0]
        q = (F.rms_norm(self.x, (s.hidden,)) @ w_qkv)[..., : s.heads * s.head_dim]
        q = q.view(batch, 1, s.heads, s.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, self.k, self.v, enable_gqa=True)
        self.attention.copy_(out.transpose(1, 2).reshape(batch, 1, -1))

    def _mlp(self, index: int) -> None:
        s = self.model.shape
        _, w_o, w_gate_up, w_down = self.model.layers[index]
        x = self.x + self.attention @ w_o
        gate, up = (F.rms_norm(x, (s.hidden,)) @ w_gate_up).chunk(2, dim=-1)
        self.x.copy_(x + (F.silu(gate) * up) @ w_down)

    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):  # warm up on a side stream before capturing, as CUDA graphs require
                for half, index in self.halves:
                    half(index)
        torch.cuda.current_stream().wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        self.full = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(self.full, pool=pool):
            for half, index in self.halves:
                half(index)
        self.pieces = []
        for half, index in self.halves:
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
                half(index)
            self.pieces.append(graph)

    def run(self, arm: str) -> float:
        """One step's seconds: ``full`` (one graph, no safepoint), or pieces with the safepoints of ``arm`` (one of
        ``check.arms``; ``off``: none) between them."""
        check = self.check
        check.step_id += 1
        safepoints = None if arm == "full" else check.arms[arm]
        if safepoints is not None:
            safepoints.begin(check.step_id, check.board, checking=True)
        check.sync()
        started = time.perf_counter()
        with torch.inference_mode():
            if arm == "full" and self.graphs:
                self.full.replay()
            else:
                for number, (half, index) in enumerate(self.halves):
                    if safepoints is not None:
                        safepoints.check(f"layers.{index}")
                    if self.graphs:
                        self.pieces[number].replay()
                    else:
                        half(index)
                        if check.emulated is not None:
                            check.emulated.launch()
        check.sync()
        return time.perf_counter() - started


def decode(check: Check, args: argparse.Namespace, facts: dict[str, Any]) -> None:
    """Uniform decode steps as one full graph vs as pieces with safepoints: what FULL_AND_PIECEWISE saves."""
    context = 64 if args.smoke else 2048
    rounds = 3 if args.smoke else 30
    rows = []
    for batch in (1, 8) if args.smoke else (1, 8, 64, 256):
        step = DecodeStep(check, batch, context)
        times: dict[str, list[float]] = {"full": [], "pieces": []}
        for number in range(rounds):
            order = ("full", "pieces") if number % 2 == 0 else ("pieces", "full")
            for arm in order:
                times[arm].append(statistics.median(step.run(SPIN if arm == "pieces" else arm) for _ in range(5)))
        full, pieces = statistics.median(times["full"]), statistics.median(times["pieces"])
        rows.append({"batch": batch, "context": context, "full_ms": full * 1e3, "pieces_bounded_ms": pieces * 1e3,
                     "pieces_over_full": pieces / full, "rounds": times})  # fmt: skip
        say(f"decode batch {batch} x {context}: full graph {full * 1e3:.2f} ms, pieces {pieces / full:.3f}x")
        del step
    document = {
        "benchmark": "torch_decode_graphs_cuda",
        "target": "a uniform decode step as one full CUDA graph (no safepoints) is faster than as piecewise "
        "graphs with bounded safepoints at every batch size: decode steps run as full graphs",
        "met": bool(not args.smoke and all(row["pieces_over_full"] > 1.0 for row in rows)),
        "decode": rows,
        "setup": {**facts, "pieces": 2 * check.model.shape.layers, "medians_of": "5 steps per round, rounds ABBA"},
    }
    write(args.out, document)


KV_BLOCK = 16  # tokens per KV block: vLLM's default on CUDA


class OffloadCheck:
    """An 8B-shaped paged KV cache in vLLM's CUDA layout, the copier the worker would own for it, and the
    previous path (index copies through a pageable pool) as the baseline."""

    def __init__(self, check: Check, blocks: int) -> None:
        s = check.model.shape
        self.check = check
        self.blocks = blocks  # the most blocks one batch moves: copy-outs read [0, blocks), reloads write after
        self.layout = (2, 2 * blocks, KV_BLOCK, s.kv_heads, s.head_dim)
        generator = torch.Generator(device=check.device).manual_seed(1)
        self.caches = [
            torch.randn(self.layout, device=check.device, dtype=check.x.dtype, generator=generator)
            for _ in range(s.layers)
        ]
        self.copier = DeviceKVCopier(self.caches, 1, capacity=blocks)
        self.pageable = torch.zeros((s.layers, blocks, *self.copier.block_shape), dtype=check.x.dtype)
        self.rng = random.Random(2)

    def batch_bytes(self, count: int) -> int:
        return count * self.copier.layer_block_bytes * len(self.caches)

    def plan(self, count: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """``count`` copy-outs (random device blocks into runs of slots, as the pool hands slots out) and the
        reloads of the same slots into other device blocks."""
        slots = list(range(count))
        saved = self.rng.sample(range(self.blocks), count)
        loaded = self.rng.sample(range(self.blocks, 2 * self.blocks), count)
        return list(zip(saved, slots, strict=True)), list(zip(loaded, slots, strict=True))

    def save(self, saves: list[tuple[int, int]]) -> None:
        self.copier.begin(fence=False)
        self.copier.issue_saves(saves)

    def load(self, loads: list[tuple[int, int]]) -> None:
        self.copier.begin(fence=False)
        self.copier.issue_loads(loads)
        for layer in range(len(self.caches)):
            self.copier.wait_layer(layer)
        self.copier.issue_saves([])

    def save_pageable(self, saves: list[tuple[int, int]]) -> None:
        """The previous CUDA copy-out: gather, a synchronous ``.to("cpu")`` into pageable memory, index copy."""
        device = self.check.device
        blocks = torch.tensor([b for b, _ in saves], dtype=torch.long, device=device)
        slots = torch.tensor([s for _, s in saves], dtype=torch.long)
        for layer, cache in enumerate(self.caches):
            source = cache.index_select(1, blocks).movedim(1, 0)
            self.pageable[layer].index_copy_(0, slots, source.to("cpu"))

    def load_pageable(self, loads: list[tuple[int, int]]) -> None:
        """The previous CUDA reload: gather from the pageable pool, ``.to(device)``, index copy."""
        device = self.check.device
        blocks = torch.tensor([b for b, _ in loads], dtype=torch.long, device=device)
        slots = torch.tensor([s for _, s in loads], dtype=torch.long)
        for layer, cache in enumerate(self.caches):
            source = self.pageable[layer].index_select(0, slots).to(device, non_blocking=True)
            cache.index_copy_(1, blocks, source.movedim(0, 1))

    def reloaded_equal(self, saves: list[tuple[int, int]], loads: list[tuple[int, int]]) -> bool:
        slot_of = {slot: block for block, slot in saves}
        source = torch.tensor([slot_of[slot] for _, slot in loads], device=self.check.device)
        target = torch.tensor([block for block, _ in loads], device=self.check.device)
        return all(torch.equal(c.index_select(1, source), c.index_select(1, target)) for c in self.caches)

    def timed(self, copy: Any, plan: list[tuple[int, int]]) -> float:
        """Seconds from issuing ``copy(plan)`` until the device (every stream) has run it."""
        self.check.sync()
        started = time.perf_counter()
        copy(plan)
        self.check.sync()
        return time.perf_counter() - started

    def event_seconds(self) -> float:
        """Copy-stream time of the copier's batches since the last call (what the worker reports as copy_s)."""
        return sum(seconds for _, _, seconds in self.copier.completed())


def offload(check: Check, args: argparse.Namespace, facts: dict[str, Any]) -> None:
    """The host KV pool's GPU copy path: bandwidth, reload correctness, cost overlapped with a prefill step."""
    began = time.monotonic()
    shape = check.model.shape
    step_tokens = shape.batch * shape.tokens
    sizes = (32, 128) if args.smoke else (256, 1024, 4096, 16384)
    reps = 3 if args.smoke else 5
    blocks = max(max(sizes), step_tokens) // KV_BLOCK
    kv = OffloadCheck(check, blocks)
    pool = "pinned" if check.device.type == "cuda" else "inline"
    say(f"KV offload: {len(kv.caches)} layers of {kv.layout}, {check.x.dtype}; host pool of {blocks} blocks "
        f"({kv.batch_bytes(blocks) / 2**30:.2f} GiB, {pool})")  # fmt: skip

    rows, baseline, equal = [], [], True
    for tokens in sizes:
        saves, loads = kv.plan(tokens // KV_BLOCK)
        size = kv.batch_bytes(len(saves))
        times: dict[str, list[float]] = {"save": [], "reload": [], "save_pageable": [], "reload_pageable": []}
        events: dict[str, list[float]] = {"save": [], "reload": []}
        for rep in range(reps + 1):  # the first round warms up (allocations, the copy stream's first use)
            for arm, copy, plan in (("save", kv.save, saves), ("reload", kv.load, loads),
                                    ("save_pageable", kv.save_pageable, saves),
                                    ("reload_pageable", kv.load_pageable, loads)):  # fmt: skip
                seconds = kv.timed(copy, plan)
                event_s = kv.event_seconds()  # the pageable arms leave the copier idle
                if rep:
                    times[arm].append(seconds)
                    if arm in events:
                        events[arm].append(event_s)
                if arm == "reload" and rep == 0:
                    equal = equal and kv.reloaded_equal(saves, loads)
        median = {arm: statistics.median(values) for arm, values in times.items()}
        rows.append({
            "tokens": tokens, "blocks": len(saves), "bytes": size,
            "save_gbps": size / median["save"] / 1e9, "reload_gbps": size / median["reload"] / 1e9,
            "save_copy_stream_gbps": size / statistics.median(events["save"]) / 1e9,
            "reload_copy_stream_gbps": size / statistics.median(events["reload"]) / 1e9,
            "save_ms": [t * 1e3 for t in times["save"]], "reload_ms": [t * 1e3 for t in times["reload"]],
        })  # fmt: skip
        baseline.append({
            "tokens": tokens, "bytes": size,
            "save_gbps": size / median["save_pageable"] / 1e9, "reload_gbps": size / median["reload_pageable"] / 1e9,
            "save_ms": [t * 1e3 for t in times["save_pageable"]],
            "reload_ms": [t * 1e3 for t in times["reload_pageable"]],
        })  # fmt: skip
        say(f"{tokens:>6} tokens ({size / 2**20:.0f} MiB): copy-out {rows[-1]['save_gbps']:.1f} GB/s, reload "
            f"{rows[-1]['reload_gbps']:.1f} GB/s; pageable {baseline[-1]['save_gbps']:.1f} / "
            f"{baseline[-1]['reload_gbps']:.1f} GB/s")  # fmt: skip

    # Overhead: every prefill step's KV copied out while the next step computes, as the worker does.
    step_saves, _ = kv.plan(step_tokens // KV_BLOCK)
    chained = 1 if args.smoke else 3  # timed steps per measurement, each overlapped with the last one's copies

    def compute_sync() -> None:  # what vLLM waits for each step (the sampled tokens): the compute stream only
        if check.device.type == "cuda":
            torch.cuda.current_stream(check.device).synchronize()

    def throughput(treatment: bool) -> float:
        check.sync()  # the copy stream idle: every measurement starts alike
        started = 0.0
        for index in range(chained + 1):
            if index == 1:
                started = time.perf_counter()
            kv.copier.begin(fence=False)
            with torch.inference_mode():
                check.model.forward(check.x, None)
            kv.copier.issue_saves(step_saves if treatment else [])
            compute_sync()
        return chained / (time.perf_counter() - started)

    throughput(True)  # warm-up
    step_s = 1.0 / statistics.median(throughput(False) for _ in range(2))
    kv.event_seconds()
    remaining = min(60.0, args.budget_s) - (time.monotonic() - began)
    max_pairs = 4 if args.smoke else max(8, min(40, int(remaining / (2 * (chained + 1) * step_s))))
    overhead = PairedOverhead(target=0.0025, min_pairs=min(10, max_pairs), max_pairs=max_pairs).run(
        throughput, "offload overhead"
    )
    summary = overhead.summary()
    low, high = summary["loss_ci95"]
    say(f"copy-outs overlapped with the next step: {summary['loss_mean']:+.3%} [{low:+.3%}, {high:+.3%}] "
        f"over {summary['n']} pairs; reloads equal: {equal}")  # fmt: skip
    document = {
        "benchmark": "torch_kv_offload_cuda",
        "target": "copying each 16k-token prefill step's KV out to the pinned host pool while the next step "
        "computes costs <= 1 % of throughput (95 % upper bound), and reloaded KV equals what was saved",
        "met": bool(not args.smoke and equal and high <= 0.01),
        "reload_equal": equal,
        "bandwidth": rows,
        "baseline": {
            "what": "the previous CUDA path: index_select, a synchronous .to('cpu') / .to(device) "
            "through a pageable host pool, index_copy_",
            "rows": baseline,
        },
        "step_ms": step_s * 1e3,
        "step_tokens": step_tokens,
        "overhead": summary,
        "setup": {
            **facts,
            "vllm": "none: coserve's DeviceKVCopier on a plain-PyTorch KV cache and model (see the docstring)",
            "kv_layout": list(kv.layout),
            "kv_dtype": str(check.x.dtype),
            "block_tokens": KV_BLOCK,
            "host_pool": "pinned" if check.device.type == "cuda" else "pageable (smoke: inline copies)",
            "copied_per_step_bytes": kv.batch_bytes(len(step_saves)),
            "timed_steps_per_measurement": chained,
            "bandwidth": f"median of {reps} rounds after one warm-up; wall time from issue until every stream "
            "is idle; *_copy_stream_gbps from the copier's CUDA timing events (its copy_s)",
        },
    }
    write(args.out, document)
    if not equal:
        raise RuntimeError("torch_check: reloaded KV differs from what was copied out")


def cost(check: Check, args: argparse.Namespace, facts: dict[str, Any]) -> None:
    """A step-cost grid on this device and coserve's cost model fitted to it (``fit_cost_model``).

    Prefills of one request, chunks over earlier context, and decode batches (B requests at c tokens of
    context each; full CUDA graphs, as vLLM replays uniform decode steps). Every other interior point of
    each sweep is held out (``hold_out_interior``); the attention term per request is compared with the
    same fit over the batch's totals.
    """
    model, s, device = check.model, check.model.shape, check.device
    dtype = check.x.dtype
    if args.smoke:
        prefills, chunks = (16, 32, 64, 128), ((32, 64), (32, 128), (64, 64), (64, 128))
        batches, contexts, repeats = (1, 2, 4), (32, 64, 128), 3
    else:
        prefills = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
        chunks = ((512, 2048), (512, 8192), (2048, 2048), (2048, 8192))
        batches, contexts, repeats = (1, 8, 32, 64, 128, 256), (512, 2048, 8192), 7

    def timed(run: Callable[[], object]) -> float:
        for _ in range(2):
            run()
        times = []
        for _ in range(repeats):
            check.sync()
            started = time.perf_counter()
            run()
            check.sync()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    samples: list[CostSample] = []
    rows: list[dict[str, Any]] = []

    def add(kind: str, sample: CostSample) -> None:
        samples.append(sample)
        rows.append({"kind": kind, "requests": sample.requests, "P": sample.new_tokens, "C": sample.context_tokens,
                     "ms": sample.latency_s * 1e3})  # fmt: skip
        say(f"cost grid: {kind} B={sample.requests} P={sample.new_tokens} C={sample.context_tokens}: "
            f"{sample.latency_s * 1e3:.2f} ms")  # fmt: skip

    with torch.inference_mode():
        for tokens in prefills:
            x = torch.randn(1, tokens, s.hidden, device=device, dtype=dtype) * 0.1
            add("prefill", CostSample(tokens, 0, timed(lambda x=x: model.forward(x, None))))
            del x
        for tokens, context in chunks:
            x = torch.randn(1, tokens, s.hidden, device=device, dtype=dtype) * 0.1
            kv = tuple(torch.randn(1, s.kv_heads, context, s.head_dim, device=device, dtype=dtype) for _ in range(2))
            add("chunk", CostSample(tokens, context, timed(lambda x=x, kv=kv: model.forward(x, None, kv))))
            del x, kv
    for batch in batches:
        for context in contexts:
            step = DecodeStep(check, batch, context)
            add("decode", CostSample(batch, batch * context, timed(lambda step=step: step.run("full")), requests=batch))
            del step
    train, holdout = hold_out_interior(samples)
    report = fit_cost_model(train, holdout)
    totals = fit_cost_model(
        [CostSample(x.new_tokens, x.context_tokens, x.latency_s) for x in train],
        [CostSample(x.new_tokens, x.context_tokens, x.latency_s) for x in holdout],
    )
    worst = report.max_relative_error_holdout
    say(f"cost model: worst held-out error {worst:.1%} (R² {report.r2_holdout:.4f}); over the batch's totals "
        f"{totals.max_relative_error_holdout:.1%}")  # fmt: skip
    document = {
        "benchmark": "torch_cost_model_cuda",
        "target": "the step cost model (attention per request) predicts held-out steps of this device within 15 %",
        "met": bool(not args.smoke and worst <= 0.15),
        "max_relative_error_holdout": worst,
        "r2_holdout": report.r2_holdout,
        "r2_train": report.r2_train,
        "num_train": report.num_train,
        "num_holdout": report.num_holdout,
        "coefficients": report.model.to_dict(),
        "baseline": {
            "name": "k2·P·(P + C), the attention over the batch's totals, same steps and fit",
            "max_relative_error_holdout": totals.max_relative_error_holdout,
            "r2_holdout": totals.r2_holdout,
            "coefficients": totals.model.to_dict(),
        },
        "samples": rows,
        "setup": {
            **facts,
            "split": "hold_out_interior",
            "repeats": repeats,
            "decode": "full CUDA graph per step" if device.type == "cuda" else "eager (smoke)",
        },
    }
    write(args.out, document)


def write(folder: Path, document: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    stamped = {**document, **stamp(document["benchmark"])}
    path = folder / f"{document['benchmark']}.json"
    path.write_text(json.dumps(finite(stamped), indent=2, allow_nan=False) + "\n")
    say(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
