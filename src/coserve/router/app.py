"""The OpenAI-compatible router: conversation-level P/D placement in front of vLLM engines (thin I/O).

Who calls it: ``coserve router --config FILE`` (uvicorn) and ``coserve up``;
tests build it with ``build_app``. The decisions are ``coserve.router.policy``'s.

Per request to ``/v1/chat/completions`` or ``/v1/completions``:

1. the body is read (at most ``maxBodyBytes``: 413), loses every engine-internal
   field a client set (``kv_transfer_params``, ``ec_transfer_params``: with vLLM's
   NixlConnector they name the host, port and blocks a decoder pulls KV from;
   and every ``coserve_*`` key of ``vllm_xargs``), and is checked (400/404 with
   an OpenAI error body naming the field); the only transfer parameters an
   engine sees are the router's own (the prefill's ``do_remote_decode``) or the
   prefiller's answer's, and the only ``coserve_*`` key is the router's class;
2. its class: what it asks for, capped at its tenant's (``Authorization: Bearer``
   key in ``tenants``); forwarded as ``vllm_xargs.coserve_class`` with the
   class's ``ttft_slo_ms`` and ``tpot_slo_ms`` (a client may relax them, never
   tighten them);
3. its conversation (``policy.conversation_id``: a client's id is canonical,
   bounded printable ASCII or its ``sha256:`` digest; an empty or non-string id
   is a 400): pinned to a decoder already (in this replica's pin table,
   or, when this replica holds no pin, found by asking the decoders which holds
   it: every decoder records the conversations the router sends it, so a turn
   lands on its decoder whatever router replica it reaches and however many
   replicas restarted), or placed now (turn 1, or a
   re-placement when the pinned decoder is gone): with prefillers, the prompt is
   prefilled on one (``max_tokens`` 1, ``kv_transfer_params`` asking for a remote
   decode) so the decoder loads its KV instead of computing it; then it is
   pinned to the decoder with the lowest KV occupancy;
4. the decoder's answer is passed through as it comes: a stream is parsed with
   httpx-sse's SSE parser and each event is sent on as soon as it is complete
   (the usage event is read for the token counts, and dropped when the client
   did not ask for it). A decoder that fails a request before anything was sent
   to the client (HTTP 502/503/504, a connection error) has the request retried
   once on another decoder, re-placing and re-pinning that conversation alone:
   never silently dropped. The failure is counted; a decoder is down and its
   conversations lose their pins only after ``pinDropFailures`` failures in a
   row within ``pinDropWindowS`` (an answered request resets the count).

Engines are polled every ``pollS`` for ``vllm:kv_cache_usage_perc``,
``vllm:num_requests_waiting`` and their KV capacity (``vllm:cache_config_info``),
read with ``prometheus_client``'s parser; an engine is down after
``decoderFailures`` consecutive failed polls (one slow answer is not a death);
with ``prefillerService`` / ``decoderService`` the headless Services are
resolved (DNS) at the same time. An engine that leaves its Service (Kubernetes
deleting its pod: a scale-down, a rollout, a node drain) is draining: it gets no
new request, its in-flight ones finish (its pod's preStop hook, ``coserve.drain``,
waits for them), and each conversation pinned to it is re-placed at its next turn.

Counted once across replicas: a conversation is new (``conversations_total``,
its turn-1 prompt in ``conversation_input_tokens``) only on the replica that
placed it, and only that replica reports its lifetime (W) when it ends, after
asking the decoder when the conversation was last served by any replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import httpx
from httpx_sse import EventSource, ServerSentEvent
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from coserve.router import fastjson
from coserve.router.batch_lock import batch_locks
from coserve.router.batches import ENDPOINTS, BatchRunner, BatchStore, public
from coserve.router.config import RouterConfig
from coserve.router.policy import (
    PROMPT_PREFIX_CHARS,
    PROMPT_PREFIX_TOKENS,
    EngineLoad,
    InvalidConversationId,
    Pin,
    PinTable,
    choose_decoder,
    choose_for_request,
    conversation_id,
    place_offline,
)
from coserve.router.policy import resolve_class as class_for
from coserve.scheduling.requests import InvalidRequestClass
from coserve.token_file import TokenFile

__all__ = ["Router", "RouterApp", "build_app", "error_response"]

logger = logging.getLogger("coserve.router")

_RETRYABLE = {502, 503, 504}
# Fields only the router creates (or copies from a prefiller's answer): with vLLM's NixlConnector the transfer
# parameters name the host, port, engine and blocks a decoder pulls KV from (from a client: an SSRF).
ENGINE_INTERNAL_FIELDS = ("kv_transfer_params", "ec_transfer_params")
# The pool's router token (coserve.engine.validation checks it): engines trust a request's class only with it.
ROUTER_TOKEN_FILE_ENV = "COSERVE_ROUTER_TOKEN_FILE"  # noqa: S105 - a variable's name, not a secret
ROUTER_TOKEN_HEADER = "x-coserve-router-token"  # noqa: S105 - a header's name, not a secret


def router_token_headers(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The header that proves a request came through the pool's router, as the token file holds it now; none
    when no token is mounted. ``ValueError`` names the variable when the file is unreadable or empty."""
    path = (os.environ if environ is None else environ).get(ROUTER_TOKEN_FILE_ENV)
    if not path:
        return {}
    return {ROUTER_TOKEN_HEADER: TokenFile(path, variable=ROUTER_TOKEN_FILE_ENV).current().decode()}


_JSON = {"content-type": "application/json"}  # what aiohttp's json= sent: the bodies are fastjson's bytes
CONVERSATION_HEADER = "x-coserve-conversation"  # tells the decoder which conversation a turn belongs to
LOOKUP_PATH = "/coserve/v1/conversations:lookup"  # the decoders' answer to "do you hold these?"


def error_response(status: int, message: str, param: str | None = None, kind: str | None = None) -> JSONResponse:
    """An OpenAI-style error body."""
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "coserve_router_requests", "Requests by endpoint and status.", ["endpoint", "status"], registry=r
        )
        self.ttft = Histogram(
            "coserve_router_ttft_seconds",
            "Time to first token (first streamed chunk, or the whole answer when not streaming), by class.",
            ["cls"],
            registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.tbt = Histogram(
            "coserve_router_tbt_seconds",
            "Time between streamed events.",
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        self.ttfet = Histogram(
            "coserve_router_ttfet_seconds",
            "From a conversation's first arrival to the first token of its latest turn.",
            registry=r,
            buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )
        self.slo = Counter(
            "coserve_router_ttft_slo",
            "Requests by class and whether TTFT met the class's SLO.",
            ["cls", "met"],
            registry=r,
        )
        self.replacements = Counter(
            "coserve_router_replacements", "Conversations re-placed because their decoder was gone.", registry=r
        )
        self.conversations = Counter("coserve_router_conversations", "New conversations (turn 1 arrivals).", registry=r)
        self.turns = Counter("coserve_router_turns", "Turns of pinned conversations (turn 2 and later).", registry=r)
        self.prompt_tokens = Counter(
            "coserve_router_prompt_tokens",
            "Prompt tokens of answered requests (engines' usage), by class.",
            ["cls"],
            registry=r,
        )
        self.output_tokens = Counter(
            "coserve_router_output_tokens",
            "Output tokens of answered requests (engines' usage), by class: the offline class's is the harvest.",
            ["cls"],
            registry=r,
        )
        self.pinned = Gauge(
            "coserve_router_pinned_conversations", "Pinned conversations by decoder.", ["decoder"], registry=r
        )
        self.prefill_queue = Gauge(
            "coserve_router_prefiller_waiting",
            "Requests waiting in each prefiller (polled).",
            ["prefiller"],
            registry=r,
        )
        self.prefill_failures = Counter(
            "coserve_router_prefill_failures", "Prefills that failed; the decoder computed the prompt.", registry=r
        )
        # What the autoscaler reads (the provisioning model's R, L_in, L_d, W and the prefillers' load):
        # R = rate(conversations_total); L_in from conversation_input_tokens; L_d = rate(output_tokens_total)
        # / R; W from conversation_lifetime_seconds; prompt tokens sent to each prefiller, prefill_tokens_total.
        self.input_tokens = Histogram(
            "coserve_router_conversation_input_tokens",
            "Turn-1 prompt tokens of new conversations (L_in; the prefiller's count when it answered).",
            registry=r,
            buckets=(64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072),
        )
        self.lifetime = Histogram(
            "coserve_router_conversation_lifetime_seconds",
            "From a conversation's first turn to its last, observed when its pin expires (W).",
            registry=r,
            buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200),
        )
        self.prefill_tokens = Counter(
            "coserve_router_prefill_tokens", "Prompt tokens sent to each prefiller.", ["prefiller"], registry=r
        )
        self.active = Gauge(
            "coserve_router_active_conversations", "Conversations pinned to a decoder (all decoders).", registry=r
        )
        self.found = Counter(
            "coserve_router_found_conversations",
            "Conversations this replica held no pin for, found on the decoder that holds them.",
            registry=r,
        )
        # The labelled series the request path updates, looked up once per label values (``labels`` validates,
        # locks and builds a key on every call; the child it returns is the same object each time).
        self.requests_of = functools.cache(self.requests.labels)
        self.ttft_of = functools.cache(self.ttft.labels)
        self.slo_of = functools.cache(self.slo.labels)
        self.prompt_tokens_of = functools.cache(self.prompt_tokens.labels)
        self.output_tokens_of = functools.cache(self.output_tokens.labels)


class Router:
    """The router's state: engines, pins, the upstream connection pool, metrics."""

    def __init__(self, config: RouterConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.prefillers: dict[str, EngineLoad] = {url: EngineLoad(url) for url in config.prefillers}
        self.decoders: dict[str, EngineLoad] = {url: EngineLoad(url) for url in config.decoders}
        self.pins = PinTable(config.pin_ttl_s, config.max_pins)
        self._failures_allowed = config.decoder_failures
        self.metrics = _Metrics()
        # read at start-up (a missing or empty token file fails fast), then followed: see _follow_token
        path = os.environ.get(ROUTER_TOKEN_FILE_ENV)
        self._token = TokenFile(path, variable=ROUTER_TOKEN_FILE_ENV) if path else None
        self._upstream_headers = {ROUTER_TOKEN_HEADER: self._token.current().decode()} if self._token else {}
        # NOTE: aiohttp, not httpx: httpx's pool scans every connection on every request, which capped
        # the router at ~400 requests/s with 64 concurrent clients (profiled); aiohttp's does not.
        self._session: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task[None] | None = None
        self.batches = BatchStore(Path(config.batch_dir)) if config.batch_dir else None
        self._runner = (
            BatchRunner(
                self.batches, self.run_offline, self.has_spare_capacity,
                locks=batch_locks(config.batch_lock, self.batches.batches, namespace=os.environ.get("POD_NAMESPACE")),
            )
            if self.batches
            else None
        )  # fmt: skip

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers=self._upstream_headers,
                timeout=aiohttp.ClientTimeout(total=self.config.upstream_timeout_s, sock_connect=5.0),
                connector=aiohttp.TCPConnector(limit=1024, limit_per_host=0, keepalive_timeout=60),
            )
        return self._session

    async def start(self) -> None:
        await self.refresh()
        self._poller = asyncio.create_task(self._poll_forever())
        if self._runner is not None:
            self._runner.start()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.stop()
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self._session is not None:
            await self._session.close()

    # -- engines ------------------------------------------------------------------------------------

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.poll_s)
            try:
                await self.refresh()
            except Exception:  # the poller must outlive any one bad poll
                logger.exception("engine poll failed")

    def _follow_token(self) -> None:
        """Send the token the mounted Secret holds now (the kubelet updates the file in place when the operator
        regenerates it); engines keep accepting the previous one for a grace period, so nothing in flight fails."""
        if self._token is None:
            return
        token = self._token.current().decode()
        if token != self._upstream_headers.get(ROUTER_TOKEN_HEADER):
            self._upstream_headers = {ROUTER_TOKEN_HEADER: token}
            if self._session is not None:
                self._session.headers[ROUTER_TOKEN_HEADER] = token  # the session's default headers, live

    async def refresh(self) -> None:
        """Follow the router token, resolve Services (if configured), then read every engine's load."""
        self._follow_token()
        for service, engines in (
            (self.config.prefiller_service, self.prefillers),
            (self.config.decoder_service, self.decoders),
        ):
            if service:
                await self._resolve(service, engines)
        everyone = [*self.prefillers.values(), *self.decoders.values()]
        await asyncio.gather(*(self._poll(engine) for engine in everyone))
        now = self.clock()
        names, ended = self.pins.expire_named(now)
        if ended:
            await self._end_conversations(ended, names, now)
        self.metrics.active.set(len(self.pins))
        counts = self.pins.per_decoder()
        for url in self.decoders:
            self.metrics.pinned.labels(url).set(counts.get(url, 0))
        for url, engine in self.prefillers.items():
            self.metrics.prefill_queue.labels(url).set(engine.waiting)

    async def _resolve(self, service: str, engines: dict[str, EngineLoad]) -> None:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(service, self.config.engine_port, type=socket.SOCK_STREAM)
        except OSError as error:
            logger.warning("cannot resolve %s: %s", service, error)
            return
        port = self.config.engine_port
        hosts = {str(info[4][0]) for info in infos}
        urls = {f"http://[{h}]:{port}" if ":" in h else f"http://{h}:{port}" for h in hosts}  # IPv6 in brackets
        for url in urls - set(engines):
            engines[url] = EngineLoad(url)
        for url in set(engines) - urls:
            self._left_service(url, engines)

    def _left_service(self, url: str, engines: dict[str, EngineLoad]) -> None:
        """An engine left its Service (Kubernetes is deleting its pod, or it is not ready): it gets no new work.

        Its in-flight requests finish (the pod's preStop hook waits for them). Pins to a leaving decoder are
        kept, not dropped: a conversation's next turn finds its decoder gone and is re-placed (prefilled again,
        its KV handed to another decoder), counted as a re-placement with its first arrival kept (R, L_in and
        W stay right); a decoder back in the Service before that turn keeps its conversations.
        """
        del engines[url]
        gauge = self.metrics.pinned if engines is self.decoders else self.metrics.prefill_queue
        with contextlib.suppress(KeyError):  # no series for a pod that is gone
            gauge.remove(url)
        if engines is self.decoders:
            pinned = self.pins.per_decoder().get(url, 0)
            logger.info("decoder %s left its Service: draining; %d conversations move at their next turn", url, pinned)

    async def _poll(self, engine: EngineLoad) -> None:
        try:
            async with self.session.get(f"{engine.url}/metrics", timeout=aiohttp.ClientTimeout(total=2.0)) as response:
                response.raise_for_status()
                text = await response.text()
            usage, waiting, capacity = _engine_load(text)
        except (TimeoutError, aiohttp.ClientError, ValueError) as error:
            engine.failed(self._failures_allowed)
            if not engine.healthy:
                logger.warning("%s is down after %d failed polls (%s)", engine.url, engine.failures, error)
            return
        engine.polled(usage, waiting)
        engine.kv_capacity_tokens = capacity or engine.kv_capacity_tokens

    async def _lookup(self, decoder: EngineLoad, conversations: list[str]) -> dict[str, dict[str, float]]:
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

    async def _find_pin(self, conversation: str, now: float) -> Pin | None:
        """The decoder another replica (or this one, before a restart) placed ``conversation`` on, if any
        decoder holds it: the one that served it last."""
        decoders = [d for d in self.decoders.values() if d.healthy]
        answers = await asyncio.gather(*(self._lookup(d, [conversation]) for d in decoders))
        best: tuple[float, EngineLoad, dict[str, float]] | None = None
        for decoder, found in zip(decoders, answers, strict=True):
            seen = found.get(conversation)
            if isinstance(seen, dict) and float(seen.get("idle_s", 1e18)) <= self.config.pin_ttl_s:
                idle = float(seen["idle_s"])
                if best is None or idle < best[0]:
                    best = (idle, decoder, seen)
        if best is None:
            return None
        self.metrics.found.inc()
        first = now - float(best[2].get("age_s", 0.0))
        return self.pins.pin(conversation, best[1].url, now, first_arrival_s=first, owned=False)

    async def _end_conversations(self, ended: list[Pin], names: list[str], now: float) -> None:
        """Pins that expired here: the ones this replica placed report their lifetime (W) once the decoder
        confirms the conversation is over; one still served through other replicas is kept."""
        by_decoder: dict[str, list[tuple[str, Pin]]] = {}
        for name, pin in zip(names, ended, strict=True):
            if pin.owned:
                by_decoder.setdefault(pin.decoder, []).append((name, pin))
        for url, pins in by_decoder.items():
            decoder = self.decoders.get(url)
            found = await self._lookup(decoder, [n for n, _ in pins]) if decoder is not None else {}
            for name, pin in pins:
                seen = found.get(name)
                idle = float(seen["idle_s"]) if isinstance(seen, dict) and "idle_s" in seen else None
                if idle is not None and idle <= self.config.pin_ttl_s:
                    kept = self.pins.pin(name, url, now - idle)  # still live elsewhere: keep owning it
                    kept.first_arrival_s, kept.turns = pin.first_arrival_s, pin.turns
                    continue
                last = pin.last_used_s if idle is None else max(pin.last_used_s, now - idle)
                self.metrics.lifetime.observe(max(0.0, last - pin.first_arrival_s))

    # -- requests ---------------------------------------------------------------------------------

    async def handle(self, request: _Body, endpoint: str) -> Response:
        arrived = self.clock()
        response = await self._handle(request, endpoint, arrived)
        self.metrics.requests_of(endpoint, str(response.status_code)).inc()
        return response

    async def _handle(self, request: _Body, endpoint: str, arrived: float) -> Response:
        body, problem = await self._read_json(request)
        if body is None:
            return problem or error_response(400, "no body")
        _drop_engine_fields(body)  # before anything else reads the body
        checked = self._check(body, endpoint)
        if checked is not None:
            return checked
        token = request.headers.get("authorization") or ""
        key = token[7:].strip() if token.lower().startswith("bearer ") else None
        tenant = self.config.tenants.get(key) if key else None
        if tenant is None:
            tenant = self.config.anonymous_class or self.config.classes.default.name
        xargs = body.get("vllm_xargs") or {}
        if not isinstance(xargs, dict):
            return error_response(400, "must be an object", "vllm_xargs")
        asked = xargs.get("coserve_class")
        priority = body.get("priority")
        if asked is not None and not isinstance(asked, str):
            return error_response(400, f"must be a class name, got {asked!r}", "vllm_xargs.coserve_class")
        if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
            return error_response(400, f"must be an integer, got {priority!r}", "priority")
        try:
            cls = class_for(self.config.classes, tenant, asked, priority)
        except InvalidRequestClass as error:
            return error_response(400, str(error), "vllm_xargs.coserve_class")
        try:
            conversation = conversation_id(request.headers, body)  # before the body's own field is dropped
        except InvalidConversationId as error:
            return error_response(400, error.reason, error.field)
        named = request.headers.get("x-conversation-id") is not None or body.get("conversation_id") is not None
        body.pop("priority", None)
        body.pop("conversation_id", None)
        slos = {}
        for key, floor_ms in (("ttft_slo_ms", cls.ttft_slo_s * 1000), ("tpot_slo_ms", cls.tpot_slo_s * 1000)):
            asked_ms = xargs.get(key)
            if asked_ms is not None and (isinstance(asked_ms, bool) or not isinstance(asked_ms, (int, float))
                                         or asked_ms <= 0):  # fmt: skip
                return error_response(400, f"must be a positive number of milliseconds, got {asked_ms!r}",
                                      f"vllm_xargs.{key}")  # fmt: skip
            # a client may relax its class's SLO, never tighten it: a tighter deadline is a higher priority
            if asked_ms is None:
                slos[key] = floor_ms
            else:  # a float as it was read (a client's NaN or Infinity is forwarded as it came: fastjson)
                slos[key] = max(asked_ms if isinstance(asked_ms, float) else float(asked_ms), floor_ms)
        body["vllm_xargs"] = {**_client_xargs(xargs), "coserve_class": cls.name, **slos}
        return await self._route(endpoint, body, conversation, cls.name, cls.ttft_slo_s, arrived, named)

    def has_spare_capacity(self, spare: float = 0.5) -> bool:
        """Offline batch work runs only while some decoder is below ``spare`` KV occupancy (``place_offline``)."""
        return place_offline(list(self.decoders.values()), list(self.prefillers.values()), spare) is not None

    async def run_offline(self, endpoint: str, body: dict[str, Any]) -> tuple[int, bytes]:
        """One batch line through the same checks and placement as online traffic, at the lowest class."""
        _drop_engine_fields(body)  # before anything else reads the line
        body.setdefault("model", self.config.model)
        body["stream"] = False
        problem = self._check(body, endpoint)
        if problem is not None:
            return problem.status_code, bytes(problem.body)
        xargs = body.get("vllm_xargs") or {}
        if not isinstance(xargs, dict):
            problem = error_response(400, "must be an object", "vllm_xargs")
            return problem.status_code, bytes(problem.body)
        try:
            conversation = conversation_id({}, body)
        except InvalidConversationId as error:
            problem = error_response(400, error.reason, error.field)
            return problem.status_code, bytes(problem.body)
        lowest = max((self.config.classes.get(n) for n in self.config.classes.names), key=lambda c: c.rank)
        slos = {"ttft_slo_ms": lowest.ttft_slo_s * 1000, "tpot_slo_ms": lowest.tpot_slo_s * 1000}
        body["vllm_xargs"] = {**_client_xargs(xargs), "coserve_class": lowest.name, **slos}
        body.pop("priority", None)
        body.pop("conversation_id", None)
        arrived = self.clock()
        placed = place_offline(list(self.decoders.values()), list(self.prefillers.values()))
        if placed is not None and placed.prefiller is None:  # the decoder prefills it too: no prefiller, no pin
            path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
            placed.decoder.admitted_tokens += _estimate_tokens(body)
            try:
                response = await self._forward(placed.decoder, path, body, lowest.name, lowest.ttft_slo_s, arrived,
                                               arrived)  # fmt: skip
            except _Unavailable as failure:
                self._forward_failed(placed.decoder, failure)
                response = error_response(503, f"decoder {placed.decoder.url} failed ({failure}); retry shortly")
            return response.status_code, bytes(response.body)
        # an idle prefiller (GoRouting takes it) or no spare decoder: the online placement
        response = await self._route(endpoint, body, conversation, lowest.name, lowest.ttft_slo_s, arrived)
        return response.status_code, bytes(response.body)

    async def _read_json(self, request: _Body) -> tuple[dict[str, Any] | None, Response | None]:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return None, error_response(413, f"request body over {limit} bytes", kind="invalid_request_error")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limit:
                return None, error_response(413, f"request body over {limit} bytes", kind="invalid_request_error")
        try:
            body = fastjson.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            return None, error_response(400, f"the body is not valid JSON: {error}")
        if not isinstance(body, dict):
            return None, error_response(400, "the body must be a JSON object")
        return body, None

    def _check(self, body: Mapping[str, Any], endpoint: str) -> Response | None:
        model = body.get("model")
        if not isinstance(model, str):
            return error_response(400, "required: the model name (a string)", "model")
        if model != self.config.model:
            return error_response(
                404, f"the model {model!r} does not exist; this pool serves {self.config.model!r}", "model",
                kind="model_not_found",
            )  # fmt: skip
        if endpoint == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                return error_response(400, "required: a non-empty list of messages", "messages")
            for index, message in enumerate(messages):
                if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                    return error_response(400, "each message needs a role", f"messages[{index}].role")
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, (str, list)) or not prompt:
                return error_response(400, "required: a prompt (text or token ids)", "prompt")
        if "stream" in body and not isinstance(body["stream"], bool):
            return error_response(400, f"must be true or false, got {body['stream']!r}", "stream")
        for key in ("max_tokens", "max_completion_tokens", "n"):
            value = body.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                return error_response(400, f"must be a positive integer, got {value!r}", key)
        return None

    async def _route(
        self, endpoint: str, body: dict[str, Any], conversation: str, cls: str, slo_s: float, arrived: float,
        named: bool = False,
    ) -> Response:  # fmt: skip
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        now = self.clock()
        if self.config.placement == "request":
            return await self._route_request(path, body, cls, slo_s, arrived)
        if self.config.placement == "turn":
            conversation = f"{conversation}/{uuid.uuid4().hex}"  # every turn a new conversation
        pin = self.pins.get(conversation, now)
        continued = _is_continuation(endpoint, body, named)
        if pin is None and self.config.placement == "conversation" and continued is not False:
            pin = await self._find_pin(conversation, now)
        tried: set[str] = set()
        for attempt in range(2):
            decoder = self.decoders.get(pin.decoder) if pin is not None else None
            if decoder is None or not decoder.healthy or decoder.url in tried:
                new = pin is None and attempt == 0  # no pin here, and no decoder holds it
                if new:
                    self.metrics.conversations.inc()
                else:  # its decoder is gone
                    self.metrics.replacements.inc()
                candidates = [d for d in self.decoders.values() if d.url not in tried]
                decoder = choose_decoder(candidates, self.config.decoder_full)
                if decoder is None:
                    return error_response(
                        503, "no decoder can take a new conversation now (all full or down); retry shortly"
                    )
                body = await self._prefill(path, body, slo_s, count_input=new)
                pin = self.pins.pin(conversation, decoder.url, now)
            else:
                self.metrics.turns.inc()
            assert pin is not None  # noqa: S101 - set on both branches above (for the type checker)
            pin.turns += 1
            decoder.admitted_tokens += _estimate_tokens(body)
            try:
                return await self._forward(decoder, path, body, cls, slo_s, arrived, pin.first_arrival_s, conversation)
            except _Unavailable as failure:
                tried.add(decoder.url)
                self._forward_failed(decoder, failure, conversation)
        return error_response(502, "the decoders failed to answer; the request was tried twice")

    def _forward_failed(self, decoder: EngineLoad, failure: _Unavailable, conversation: str | None = None) -> None:
        """A request failed on ``decoder`` before anything reached the client: counted; the decoder is down and
        its conversations lose their pins only once that confirms it lost (``pinDropFailures`` in a row
        within ``pinDropWindowS``). The caller retries the request elsewhere (and re-pins its conversation)."""
        config = self.config
        if decoder.forward_failed(self.clock(), config.pin_drop_failures, config.pin_drop_window_s):
            dropped = self.pins.drop_decoder(decoder.url)
            logger.warning(
                "decoder %s failed %d requests in a row within %g s (last: %s): down, %d conversations lose "
                "their pins", decoder.url, config.pin_drop_failures, config.pin_drop_window_s, failure, dropped,
            )  # fmt: skip
        elif conversation is not None:
            logger.warning("decoder %s failed (%s): re-placing conversation %s", decoder.url, failure, conversation)
        else:
            logger.warning("decoder %s failed (%s): retrying the request elsewhere", decoder.url, failure)

    async def _route_request(self, path: str, body: dict[str, Any], cls: str, slo_s: float, arrived: float) -> Response:
        """The per-request baseline: the least-occupied decoder computes what it lacks; nothing is pinned."""
        tried: set[str] = set()
        for _ in range(2):
            decoder = choose_decoder(
                [d for d in self.decoders.values() if d.url not in tried], self.config.decoder_full
            )
            if decoder is None:
                break
            decoder.admitted_tokens += _estimate_tokens(body)
            try:
                return await self._forward(decoder, path, body, cls, slo_s, arrived, arrived)
            except _Unavailable as failure:
                tried.add(decoder.url)
                self._forward_failed(decoder, failure)
        return error_response(503, "no decoder can take the request now (all full or down); retry shortly")

    async def _prefill(self, path: str, body: dict[str, Any], slo_s: float, count_input: bool = True) -> dict[str, Any]:
        """Turn 1 on a prefiller: its KV goes to the decoder (handoff); on failure the decoder computes it.
        Either way a new conversation's L_in is observed (the prefiller's own count when it answered)."""
        tokens = _estimate_tokens(body)
        prefiller = choose_for_request(list(self.prefillers.values()), tokens, slo_s, self.config.prefill_latency)
        if prefiller is None:
            if count_input:
                self.metrics.input_tokens.observe(tokens)
            return body
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
        answer = answer if isinstance(answer, dict) else {}
        usage = answer.get("usage")
        counted = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        tokens = counted if isinstance(counted, int) else tokens
        if count_input:
            self.metrics.input_tokens.observe(tokens)
        if answer:
            self.metrics.prefill_tokens.labels(prefiller.url).inc(tokens)
        params = answer.get("kv_transfer_params")
        return {**body, "kv_transfer_params": params} if params else body

    async def _forward(
        self, decoder: EngineLoad, path: str, body: dict[str, Any], cls: str, slo_s: float, arrived: float,
        first_arrival: float, conversation: str | None = None,
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
            raise _Unavailable(str(error) or type(error).__name__) from error
        if response.status in _RETRYABLE:
            response.release()
            raise _Unavailable(f"HTTP {response.status}")
        content_type = response.headers.get("content-type", "application/json")
        out_headers = {"content-type": content_type}
        if not streaming or not content_type.startswith("text/event-stream"):  # an error answers a stream in JSON
            try:
                content = await response.read()
            except (TimeoutError, aiohttp.ClientError) as error:
                raise _Unavailable(str(error) or type(error).__name__) from error
            finally:
                response.release()
            decoder.forward_answered()
            self._observe(cls, slo_s, arrived, first_arrival)
            self._count_usage(content, cls)
            return Response(content, response.status, headers=out_headers)
        decoder.forward_answered()
        return StreamingResponse(
            self._relay(response, cls, slo_s, arrived, first_arrival, wants_usage), response.status, headers=out_headers
        )

    async def _relay(
        self, response: aiohttp.ClientResponse, cls: str, slo_s: float, arrived: float, first_arrival: float,
        pass_usage: bool = True,
    ) -> AsyncIterator[bytes]:  # fmt: skip
        """The decoder's SSE stream, each event sent on as soon as httpx-sse's parser has it complete (never
        held for the next read); the final usage event is read for the token counts and dropped when the client
        did not ask for it (the router asked on its behalf)."""
        last: float | None = None
        last_id = ""
        body = httpx.Response(
            response.status, headers={"content-type": response.headers.get("content-type", "")},
            stream=_UpstreamBytes(response.content),
        )  # fmt: skip
        try:
            async with contextlib.aclosing(EventSource(body).aiter_sse()) as events:
                async for sse in events:
                    now = self.clock()
                    if last is None:
                        self._observe(cls, slo_s, arrived, first_arrival)
                    else:
                        self.metrics.tbt.observe(now - last)
                    last = now
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


class _Body(Protocol):
    """What the request handlers read: lower-case header lookup and the body's chunks (a Starlette
    ``Request`` or ``_RawRequest``)."""

    @property
    def headers(self) -> Mapping[str, str]: ...

    def stream(self) -> AsyncIterator[bytes]: ...


class _RawRequest:
    """The hot path's request: headers and body straight from the ASGI scope, without Starlette's Request."""

    def __init__(self, scope: Mapping[str, Any], receive: Callable[[], Awaitable[Mapping[str, Any]]]) -> None:
        self.headers: dict[str, str] = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        self._receive = receive

    async def stream(self) -> AsyncIterator[bytes]:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                return
            yield message.get("body", b"")
            if not message.get("more_body"):
                return


class _Unavailable(RuntimeError):
    """The decoder could not be used, and nothing was sent to the client yet: safe to retry elsewhere."""


class _UpstreamBytes(httpx.AsyncByteStream):
    """An aiohttp response's body, read as it arrives, as the stream of the ``httpx.Response`` that httpx-sse's
    ``EventSource`` parses (the router's upstream client is aiohttp; the parser reads httpx responses)."""

    def __init__(self, content: aiohttp.StreamReader) -> None:
        self._content = content

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._content.iter_any():
            yield chunk


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


def _drop_engine_fields(body: dict[str, Any]) -> None:
    """Remove what only the router may set (``ENGINE_INTERNAL_FIELDS``) from a client's request."""
    for name in ENGINE_INTERNAL_FIELDS:
        body.pop(name, None)


def _client_xargs(xargs: Mapping[str, Any]) -> dict[str, Any]:
    """A client's ``vllm_xargs`` without the ``coserve_*`` keys: the router sets the ones engines read."""
    return {key: value for key, value in xargs.items() if not key.lower().startswith("coserve_")}


def _engine_load(text: str) -> tuple[float, int, int]:
    """KV usage (the highest engine's), requests waiting and KV capacity in tokens from an engine's /metrics."""
    usage, waiting, capacity = 0.0, 0.0, 0
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:kv_cache_usage_perc":
            usage = max((sample.value for sample in family.samples), default=0.0)
        elif family.name == "vllm:num_requests_waiting":
            waiting = sum(sample.value for sample in family.samples)
        elif family.name in ("vllm:cache_config_info", "vllm:cache_config"):  # its labels: the KV capacity
            for sample in family.samples:
                blocks, size = sample.labels.get("num_gpu_blocks"), sample.labels.get("block_size")
                if blocks and size and blocks.isdigit() and size.isdigit():
                    capacity += int(blocks) * int(size)
    return usage, int(waiting), capacity


def _is_continuation(endpoint: str, body: Mapping[str, Any], named: bool) -> bool | None:
    """Whether a request carries earlier turns: True for chat with an assistant or tool message; False for
    chat without one (turn 1) and for a completion whose prompt is too short for a stable name (no earlier
    turn can share it); None (ask the decoders) for other completions and any explicitly named one."""
    if endpoint == "chat":
        messages = body.get("messages") or ()
        return any(isinstance(m, dict) and m.get("role") in ("assistant", "tool") for m in messages)
    if named:
        return None
    prompt = body.get("prompt")
    short = (isinstance(prompt, str) and len(prompt) <= PROMPT_PREFIX_CHARS) or (
        isinstance(prompt, list) and len(prompt) <= PROMPT_PREFIX_TOKENS
    )
    return False if short else None


def _estimate_tokens(body: Mapping[str, Any]) -> int:
    """A cheap size estimate for the admitted-token accounting (4 characters a token)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return len(prompt)
    if isinstance(prompt, str):
        return len(prompt) // 4
    return sum(len(str(m.get("content", ""))) for m in body.get("messages") or [] if isinstance(m, dict)) // 4


def build_app(config: RouterConfig, router: Router | None = None) -> RouterApp:
    """The ASGI app; ``router`` (tests) or a new one, started and closed with the app."""
    state = router or Router(config)

    async def chat(request: Request) -> Response:
        return await state.handle(request, "chat")

    async def completions(request: Request) -> Response:
        return await state.handle(request, "completions")

    async def models(_: Request) -> Response:
        return JSONResponse(
            {"object": "list", "data": [{"id": config.model, "object": "model", "owned_by": "coserve"}]}
        )

    async def live(_: Request) -> Response:
        """Liveness: the process serves (a router without decoders is waiting, not broken)."""
        return JSONResponse({"status": "ok"})

    async def ready(_: Request) -> Response:
        """Readiness: the router can place a request (a healthy decoder below full)."""
        up = [d.url for d in state.decoders.values() if d.healthy]
        placeable = choose_decoder(list(state.decoders.values()), config.decoder_full) is not None
        return JSONResponse({"decoders_up": len(up), "pinned": len(state.pins)}, 200 if placeable else 503)

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(state.metrics.registry), headers={"content-type": "text/plain; version=0.0.4"})

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.close()

    batch_routes: list[Route] = []
    if state.batches is not None:
        store = state.batches

        async def upload(request: Request) -> Response:
            try:
                form = await request.form(max_part_size=64 << 20)
            except Exception as error:  # noqa: BLE001 - any malformed multipart body is the client's
                return error_response(400, f"expected a multipart form with a file: {error}", "file")
            upload_file = form.get("file")
            if upload_file is None or isinstance(upload_file, str):
                return error_response(400, "required: a file field with the JSONL of requests", "file")
            purpose = form.get("purpose", "batch")
            try:
                meta = store.add_file(await upload_file.read(), upload_file.filename or "input.jsonl", str(purpose))
            except (ValueError, UnicodeDecodeError) as error:
                return error_response(400, str(error), "file")
            return JSONResponse(meta)

        async def file_meta(request: Request) -> Response:
            meta = store.file(request.path_params["file_id"])
            return JSONResponse(meta) if meta else error_response(404, "no such file", "file_id")

        async def file_content(request: Request) -> Response:
            content = store.content(request.path_params["file_id"])
            if content is None:
                return error_response(404, "no such file", "file_id")
            return Response(content, headers={"content-type": "application/jsonl"})

        async def create_batch(request: Request) -> Response:
            body, problem = await state._read_json(request)
            if body is None:
                return problem or error_response(400, "no body")
            endpoint = body.get("endpoint")
            if endpoint not in ENDPOINTS:
                return error_response(400, f"must be one of {', '.join(ENDPOINTS)}", "endpoint")
            file_id = body.get("input_file_id")
            if not isinstance(file_id, str):
                return error_response(400, "required: the id of an uploaded file", "input_file_id")
            try:
                return JSONResponse(public(store.create_batch(file_id, endpoint)))
            except KeyError:
                return error_response(404, f"no file {file_id!r}", "input_file_id")

        async def get_batch(request: Request) -> Response:
            batch = store.batch(request.path_params["batch_id"])
            return JSONResponse(public(batch)) if batch else error_response(404, "no such batch", "batch_id")

        async def cancel_batch(request: Request) -> Response:
            batch = store.batch(request.path_params["batch_id"])
            if batch is None:
                return error_response(404, "no such batch", "batch_id")
            if batch["status"] == "in_progress":
                batch["status"] = "cancelling"
                store.save(batch)
            return JSONResponse(public(batch))

        batch_routes = [
            Route("/v1/files", upload, methods=["POST"]),
            Route("/v1/files/{file_id}", file_meta, methods=["GET"]),
            Route("/v1/files/{file_id}/content", file_content, methods=["GET"]),
            Route("/v1/batches", create_batch, methods=["POST"]),
            Route("/v1/batches/{batch_id}", get_batch, methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", cancel_batch, methods=["POST"]),
        ]

    app = Starlette(
        routes=[
            *batch_routes,
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/live", live, methods=["GET"]),
            Route("/ready", ready, methods=["GET"]),
            Route("/health", ready, methods=["GET"]),  # kept for existing probes and scripts: readiness
            Route("/metrics", metrics, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state.router = state
    return RouterApp(app, state)


_HOT_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


class RouterApp:
    """The ASGI app: the two completion endpoints straight to the router, everything else through Starlette.

    NOTE: Starlette's middleware, routing and Request cost about a fifth of the router's CPU per request
    (profiled at 500 requests/s), and on 2 shared cores CPU per request is what the p99 latency is made of.
    """

    def __init__(self, app: Starlette, router: Router) -> None:
        self.app = app
        self.state = app.state
        self.router = router

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        endpoint = _HOT_PATHS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if endpoint is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        try:
            response = await self.router.handle(_RawRequest(scope, receive), endpoint)
        except Exception:  # what Starlette's error middleware would do: a 500, logged, no traceback to the client
            logger.exception("unhandled error on %s", scope["path"])
            response = error_response(500, "internal error in the router; it is logged")
        await response(scope, receive, send)
