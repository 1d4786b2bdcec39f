"""OpenAI-style offline batches: upload a JSONL file, create a batch, and the router runs it on spare capacity.

Who calls it: ``coserve.router.app`` mounts the routes (``/v1/files``,
``/v1/batches``: ``coserve.router.routes``) when the config names a ``batchDir``,
and starts one ``BatchRunner`` (its lines run through ``coserve.router.offline``).
Everything is persisted under ``batchDir`` (a local directory
in the local pool, a volume in Kubernetes): ``files/<id>.jsonl`` with
``<id>.json`` metadata; ``batches/<id>.json``, the batch's state, and
``batches/<id>.progress``, its request counts while it runs.

Several router replicas may share ``batchDir``; any replica answers reads. Each
batch is run by one runner at a time: the holder of its lock
(``coserve.router.batch_lock``: an ``flock`` on ``batches/<id>.lock``, or a
Kubernetes Lease per batch), which a runner keeps for as long as it runs the
batch and which passes to another replica when the holder dies.

Across any replica's death, each line's answer is written exactly once, and
each line runs to completion once but for the window named last:

- a line is done when its output line is in the output file: answers are
  appended (written, flushed, fsynced) as they come, each carrying its input
  line's ``custom_id`` (unique within a file: uploads are checked), and a
  runner that takes a batch over reads the output once, trims a torn last line
  of a holder that died mid-write, and skips every line already answered;
- a request in flight when its runner dies is not run twice: the runner's
  connections close with its process, and vLLM aborts a request whose client
  went away. In vLLM 0.32, ``create_completion`` and ``create_chat_completion``
  (``vllm/entrypoints/openai/{completion,chat_completion}/api_router.py``) are
  wrapped in ``with_cancellation`` (``vllm/entrypoints/serve/utils/api_utils.py``),
  which runs the handler beside ``listen_for_disconnect``, a wait for the ASGI
  ``http.disconnect`` message, and cancels the handler when that comes first;
  the cancellation reaches ``AsyncLLM.generate`` (``vllm/v1/engine/async_llm.py``),
  whose ``except (asyncio.CancelledError, GeneratorExit)`` calls
  ``self.abort(request_id)``, so the request leaves the engine unfinished and
  the next holder runs it from the start;
- what is left: an answer the engine finished and sent just before its runner
  died, but that was not yet appended, is run again. A sender hands its answer
  to the output before it takes the next line, so this is at most
  ``concurrency`` lines per death, and only those whose answer was already on
  its way back. And the abort needs the runner's kernel to close its
  connections: when a whole node vanishes, an engine notices only when TCP
  gives up, and may finish a request the next holder runs again.

The runner reads the input as a stream (a read offset into the file, a block of
lines at a time) and appends to the output; file I/O runs in worker threads,
never on the event loop, and nothing is read more than once per takeover: a
batch costs time linear in its lines. Lines run at the lowest (offline) class,
at most ``concurrency`` at a time, and only while ``has_spare_capacity()`` (some
decoder below ``spare`` KV occupancy), so online traffic keeps the capacity it
needs; ``send`` places each one as ``coserve.router.policy.place_offline``
decides (``Router.run_offline``): straight to a decoder with spare KV, which
prefills and decodes it, and through a prefiller only when one is idle.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from coserve.router.batch_lock import BatchHold, BatchLocks, batch_locks_from_env

__all__ = ["BatchRunner", "BatchStore", "HoldLost"]

logger = logging.getLogger("coserve.router.batches")

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
MAX_LINES = 50_000
RUNNING = ("in_progress", "cancelling")
READ_LINES = 256  # input lines parsed per trip to a worker thread
PROGRESS_EVERY_S = 0.5  # how often a running batch's request counts are saved

Send = Callable[[str, dict[str, Any]], Awaitable[tuple[int, bytes]]]


class HoldLost(RuntimeError):
    """This runner's hold on a batch lapsed: another runner may run it now, so this one writes nothing more."""


def _write_json(path: Path, data: dict[str, Any]) -> None:
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")  # unique: replicas may write at once
    partial.write_text(json.dumps(data))
    os.replace(partial, path)  # a crash never leaves half a state file


def _jsonl_lines(content: bytes) -> list[bytes]:
    """The lines of a JSONL file as the runner reads them: split at ``\\n`` only, the last newline optional."""
    lines = content.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return lines


class BatchStore:
    """Files and batches on disk."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files = root / "files"
        self.batches = root / "batches"
        self.files.mkdir(parents=True, exist_ok=True)
        self.batches.mkdir(parents=True, exist_ok=True)
        # batch file -> ((inode, mtime, size) when read, its state): only ended batches, which never change
        self._ended: dict[Path, tuple[tuple[int, int, int], dict[str, Any]]] = {}

    def add_file(self, content: bytes, filename: str, purpose: str) -> dict[str, Any]:
        """Validate and store an uploaded batch input; ``ValueError`` names the first bad line."""
        content.decode("utf-8")  # UnicodeDecodeError: not a text file
        lines = _jsonl_lines(content)
        if not lines or len(lines) > MAX_LINES:
            raise ValueError(f"the file must hold 1 to {MAX_LINES} JSON lines, got {len(lines)}")
        seen = set()
        for number, line in enumerate(lines, 1):
            try:
                item = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"line {number}: not JSON: {error}") from None
            if not isinstance(item, dict) or not isinstance(item.get("custom_id"), str):
                raise ValueError(f"line {number}: needs a string custom_id")
            if item["custom_id"] in seen:
                raise ValueError(f"line {number}: custom_id {item['custom_id']!r} repeats")
            seen.add(item["custom_id"])
            if item.get("method", "POST") != "POST" or item.get("url") not in ENDPOINTS:
                raise ValueError(f"line {number}: url must be one of {', '.join(ENDPOINTS)} with method POST")
            if not isinstance(item.get("body"), dict):
                raise ValueError(f"line {number}: body must be an object")
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        (self.files / f"{file_id}.jsonl").write_bytes(content)
        meta = {"id": file_id, "object": "file", "bytes": len(content), "created_at": int(time.time()),
                "filename": filename, "purpose": purpose}  # fmt: skip
        _write_json(self.files / f"{file_id}.json", meta)
        return meta

    def file(self, file_id: str) -> dict[str, Any] | None:
        path = self.files / f"{Path(file_id).name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def content(self, file_id: str) -> bytes | None:
        path = self.files / f"{Path(file_id).name}.jsonl"
        return path.read_bytes() if path.exists() else None

    def content_path(self, file_id: str) -> Path:
        return self.files / f"{Path(file_id).name}.jsonl"

    def create_batch(self, input_file_id: str, endpoint: str) -> dict[str, Any]:
        content = self.content(input_file_id)
        if content is None:
            raise KeyError(input_file_id)
        total = len(_jsonl_lines(content))
        batch_id = f"batch_{uuid.uuid4().hex[:24]}"
        output_id = f"file-{uuid.uuid4().hex[:24]}"
        batch = {
            "id": batch_id, "object": "batch", "endpoint": endpoint, "input_file_id": input_file_id,
            "output_file_id": output_id, "status": "in_progress", "created_at": int(time.time()),
            "completion_window": "24h", "request_counts": {"total": total, "completed": 0, "failed": 0},
        }  # fmt: skip
        self.content_path(output_id).write_bytes(b"")
        _write_json(self.files / f"{output_id}.json", {"id": output_id, "object": "file", "bytes": 0,
                    "created_at": int(time.time()), "filename": f"{batch_id}_output.jsonl",
                    "purpose": "batch_output"})  # fmt: skip
        self.save(batch)
        return batch

    def batch(self, batch_id: str) -> dict[str, Any] | None:
        """The batch's state, with its runner's latest request counts."""
        name = Path(batch_id).name
        path = self.batches / f"{name}.json"
        if not path.exists():
            return None
        batch: dict[str, Any] = json.loads(path.read_text())
        with contextlib.suppress(FileNotFoundError):
            counts = json.loads((self.batches / f"{name}.progress").read_text())
            batch["request_counts"] = {**batch["request_counts"], **counts}
        return batch

    def save(self, batch: dict[str, Any]) -> None:
        _write_json(self.batches / f"{batch['id']}.json", batch)

    def save_progress(self, batch_id: str, counts: dict[str, int]) -> None:
        """Written by the batch's runner only, beside the state others write (a cancel): neither loses the other's."""
        _write_json(self.batches / f"{batch_id}.progress", counts)

    def running(self) -> list[dict[str, Any]]:
        """Batches in progress or being cancelled; an ended batch's file is read again only if it changed."""
        found = []
        for path in sorted(self.batches.glob("*.json")):
            try:
                stat = path.stat()
                key = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
                ended = self._ended.get(path)
                if ended is not None and ended[0] == key:
                    continue
                batch = json.loads(path.read_text())
            except FileNotFoundError:
                continue
            if batch["status"] in RUNNING:
                found.append(batch)
            else:
                self._ended[path] = (key, batch)
        return found


def public(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in batch.items() if k != "next_line"}  # next_line: kept by earlier versions


# --- the runner's file I/O: each function runs in a worker thread ----------------------------------------


def _open_input(path: Path) -> IO[bytes]:
    return open(path, "rb")  # closed by the run that reads it


def _read_block(stream: IO[bytes], limit: int) -> list[dict[str, Any]]:
    """Up to ``limit`` more input lines, parsed; ``[]`` at the end. The stream's position is the read offset."""
    items: list[dict[str, Any]] = []
    while len(items) < limit:
        line = stream.readline()
        if not line:
            break
        if line.strip():
            items.append(json.loads(line))
    return items


def _open_output(path: Path) -> tuple[IO[bytes], set[str], dict[str, int]]:
    """At takeover: the answered custom ids and counts, read once as a stream; the output opened to append.

    A last line without its newline is a holder's write cut short by its death: it is cut off, and its
    request runs again (it was never counted as done).
    """
    answered: set[str] = set()
    counts = {"completed": 0, "failed": 0}
    with open(path, "a+b") as stream:
        stream.seek(0)
        end = 0
        for line in stream:
            if not line.endswith(b"\n"):
                stream.truncate(end)
                logger.warning("%s: cut off a torn last line of %d bytes", path.name, len(line))
                break
            end += len(line)
            if not line.strip():
                continue
            record = json.loads(line)
            answered.add(record["custom_id"])
            counts["completed" if record["response"]["status_code"] == 200 else "failed"] += 1
    return open(path, "ab"), answered, counts  # closed by the run that appends to it


def _append_durably(stream: IO[bytes], lines: list[bytes]) -> None:
    stream.write(b"".join(lines))
    stream.flush()
    os.fsync(stream.fileno())


def _record(custom_id: str, status: int, body: bytes) -> bytes:
    try:
        parsed: Any = json.loads(body)
    except ValueError:
        parsed = {"raw": body.decode(errors="replace")}
    record = {"id": f"batch_req_{uuid.uuid4().hex[:16]}", "custom_id": custom_id,
              "response": {"status_code": status, "body": parsed}}  # fmt: skip
    return (json.dumps(record) + "\n").encode()


# --- one batch's run ---------------------------------------------------------------------------------------


class _Lines:
    """The input lines not answered yet, read ahead a block at a time; senders take them one by one."""

    def __init__(self, stream: IO[bytes], answered: set[str]) -> None:
        self.stream = stream
        self.answered = answered
        self._ready: collections.deque[dict[str, Any]] = collections.deque()
        self._eof = False
        self._lock = asyncio.Lock()  # one read at a time: the stream has one offset

    async def next(self) -> dict[str, Any] | None:
        async with self._lock:
            while not self._ready:
                if self._eof:
                    return None
                block = await asyncio.to_thread(_read_block, self.stream, READ_LINES)
                self._eof = not block
                self._ready.extend(item for item in block if item["custom_id"] not in self.answered)
            return self._ready.popleft()


class _Output:
    """Appends answers to a batch's output, checking the hold before each write.

    Group commit: answers that arrive while a write is under way go out together
    in the next one, so a slow disk means fewer, larger writes, not a queue.
    ``append`` returns once its line is durable.
    """

    def __init__(self, store: BatchStore, batch_id: str, stream: IO[bytes], hold: BatchHold,
                 counts: dict[str, int]) -> None:  # fmt: skip
        self.store = store
        self.batch_id = batch_id
        self.stream = stream
        self.hold = hold
        self.counts = counts  # "completed", "failed" -> lines written
        self._pending: list[bytes] = []
        self._pending_counts = {"completed": 0, "failed": 0}
        self._next_write = 0  # the number of the write that will carry lines appended now
        self._lock = asyncio.Lock()  # one write at a time
        self._error: BaseException | None = None
        self._saved_at = time.monotonic()

    async def append(self, status: int, line: bytes) -> None:
        self._pending.append(line)
        self._pending_counts["completed" if status == 200 else "failed"] += 1
        ticket = self._next_write
        async with self._lock:
            if self._error is not None:
                raise self._error
            if self._next_write > ticket:  # a write while this one waited carried its line
                return
            lines, self._pending = self._pending, []
            added, self._pending_counts = self._pending_counts, {"completed": 0, "failed": 0}
            self._next_write += 1
            save = time.monotonic() - self._saved_at >= PROGRESS_EVERY_S
            try:
                if not self.hold.valid:
                    raise HoldLost(f"batch {self.batch_id}: the hold lapsed")
                for key, value in added.items():
                    self.counts[key] += value
                await asyncio.to_thread(self._write, lines, dict(self.counts) if save else None)
            except BaseException as error:
                self._error = error
                raise
            if save:
                self._saved_at = time.monotonic()

    def _write(self, lines: list[bytes], counts: dict[str, int] | None) -> None:
        _append_durably(self.stream, lines)
        if counts is not None:
            self.store.save_progress(self.batch_id, counts)


@dataclass
class _Run:
    hold: BatchHold
    cancelled: asyncio.Event
    task: asyncio.Task[None] | None = None


class BatchRunner:
    """Runs in-progress batches through ``send(endpoint, body) -> (status, body bytes)``, each on one runner.

    ``start`` begins a scan every ``idle_s``: it lists the batches in progress and
    tries to take each one this runner does not run yet (``locks``; default: from
    ``COSERVE_BATCH_LOCK``, see ``coserve.router.batch_lock``). A batch it takes
    runs in its own task until it ends, is cancelled, its hold lapses, or
    ``stop`` is called; the lock is released then, so another replica takes over
    at its next scan.
    """

    def __init__(
        self,
        store: BatchStore,
        send: Send,
        has_spare_capacity: Callable[[], bool],
        concurrency: int = 2,
        idle_s: float = 0.2,
        locks: BatchLocks | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency: must be at least 1, got {concurrency}")
        if idle_s <= 0:
            raise ValueError(f"idle_s: must be positive, got {idle_s}")
        self.store = store
        self.send = send
        self.has_spare_capacity = has_spare_capacity
        self.concurrency = concurrency
        self.idle_s = idle_s
        self.locks = locks if locks is not None else batch_locks_from_env(store.batches)
        self._scanner: asyncio.Task[None] | None = None
        self._runs: dict[str, _Run] = {}  # batch id -> its run on this runner

    def start(self) -> None:
        self._scanner = asyncio.create_task(self._scan_forever())

    async def stop(self) -> None:
        """Stop every run (requests in flight are cancelled, so vLLM aborts them) and release their locks."""
        runs = list(self._runs.values())
        tasks = [task for task in (self._scanner, *(run.task for run in runs)) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for run in runs:  # idempotent; a run cancelled before its first step never reached its own release
            await run.hold.release()
        await self.locks.close()

    async def _scan_forever(self) -> None:
        while True:
            try:
                await self._scan()
            except Exception:  # the runner must outlive one bad scan
                logger.exception("batch scan failed")
            await asyncio.sleep(self.idle_s)

    async def _scan(self) -> None:
        for batch_id, run in list(self._runs.items()):
            if not run.hold.valid and run.task is not None:
                logger.warning("batch %s: the hold lapsed; stopping its run", batch_id)
                run.task.cancel()  # its requests in flight are aborted before another runner may take over
        for batch in await asyncio.to_thread(self.store.running):
            batch_id = batch["id"]
            mine = self._runs.get(batch_id)
            if mine is not None:
                if batch["status"] == "cancelling":
                    mine.cancelled.set()
                continue
            hold = await self.locks.try_acquire(batch_id)
            if hold is not None:
                run = self._runs[batch_id] = _Run(hold, asyncio.Event())
                run.task = asyncio.create_task(self._run(run))
                run.task.add_done_callback(functools.partial(self._ended, batch_id))

    def _ended(self, batch_id: str, _: asyncio.Task[None]) -> None:
        self._runs.pop(batch_id, None)

    async def _run(self, run: _Run) -> None:
        batch_id = run.hold.batch_id
        try:
            batch = await asyncio.to_thread(self.store.batch, batch_id)  # afresh: the scan's copy may be stale
            if batch is None or batch["status"] not in RUNNING:
                return  # it ended on another runner between the scan and the lock
            if batch["status"] == "cancelling":
                run.cancelled.set()
            await self._run_lines(batch, run)
        except HoldLost as error:
            logger.warning("%s; stopped without writing more", error)
        except Exception:
            logger.exception("batch %s stopped; it resumes at a later scan", batch_id)
            await asyncio.sleep(1.0)  # back off before another runner (or this one) tries again
        finally:
            await run.hold.release()

    async def _run_lines(self, batch: dict[str, Any], run: _Run) -> None:
        total = batch["request_counts"]["total"]
        try:
            source = await asyncio.to_thread(_open_input, self.store.content_path(batch["input_file_id"]))
        except FileNotFoundError:
            await self._end(batch["id"], run.hold, "failed", batch["request_counts"])
            return
        try:
            stream, answered, counts = await asyncio.to_thread(
                _open_output, self.store.content_path(batch["output_file_id"])
            )
        except BaseException:
            source.close()
            raise
        output = _Output(self.store, batch["id"], stream, run.hold, counts)
        lines = _Lines(source, answered)
        senders = [asyncio.create_task(self._send_lines(lines, output, run)) for _ in range(self.concurrency)]
        try:
            await asyncio.gather(*senders)
        finally:
            for sender in senders:
                sender.cancel()
            await asyncio.gather(*senders, return_exceptions=True)
            source.close()
            stream.close()  # nothing left to flush: every append was fsynced
        ended = "cancelled" if run.cancelled.is_set() else "completed"
        await self._end(batch["id"], run.hold, ended, {"total": total, **output.counts})

    async def _send_lines(self, lines: _Lines, output: _Output, run: _Run) -> None:
        while not run.cancelled.is_set():
            item = await lines.next()
            if item is None:
                return
            while not self.has_spare_capacity():
                if run.cancelled.is_set():
                    return
                await asyncio.sleep(self.idle_s)
            if run.cancelled.is_set():
                return
            try:
                status, body = await self.send(ENDPOINTS[item["url"]], dict(item["body"]))
            except Exception as error:  # noqa: BLE001 - the line fails, the batch goes on
                logger.warning("batch line %r: %s", item["custom_id"], error)
                status, body = 500, json.dumps({"error": {"message": f"the router failed: {error}"}}).encode()
            await output.append(status, _record(item["custom_id"], status, body))

    async def _end(self, batch_id: str, hold: BatchHold, status: str, counts: dict[str, int]) -> None:
        """Record the batch's end (a cancel that came meanwhile makes a completed batch cancelled)."""

        def end_now() -> None:
            batch = self.store.batch(batch_id)
            if batch is None:
                return
            final = "cancelled" if status == "completed" and batch["status"] == "cancelling" else status
            batch.update({"status": final, f"{final}_at": int(time.time()), "request_counts": counts})
            batch.pop("next_line", None)
            self.store.save_progress(batch_id, {k: v for k, v in counts.items() if k != "total"})
            self.store.save(batch)

        if not hold.valid:
            raise HoldLost(f"batch {batch_id}: the hold lapsed before its end was written")
        await asyncio.to_thread(end_now)
