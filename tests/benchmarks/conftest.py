"""The benchmark scripts, imported as they run: their folder first on sys.path, so the ``harness`` package
and their other neighbours import as they do when the script is run."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
GPU_DIR = BENCHMARKS / "gpu"


def _script(name: str, folder: Path = BENCHMARKS) -> Iterator[ModuleType]:
    saved = list(sys.path)
    sys.path.insert(0, str(folder))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path[:] = saved


@pytest.fixture(scope="module")
def harness() -> Iterator[SimpleNamespace]:
    """benchmarks/harness's modules with no engine or client in them: stats, results, workload, sweep."""
    saved = list(sys.path)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        names = ("stats", "results", "workload", "sweep")
        yield SimpleNamespace(**{name: importlib.import_module(f"harness.{name}") for name in names})
    finally:
        sys.path[:] = saved


@pytest.fixture(scope="module")
def coserving() -> Iterator[ModuleType]:
    yield from _script("coserving")


@pytest.fixture(scope="module")
def world() -> Iterator[ModuleType]:
    """benchmarks/autoscaling.py: the autoscaling benchmark's world and analysis."""
    yield from _script("autoscaling")


@pytest.fixture(scope="module")
def fidelity() -> Iterator[ModuleType]:
    yield from _script("simulator_fidelity")


@pytest.fixture(scope="module")
def freshness() -> Iterator[ModuleType]:
    """benchmarks/freshness.py: result stamps and their status."""
    yield from _script("freshness")


@pytest.fixture(scope="module")
def router_overhead() -> Iterator[ModuleType]:
    """benchmarks/router_overhead.py: coserve's router against vllm-router's swept configurations."""
    yield from _script("router_overhead")


@pytest.fixture(scope="module")
def ttfet() -> Iterator[ModuleType]:
    """benchmarks/ttfet.py: conversation-level placement against coserve's baselines and vllm-router's policies."""
    yield from _script("ttfet")


@pytest.fixture(scope="module")
def harness_provisioned() -> Iterator[ModuleType]:
    """benchmarks/harness/provisioned.py: the load the plan provisions a local pool's engines for."""
    yield from _script("harness.provisioned")


@pytest.fixture(scope="module")
def harness_runs() -> Iterator[ModuleType]:
    """benchmarks/harness/runs.py: a sweep's finished runs, kept so that it resumes."""
    yield from _script("harness.runs")


@pytest.fixture(scope="module")
def harness_pool() -> Iterator[ModuleType]:
    """benchmarks/harness/pool.py: the local P/D pool and the coserve router as the benchmarks start it."""
    yield from _script("harness.pool")


@pytest.fixture(scope="module")
def harness_peers() -> Iterator[ModuleType]:
    """benchmarks/harness/peers.py: vllm-router and processes started for a run."""
    yield from _script("harness.peers")


@pytest.fixture(scope="module")
def plan_check() -> Iterator[ModuleType]:
    yield from _script("plan_check")


@pytest.fixture(scope="module")
def torch_check() -> Iterator[ModuleType]:
    """benchmarks/gpu/torch_check.py imported as a module (it puts ``src/`` and ``benchmarks/`` on sys.path)."""
    yield from _script("torch_check", GPU_DIR)


@pytest.fixture(scope="module")
def simulator_at_scale() -> Iterator[ModuleType]:
    yield from _script("simulator_at_scale")


@pytest.fixture(scope="module")
def reconcile() -> Iterator[ModuleType]:
    yield from _script("reconcile")
