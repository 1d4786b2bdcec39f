"""What a request must be before it is placed: read, stripped of engine-internal fields, checked and classed.

Who calls it: ``coserve.router.app.Router.handle`` once per request to ``/v1/chat/completions`` or
``/v1/completions`` (``admit``), ``coserve.router.offline`` once per batch line (``drop_engine_fields``,
``check``, ``client_xargs``) and the batch routes of ``coserve.router.routes`` (``read_json``). Nothing here
sends a request upstream; every refusal is an OpenAI error body (``error_response``) naming the field.

In the order ``admit`` applies them:

1. the body is read, at most ``maxBodyBytes`` (413), and must be a JSON object (400);
2. it loses every engine-internal field a client set, at the top level, in ``vllm_xargs`` or in a literal
   ``extra_body`` (``coserve.kv.transfer_params``: with vLLM's NixlConnector they name the host, port and
   blocks a decoder pulls KV from) before anything else reads it:
   the only transfer parameters an engine sees are the router's own (the prefill's ``do_remote_decode``) or
   the prefiller's answer's;
3. it is checked (``check``: the model, 404 when it is not this pool's; the messages or prompt; ``stream``,
   ``max_tokens``, ``max_completion_tokens``, ``n``);
4. its class: what it asks for (``vllm_xargs.coserve_class``, ``priority``), capped at its tenant's
   (``Authorization: Bearer`` key in ``tenants``), with the class's ``ttft_slo_ms`` and ``tpot_slo_ms``
   (a client may relax them, never tighten them); its ``vllm_xargs`` lose every other ``coserve_*`` key, so
   the only one an engine sees is the router's class;
5. its conversation (``policy.conversation_id``; an empty or non-string id is a 400), read before the body's
   own ``conversation_id`` field is dropped.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.responses import JSONResponse, Response

from coserve.kv.transfer_params import strip_engine_fields
from coserve.router import fastjson
from coserve.router.config import RouterConfig
from coserve.router.policy import InvalidConversationId, conversation_id
from coserve.router.policy import resolve_class as class_for
from coserve.scheduling.requests import InvalidRequestClass, RequestClass

_SLO_KEYS = ("ttft_slo_ms", "tpot_slo_ms")


def error_response(status: int, message: str, param: str | None = None, kind: str | None = None) -> JSONResponse:
    """An OpenAI-style error body."""
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


class RequestBody(Protocol):
    """What the request handlers read: lower-case header lookup and the body's chunks (a Starlette
    ``Request`` or ``coserve.router.routes.RawRequest``)."""

    @property
    def headers(self) -> Mapping[str, str]: ...

    def stream(self) -> AsyncIterator[bytes]: ...


@dataclass(slots=True)
class Admitted:
    """A request ready to place: its body as engines get it, its conversation and its class."""

    body: dict[str, Any]
    conversation: str
    cls: RequestClass
    named: bool  # the client named the conversation (header or body field), rather than the router hashing it


async def read_json(request: RequestBody, limit: int) -> tuple[dict[str, Any] | None, Response | None]:
    """The body as a JSON object, or the error answer: 413 over ``limit`` bytes, 400 when it is no object."""
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


def drop_engine_fields(body: dict[str, Any]) -> None:
    """Remove what only the router may set from a client's request, wherever vLLM reads it
    (``coserve.kv.transfer_params``): with NixlConnector the transfer parameters name the host, port, engine
    and blocks a decoder pulls KV from (from a client: an SSRF, or a malformed value that kills the engine)."""
    strip_engine_fields(body)


def client_xargs(xargs: Mapping[str, Any]) -> dict[str, Any]:
    """A client's ``vllm_xargs`` without the ``coserve_*`` keys: the router sets the ones engines read."""
    return {key: value for key, value in xargs.items() if not key.lower().startswith("coserve_")}


def check(body: Mapping[str, Any], endpoint: str, model: str) -> Response | None:
    """The error answer for a body this pool cannot serve at ``endpoint``; None when it can."""
    name = body.get("model")
    if not isinstance(name, str):
        return error_response(400, "required: the model name (a string)", "model")
    if name != model:
        return error_response(
            404, f"the model {name!r} does not exist; this pool serves {model!r}", "model", kind="model_not_found"
        )
    problem = _check_messages(body) if endpoint == "chat" else _check_prompt(body)
    if problem is not None:
        return problem
    if "stream" in body and not isinstance(body["stream"], bool):
        return error_response(400, f"must be true or false, got {body['stream']!r}", "stream")
    for key in ("max_tokens", "max_completion_tokens", "n"):
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            return error_response(400, f"must be a positive integer, got {value!r}", key)
    return None


def _check_messages(body: Mapping[str, Any]) -> Response | None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return error_response(400, "required: a non-empty list of messages", "messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return error_response(400, "each message needs a role", f"messages[{index}].role")
    return None


def _check_prompt(body: Mapping[str, Any]) -> Response | None:
    prompt = body.get("prompt")
    if not isinstance(prompt, (str, list)) or not prompt:
        return error_response(400, "required: a prompt (text or token ids)", "prompt")
    return None


async def admit(request: RequestBody, endpoint: str, config: RouterConfig) -> Admitted | Response:
    """A client's request, read, checked and classed (the module's steps), or the error answer."""
    body, problem = await read_json(request, config.max_body_bytes)
    if body is None:
        return problem or error_response(400, "no body")
    drop_engine_fields(body)  # before anything else reads the body
    checked = check(body, endpoint, config.model)
    if checked is not None:
        return checked
    xargs = body.get("vllm_xargs") or {}
    if not isinstance(xargs, dict):
        return error_response(400, "must be an object", "vllm_xargs")
    cls = _request_class(request.headers, body, xargs, config)
    if not isinstance(cls, RequestClass):
        return cls
    try:
        conversation = conversation_id(request.headers, body)  # before the body's own field is dropped
    except InvalidConversationId as error:
        return error_response(400, error.reason, error.field)
    named = request.headers.get("x-conversation-id") is not None or body.get("conversation_id") is not None
    body.pop("priority", None)
    body.pop("conversation_id", None)
    slos = _slos(xargs, cls)
    if not isinstance(slos, dict):
        return slos
    body["vllm_xargs"] = {**client_xargs(xargs), "coserve_class": cls.name, **slos}
    return Admitted(body, conversation, cls, named)


def _request_class(
    headers: Mapping[str, str], body: Mapping[str, Any], xargs: Mapping[str, Any], config: RouterConfig
) -> RequestClass | Response:
    """The class a request asks for (``vllm_xargs.coserve_class``, ``priority``), capped at its tenant's."""
    token = headers.get("authorization") or ""
    key = token[7:].strip() if token.lower().startswith("bearer ") else None
    tenant = config.tenants.get(key) if key else None
    if tenant is None:
        tenant = config.anonymous_class or config.classes.default.name
    asked = xargs.get("coserve_class")
    priority = body.get("priority")
    if asked is not None and not isinstance(asked, str):
        return error_response(400, f"must be a class name, got {asked!r}", "vllm_xargs.coserve_class")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        return error_response(400, f"must be an integer, got {priority!r}", "priority")
    try:
        return class_for(config.classes, tenant, asked, priority)
    except InvalidRequestClass as error:
        return error_response(400, str(error), "vllm_xargs.coserve_class")


def _slos(xargs: Mapping[str, Any], cls: RequestClass) -> dict[str, float] | Response:
    """The SLOs forwarded in ``vllm_xargs``: the class's, or a client's looser ones."""
    slos = {}
    for key, floor_ms in zip(_SLO_KEYS, (cls.ttft_slo_s * 1000, cls.tpot_slo_s * 1000), strict=True):
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
    return slos


def lowest_class(config: RouterConfig) -> RequestClass:
    """The class offline batch lines run at: the lowest rank configured."""
    return max((config.classes.get(n) for n in config.classes.names), key=lambda c: c.rank)
