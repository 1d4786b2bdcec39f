"""ASGI middleware for vLLM's OpenAI server: reject a bad class or SLO with HTTP 400.

vLLM passes ``vllm_xargs`` to the engine core untouched, where a bad value can
no longer be answered with a client error. This middleware checks the coserve
fields of each completion request before vLLM sees it:

    {"priority": 1, "vllm_xargs": {"coserve_class": "interactive", "ttft_slo_ms": 500, "tpot_slo_ms": 50}}

and answers an unknown class or a non-positive or non-numeric SLO with an
OpenAI-style error body naming the field. Install it with
``--middleware coserve.engine.validation.RequestClassValidator`` (the operator
renders it). It reads the same ``COSERVE_CONFIG`` file as the scheduler.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from coserve.scheduling import InvalidRequestClass
from coserve.scheduling.config import load_engine_config
from coserve.scheduling.requests import ClassRegistry

__all__ = ["RequestClassValidator", "openai_error"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

CHECKED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
MAX_BODY_BYTES = 64 << 20


def openai_error(message: str, param: str | None, status: int = 400) -> bytes:
    """The error body OpenAI clients parse: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = "BadRequestError" if 400 <= status < 500 else "InternalServerError"
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}}).encode()


def check_request(body: Any, classes: ClassRegistry) -> InvalidRequestClass | None:
    """The first coserve problem with a parsed request body, or ``None``."""
    if not isinstance(body, dict):
        return None  # not ours to judge: vLLM answers malformed JSON itself
    priority = body.get("priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        return InvalidRequestClass("priority", f"must be an integer, got {priority!r}")
    extra = body.get("vllm_xargs")
    if extra is not None and not isinstance(extra, dict):
        return InvalidRequestClass("vllm_xargs", f"must be an object, got {type(extra).__name__}")
    try:
        classes.resolve(extra, priority)
    except InvalidRequestClass as error:
        return error
    return None


class RequestClassValidator:
    """Pure ASGI middleware; buffers only the bodies of completion requests (bounded)."""

    def __init__(self, app: ASGIApp, classes: ClassRegistry | None = None) -> None:
        self.app = app
        self.classes = classes or load_engine_config(os.environ.get("COSERVE_CONFIG"), 2048).classes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or scope.get("method") != "POST" or scope.get("path") not in CHECKED_PATHS:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay(chunks, message, receive), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                await _respond(
                    send, 413, openai_error(f"request body is larger than {MAX_BODY_BYTES} bytes", None, 413)
                )
                return
            chunks.append(chunk)
            more = bool(message.get("more_body"))
        body = b"".join(chunks)
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None
        problem = check_request(parsed, self.classes)
        if problem is not None:
            await _respond(send, 400, openai_error(f"{problem.field}: {problem.reason}", problem.field))
            return
        await self.app(scope, _replay([body], None, receive), send)


def _replay(chunks: list[bytes], pending: Message | None, receive: Receive) -> Receive:
    """A ``receive`` that hands the buffered body downstream once, then the real stream."""
    queue: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
    if pending is not None:
        queue.append(pending)

    async def replay() -> Message:
        if queue:
            return queue.pop(0)
        return await receive()

    return replay


async def _respond(send: Send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
