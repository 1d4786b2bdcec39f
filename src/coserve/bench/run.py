"""``coserve bench``: replay a workload against any OpenAI-compatible endpoint and report its latencies.

Who calls it: the ``coserve bench`` command (and the README's main job, after
``coserve up``). The workload is ``coserve.bench.workload``'s; this module sends
it over HTTP with aiohttp, one streamed ``/v1/completions`` request per turn
(``X-Conversation-Id`` names its conversation, so coserve's router pins it; any
other server ignores the header), shows a progress bar on stderr, and writes
``bench.json`` (summary and one record per turn) and ``bench.png`` (latency
distributions) into the output folder.

Measured from the client: TTFT (send to the first streamed chunk with a choice),
TBT (between such chunks), end-to-end latency, and TTFET (a conversation's first
send to the first token of its final turn).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import aiohttp

from coserve.bench.workload import Conversation, Turn, summarize

__all__ = ["BenchError", "Progress", "discover_model", "replay", "write_report"]


class BenchError(RuntimeError):
    """The endpoint cannot be benchmarked (unreachable, no model); the message says why."""


class Progress:
    """A one-line progress bar on a terminal; a line every tenth of the way otherwise (CI logs)."""

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 30) -> None:
        self.total, self.width = total, width
        self.stream = stream or sys.stderr
        self.done = self.errors = 0
        self.started = time.monotonic()
        self._tty = self.stream.isatty()
        self._reported = -1

    def advance(self, error: bool) -> None:
        self.done += 1
        self.errors += int(error)
        filled = self.width * self.done // max(1, self.total)
        line = (
            f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} requests, "
            f"{self.errors} errors, {time.monotonic() - self.started:.0f} s"
        )
        if self._tty:
            self.stream.write("\r" + line + ("\n" if self.done == self.total else ""))
            self.stream.flush()
        elif (tenth := 10 * self.done // max(1, self.total)) > self._reported:
            self._reported = tenth
            print(line, file=self.stream, flush=True)


@dataclass
class _Endpoint:
    base: str  # ends in /v1
    model: str
    headers: dict[str, str]


def _v1(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


async def discover_model(url: str, api_key: str | None, wait_s: float) -> str:
    """The first model ``GET /v1/models`` lists, waiting up to ``wait_s`` for the endpoint to answer."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + wait_s
    last = "no answer"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        while True:
            try:
                async with session.get(f"{_v1(url)}/models", headers=headers) as response:
                    if response.status == 200:
                        models = (await response.json(content_type=None)).get("data") or []
                        if not models:
                            raise BenchError(f"{_v1(url)}/models lists no model")
                        return str(models[0]["id"])
                    last = f"HTTP {response.status}: {(await response.text())[:200]}"
            except (aiohttp.ClientError, TimeoutError, ValueError) as error:
                last = str(error) or type(error).__name__
            if time.monotonic() >= deadline:
                raise BenchError(f"{_v1(url)}/models did not answer within {wait_s:.0f} s ({last})")
            await asyncio.sleep(1.0)


async def _turn(session: aiohttp.ClientSession, endpoint: _Endpoint, conversation: str, turn: Turn) -> dict[str, Any]:
    body = {
        "model": endpoint.model,
        "prompt": list(turn.prompt),
        "max_tokens": turn.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,  # vLLM: answer exactly max_tokens, as the trace did; others ignore it
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {**endpoint.headers, "x-conversation-id": conversation}
    record: dict[str, Any] = {"conversation": conversation, "prompt_tokens": len(turn.prompt), "error": None}
    sent = time.monotonic()
    record["sent_s"] = sent
    first = last = None
    gaps: list[float] = []
    chunks = 0
    try:
        async with session.post(f"{endpoint.base}/completions", json=body, headers=headers) as response:
            if response.status != 200:
                record["error"] = f"HTTP {response.status}: {(await response.text())[:300]}"
                return record
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    record["error"] = str(event["error"].get("message", event["error"]))[:300]
                    return record
                if event.get("usage"):
                    record["output_tokens"] = event["usage"].get("completion_tokens")
                if event.get("choices"):  # a token step (its text may be empty: a partial character)
                    now = time.monotonic()
                    chunks += 1
                    if first is None:
                        first = now
                    elif last is not None:
                        gaps.append(now - last)
                    last = now
    except (aiohttp.ClientError, TimeoutError, ValueError) as error:
        record["error"] = f"{type(error).__name__}: {error}"[:300]
        return record
    done = time.monotonic()
    record.update(
        ttft_s=(first - sent) if first is not None else None,
        tbt_s=gaps,
        e2e_s=done - sent,
        first_token_at_s=first,
        done_at_s=done,
    )
    record.setdefault("output_tokens", chunks)
    if first is None:
        record["error"] = "the stream carried no token"
    return record


async def _conversation(
    session: aiohttp.ClientSession, endpoint: _Endpoint, conversation: Conversation, origin: float,
    progress: Progress | None,
) -> list[dict[str, Any]]:  # fmt: skip
    await asyncio.sleep(max(0.0, origin + conversation.start_s - time.monotonic()))
    arrived = time.monotonic()
    records = []
    for index, turn in enumerate(conversation.turns):
        if index:
            await asyncio.sleep(turn.gap_s)
        if turn.arrival_s is not None:
            await asyncio.sleep(max(0.0, origin + turn.arrival_s - time.monotonic()))
        record = await _turn(session, endpoint, conversation.conversation_id, turn)
        record.update(turn=index + 1, final=index == len(conversation.turns) - 1)
        if record["error"] is None and record["final"]:
            record["ttfet_s"] = record["first_token_at_s"] - arrived
        records.append(record)
        if progress is not None:
            progress.advance(record["error"] is not None)
        if record["error"] is not None:
            # a later turn builds on this one's answer: without it the conversation cannot go on
            for _ in conversation.turns[index + 1 :]:
                if progress is not None:
                    progress.advance(True)
                records.append({"conversation": conversation.conversation_id, "error": "an earlier turn failed"})
            break
    return records


async def replay(
    url: str,
    model: str,
    conversations: Sequence[Conversation],
    *,
    api_key: str | None = None,
    timeout_s: float = 1800.0,
    progress: Progress | None = None,
    concurrency: int = 1024,
) -> tuple[list[dict[str, Any]], float]:
    """Send every conversation at its time; (one record per turn, the run's duration in seconds)."""
    endpoint = _Endpoint(_v1(url), model, {"authorization": f"Bearer {api_key}"} if api_key else {})
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s), connector=connector) as session:
        origin = time.monotonic()
        results = await asyncio.gather(*(_conversation(session, endpoint, c, origin, progress) for c in conversations))
        duration = time.monotonic() - origin
    return [record for records in results for record in records], duration


def write_report(
    folder: Path, records: Sequence[dict[str, Any]], duration_s: float, setup: dict[str, Any],
    ttft_p95_target_s: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Write ``bench.json`` (and ``bench.png`` when matplotlib is installed); the report."""
    folder.mkdir(parents=True, exist_ok=True)
    summary = summarize(records, duration_s)
    ttft_p95 = summary["ttft_s"]["p95"]  # type: ignore[index]
    met = summary["errors"] == 0
    target = "every request answered"
    if ttft_p95_target_s is not None:
        target += f", p95 TTFT <= {ttft_p95_target_s} s"
        met = met and ttft_p95 is not None and ttft_p95 <= ttft_p95_target_s
    report = {"benchmark": "coserve_bench", "target": target, "met": bool(met), **summary, "setup": setup,
              "records": list(records)}  # fmt: skip
    (folder / "bench.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    _plot(folder / "bench.png", records, setup)
    return report


def _plot(path: Path, records: Sequence[dict[str, Any]], setup: dict[str, Any]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no bench.png (pip install 'coserve[bench]')", file=sys.stderr)
        return
    ok = [r for r in records if not r.get("error")]
    series = {
        "TTFT (s)": [r["ttft_s"] for r in ok if r.get("ttft_s") is not None],
        "TBT (s)": [gap for r in ok for gap in r.get("tbt_s") or []],
        "TTFET (s)": [r["ttfet_s"] for r in ok if r.get("ttfet_s") is not None],
        "end to end (s)": [r["e2e_s"] for r in ok],
    }
    figure, axes = plt.subplots(1, len(series), figsize=(4 * len(series), 3.2))
    for axis, (label, values) in zip(axes, series.items(), strict=True):
        if values:
            ordered = sorted(values)
            axis.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))])
        axis.set_xlabel(label)
        axis.set_ylabel(
            {"TBT (s)": "fraction of token gaps", "TTFET (s)": "fraction of conversations"}.get(
                label, "fraction of requests"
            )
        )
        axis.grid(alpha=0.3)
    figure.suptitle(f"coserve bench: {setup.get('workload')} against {setup.get('url')}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
