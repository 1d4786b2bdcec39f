"""The peers coserve is compared with, and processes pinned to cores: vLLM's own router (``vllm-router``).

Who calls what: ``ttfet.py`` puts vllm-router in front of the same engines coserve's router serves;
``router_overhead.py`` puts it in front of the same fake upstream, each process on its own core
(``launched``). Each sweeps vllm-router's policies, as a competent operator of it would.
``reconcile.py`` runs its API server emulator and the operator under test with ``launched`` too.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

POLICIES = ("round_robin", "consistent_hash", "cache_aware")


def free_port() -> int:
    """A TCP port on 127.0.0.1 no one listens on now (for a process this run is about to start)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def vllm_router_command(port: int, policy: str, workers: Sequence[str], *extra: str) -> list[str]:
    """vllm-router on ``port`` over ``workers`` with ``policy``. Its warning level logs three lines per
    request: error only. ``extra`` adds flags (its P/D mode, health checks)."""
    return [
        str(Path(sys.executable).with_name("vllm-router")), "--host", "127.0.0.1", "--port", str(port),
        "--policy", policy, "--log-level", "error", "--worker-startup-check-interval", "1",
        "--prometheus-port", str(free_port()), *extra, *(["--worker-urls", *workers] if workers else []),
    ]  # fmt: skip


def vllm_router_pd_command(port: int, policy: str, prefillers: Sequence[str], decoders: Sequence[str]) -> list[str]:
    """vllm-router in its vLLM P/D mode: ``policy`` chooses the decoder."""
    pd = ["--vllm-pd-disaggregation", *(a for p in prefillers for a in ("--prefill", p))]
    return vllm_router_command(port, policy, [], *pd, *(a for d in decoders for a in ("--decode", d)))


@contextmanager
def vllm_router(command: list[str], port: int, startup_s: float = 120.0) -> Iterator[str]:
    """vllm-router running ``command`` until the block ends; its URL once it is ready (all workers healthy)."""
    url = f"http://127.0.0.1:{port}"
    with launched(command, quiet=True) as process:
        wait_ready(process, f"{url}/readiness", startup_s, "vllm-router")
        yield url


def wait_ready(process: subprocess.Popen[bytes], url: str, startup_s: float, what: str) -> None:
    """Return once ``url`` answers 200; RuntimeError if ``process`` exits first or ``startup_s`` pass."""
    deadline = time.monotonic() + startup_s
    while not answers(url):
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited ({process.returncode}): {' '.join(map(str, process.args))}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not become ready in {startup_s:.0f} s")
        time.sleep(0.5)


def answers(url: str) -> bool:
    """Whether ``url`` answers 200 now."""
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def launched(
    command: list[str],
    cores: set[int] | None = None,
    env: dict[str, str] | None = None,
    quiet: bool = False,
    log: Path | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """``command`` running while the block runs: on ``cores`` (None: this process's), its stdout dropped
    (``quiet``) or appended with its stderr to ``log``. Stopped when the block ends, killed if it will not stop."""
    with ExitStack() as stack:
        output: Any = None
        if log is not None:
            output = stack.enter_context(log.open("a"))
        elif quiet:
            output = subprocess.DEVNULL
        process = subprocess.Popen(  # noqa: S603 - this script, our own CLI, the pinned vllm-router
            command,
            env={**os.environ, **(env or {})},
            stdout=output,
            stderr=subprocess.STDOUT if log is not None else None,
            preexec_fn=None if cores is None else lambda: os.sched_setaffinity(0, cores),
        )
        try:
            yield process
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
