"""ASGI middleware for vLLM's OpenAI server: reject a bad class or SLO with HTTP 400.

vLLM passes ``vllm_xargs`` to the engine core untouched, where a bad value can
no longer be answered with a client error. This middleware checks the coserve
fields of each completion request before vLLM sees it:

    {"priority": 1, "vllm_xargs": {"coserve_class": "interactive", "ttft_slo_ms": 500, "tpot_slo_ms": 50}}

and answers an unknown class or a non-positive or non-numeric SLO with an
OpenAI-style error body naming the field.

It is also where an arrival is first seen, while the engine core is blocked
in the running step. When the engine has safepoints, the middleware wraps the
API server's hand-off to the engine core (``engine_client.engine_core
.add_request_async``, called once vLLM has parsed, tokenized and admitted the
request): for a request this middleware let through as the router's, it reads
the step posted on the safepoint board and, if ``should_preempt`` says waiting
would break the arrival's first-token deadline, raises the abort flag so the
workers leave the step at the next layer boundary. A request vLLM rejects
(a prompt longer than the model, a bad sampling parameter) never reaches the
hand-off, so it never raises the flag. Install it with
``--middleware coserve.engine.validation.RequestClassValidator`` (the operator
renders it). It reads the same ``COSERVE_CONFIG`` file as the scheduler.

Only the pool's router may claim a class and raise the flag. When
``COSERVE_ROUTER_TOKEN_FILE`` names a file (the operator mounts the pool's
router token there, in the router and in the engines), a request must carry
that token in ``X-Coserve-Router-Token``. One that does not is held to
``ROUTE_POLICY``: on every route that generates it is served at the lowest
class, with the class's own SLOs, no ``priority`` and no KV-transfer
parameters, and never raises the flag, so a client that reaches an engine
directly can neither jump the queue, stall other classes' steps nor steer a
decoder's KV pull; routes that only read pass; every other route (an abort,
an elastic scale, a stored response, one a future vLLM adds) is refused with
a 403. Without the variable (a local engine) every request is trusted.

It also keeps the engine's ``ConversationLog``: the conversation each routed
request names in ``X-Coserve-Conversation`` is recorded, and the routers ask
``POST /coserve/v1/conversations:lookup`` (``{"ids": [...]}``, router token
required when one is mounted) which of their conversations this engine holds,
so every router replica finds a conversation's decoder, whatever replica placed it.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, MutableMapping
from contextvars import ContextVar
from typing import Any

from coserve.engine.conversations import ConversationLog
from coserve.engine.safepoint import SafepointBoard, board_name
from coserve.kv.transfer_params import ENGINE_INTERNAL_FIELDS, transfer_params_problem
from coserve.scheduling import InvalidRequestClass, RunningStep, SchedRequest, should_preempt
from coserve.scheduling.config import CONFIG_ENV, EngineSchedulingConfig, load_engine_config
from coserve.scheduling.requests import ClassRegistry
from coserve.token_file import TokenFile

__all__ = [
    "ROUTER_TOKEN_FILE_ENV",
    "ROUTER_TOKEN_HEADER",
    "ROUTE_POLICY",
    "RequestClassValidator",
    "demote",
    "demote_generate",
    "load_router_token",
    "openai_error",
    "route_policy",
]

ROUTER_TOKEN_FILE_ENV = "COSERVE_ROUTER_TOKEN_FILE"  # noqa: S105 - a variable's name, not a secret
ROUTER_TOKEN_HEADER = "x-coserve-router-token"  # noqa: S105 - a header's name, not a secret
CONVERSATION_HEADER = "x-coserve-conversation"
LOOKUP_PATH = "/coserve/v1/conversations:lookup"
MAX_LOOKUP_IDS = 10_000

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

logger = logging.getLogger(__name__)

# Set by the middleware, for the task serving a request it let through as the router's, and read where
# vLLM hands the accepted request to the engine core (the same task, or a response task that copied its
# context). Anything else that reaches the hand-off (a demoted request, an internal one) sees False.
_FROM_ROUTER: ContextVar[bool] = ContextVar("coserve_from_router", default=False)

MAX_BODY_BYTES = 64 << 20

# What a caller without the router token may do on each of vLLM 0.32's routes (when a token is mounted).
# OPEN: passes untouched (it reads, or renders a prompt, and never generates). OPENAI / GENERATE: generation,
# served at the lowest class (the body's class claims, priority and KV-transfer parameters rewritten, see
# ``demote`` and ``demote_generate``). Every other route, and every route a future vLLM adds, is refused to
# such callers with a 403 (``tests/engine/test_route_policy.py`` lists vLLM's routes from its own app, so a
# new one fails it until someone decides). The router, which carries the token, reaches every route.
OPEN, OPENAI, GENERATE = "open", "openai", "generate"
ROUTE_POLICY: dict[tuple[str, str], str] = {
    **{("GET", path): OPEN for path in (
        "/health", "/metrics", "/ping", "/load", "/version", "/v1/models",
        "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc",
    )},
    **{("POST", path): OPEN for path in (
        "/ping", "/tokenize", "/detokenize", "/v1/messages/count_tokens",
        "/v1/chat/completions/render", "/v1/completions/render", "/v1/responses/render", "/v1/messages/render",
        "/v1/chat/completions/derender", "/v1/completions/derender",
    )},
    **{("POST", path): OPENAI for path in (
        "/v1/chat/completions", "/v1/completions", "/v1/chat/completions/batch", "/v1/responses",
        "/v1/messages", "/invocations",
    )},
    ("POST", "/inference/v1/generate"): GENERATE,
}  # fmt: skip
_SLO_KEYS = ("ttft_slo_ms", "tpot_slo_ms")


def route_policy(method: str, path: str) -> str | None:
    """``OPEN``, ``OPENAI``, ``GENERATE`` for a known route (HEAD as GET), ``None`` for any other."""
    return ROUTE_POLICY.get(("GET" if method == "HEAD" else method, path))


def openai_error(message: str, param: str | None, status: int = 400) -> bytes:
    """The error body OpenAI clients parse: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = "BadRequestError" if 400 <= status < 500 else "InternalServerError"
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}}).encode()


def load_router_token(path: str | None) -> bytes | None:
    """The pool's router token from ``path`` (``None``: no path, every request is trusted).

    A path that is set but unreadable or empty stops the engine at start-up: trusting every
    request because a Secret failed to mount would silently reopen what the token closes.
    """
    if not path:
        return None
    try:
        token = open(path, "rb").read().strip()  # noqa: SIM115 - read once at start-up
    except OSError as error:
        raise ValueError(f"{ROUTER_TOKEN_FILE_ENV}: cannot read {path}: {error}") from error
    if not token:
        raise ValueError(f"{ROUTER_TOKEN_FILE_ENV}: {path} is empty")
    return token


def demote(body: dict[str, Any], lowest: str) -> dict[str, Any]:
    """``body`` as a request without the router's proof is served: the lowest class, its own SLOs, no priority,
    no engine-internal fields (an OpenAI-style body: the class in ``vllm_xargs``)."""
    out = {k: v for k, v in body.items() if k != "priority" and k not in ENGINE_INTERNAL_FIELDS}
    out["vllm_xargs"] = _lowest_args(body.get("vllm_xargs"), lowest)
    return out


def demote_generate(body: dict[str, Any], lowest: str) -> dict[str, Any]:
    """``demote`` for vLLM's token-in/token-out ``/inference/v1/generate``: the class in its sampling params."""
    out = {k: v for k, v in body.items() if k != "priority" and k not in ENGINE_INTERNAL_FIELDS}
    params = body.get("sampling_params")
    params = {k: v for k, v in params.items() if k != "priority"} if isinstance(params, dict) else {}
    params["extra_args"] = _lowest_args(params.get("extra_args"), lowest)
    out["sampling_params"] = params
    return out


def _lowest_args(extra: Any, lowest: str) -> dict[str, Any]:
    kept = (
        {k: v for k, v in extra.items() if k not in _SLO_KEYS and k not in ENGINE_INTERNAL_FIELDS}
        if isinstance(extra, dict)
        else {}
    )
    return {**kept, "coserve_class": lowest}


def check_request(body: Any, classes: ClassRegistry, kind: str = OPENAI) -> InvalidRequestClass | None:
    """The first coserve problem with a parsed request body, or ``None``.

    ``kind`` says where the class is: ``vllm_xargs`` (OPENAI) or ``sampling_params.extra_args`` (GENERATE).
    """
    if not isinstance(body, dict):
        return None  # not ours to judge: vLLM answers malformed JSON itself
    malformed = transfer_params_problem(body, generate=kind == GENERATE)
    if malformed is not None:  # even from the router: the engine core must never see it
        return InvalidRequestClass(*malformed)
    priority = body.get("priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        return InvalidRequestClass("priority", f"must be an integer, got {priority!r}")
    field = "vllm_xargs"
    extra = body.get("vllm_xargs")
    if kind == GENERATE:
        params = body.get("sampling_params")
        field, extra = "sampling_params.extra_args", params.get("extra_args") if isinstance(params, dict) else None
    if extra is not None and not isinstance(extra, dict):
        return InvalidRequestClass(field, f"must be an object, got {type(extra).__name__}")
    try:
        classes.resolve(extra, priority)
    except InvalidRequestClass as error:
        return error
    return None


class RequestClassValidator:
    """Pure ASGI middleware; buffers only the bodies of completion requests (bounded)."""

    def __init__(
        self, app: ASGIApp, config: EngineSchedulingConfig | None = None, router_token: bytes | None = None
    ) -> None:
        self.app = app
        self.config = config or load_engine_config(os.environ.get(CONFIG_ENV), 2048)
        self.classes: ClassRegistry = self.config.classes
        # a fixed token (tests, embedding), else the mounted Secret's file, re-read when it changes
        self.router_token = router_token
        path = os.environ.get(ROUTER_TOKEN_FILE_ENV) if router_token is None else None
        if path:
            load_router_token(path)  # an unreadable or empty file stops the engine at start-up, naming it
        self._token_file = TokenFile(path, variable=ROUTER_TOKEN_FILE_ENV) if path else None
        self._lowest = max((self.classes.get(n) for n in self.classes.names), key=lambda c: c.rank).name
        offline = self.config.offline_class
        self._offline_rank = self.classes.get(offline).rank if offline is not None else None
        self._board: SafepointBoard | None = None
        self._board_checked = False
        self._wrapped: bool | None = None  # None: the hand-off is not wrapped yet
        self.conversations = ConversationLog()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope.get("type")
        if kind == "http" and scope.get("method") == "POST" and scope.get("path") == LOOKUP_PATH:
            await self._lookup(scope, receive, send)
            return
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)  # lifespan
            return
        trusted = self._from_router(scope)
        policy = route_policy(str(scope.get("method", "GET")), str(scope.get("path", ""))) if kind == "http" else None
        if policy is None and not trusted:
            await self._refuse(scope, receive, send)
            return
        if policy not in (OPENAI, GENERATE):
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
        problem = check_request(parsed, self.classes, policy)
        if problem is not None:
            await _respond(send, 400, openai_error(f"{problem.field}: {problem.reason}", problem.field))
            return
        proven = False
        if isinstance(parsed, dict):
            if not trusted:
                demoted = demote_generate(parsed, self._lowest) if policy == GENERATE else demote(parsed, self._lowest)
                body = json.dumps(demoted).encode()
                scope = {**scope, "headers": _with_length(scope.get("headers") or [], len(body))}
            else:
                proven = self._watch_hand_off(scope)
                conversation = _header(scope, CONVERSATION_HEADER)
                if conversation:
                    self.conversations.record(conversation, time.monotonic())
        marker = _FROM_ROUTER.set(proven)
        try:
            await self.app(scope, _replay([body], None, receive), send)
        finally:
            _FROM_ROUTER.reset(marker)

    async def _lookup(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Which of the asked conversations this engine holds (the routers' question; see the module doc)."""
        if not self._from_router(scope):
            await _respond(send, 403, openai_error("only the pool's router may look up conversations", None, 403))
            return
        raw = bytearray()
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if len(raw) > MAX_BODY_BYTES:
                await _respond(send, 413, openai_error("lookup body too large", None, 413))
                return
            if not message.get("more_body"):
                break
        try:
            ids = json.loads(raw).get("ids")
        except (ValueError, AttributeError):
            ids = None
        if not isinstance(ids, list) or len(ids) > MAX_LOOKUP_IDS or not all(isinstance(i, str) for i in ids):
            await _respond(send, 400, openai_error(f"expected {{'ids': [at most {MAX_LOOKUP_IDS} strings]}}", "ids"))
            return
        body = json.dumps({"found": self.conversations.lookup(ids, time.monotonic())}).encode()
        await _respond(send, 200, body)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A route a caller without the router token may not use: 403 (a WebSocket is closed, policy violation)."""
        path = scope.get("path")
        if scope.get("type") == "websocket":
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1008, "reason": "the pool's router token is required"})
            return
        logger.info("refused %s %s: no router token", scope.get("method"), path)
        message = f"{scope.get('method')} {path} is served only through the pool's router"
        await _respond(send, 403, openai_error(message, None, 403))

    def _from_router(self, scope: Scope) -> bool:
        """The request carries the pool's router token (compared in constant time)."""
        if self.router_token is None and self._token_file is None:
            return True
        for key, value in scope.get("headers") or []:
            if key.lower() == ROUTER_TOKEN_HEADER.encode():
                sent = bytes(value).strip()
                if self._token_file is not None:
                    return self._token_file.accepts(sent)
                return hmac.compare_digest(sent, self.router_token or b"")
        return False

    def _watch_hand_off(self, scope: Scope) -> bool:
        """Wrap the engine client's hand-off to the engine core once; whether arrivals can preempt here.

        False when the engine has no safepoints, or when the API server has no engine client to wrap
        (then nothing raises the flag: losing a preemption is safe, raising it unchecked is not).
        """
        if self._board_for(scope) is None:
            return False
        if self._wrapped is None:
            state = getattr(scope.get("app"), "state", None)
            core: Any = getattr(getattr(state, "engine_client", None), "engine_core", None)
            hand_off = getattr(core, "add_request_async", None)
            if core is None or hand_off is None:
                logger.warning("coserve: the API server has no engine_core to wrap; arrivals will not preempt")
                self._wrapped = False
                return False

            async def add_request_async(request: Any) -> Any:
                result = await hand_off(request)
                if _FROM_ROUTER.get():
                    self.maybe_preempt(request)
                return result

            core.add_request_async = add_request_async
            self._wrapped = True
        return self._wrapped

    def maybe_preempt(self, request: Any) -> None:
        """Raise the abort flag if an accepted arrival would miss its deadline behind the running step.

        Called with the ``EngineCoreRequest`` vLLM has just handed to the engine core: the class and SLOs
        come from its ``extra_args`` and ``priority`` as the scheduler will read them, the prompt length is
        the tokenized one.
        """
        board = self._board
        if board is None:
            return
        step = board.posted_step()
        if step is None:
            return
        params = getattr(request, "sampling_params", None)
        try:
            cls, ttft_s, tpot_s = self.classes.resolve(getattr(params, "extra_args", None), request.priority)
        except InvalidRequestClass:
            return  # the scheduler serves it at the default class: nothing urgent
        now_s = time.time()
        prompt = getattr(request, "prompt_token_ids", None)
        arrival = SchedRequest(
            request_id=str(request.request_id),
            cls=cls,
            arrival_s=float(getattr(request, "arrival_time", 0.0) or now_s),
            ttft_slo_s=ttft_s,
            tpot_slo_s=tpot_s,
            num_prompt_tokens=max(1, len(prompt) if prompt is not None else 1),
            num_computed_tokens=0,
            num_output_tokens=0,
            max_output_tokens=1,
            is_running=False,
        )
        running = RunningStep(step.started_s, step.predicted_s, [step.min_rank], step.num_layers)
        if should_preempt(running, arrival, now_s, self.config.cost_model, self._offline_rank).preempt:
            board.request_abort(step.step_id)

    def _board_for(self, scope: Scope) -> SafepointBoard | None:
        if self._board is not None or self._board_checked:
            return self._board
        app = scope.get("app")
        vllm_config = getattr(getattr(app, "state", None), "vllm_config", None)
        transfer = getattr(vllm_config, "kv_transfer_config", None)
        if transfer is None or not configured(transfer):  # coserve's connector alone, or inside MultiConnector
            self._board_checked = True  # no safepoints in this engine
            return None
        self._board = SafepointBoard.attach(board_name(str(transfer.engine_id)))
        return self._board


def configured(kv_transfer_config: object) -> bool:
    """Whether a ``--kv-transfer-config`` loads coserve's connector, alone or inside MultiConnector (GPU pods)."""
    if kv_transfer_config is None:
        return False
    if getattr(kv_transfer_config, "kv_connector", None) == "CoServeConnector":
        return True
    extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
    children = extra.get("connectors") if isinstance(extra, dict) else None
    return any(isinstance(c, dict) and c.get("kv_connector") == "CoServeConnector" for c in children or ())


def _header(scope: Scope, name: str) -> str | None:
    """A request header's value (``name`` lower-case), or ``None``."""
    wanted = name.encode()
    for key, value in scope.get("headers") or []:
        if key.lower() == wanted:
            return bytes(value).decode("latin-1").strip() or None
    return None


def _with_length(headers: list[tuple[bytes, bytes]], length: int) -> list[tuple[bytes, bytes]]:
    """The request headers with ``content-length`` set to the rewritten body's."""
    kept = [(k, v) for k, v in headers if k.lower() != b"content-length"]
    return [*kept, (b"content-length", str(length).encode())]


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
