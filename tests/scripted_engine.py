"""Test helper: a fake vLLM engine whose answers a test scripts (a test double for the router's HTTP tests).

``ScriptedEngine`` answers ``/v1/completions`` and ``/v1/chat/completions`` like vLLM's OpenAI server
and reports a KV usage on ``/metrics`` (as ``router_served.FakeEngine``), and a test can script what
it does next: answer the next requests with an error status (``fail_next``), put KV-transfer
parameters in its answer (a prefiller's, ``answer_kv_params``), or stream given byte parts with a
pause between them, or break off (``stream_parts``), optionally holding back after one part until the test
releases it (``hold_after``, ``release``). With ``conversations=True`` it runs behind the engines'
real coserve middleware (``coserve.engine.validation.RequestClassValidator``), which records the
conversation the router names in each turn and answers the routers' lookups.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from router_served import Served

USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def event(data: Any) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


class ScriptedEngine:
    """A fake engine; every request's body and headers are kept in ``requests`` and ``headers``."""

    def __init__(self, name: str, kv_usage: float = 0.1, conversations: bool = False) -> None:
        self.name = name
        self.kv_usage = kv_usage
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.fail_next = 0  # answer this many of the next completion requests with ``fail_status``
        self.fail_status = 503
        self.answer_kv_params: dict[str, Any] | None = None
        # None: three token events, the usage event if asked, [DONE]; an exception: the stream breaks off there
        self.stream_parts: list[bytes | Exception] | None = None
        self.pause_s = 0.01  # between two streamed parts (so that they reach the router as separate reads)
        self.hold_after: int | None = None  # index of the part after which the stream waits for ``release``
        self.release = threading.Event()
        self.released_in_time: bool | None = None
        self.delay_s = 0.0  # before answering a completion request

        async def complete(request: Request) -> Response:
            body = await request.json()
            await asyncio.sleep(self.delay_s)
            self.requests.append(body)
            self.headers.append(dict(request.headers))
            if self.fail_next > 0:
                self.fail_next -= 1
                return JSONResponse({"error": {"message": "overloaded"}}, self.fail_status)
            if body.get("stream"):
                return StreamingResponse(self._stream(body), media_type="text/event-stream")
            answer: dict[str, Any] = {"choices": [{"text": self.name}], "usage": dict(USAGE)}
            if self.answer_kv_params is not None:
                answer["kv_transfer_params"] = self.answer_kv_params
            return JSONResponse(answer)

        async def metrics(_: Request) -> Response:
            return PlainTextResponse(
                f'vllm:kv_cache_usage_perc{{engine="0"}} {self.kv_usage}\n'
                'vllm:num_requests_waiting{engine="0"} 0\n'
                'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="10000"} 1.0\n'
            )

        app: Any = Starlette(
            routes=[
                Route("/v1/completions", complete, methods=["POST"]),
                Route("/v1/chat/completions", complete, methods=["POST"]),
                Route("/metrics", metrics),
            ]
        )
        if conversations:
            from coserve.engine.validation import RequestClassValidator
            from coserve.scheduling.config import load_engine_config

            app = RequestClassValidator(app, load_engine_config(None, 256), router_token=None)
        self.served = Served(app)
        self.url = self.served.url

    async def _stream(self, body: dict[str, Any]) -> Any:
        parts: list[bytes | Exception] | None = self.stream_parts
        if parts is None:
            parts = [event({"choices": [{"text": f"{self.name}{i}"}]}) for i in range(3)]
            if (body.get("stream_options") or {}).get("include_usage"):
                parts.append(event({"choices": [], "usage": USAGE}))
            parts.append(b"data: [DONE]\n\n")
        for index, part in enumerate(parts):
            if isinstance(part, Exception):
                raise part
            yield part
            if index == self.hold_after:
                deadline = time.monotonic() + 10
                while not self.release.is_set() and time.monotonic() < deadline:
                    await asyncio.sleep(0.005)
                self.released_in_time = self.release.is_set()
            await asyncio.sleep(self.pause_s)

    def stop(self) -> None:
        if self.served.thread.is_alive():
            self.served.stop()
