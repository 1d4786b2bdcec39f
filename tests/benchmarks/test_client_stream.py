"""The benchmarks' streaming client: a stream that ends in the router's error event fails with that event's
text, so a failed run says why (a real aiohttp server on loopback stands in for the router)."""

from __future__ import annotations

import asyncio
import importlib
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _client() -> object:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module("harness.client")
    finally:
        sys.path.remove(str(BENCHMARKS))


async def _serve(events: list[bytes]) -> tuple[web.AppRunner, str]:
    async def completions(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(event)
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def _first(events: list[bytes]) -> float:
    client = _client()
    runner, base = await _serve(events)
    try:
        async with aiohttp.ClientSession() as session:
            return await client.first_token_at(session, base, {"prompt": "x"})  # type: ignore[attr-defined, no-any-return]
    finally:
        await runner.cleanup()


def test_a_token_is_timed() -> None:
    assert asyncio.run(_first([b'data: {"choices":[{"text":"a"}]}\n\n', b"data: [DONE]\n\n"])) > 0


def test_a_stream_ended_by_the_routers_error_event_fails_with_its_text() -> None:
    error = b'data: {"error": {"message": "the decoder failed mid-answer: reset", "code": 502}}\n\n'
    with pytest.raises(RuntimeError, match=r"without a token: .*the decoder failed mid-answer: reset"):
        asyncio.run(_first([error]))
    with pytest.raises(RuntimeError, match=r"without a token$"):
        asyncio.run(_first([b"data: [DONE]\n\n"]))
