"""The harness's process helpers with real processes: the coserve router started as the benchmarks start it,
and a process that dies before it is ready reported as such (not waited on until the deadline)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import ModuleType

import httpx
import pytest


def test_router_process_answers_once_it_yields_and_is_gone_after(harness_pool: ModuleType, tmp_path: Path) -> None:
    from router_served import FakeEngine  # a test double: an engine that answers like vLLM's server

    engine = FakeEngine("d0")
    try:
        with harness_pool.router_process({"model": "tiny", "decoders": [engine.url]}, tmp_path) as base:
            assert httpx.get(f"{base}/health", timeout=5).status_code == 200
            answer = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "hi"}, timeout=10)
            assert answer.status_code == 200, answer.text
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{base}/health", timeout=2)
    finally:
        engine.served.stop()


def test_a_process_that_exits_before_it_is_ready_fails_at_once(harness_peers: ModuleType) -> None:
    port = harness_peers.free_port()
    started = time.monotonic()
    with (
        pytest.raises(RuntimeError, match=r"exited \(3\)"),
        harness_peers.launched([sys.executable, "-c", "raise SystemExit(3)"]) as process,
    ):
        harness_peers.wait_ready(process, f"http://127.0.0.1:{port}/health", 60, "the peer")
    assert time.monotonic() - started < 30  # it did not wait out the 60 s


def test_a_process_that_never_answers_times_out(harness_peers: ModuleType) -> None:
    port = harness_peers.free_port()
    with (
        pytest.raises(RuntimeError, match="did not become ready in 1 s"),
        harness_peers.launched([sys.executable, "-c", "import time; time.sleep(60)"]) as process,
    ):
        harness_peers.wait_ready(process, f"http://127.0.0.1:{port}/health", 1, "the peer")
