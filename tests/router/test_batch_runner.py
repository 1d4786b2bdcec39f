"""Offline batches run every line exactly once, in time linear in the lines, across a runner's ``kill -9``.

The upstreams are test doubles for vLLM's OpenAI server (no engine runs here): an in-process ``send``
that counts executions per ``custom_id``, and, for the two-process test, a Starlette app on loopback
that counts them too and, as vLLM's ``with_cancellation`` does, abandons a request whose client went away.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from coserve.router.batch_lock import FileLocks
from coserve.router.batches import BatchRunner, BatchStore
from router_served import Served


def batch_input(num_lines: int) -> bytes:
    lines = ({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": {"prompt": f"r{i}"}}
             for i in range(num_lines))  # fmt: skip
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def output_ids(store: BatchStore, batch: dict[str, Any]) -> Counter[str]:
    output = store.content(batch["output_file_id"]) or b""
    whole = output.split(b"\n")[:-1]  # a line being written by another process may be half there
    return Counter(json.loads(line)["custom_id"] for line in whole if line)


def wait_until(predicate: Callable[[], Any], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)


async def run_in_process(
    root: Path, num_lines: int, prepare: Callable[[BatchStore, dict[str, Any]], None] | None = None
) -> tuple[float, Counter[str], BatchStore, dict[str, Any]]:
    """Run one batch of ``num_lines`` to completion; (wall seconds, executions per custom_id, store, batch)."""
    store = BatchStore(root)
    executions: Counter[str] = Counter()

    async def send(endpoint: str, body: dict[str, Any]) -> tuple[int, bytes]:
        executions[body["prompt"]] += 1
        await asyncio.sleep(0)  # a request yields to the loop
        return 200, b'{"choices": [{"text": "ok"}]}'

    file_id = store.add_file(batch_input(num_lines), "in.jsonl", "batch")["id"]
    runner = BatchRunner(store, send, lambda: True, concurrency=16, idle_s=0.01, locks=FileLocks(store.batches))
    started = time.perf_counter()
    batch = store.create_batch(file_id, "/v1/completions")
    if prepare is not None:
        prepare(store, batch)
    runner.start()
    try:
        deadline = time.monotonic() + 300
        while (store.batch(batch["id"]) or {})["status"] != "completed":
            assert time.monotonic() < deadline, f"a batch of {num_lines} lines did not complete in 300 s"
            await asyncio.sleep(0.01)
    finally:
        await runner.stop()
    return time.perf_counter() - started, executions, store, batch


@pytest.mark.asyncio
async def test_a_batch_runs_each_line_once_in_time_linear_in_its_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    times_s = {}
    for num_lines in (1_000, 10_000):
        elapsed_s, executions, store, batch = await run_in_process(tmp_path / str(num_lines), num_lines)
        times_s[num_lines] = elapsed_s
        everyone = {f"r{i}" for i in range(num_lines)}
        assert set(executions) == everyone and set(executions.values()) == {1}
        written = output_ids(store, batch)
        assert set(written) == everyone and set(written.values()) == {1}
        counts = (store.batch(batch["id"]) or {})["request_counts"]
        assert counts == {"total": num_lines, "completed": num_lines, "failed": 0}
    with capsys.disabled():
        print(f"\n{'lines':>8} {'wall s':>8} {'us/line':>8}")
        for num_lines, elapsed_s in times_s.items():
            print(f"{num_lines:>8} {elapsed_s:>8.3f} {elapsed_s / num_lines * 1e6:>8.0f}")
        print(f"ratio 10k/1k: {times_s[10_000] / times_s[1_000]:.1f} (linear: about 10)")
    assert times_s[10_000] < 15 * times_s[1_000]


@pytest.mark.asyncio
async def test_a_takeover_skips_answered_lines_and_reruns_a_torn_last_one(tmp_path: Path) -> None:
    def died_mid_write(store: BatchStore, batch: dict[str, Any]) -> None:
        answered = b"".join(
            json.dumps({"id": f"x{i}", "custom_id": f"r{i}", "response": {"status_code": 200, "body": {}}}).encode()
            + b"\n"
            for i in range(3)
        )
        torn = b'{"id": "x3", "custom_id": "r3", "respo'  # the holder died in the middle of this write
        store.content_path(batch["output_file_id"]).write_bytes(answered + torn)

    _, executions, store, batch = await run_in_process(tmp_path, 10, died_mid_write)
    assert executions == Counter({f"r{i}": 1 for i in range(3, 10)})  # r0..r2 were answered before
    assert output_ids(store, batch) == Counter({f"r{i}": 1 for i in range(10)})
    assert (store.batch(batch["id"]) or {})["request_counts"] == {"total": 10, "completed": 10, "failed": 0}


# --- two runner processes, one killed -------------------------------------------------------------------


class CountingUpstream:
    """A test double for vLLM's OpenAI server on loopback: counts executions per custom_id (the prompt).

    The first ``free`` requests answer at once; later ones wait for ``open_gate()``, and one whose
    client disconnects meanwhile is abandoned unfinished, as vLLM's ``with_cancellation`` does.
    """

    def __init__(self, free: int) -> None:
        self.free = free
        self.lock = threading.Lock()
        self.arrivals: list[tuple[str, str]] = []  # (custom_id, runner pid) in order of arrival
        self.waiting: dict[str, str] = {}  # custom_id -> runner pid, for requests held at the gate
        self.completed: Counter[str] = Counter()
        self.aborted: list[tuple[str, str]] = []  # (custom_id, runner pid)
        self.gate = asyncio.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.served = Served(Starlette(routes=[Route("/v1/completions", self.complete, methods=["POST"])]))
        self.url = self.served.url

    def open_gate(self) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self.gate.set)

    def snapshot(self) -> tuple[list[tuple[str, str]], dict[str, str], Counter[str], list[tuple[str, str]]]:
        with self.lock:
            return list(self.arrivals), dict(self.waiting), Counter(self.completed), list(self.aborted)

    async def complete(self, request: Request) -> Response:
        self.loop = asyncio.get_running_loop()
        custom_id, runner = (await request.json())["prompt"], request.headers["x-runner"]
        with self.lock:
            self.arrivals.append((custom_id, runner))
            held = len(self.arrivals) > self.free and not self.gate.is_set()
            if held:
                self.waiting[custom_id] = runner
        if held:
            opened, gone = asyncio.ensure_future(self.gate.wait()), asyncio.ensure_future(disconnected(request))
            await asyncio.wait({opened, gone}, return_when=asyncio.FIRST_COMPLETED)
            opened.cancel()
            gone.cancel()
            with self.lock:
                del self.waiting[custom_id]
                if not self.gate.is_set():  # the client went away first: abandoned, never finished
                    self.aborted.append((custom_id, runner))
                    return Response(status_code=499)
        with self.lock:
            self.completed[custom_id] += 1
        return JSONResponse({"choices": [{"text": custom_id}]})


async def disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body was read: only ``http.disconnect`` can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


RUNNER = """
import asyncio, os, sys
from pathlib import Path

import aiohttp

from coserve.router.batch_lock import FileLocks
from coserve.router.batches import BatchRunner, BatchStore

async def main(upstream: str, root: str) -> None:
    store = BatchStore(Path(root))
    async with aiohttp.ClientSession() as session:
        async def send(endpoint: str, body: dict) -> tuple[int, bytes]:
            headers = {"x-runner": str(os.getpid())}
            async with session.post(f"{upstream}/v1/{endpoint}", json=body, headers=headers) as response:
                return response.status, await response.read()

        runner = BatchRunner(store, send, lambda: True, concurrency=int(sys.argv[3]), idle_s=0.02,
                             locks=FileLocks(store.batches))
        runner.start()
        await asyncio.Event().wait()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def test_two_runner_processes_share_a_batch_and_a_kill_9_loses_no_line_and_runs_none_twice(tmp_path: Path) -> None:
    num_lines, free, concurrency = 120, 40, 4
    upstream = CountingUpstream(free)
    store = BatchStore(tmp_path / "batches")
    file_id = store.add_file(batch_input(num_lines), "in.jsonl", "batch")["id"]
    batch = store.create_batch(file_id, "/v1/completions")
    logs = [(tmp_path / f"runner{i}.log").open("w") for i in range(2)]
    runners = [
        subprocess.Popen(
            [sys.executable, "-c", RUNNER, upstream.url, str(store.root), str(concurrency)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        for log in logs
    ]
    try:
        # the holder answers `free` lines, writes them all, and holds `concurrency` more at the gate
        wait_until(
            lambda: (
                sum(upstream.snapshot()[2].values()) == free
                and len(upstream.snapshot()[1]) == concurrency
                and sum(output_ids(store, batch).values()) == free
            ),
            "the first runner to answer the free lines and wait on the rest",
        )
        arrivals, waiting, _, _ = upstream.snapshot()
        assert len({pid for _, pid in arrivals}) == 1  # one runner runs the batch; the other keeps off
        holder_pid = int(arrivals[0][1])
        holder = next(r for r in runners if r.pid == holder_pid)
        survivor = next(r for r in runners if r.pid != holder_pid)
        in_flight = set(waiting)

        os.kill(holder_pid, signal.SIGKILL)
        holder.wait(timeout=10)
        # the kernel closed its connections: the upstream abandons the requests it held, unfinished
        wait_until(lambda: len(upstream.snapshot()[3]) == concurrency, "the killed runner's requests to be aborted")
        upstream.open_gate()
        wait_until(lambda: (store.batch(batch["id"]) or {})["status"] == "completed", "the survivor to finish")

        arrivals, _, completed, aborted = upstream.snapshot()
        everyone = {f"r{i}" for i in range(num_lines)}
        assert completed == Counter(dict.fromkeys(everyone, 1))  # every line ran to completion exactly once
        assert output_ids(store, batch) == Counter(dict.fromkeys(everyone, 1))  # and was written exactly once
        assert sorted(aborted) == sorted((custom_id, str(holder_pid)) for custom_id in in_flight)
        answered_first = {custom_id for custom_id, pid in arrivals[:free]}
        by_survivor = [custom_id for custom_id, pid in arrivals if pid == str(survivor.pid)]
        assert sorted(by_survivor) == sorted(everyone - answered_first)  # it skipped what was written, reran the rest
        assert in_flight <= set(by_survivor)
        counts = (store.batch(batch["id"]) or {})["request_counts"]
        assert counts == {"total": num_lines, "completed": num_lines, "failed": 0}
    except BaseException:
        for i, log in enumerate(logs):
            log.flush()
            print(f"--- runner {i} ---\n{(tmp_path / f'runner{i}.log').read_text()}")
        raise
    finally:
        for runner in runners:
            if runner.poll() is None:
                runner.kill()
                runner.wait(timeout=10)
        for log in logs:
            log.close()
        upstream.served.stop()
