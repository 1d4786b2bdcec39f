"""Test helpers: an ASGI app on a real local port in a thread, and a fast fake engine.

``FakeEngine`` answers like vLLM's OpenAI server and reports a KV usage on
/metrics: a test double for the router's HTTP tests (tests/engine has the
real-engine ones).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Served:
    """An ASGI app on a real port, in a thread."""

    def __init__(self, app: Any, loop: str = "auto", host: str = "127.0.0.1", port: int | None = None) -> None:
        self.port = free_port() if port is None else port
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(app, host=host, port=self.port, log_level="error", loop=loop)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


class FakeEngine:
    """Answers like vLLM's OpenAI server and reports a KV usage on /metrics."""

    def __init__(
        self, name: str, kv_usage: float = 0.1, waiting: int = 0, host: str = "127.0.0.1", port: int | None = None
    ) -> None:
        self.name = name
        self.kv_usage = kv_usage
        self.waiting = waiting
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []  # each request's headers, in the order they came

        async def complete(request: Request) -> Response:
            body = await request.json()
            self.requests.append(body)
            self.headers.append(dict(request.headers))
            if body.get("stream"):
                options = body.get("stream_options") or {}

                async def chunks() -> Any:
                    for index in range(3):
                        yield f"data: {json.dumps({'choices': [{'text': f'{self.name}{index}'}]})}\n\n".encode()
                        await asyncio.sleep(0.01)
                    if options.get("include_usage"):  # as vLLM: a last event with the usage and no choices
                        usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
                        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
                    yield b"data: [DONE]\n\n"

                return StreamingResponse(chunks(), media_type="text/event-stream")
            return JSONResponse(
                {"choices": [{"text": self.name}], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}
            )

        async def metrics(_: Request) -> Response:
            return PlainTextResponse(
                f'vllm:kv_cache_usage_perc{{engine="0"}} {self.kv_usage}\n'
                f'vllm:num_requests_waiting{{engine="0"}} {self.waiting}\n'
                'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100",prefix_caching="True"} 1.0\n'
            )

        app = Starlette(
            routes=[
                Route("/v1/completions", complete, methods=["POST"]),
                Route("/v1/chat/completions", complete, methods=["POST"]),
                Route("/metrics", metrics),
            ]
        )
        self.served = Served(app, host=host, port=port)
        self.url = self.served.url


class ServiceDns:
    """Cluster DNS for one headless Service (a test double: no Kubernetes here): ``name`` resolves to the
    addresses in ``addresses``, the Service's ready pods; other names resolve as usual.

    Install it over ``socket.getaddrinfo`` and run the router on asyncio's event loop (``Served(...,
    loop="asyncio")``): uvloop resolves names inside libuv, where no Python double can answer.
    """

    def __init__(self, name: str, addresses: list[str]) -> None:
        self.name = name
        self.addresses = list(addresses)
        self._real = socket.getaddrinfo

    def getaddrinfo(self, host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host != self.name:
            return self._real(host, port, *args, **kwargs)
        if not self.addresses:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, int(port))) for ip in self.addresses]
