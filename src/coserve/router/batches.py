"""OpenAI-style offline batches: upload a JSONL file, create a batch, and the router runs it on spare capacity.

Who calls it: ``coserve.router.app`` mounts the routes (``/v1/files``,
``/v1/batches``) when the config names a ``batchDir``, and starts one runner
task. Everything is persisted under ``batchDir`` (a local directory in the
local pool, a volume in Kubernetes): ``files/<id>.jsonl`` with ``<id>.json``
metadata, ``batches/<id>.json`` with the batch's state and progress. A batch's
output lines are appended (and flushed) before its progress is saved, so a
router that restarts resumes every accepted batch where it stopped, at most
repeating the request in flight (its output line is written once: lines
already in the output are skipped on resume).

Several router replicas may share ``batchDir`` (a ReadWriteMany claim in
Kubernetes): each batch is run by one of them at a time, the holder of its
lease file ``batches/<id>.lease``, renewed on every step and taken over when
older than ``lease_s`` (its holder died). Any replica answers reads.

The runner sends each line through the router's own placement at the lowest
(offline) class, at most ``concurrency`` at a time, and only while every decoder
is below ``spare`` KV occupancy, so online traffic keeps the capacity it needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

__all__ = ["BatchRunner", "BatchStore"]

logger = logging.getLogger("coserve.router.batches")

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
MAX_LINES = 50_000


def _write_json(path: Path, data: dict[str, Any]) -> None:
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(data))
    os.replace(partial, path)  # a crash never leaves half a state file


class BatchStore:
    """Files and batches on disk."""

    def __init__(self, root: Path) -> None:
        self.files = root / "files"
        self.batches = root / "batches"
        self.files.mkdir(parents=True, exist_ok=True)
        self.batches.mkdir(parents=True, exist_ok=True)

    def add_file(self, content: bytes, filename: str, purpose: str) -> dict[str, Any]:
        """Validate and store an uploaded batch input; ``ValueError`` names the first bad line."""
        lines = content.decode("utf-8").splitlines()
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

    def create_batch(self, input_file_id: str, endpoint: str) -> dict[str, Any]:
        content = self.content(input_file_id)
        if content is None:
            raise KeyError(input_file_id)
        total = len(content.decode().splitlines())
        batch_id = f"batch_{uuid.uuid4().hex[:24]}"
        output_id = f"file-{uuid.uuid4().hex[:24]}"
        batch = {
            "id": batch_id, "object": "batch", "endpoint": endpoint, "input_file_id": input_file_id,
            "output_file_id": output_id, "status": "in_progress", "created_at": int(time.time()),
            "completion_window": "24h", "request_counts": {"total": total, "completed": 0, "failed": 0},
            "next_line": 0,
        }  # fmt: skip
        (self.files / f"{output_id}.jsonl").write_bytes(b"")
        _write_json(self.files / f"{output_id}.json", {"id": output_id, "object": "file", "bytes": 0,
                    "created_at": int(time.time()), "filename": f"{batch_id}_output.jsonl",
                    "purpose": "batch_output"})  # fmt: skip
        self.save(batch)
        return batch

    def batch(self, batch_id: str) -> dict[str, Any] | None:
        path = self.batches / f"{Path(batch_id).name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def save(self, batch: dict[str, Any]) -> None:
        _write_json(self.batches / f"{batch['id']}.json", batch)

    def running(self) -> list[dict[str, Any]]:
        items = [json.loads(p.read_text()) for p in sorted(self.batches.glob("*.json"))]
        return [b for b in items if b["status"] in ("in_progress", "cancelling")]


def public(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in batch.items() if k != "next_line"}


class BatchRunner:
    """Runs in-progress batches line by line through ``send(endpoint, body) -> (status, body bytes)``."""

    def __init__(
        self,
        store: BatchStore,
        send: Callable[[str, dict[str, Any]], Awaitable[tuple[int, bytes]]],
        has_spare_capacity: Callable[[], bool],
        concurrency: int = 2,
        idle_s: float = 0.2,
        lease_s: float = 30.0,
    ) -> None:
        self.store = store
        self.owner = f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"
        self.lease_s = lease_s
        self.send = send
        self.has_spare_capacity = has_spare_capacity
        self.concurrency = concurrency
        self.idle_s = idle_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._forever())

    async def stop(self) -> None:
        """Stop running and release this runner's leases, so another replica takes its batches over at once."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.release()

    def release(self) -> None:
        for lease in self.store.batches.glob("*.lease"):
            with contextlib.suppress(FileNotFoundError):
                if lease.read_text() == self.owner:
                    lease.unlink()

    async def _forever(self) -> None:
        while True:
            try:
                worked = False
                for batch in self.store.running():
                    if self.claim(batch["id"]):
                        worked = await self._advance(batch) or worked
                if not worked:
                    await asyncio.sleep(self.idle_s)
            except asyncio.CancelledError:
                raise
            except Exception:  # the runner must outlive one bad batch
                logger.exception("batch runner step failed")
                await asyncio.sleep(1.0)

    def claim(self, batch_id: str) -> bool:
        """Hold (or renew, or take over a stale) lease on ``batch_id``; ``False``: another replica runs it."""
        lease = self.store.batches / f"{batch_id}.lease"
        try:
            holder, age = lease.read_text(), time.time() - lease.stat().st_mtime
        except FileNotFoundError:
            holder, age = "", float("inf")
        if holder == self.owner:
            os.utime(lease)
            return True
        if age < self.lease_s:
            return False
        partial = lease.with_name(f"{lease.name}.{uuid.uuid4().hex[:8]}")
        partial.write_text(self.owner)
        os.replace(partial, lease)
        return lease.read_text() == self.owner  # of two replicas taking over at once, the last writer runs it

    async def _advance(self, batch: dict[str, Any]) -> bool:
        """Run up to ``concurrency`` lines of ``batch``; ``False`` when it waited for capacity or finished."""
        if batch["status"] == "cancelling":
            batch["status"] = "cancelled"
            self.store.save(batch)
            return False
        lines = (self.store.content(batch["input_file_id"]) or b"").decode().splitlines()
        start = batch["next_line"]
        if start >= len(lines):
            batch["status"] = "completed"
            batch["completed_at"] = int(time.time())
            self.store.save(batch)
            return False
        if not self.has_spare_capacity():
            return False
        output = self.store.files / f"{batch['output_file_id']}.jsonl"
        done = {json.loads(line)["custom_id"] for line in output.read_text().splitlines() if line}
        chunk = [json.loads(line) for line in lines[start : start + self.concurrency]]
        todo = [item for item in chunk if item["custom_id"] not in done]
        results = await asyncio.gather(*(self.send(ENDPOINTS[item["url"]], dict(item["body"])) for item in todo))
        with output.open("a") as out:
            for item, (status, body) in zip(todo, results, strict=True):
                try:
                    parsed: Any = json.loads(body)
                except ValueError:
                    parsed = {"raw": body.decode(errors="replace")}
                record = {"id": f"batch_req_{uuid.uuid4().hex[:16]}", "custom_id": item["custom_id"],
                          "response": {"status_code": status, "body": parsed}}  # fmt: skip
                out.write(json.dumps(record) + "\n")
                key = "completed" if status == 200 else "failed"
                batch["request_counts"][key] += 1
            out.flush()
            os.fsync(out.fileno())
        latest = self.store.batch(batch["id"]) or batch
        batch["next_line"] = start + len(chunk)
        if latest["status"] == "cancelling":  # cancelled while these ran: stop after them
            batch["status"] = "cancelled"
        self.store.save(batch)
        return True
