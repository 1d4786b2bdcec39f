"""The router's client of its engines: prefill, forward, the SSE relay, lookups and metric scrapes.

Who calls it: ``coserve.router.placement`` once per placed request (``prefill`` on turn 1, ``forward`` to the
decoder) and once per conversation it must find (``lookup``); ``coserve.router.offline`` per batch line
(``forward``); ``coserve.router.engines`` at every poll (``metrics_text``, ``follow_token``). Nothing here
chooses an engine: each call is told which one.

- ``forward`` passes the decoder's answer through as it comes: a stream is parsed with httpx-sse's SSE parser
  and each event is sent on as soon as it is complete (the usage event is read for the token counts, and
  dropped when the client did not ask for it). A decoder that fails before anything reached the client
  (HTTP 502/503/504, a connection error, a stream whose first event is a server error or its end: vLLM answers
  200 and then streams an engine failure) raises ``Unavailable``: the caller may retry elsewhere. One that fails
  mid-stream ends the stream with an error event.
- ``prefill`` sends turn 1 with ``max_tokens`` 1 (and ``kv_transfer_params`` asking for a remote decode) and
  returns the prefiller's answer, empty when it failed (the decoder then computes the prompt).
- Every request carries the pool's router token (``ROUTER_TOKEN_HEADER``), as the mounted file holds it at
  the last ``follow_token``: engines trust a request's class only with it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Any

import aiohttp
import httpx
from httpx_sse import EventSource, ServerSentEvent
from starlette.responses import Response, StreamingResponse

from coserve.router import fastjson
from coserve.router.config import RouterConfig
from coserve.router.metrics import RouterMetrics
from coserve.router.policy import EngineLoad
from coserve.token_file import TokenFile

logger = logging.getLogger("coserve.router")

_RETRYABLE = {502, 503, 504}
# The pool's router token (coserve.engine.validation checks it): engines trust a request's class only with it.
ROUTER_TOKEN_FILE_ENV = "COSERVE_ROUTER_TOKEN_FILE"  # noqa: S105 - a variable's name, not a secret
ROUTER_TOKEN_HEADER = "x-coserve-router-token"  # noqa: S105 - a header's name, not a secret
_JSON = {"content-type": "application/json"}  # what aiohttp's json= sent: the bodies are fastjson's bytes
CONVERSATION_HEADER = "x-coserve-conversation"  # tells the decoder which conversation a turn belongs to
LOOKUP_PATH = "/coserve/v1/conversations:lookup"  # the decoders' answer to "do you hold these?"


def router_token_headers(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The header that proves a request came through the pool's router, as the token file holds it now; none
    when no token is mounted. ``ValueError`` names the variable when the file is unreadable or empty."""
    path = (os.environ if environ is None else environ).get(ROUTER_TOKEN_FILE_ENV)
    if not path:
        return {}
    return {ROUTER_TOKEN_HEADER: TokenFile(path, variable=ROUTER_TOKEN_FILE_ENV).current().decode()}


class Unavailable(RuntimeError):
    """The decoder could not be used, and nothing was sent to the client yet: safe to retry elsewhere."""


class Upstream:
    """The connection pool to every engine, and the requests the router sends them."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.metrics = metrics
        self.clock = clock
        # read at start-up (a missing or empty token file fails fast), then followed: see follow_token
        path = os.environ.get(ROUTER_TOKEN_FILE_ENV)
        self._token = TokenFile(path, variable=ROUTER_TOKEN_FILE_ENV) if path else None
        self._upstream_headers = {ROUTER_TOKEN_HEADER: self._token.current().decode()} if self._token else {}
        # NOTE: aiohttp, not httpx: httpx's pool scans every connection on every request, which capped
        # the router at ~400 requests/s with 64 concurrent clients (profiled); aiohttp's does not.
        self._session: aiohttp.ClientSession | None = None
        self._ledger_ids = itertools.count()  # names of the decoders' ledger entries

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # NOTE: answers are relayed as the engines send them: identity encoding asked for (nothing to
            # decompress, no encoding to strip before the client), and no User-Agent to build per request
            self._session = aiohttp.ClientSession(
                headers={**self._upstream_headers, "accept-encoding": "identity"},
                timeout=aiohttp.ClientTimeout(total=self.config.upstream_timeout_s, sock_connect=5.0),
                connector=aiohttp.TCPConnector(limit=1024, limit_per_host=0, keepalive_timeout=60),
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def follow_token(self) -> None:
        """Send the token the mounted Secret holds now (the kubelet updates the file in place when the operator
        regenerates it); engines keep accepting the previous one for a grace period, so nothing in flight fails."""
        if self._token is None:
            return
        token = self._token.current().decode()
        if token != self._upstream_headers.get(ROUTER_TOKEN_HEADER):
            self._upstream_headers = {ROUTER_TOKEN_HEADER: token}
            if self._session is not None:
                self._session.headers[ROUTER_TOKEN_HEADER] = token  # the session's default headers, live

    def engine_headers(self) -> dict[str, str]:
        """The headers every request to an engine carries (the router token, when one is mounted): what a proxy
        that forwards for the router (``coserve.epp``) adds."""
        return dict(self._upstream_headers)

    # -- engines' answers about themselves ---------------------------------------------------------

    async def metrics_text(self, url: str) -> str:
        """An engine's ``/metrics`` page; raises what aiohttp raises (and ``TimeoutError`` after 2 s)."""
        async with self.session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=2.0)) as response:
            response.raise_for_status()
            return await response.text()

    async def lookup(self, decoder: EngineLoad, conversations: list[str]) -> dict[str, dict[str, float]]:
        """Which of ``conversations`` ``decoder`` holds (its ConversationLog); nothing when it cannot say."""
        try:
            async with self.session.post(
                f"{decoder.url}{LOOKUP_PATH}", json={"ids": conversations}, timeout=aiohttp.ClientTimeout(total=2.0)
            ) as response:
                if response.status != 200:
                    return {}
                found = (await response.json(content_type=None, loads=fastjson.loads)).get("found")
        except (TimeoutError, aiohttp.ClientError, ValueError, AttributeError):
            return {}
        return found if isinstance(found, dict) else {}

    # -- requests ----------------------------------------------------------------------------------

    async def prefill(self, prefiller: EngineLoad, path: str, body: dict[str, Any], tokens: int) -> dict[str, Any]:
        """Turn 1 on ``prefiller`` (``tokens``: its estimated prompt); the prefiller's answer, or ``{}`` when it
        failed (counted, and a prefiller that cannot be reached is marked down until its next poll)."""
        prefill = {**body, "stream": False, "max_tokens": 1}
        if self.config.kv_transfer_params:
            prefill["kv_transfer_params"] = {"do_remote_decode": True}
        prefill.pop("max_completion_tokens", None)
        prefill.pop("stream_options", None)
        prefiller.admitted_tokens += tokens
        ledger = uuid.uuid4().hex  # its entry in the prefiller's ledger of work left (GoRouting's estimate)
        prefiller.sent(ledger, tokens, 1)
        answer: Any = None
        try:
            async with self.session.post(
                f"{prefiller.url}{path}", data=fastjson.dumps(prefill), headers=_JSON
            ) as response:
                response.raise_for_status()
                answer = await response.json(content_type=None, loads=fastjson.loads)
        except (TimeoutError, aiohttp.ClientError, ValueError) as error:
            logger.warning("prefill on %s failed (%s): the decoder computes the prompt", prefiller.url, error)
            self.metrics.prefill_failures.inc()
            if isinstance(error, aiohttp.ClientConnectionError):
                prefiller.healthy = False
        finally:
            prefiller.answered(ledger)
        return answer if isinstance(answer, dict) else {}

    async def forward(
        self, decoder: EngineLoad, path: str, body: dict[str, Any], cls: str, slo_s: float, arrived: float,
        first_arrival: float, conversation: str | None = None, computes: int = 0,
    ) -> Response:  # fmt: skip
        """``body`` to ``decoder``, its answer passed through (a stream relayed as it comes); ``Unavailable``
        when the decoder failed before anything was sent to the client. ``computes``: the prompt tokens the
        decoder computes itself, for its entry in the decoder's ledger (whose streamed events count its
        tokens), which the turn-1 prefill-site choice reads."""
        ledger = f"d{next(self._ledger_ids)}"
        decoder.sent(ledger, computes, output_tokens(body))
        try:
            return await self._forward(decoder, ledger, path, body, cls, slo_s, arrived, first_arrival, conversation)
        except BaseException:
            decoder.answered(ledger)
            raise

    async def _forward(
        self, decoder: EngineLoad, ledger: str, path: str, body: dict[str, Any], cls: str, slo_s: float,
        arrived: float, first_arrival: float, conversation: str | None,
    ) -> Response:  # fmt: skip
        headers = {**_JSON, CONVERSATION_HEADER: conversation} if conversation else _JSON
        streaming = bool(body.get("stream"))
        wants_usage = False
        if streaming:  # token counts from vLLM's usage; the usage chunk reaches the client only if it asked
            options = body.get("stream_options")
            wants_usage = isinstance(options, dict) and bool(options.get("include_usage"))
            if not wants_usage:
                body = {**body, "stream_options": {**(options if isinstance(options, dict) else {}),
                                                   "include_usage": True}}  # fmt: skip
        try:
            response = await self.session.post(f"{decoder.url}{path}", data=fastjson.dumps(body), headers=headers)
        except (TimeoutError, aiohttp.ClientConnectionError) as error:
            raise Unavailable(str(error) or type(error).__name__) from error
        if response.status in _RETRYABLE:
            response.release()
            raise Unavailable(f"HTTP {response.status}")
        content_type = response.headers.get("content-type", "application/json")
        out_headers = {"content-type": content_type}
        if not streaming or not content_type.startswith("text/event-stream"):  # an error answers a stream in JSON
            try:
                content = await response.read()
            except (TimeoutError, aiohttp.ClientError) as error:
                raise Unavailable(str(error) or type(error).__name__) from error
            finally:
                response.release()
                decoder.answered(ledger)
            decoder.forward_answered()
            self._observe(cls, slo_s, arrived, first_arrival)
            self._count_usage(content, cls)
            return Response(content, response.status, headers=out_headers)
        # the decoder's first event before anything reaches the client: a stream that fails or begins with a
        # server error (vLLM answers 200, then its error event) can still be retried on another decoder
        events = EventSource(
            httpx.Response(
                response.status, headers={"content-type": content_type}, stream=_UpstreamBytes(response.content)
            )
        ).aiter_sse()
        first: ServerSentEvent | None = None
        try:
            first = await anext(events, None)
            failed = _server_error(first.data) if first is not None else "the stream ended before its first event"
        except (TimeoutError, aiohttp.ClientError) as error:
            failed = str(error) or type(error).__name__
        if first is None or failed:
            await events.aclose()
            response.release()
            raise Unavailable(f"the decoder's stream failed before its first token: {failed}")
        decoder.forward_answered()
        relay = self._relay(response, first, events, cls, slo_s, arrived, first_arrival, wants_usage, decoder, ledger)
        return StreamingResponse(relay, response.status, headers=out_headers)

    async def _relay(
        self, response: aiohttp.ClientResponse, first: ServerSentEvent, rest: AsyncGenerator[ServerSentEvent, None],
        cls: str, slo_s: float, arrived: float, first_arrival: float, pass_usage: bool = True,
        decoder: EngineLoad | None = None, ledger: str = "",
    ) -> AsyncIterator[bytes]:  # fmt: skip
        """The decoder's SSE stream (its ``first`` event, already read, then the ``rest``), each event sent on as
        soon as httpx-sse's parser has it complete (never held for the next read); the final usage event is read
        for the token counts and dropped when the client did not ask for it (the router asked on its behalf).
        Each event counts a token in ``decoder``'s ledger entry ``ledger``, which the stream's end closes."""
        events_seen = 0
        last: float | None = None
        last_id = ""
        try:
            async with contextlib.aclosing(_chained(first, rest)) as events:
                async for sse in events:
                    now = self.clock()
                    if last is None:
                        self._observe(cls, slo_s, arrived, first_arrival)
                    else:
                        self.metrics.tbt.observe(now - last)
                    last = now
                    events_seen += 1
                    if decoder is not None:
                        decoder.progressed(ledger, events_seen)
                    if self._usage_event(sse.data, cls) and not pass_usage:
                        continue
                    encoded = _encode_event(sse, last_id)
                    last_id = sse.id
                    if encoded:
                        yield encoded
        except (TimeoutError, aiohttp.ClientError) as error:
            # the client already has part of the answer: end the stream with an error event, not silence
            message = json.dumps({"error": {"message": f"the decoder failed mid-answer: {error}", "code": 502}})
            yield f"data: {message}\n\n".encode()
        finally:
            response.release()
            if decoder is not None:
                decoder.answered(ledger)

    # -- what the answers count --------------------------------------------------------------------

    def _usage_event(self, data: str, cls: str) -> bool:
        """Whether an event's ``data`` is vLLM's closing usage event (no choices); counts its tokens if so."""
        if '"usage"' not in data or not data.startswith("{"):
            return False
        try:
            parsed = fastjson.loads(data)
        except ValueError:
            return False
        usage = parsed.get("usage") if isinstance(parsed, dict) else None
        if not isinstance(usage, dict) or parsed.get("choices"):
            return False
        self.metrics.prompt_tokens_of(cls).inc(usage.get("prompt_tokens") or 0)
        self.metrics.output_tokens_of(cls).inc(usage.get("completion_tokens") or 0)
        return True

    def _observe(self, cls: str, slo_s: float, arrived: float, first_arrival: float) -> None:
        now = self.clock()
        self.metrics.ttft_of(cls).observe(now - arrived)
        self.metrics.slo_of(cls, "true" if now - arrived <= slo_s else "false").inc()
        self.metrics.ttfet.observe(now - first_arrival)

    def _count_usage(self, content: bytes, cls: str) -> None:
        try:
            usage = fastjson.loads(content).get("usage") or {}
        except (ValueError, AttributeError):
            return
        self.metrics.prompt_tokens_of(cls).inc(usage.get("prompt_tokens") or 0)
        self.metrics.output_tokens_of(cls).inc(usage.get("completion_tokens") or 0)


# what a request without max_tokens is counted to decode in the decoder's ledger (vLLM's own default is the
# context left, which says nothing of when it ends)
DEFAULT_OUTPUT_TOKENS = 256


def output_tokens(body: Mapping[str, Any]) -> int:
    """The output tokens ``body`` asks for (``max_completion_tokens``, else ``max_tokens``), else the default."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return DEFAULT_OUTPUT_TOKENS


class _UpstreamBytes(httpx.AsyncByteStream):
    """An aiohttp response's body, read as it arrives, as the stream of the ``httpx.Response`` that httpx-sse's
    ``EventSource`` parses (the router's upstream client is aiohttp; the parser reads httpx responses)."""

    def __init__(self, content: aiohttp.StreamReader) -> None:
        self._content = content

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._content.iter_any():
            yield chunk


async def _chained(
    first: ServerSentEvent, rest: AsyncGenerator[ServerSentEvent, None]
) -> AsyncGenerator[ServerSentEvent, None]:
    """``first``, then every event of ``rest`` (closed when this is)."""
    yield first
    async with contextlib.aclosing(rest):
        async for sse in rest:
            yield sse


def _server_error(data: str) -> str:
    """What failed, when the first SSE ``data`` of a decoder's answer is a server error (vLLM's streamed
    ``{"error": {...}}`` with a code of 500 or more, or none) or the stream's end; "" for anything else, a client
    error included (it would fail on any decoder)."""
    if data == "[DONE]":  # the end, before any answer
        return "the stream ended before its first token"
    if not data.startswith('{"error"'):
        return ""
    try:
        error = fastjson.loads(data).get("error")
    except (ValueError, AttributeError):
        return ""
    if not isinstance(error, dict):
        return ""
    code = error.get("code")
    if isinstance(code, int) and code < 500:
        return ""
    return str(error.get("message") or data)[:300]


def _encode_event(sse: ServerSentEvent, last_id: str) -> bytes:
    """An event as it goes on to the client (the fields it has; ``id`` only when it changed, as the parser keeps
    the last one); an event with nothing in it (no data, no field) is nothing."""
    lines = []
    if sse.event != "message":
        lines.append(f"event: {sse.event}")
    if sse.id != last_id:
        lines.append(f"id: {sse.id}")
    if sse.retry is not None:
        lines.append(f"retry: {sse.retry}")
    if sse.data:
        lines.extend(f"data: {line}" for line in sse.data.split("\n"))
    return ("\n".join(lines) + "\n\n").encode() if lines else b""
