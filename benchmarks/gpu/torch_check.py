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
  interleaved ABBA pairs until the 95 % interval's half-width is under 0.25 % or the time budget ends.
  Target: upper bound ≤ 0.5 %.

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

All parts take about 5 minutes on an H200 (``--only prefill|decode|offload|cost`` runs one).

``--smoke`` runs the same code on a CPU with a 4-layer model and a handful of trials (CI runs it): the
figures mean nothing there, the plumbing is what it checks. Run on a GPU machine from the project root:

    COSERVE_COMMIT=$(git rev-parse HEAD) python benchmarks/gpu/torch_check.py --out DIR

(``PYTHONPATH`` is set by the script itself: it needs only ``src/`` and ``benchmarks/`` of a checkout.)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
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


SMOKE = Shape(layers=4, hidden=128, heads=4, kv_heads=2, head_dim=32, mlp=256, batch=2, tokens=64)


class Model:
    """A Llama-shaped decoder stack; ``forward`` calls ``safepoints.check`` where vLLM calls the connector."""

    def __init__(self, shape: Shape, device: torch.device, dtype: torch.dtype) -> None:
        self.shape = shape
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
    ) -> torch.Tensor:
        """One step over ``x``; ``context``, (K, V) of earlier tokens each layer also attends to (a prefill chunk:
        the new tokens attend to all of it, a non-causal approximation of the chunk's own causal mask)."""
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
            if context is None:
                attention = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                keys, values = torch.cat([context[0], k], dim=2), torch.cat([context[1], v], dim=2)
                attention = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
            if safepoints is not None:
                safepoints.check(f"layers.{index}")  # save_kv_layer: after attention
            x = x + attention.transpose(1, 2).reshape(batch, tokens, -1) @ w_o
            gate, up = (F.rms_norm(x, (s.hidden,)) @ w_gate_up).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ w_down
        return x


class HostEvents:
    """On a CPU the host is the device: recording and waiting are no-ops (the smoke run's stand-in)."""

    def __init__(self, count: int) -> None:
        self.count = count

    def record(self, slot: int) -> None:
        return None

    def wait(self, slot: int) -> None:
        return None

    def capturing(self) -> bool:
        return False


class Check:
    """One model, one board, one input; runs steps with each arm's safepoints."""

    def __init__(self, shape: Shape, device: torch.device) -> None:
        self.device = device
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.model = Model(shape, device, dtype)
        self.x = torch.randn(shape.batch, shape.tokens, shape.hidden, device=device, dtype=dtype) * 0.1
        self.board = SafepointBoard.create(f"coserve-sp-torchcheck{id(self) % 100000}")
        self.step_id = 0
        events = CudaEvents if device.type == "cuda" else HostEvents
        # one LayerSafepoints per arm, each made once, as a worker makes its own at start-up
        self.arms: dict[str, LayerSafepoints | None] = {
            "bounded": LayerSafepoints(RunAheadBound(DEFAULT_RUNAHEAD, events)),
            "host": LayerSafepoints(None),
            "off": None,
        }

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self, arm: str, abort_after_s: float | None = None) -> tuple[float, bool, float | None]:
        """One step: (its seconds, whether it was preempted, seconds from the abort until the device was idle)."""
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
                self.model.forward(self.x, safepoints)
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
    parser.add_argument("--smoke", action="store_true", help="a 4-layer model on the CPU, a few trials")
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

    remaining = args.budget_s - (time.monotonic() - began)
    max_pairs = 4 if args.smoke else max(8, min(200, int(remaining / (2.2 * step_s))))

    def throughput(treatment: bool) -> float:
        return 1.0 / check.step("bounded" if treatment else "off")[0]

    overhead = PairedOverhead(target=0.0025, min_pairs=min(30, max_pairs), max_pairs=max_pairs).run(
        throughput, "overhead"
    )
    summary = overhead.summary()
    document = {
        "benchmark": "torch_safepoint_overhead_cuda",
        "target": "throughput loss of the bounded checks (K = 1) vs none: 95 % upper bound <= 0.5 %",
        "met": bool(not args.smoke and summary["loss_ci95"][1] <= 0.005),
        "step_ms": step_s * 1e3,
        "overhead": summary,
        "setup": facts,
    }
    write(args.out, document)
    low, high = summary["loss_ci95"]
    say(f"overhead {summary['loss_mean']:+.3%} [{low:+.3%}, {high:+.3%}] over {summary['n']} pairs")


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
        """One step's seconds: ``full`` (one graph, no safepoint) or ``pieces`` (bounded safepoints between)."""
        check = self.check
        check.step_id += 1
        safepoints = check.arms["bounded"]
        assert safepoints is not None
        safepoints.begin(check.step_id, check.board, checking=arm == "pieces")
        check.sync()
        started = time.perf_counter()
        with torch.inference_mode():
            if arm == "full":
                if self.graphs:
                    self.full.replay()
                else:
                    for half, index in self.halves:
                        half(index)
            else:
                for number, (half, index) in enumerate(self.halves):
                    safepoints.check(f"layers.{index}")
                    if self.graphs:
                        self.pieces[number].replay()
                    else:
                        half(index)
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
                times[arm].append(statistics.median(step.run(arm) for _ in range(5)))
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
