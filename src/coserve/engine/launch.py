"""Start a real vLLM OpenAI server with coserve's plugin pieces, on this machine.

The same flags the operator renders for a pod (scheduler, worker, connector,
request validator), for a local process: the engine tests, the benchmarks
and, later, ``coserve up`` start engines through ``EngineServer``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from coserve.kv.handoff import KV_LOAD_FAILURE_POLICY
from coserve.scheduling.config import CONFIG_ENV

__all__ = ["EngineServer", "EngineSettings", "shared_machine_threads"]

THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"  # vLLM CPU: the cores an engine's OpenMP threads are bound to


def shared_machine_threads(index: int, engines: int, cores: Sequence[int]) -> dict[str, str]:
    """The environment that gives the ``index``-th of ``engines`` vLLM CPU engines on one machine its share of
    ``cores`` (the cores this process may use).

    vLLM binds each engine's OpenMP threads to every core it may use, one spinning thread per core, so several
    engines on one machine fight over every core: three on two cores ran a request 7x slower than one alone,
    where a fair share is 1.5x. With at least one core per engine each gets its own cores (a contiguous run,
    bound); with fewer, each gets one unbound thread and the kernel shares the cores. One engine keeps vLLM's
    own binding (empty). Who calls it: ``coserve up`` and the benchmarks' local pools, before each engine starts.
    """
    if engines <= 1 or not cores:
        return {}
    if engines > len(cores):
        return {THREADS_BIND_ENV: "nobind", "OMP_NUM_THREADS": "1"}
    ordered = sorted(cores)
    own = ordered[index * len(ordered) // engines : (index + 1) * len(ordered) // engines]
    return {THREADS_BIND_ENV: ",".join(str(core) for core in own)}


@dataclass
class EngineSettings:
    """What to start; ``coserve=False`` gives stock vLLM with the same model and limits (a baseline).

    Stock means no coserve code in the engine at all: no scheduler, worker, connector or middleware
    flags, no ``COSERVE_CONFIG``, and ``VLLM_PLUGINS`` set empty so vLLM loads no general plugin
    (coserve's registers through an entry point whenever it is installed).
    """

    model: Path
    workdir: Path
    engine_config: dict[str, Any] = field(default_factory=dict)
    coserve: bool = True
    safepoints: bool = True
    max_num_batched_tokens: int = 256
    max_model_len: int = 4096
    dtype: str = "float32"
    extra_args: list[str] = field(default_factory=list)
    startup_timeout_s: float = 300.0
    # KV offload / handoff settings (coserve.kv.config) and the connector's role
    kv: dict[str, Any] = field(default_factory=dict)
    kv_role: str = "kv_both"
    # other KV connectors after coserve's, in vLLM's MultiConnector (as the operator renders GPU engines)
    kv_siblings: list[dict[str, Any]] = field(default_factory=list)
    # vLLM's dev endpoints (POST /reset_prefix_cache): tests and benchmarks evict KV with them
    dev_mode: bool = False
    served_model_name: str = "tiny"
    # added to the server's environment (e.g. ``shared_machine_threads``: its share of this machine's cores)
    env: dict[str, str] = field(default_factory=dict)


def engine_healthy(base: str) -> bool:
    """Whether the vLLM server at ``base`` answers ``GET /health`` with 200 (used while it starts)."""
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=2) as response:  # noqa: S310 - loopback
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (nothing holds it for the caller: bind it soon)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EngineServer:
    """A running server; use as a context manager. ``base`` is its URL, ``engine_id`` names its board."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.port = free_port()
        self.engine_id = f"coserve{self.port}{os.getpid()}"
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = settings.workdir / f"vllm-{self.port}.log"
        self._process: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        s = self.settings
        args = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(s.model),
            "--served-model-name",
            s.served_model_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            s.dtype,
            "--max-model-len",
            str(s.max_model_len),
            "--max-num-batched-tokens",
            str(s.max_num_batched_tokens),
            "--enforce-eager",
            "--enable-prefix-caching",
            "--seed",
            "0",
        ]
        if s.coserve:
            transfer: dict[str, Any] = {
                "kv_connector": "CoServeConnector",
                "kv_connector_module_path": "coserve.engine.connector",
                "kv_role": s.kv_role,
                "engine_id": self.engine_id,
                "kv_load_failure_policy": KV_LOAD_FAILURE_POLICY,
                "kv_connector_extra_config": {"safepoints": s.safepoints, **s.kv},
            }
            if s.kv_siblings:
                # NOTE: MultiConnector gives each child its own engine_id; a child that names one too is refused
                transfer.pop("engine_id")
                transfer.pop("kv_load_failure_policy")
                siblings = [{"kv_role": s.kv_role, **sibling} for sibling in s.kv_siblings]
                transfer = {
                    "kv_connector": "MultiConnector",
                    "kv_role": s.kv_role,
                    "engine_id": self.engine_id,
                    "kv_load_failure_policy": KV_LOAD_FAILURE_POLICY,  # vLLM reads it here, not in the children
                    "kv_connector_extra_config": {"connectors": [transfer, *siblings]},
                }
            args += [
                "--scheduler-cls",
                "coserve.engine.scheduler.TDGScheduler",
                "--middleware",
                "coserve.engine.validation.RequestClassValidator",
                "--kv-transfer-config",
                json.dumps(transfer),
                "--worker-cls",
                "coserve.engine.worker.SafepointCPUWorker",
            ]
        return [*args, *s.extra_args]

    def environment(self, config: Path) -> dict[str, str]:
        """The server's environment: coserve's config file, or, for stock vLLM, no plugin at all."""
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "VLLM_CPU_CI_ENV": "1",
            **self.settings.env,
        }
        if self.settings.coserve:
            env[CONFIG_ENV] = str(config)
        else:
            env.pop(CONFIG_ENV, None)
            env["VLLM_PLUGINS"] = ""  # an empty allow-list: vLLM loads no general plugin
        return env

    def __enter__(self) -> EngineServer:
        s = self.settings
        s.workdir.mkdir(parents=True, exist_ok=True)
        config = s.workdir / f"engine-{self.port}.json"
        config.write_text(json.dumps(s.engine_config))
        env = self.environment(config)
        if s.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(  # noqa: S603 - our own argv, no shell
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=s.workdir
            )
        deadline = time.monotonic() + s.startup_timeout_s
        while not self._healthy():
            if self._process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self._process.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"vLLM did not start in {s.startup_timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(1)
        return self

    def _healthy(self) -> bool:
        return engine_healthy(self.base)

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None
        from coserve.engine.safepoint import SafepointBoard, board_name

        SafepointBoard.remove(board_name(self.engine_id))
