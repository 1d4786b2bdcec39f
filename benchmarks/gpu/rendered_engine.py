"""The rendered decoder of a GPU pool, launched on this machine's GPU with only the substitutions it needs.

Who uses it: ``benchmarks/gpu/gpu_check.py`` (the GPU check, run by ``benchmarks/gpu/check.sh``).
What runs is the decoder ``coserve render`` gives for the pool: vLLM's OpenAI server with
``SafepointGPUWorker``, ``TDGScheduler``, the request validator and MultiConnector with coserve's
connector first, then NixlConnector. No ``--enforce-eager``: vLLM compiles the model and, because
coserve's connector asks for it (``requires_piecewise_for_cudagraph``), captures piecewise CUDA
graphs split at attention. Substituted by ``coserve.engine.rendered.local_launch``, the code
``tests/engine/test_render_parity.py`` launches its engines with, and nothing else:

- ``python3`` → this interpreter; ``--model`` (an HF id) → the tiny model's folder;
- ``--port`` → a free port, plus ``--host 127.0.0.1``; ``--served-model-name`` gets the alias
  ``tiny`` beside the rendered name (the benchmark functions ask for that model);
- the ConfigMap mount ``/etc/coserve`` → a folder holding the rendered ConfigMap's files;
- ``COSERVE_ROUTER_TOKEN_FILE`` (the router's token, where the rendering mounts one) is left out:
  the benchmark clients talk to the engine directly and send no token, and a request without it
  is served at the lowest class and never preempts. Without it the engine trusts every request,
  as a local engine (``EngineServer``, ``coserve up``) does;
- only where NIXL cannot start (the check's NIXL probe fails, or the engine dies naming NIXL/UCX):
  ``NixlConnector`` → vLLM's ``ExampleConnector`` in the same position with the same ``kv_role``;
- the baseline engine only: ``"safepoints": false`` in coserve's connector settings.

Added to the environment: ``HF_HUB_OFFLINE=1``, ``VLLM_SERVER_DEV_MODE=1`` (``kv_reload`` empties
the caches through ``POST /reset_prefix_cache``) and, while NixlConnector runs, a free
``VLLM_NIXL_SIDE_CHANNEL_PORT``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from coserve.engine.launch import engine_healthy, free_port
from coserve.engine.rendered import (
    Launch,
    Substitutions,
    config_files,
    engine_container,
    example_connector,
    flag_values,
    local_launch,
)
from coserve.engine.safepoint import SafepointBoard

__all__ = [
    "EngineStartError",
    "GPUEngine",
    "Launch",
    "Rendered",
    "free_port",
    "log_facts",
    "nixl_failed",
    "plan_launch",
    "pool_variant",
]

HOST_POOL_BYTES = 2 << 30  # as benchmarks/kv_offload.py
SERVED_ALIAS = "tiny"  # the model name the benchmark functions send
SHM = Path("/dev/shm")  # noqa: S108 - where POSIX shared memory (the safepoint board) lives
BOARD_PREFIX = "coserve-sp-"
WORKER = "coserve.engine.worker.SafepointGPUWorker"
NIXL_LOG = re.compile(r"nixl|ucx", re.IGNORECASE)
FAILURE = re.compile(r"error|exception|fail|not available", re.IGNORECASE)


def pool_variant(document: dict[str, Any]) -> dict[str, Any]:
    """The pool with offline work (what safepoints preempt) and coserve's host KV pool (what kv_reload reloads)."""
    out = copy.deepcopy(document)
    spec = out["spec"]
    spec["offline"] = {**(spec.get("offline") or {}), "enabled": True}
    spec["kvOffload"] = {"enabled": True, "backend": "host", "hostMemoryBytes": HOST_POOL_BYTES}
    return out


@dataclass
class Rendered:
    """The decoder container and the ConfigMap files of a ``coserve render -o json`` output."""

    container: dict[str, Any]
    files: dict[str, str]

    @classmethod
    def load(cls, path: Path) -> Rendered:
        objects = json.loads(path.read_text())["items"]
        return cls(engine_container(objects, "decoder"), config_files(objects))


def plan_launch(
    rendered: Rendered, model: Path, config_dir: Path, *, safepoints: bool, substitute_nixl: bool, kv_dir: Path
) -> Launch:
    """The module docstring's substitutions, applied to the rendered decoder; nothing else changes."""
    _check_gpu_rendering(rendered.container)
    substitutions = Substitutions(
        model=str(model), port=free_port(), mounts={"config": config_dir}, served_alias=SERVED_ALIAS,
        nixl=example_connector(kv_dir) if substitute_nixl else None, safepoints=safepoints, router_token=False,
    )  # fmt: skip
    launch = local_launch(rendered.container, substitutions)
    connectors = launch.connectors
    if connectors[:1] != ["CoServeConnector"] or "--worker-cls" not in launch.argv:
        raise ValueError(f"expected MultiConnector with CoServeConnector first and --worker-cls, got {connectors}")
    launch.env["VLLM_SERVER_DEV_MODE"] = "1"
    if "NixlConnector" in connectors:
        launch.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
    return launch


def _check_gpu_rendering(container: dict[str, Any]) -> None:
    """What this check needs of the rendering: CUDA graphs, the GPU worker, MultiConnector."""
    args = list(container["args"])
    if "--enforce-eager" in args:
        raise ValueError("the rendered decoder has --enforce-eager: it would run without CUDA graphs")
    flags = dict(flag_values(args))
    if "--worker-cls" in flags and flags["--worker-cls"] != WORKER:
        raise ValueError(f"the rendered decoder's worker is {flags['--worker-cls']}, expected {WORKER}")
    if "--kv-transfer-config" in flags:
        kind = json.loads(flags["--kv-transfer-config"] or "{}").get("kv_connector")
        if kind != "MultiConnector":
            raise ValueError(f"the GPU rendering should use MultiConnector, got {kind}")


# --- a running engine ----------------------------------------------------------------------------------


class EngineStartError(RuntimeError):
    """The engine exited or did not answer /health in time; ``log_tail`` says why."""

    def __init__(self, message: str, log_tail: str) -> None:
        super().__init__(f"{message}\n{log_tail}")
        self.log_tail = log_tail


class GPUEngine:
    """The launched decoder; ``base`` and ``engine_id`` are what preemption.py's functions read."""

    def __init__(self, launch: Launch, log: Path, startup_timeout_s: float) -> None:
        self.launch = launch
        self.log = log
        self.startup_timeout_s = startup_timeout_s
        port = launch.argv[launch.argv.index("--port") + 1]
        self.base = f"http://127.0.0.1:{port}"
        self.engine_id = ""  # the board's suffix (board_name(engine_id) == the board's name)
        self.board: SafepointBoard | None = None
        self.started_in_s = 0.0
        self._process: subprocess.Popen[bytes] | None = None
        self._children: list[Any] = []

    def __enter__(self) -> GPUEngine:
        before = set(SHM.glob(BOARD_PREFIX + "*"))
        started = time.monotonic()
        # NOTE: same process group as this driver: check.sh's `timeout` then stops the engines with it.
        with self.log.open("wb") as log:
            self._process = subprocess.Popen(  # noqa: S603 - the rendered argv, no shell
                self.launch.argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.launch.env}
            )
        try:
            self._wait_healthy(started)
            self.started_in_s = time.monotonic() - started
            self._children = _descendants(self._process.pid)
            created = sorted(set(SHM.glob(BOARD_PREFIX + "*")) - before)
            if len(created) != 1:
                raise EngineStartError(f"expected one new safepoint board in {SHM}, found {created}", self.log_tail())
            self.engine_id = created[0].name.removeprefix(BOARD_PREFIX)
            self.board = SafepointBoard.attach(created[0].name)
        except BaseException:
            self._stop()
            raise
        return self

    def _wait_healthy(self, started: float) -> None:
        assert self._process is not None
        while not self._healthy():
            if self._process.poll() is not None:
                raise EngineStartError(f"the engine exited with {self._process.returncode}", self.log_tail())
            if time.monotonic() - started > self.startup_timeout_s:
                raise EngineStartError(f"no /health within {self.startup_timeout_s:.0f} s", self.log_tail())
            time.sleep(0.5)

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self.board is not None:
            self.board.close()
            self.board = None
        self._stop()
        if self.engine_id:
            SafepointBoard.remove(BOARD_PREFIX + self.engine_id)

    def _stop(self) -> None:
        process = self._process
        if process is None:
            return
        children = self._children or _descendants(process.pid)  # the engine core and its workers
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        _reap(children)
        self._process = None

    def _healthy(self) -> bool:
        return engine_healthy(self.base)

    def log_tail(self, num_chars: int = 6000) -> str:
        try:
            return self.log.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""


def _descendants(pid: int) -> list[Any]:
    try:
        import psutil  # vLLM's own dependency
    except ImportError:
        return []
    with contextlib.suppress(Exception):
        return list(psutil.Process(pid).children(recursive=True))
    return []


def _reap(processes: list[Any]) -> None:
    """Give processes the engine started 30 s to leave after it did, then kill those still there."""
    if not processes:
        return
    import psutil

    _, alive = psutil.wait_procs(processes, timeout=30)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()


def nixl_failed(log_tail: str) -> bool:
    """Whether a failed start's log blames NIXL or UCX (not just "NIXL is available")."""
    return any(NIXL_LOG.search(line) and FAILURE.search(line) for line in log_tail.splitlines())


def log_facts(log: Path) -> dict[str, Any]:
    """What vLLM's log says about compilation and CUDA graphs (tqdm bars are split on carriage returns)."""
    lines = re.split(r"[\r\n]+", log.read_text(errors="replace"))
    captures = sorted({m.group(1) for line in lines if (m := re.search(r"Capturing CUDA graphs \(([^)]*)\)", line))})
    finished = [line.strip() for line in lines if "Graph capturing finished" in line]
    override = [line.strip() for line in lines if "requires PIECEWISE CUDA graph mode" in line]
    disabled = [line.strip() for line in lines if "Cudagraph is disabled" in line]
    dtype = next((m.group(1) for line in lines if (m := re.search(r"\bdtype=(torch\.\w+)", line))), None)
    runner = next((line.strip() for line in lines if "V1 model runner" in line or "Model Runner V2" in line), None)
    piecewise = any("PIECEWISE" in c for c in captures)
    full = any(re.search(r"\bFULL\b", c) for c in captures)
    return {
        "captured": captures,  # e.g. "mixed prefill-decode, PIECEWISE"
        "piecewise_captured": piecewise,
        "full_graphs_captured": full,
        "override_to_piecewise_logged": bool(override),
        "capture_finished": finished[:1],
        "cudagraphs_disabled": bool(disabled),
        "dtype": dtype,
        "model_runner_note": runner,
    }
