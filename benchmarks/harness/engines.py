"""The engines the benchmarks measure: the benchmark model, its cost model, stock and coserve engines.

Who calls what: a script builds the model with ``bench_model`` and profiles it once with
``measured_cost_model`` (the deployment workflow: profile, then serve with the fitted model), then starts
engines with ``coserve.engine.launch.EngineServer``: coserve's from ``coserve_settings``, stock vLLM's
from ``stock_settings``. A whole prefiller/decoder pool and its router are in ``harness.pool``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from coserve.engine.launch import EngineSettings
from coserve.engine.profiler import default_model_cache
from coserve.engine.tiny_model import TinyModelSpec, build_tiny_model

from .stats import say


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


def coserve_settings(model: Path, workdir: Path, config: Mapping[str, Any], **options: Any) -> EngineSettings:
    """A coserve engine: the plugin, SlideBatching with ``config`` (classes, cost model), safepoints."""
    return EngineSettings(model=model, workdir=workdir, engine_config=dict(config), **options)


def stock_settings(
    model: Path, workdir: Path, budget: int | None = None, policy: str = "priority", extra: Sequence[str] = ()
) -> EngineSettings:
    """Stock vLLM on the same model: no plugin, ``--scheduling-policy policy``, a token budget of ``budget``
    (vLLM's default when None) and any ``extra`` flags a sweep tunes."""
    options: dict[str, Any] = {} if budget is None else {"max_num_batched_tokens": budget}
    return EngineSettings(
        model=model,
        workdir=workdir,
        coserve=False,
        extra_args=["--scheduling-policy", policy, *extra],
        **options,
    )
