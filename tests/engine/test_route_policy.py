"""Default-deny at the engine: what a caller without the pool's router token may do on each of vLLM's routes.

The route table is read from vLLM's own API server app (``build_app``, no engine needed), so a route a
future vLLM adds fails ``test_every_vllm_route_is_decided`` until someone decides what such callers get.
The middleware runs as the real ASGI class in front of a recording app standing in for vLLM's handlers.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import pytest

from coserve.engine.validation import (
    GENERATE,
    OPEN,
    OPENAI,
    ROUTE_POLICY,
    ROUTER_TOKEN_HEADER,
    RequestClassValidator,
    route_policy,
)
from coserve.scheduling.config import load_engine_config

TOKEN = b"pool-router-token-123"
CONFIG = {
    "priorityClasses": [
        {"name": "interactive", "weight": 10, "ttftSloMs": 2000, "tpotSloMs": 200},
        {"name": "offline", "weight": 1, "ttftSloMs": 3600000, "tpotSloMs": 10000},
    ],
}

# Routes refused to callers without the token, each on purpose: they abort or cancel other callers' work,
# read stored responses, rescale the engine, expose KV event endpoints, or generate through a request
# format that cannot carry coserve's class (so they cannot be served at the lowest class).
REFUSED = {
    ("GET", "/kv_event_sources"),
    ("POST", "/inference/v1/abort_requests"),
    ("POST", "/scale_elastic_ep"),
    ("POST", "/is_scaling_elastic_ep"),
    ("GET", "/v1/responses/{response_id}"),
    ("POST", "/v1/responses/{response_id}/cancel"),
    ("POST", "/generative_scoring"),
    ("POST", "/v1/systemone"),
}


_LIST_ROUTES = """
import json, warnings
from vllm.entrypoints.launchers.app import build_app
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "m"])
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    app = build_app(args, ("generate",))
routes = []
for route in app.routes:
    path = getattr(route, "path", None)
    for method in getattr(route, "methods", None) or {"GET"}:  # /metrics is a mounted app: scraped by GET
        if path is not None and method != "HEAD":
            routes.append([method, path])
print(json.dumps(routes))
"""


def vllm_routes() -> set[tuple[str, str]]:
    """vLLM's API server routes, from its own ``build_app`` (no engine), in a process of its own: building the
    app configures logging process-wide, which would silence other tests' log capture."""
    done = subprocess.run([sys.executable, "-c", _LIST_ROUTES], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return {(method, path) for method, path in json.loads(done.stdout.strip().splitlines()[-1])}


def test_every_vllm_route_is_decided() -> None:
    routes = vllm_routes()
    undecided = routes - set(ROUTE_POLICY) - REFUSED
    assert not undecided, (
        f"routes of vLLM that the engine's validator does not decide for untrusted callers: {undecided}"
    )
    generating = {route for route, policy in ROUTE_POLICY.items() if policy in (OPENAI, GENERATE)}
    assert ("POST", "/inference/v1/generate") in generating and ("POST", "/v1/responses") in generating
    assert not (REFUSED & set(ROUTE_POLICY))
    assert route_policy("HEAD", "/health") == OPEN and route_policy("POST", "/inference/v1/abort_requests") is None


class Recorder:
    """Stands in for vLLM's handlers: records what reaches them and answers 200."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = b""
        if scope["type"] == "http":
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
        self.seen.append((scope["path"], json.loads(body) if body else None))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def call(
    method: str, path: str, body: dict[str, Any] | None = None, token: bytes | None = None
) -> tuple[int, Any, Recorder]:
    recorder = Recorder()
    validator = RequestClassValidator(recorder, load_engine_config_from(CONFIG), router_token=TOKEN)
    raw = json.dumps(body).encode() if body is not None else b""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    if token is not None:
        headers.append((ROUTER_TOKEN_HEADER.encode(), token))
    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    sent: list[dict[str, Any]] = []
    messages = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(validator(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    answer = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(answer) if answer else None, recorder


def load_engine_config_from(document: dict[str, Any]) -> Any:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(document, handle)
    return load_engine_config(handle.name, 2048)


CLAIMS = {"priority": -100, "kv_transfer_params": {"remote_host": "10.0.0.9", "remote_port": 5600}}


@pytest.mark.parametrize(
    "path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/invocations"]
)
def test_an_untrusted_caller_generates_only_at_the_lowest_class(path: str) -> None:
    body = {"model": "m", "input": "hi", **CLAIMS, "vllm_xargs": {"coserve_class": "interactive", "ttft_slo_ms": 1}}
    status, _, recorder = call("POST", path, body)
    assert status == 200
    ((_, seen),) = recorder.seen
    assert "priority" not in seen and "kv_transfer_params" not in seen
    assert seen["vllm_xargs"] == {"coserve_class": "offline"}


def test_the_token_in_token_out_route_is_demoted_too() -> None:
    body = {"token_ids": [1, 2], **CLAIMS, "sampling_params": {"max_tokens": 4, "priority": -5,
            "extra_args": {"coserve_class": "interactive", "tpot_slo_ms": 1,
                           "kv_transfer_params": {"x": 1}}}}  # fmt: skip
    status, _, recorder = call("POST", "/inference/v1/generate", body)
    assert status == 200
    ((_, seen),) = recorder.seen
    assert "priority" not in seen and "kv_transfer_params" not in seen
    assert seen["sampling_params"] == {"max_tokens": 4, "extra_args": {"coserve_class": "offline"}}


def test_a_bad_class_on_the_generate_route_is_a_400_naming_the_field() -> None:
    body = {"token_ids": [1], "sampling_params": {"extra_args": {"coserve_class": "gold"}}}
    status, answer, recorder = call("POST", "/inference/v1/generate", body, token=TOKEN)
    assert status == 400 and not recorder.seen
    assert "coserve_class" in answer["error"]["message"]


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/inference/v1/abort_requests"), ("POST", "/scale_elastic_ep"), ("GET", "/v1/responses/resp_1"),
     ("POST", "/generative_scoring"), ("POST", "/v2/something/new"), ("DELETE", "/v1/models")],
)  # fmt: skip
def test_an_untrusted_caller_is_refused_every_other_route(method: str, path: str) -> None:
    status, answer, recorder = call(method, path, {"request_ids": ["cmpl-1"]})
    assert status == 403 and not recorder.seen
    assert answer["error"]["code"] == 403 and "router" in answer["error"]["message"]


@pytest.mark.parametrize(("method", "path"), [("GET", "/metrics"), ("GET", "/health"), ("POST", "/tokenize")])
def test_reading_routes_stay_open(method: str, path: str) -> None:
    status, _, recorder = call(method, path, {"prompt": "hi"} if method == "POST" else None)
    assert status == 200 and len(recorder.seen) == 1


def test_the_router_reaches_every_route_untouched() -> None:
    body = {"model": "m", "prompt": [1], "priority": 1, "vllm_xargs": {"coserve_class": "interactive"}}
    status, _, recorder = call("POST", "/v1/completions", body, token=TOKEN)
    assert status == 200 and recorder.seen == [("/v1/completions", body)]
    status, _, recorder = call("POST", "/inference/v1/abort_requests", {"request_ids": ["a"]}, token=TOKEN)
    assert status == 200 and recorder.seen == [("/inference/v1/abort_requests", {"request_ids": ["a"]})]


def test_an_untrusted_websocket_is_closed() -> None:
    recorder = Recorder()
    validator = RequestClassValidator(recorder, load_engine_config_from(CONFIG), router_token=TOKEN)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "websocket.connect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(validator({"type": "websocket", "path": "/v1/realtime", "headers": []}, receive, send))
    assert sent == [{"type": "websocket.close", "code": 1008, "reason": "the pool's router token is required"}]
    assert not recorder.seen


WELL_FORMED = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [3, 4],
               "remote_engine_id": "p0", "remote_request_id": "r0", "remote_host": "10.0.0.7", "remote_port": 5600,
               "tp_size": 1}  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"vllm_xargs": {"kv_transfer_params": "boom"}}, "vllm_xargs.kv_transfer_params"),
        ("/v1/completions", {"vllm_xargs": {"ec_transfer_params": [1, 2]}}, "vllm_xargs.ec_transfer_params"),
        ("/v1/chat/completions", {"kv_transfer_params": "boom"}, "kv_transfer_params"),
        ("/v1/completions", {"kv_transfer_params": [1]}, "kv_transfer_params"),
        ("/v1/completions", {"kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params"),
        ("/v1/completions", {"kv_transfer_params": {**WELL_FORMED, "remote_port": "80"}},
         "kv_transfer_params.remote_port"),
        ("/v1/completions", {"kv_transfer_params": {**WELL_FORMED, "remote_block_ids": "0"}},
         "kv_transfer_params.remote_block_ids"),
        ("/v1/completions", {"kv_transfer_params": {"do_remote_decode": "yes"}}, "kv_transfer_params.do_remote_decode"),
        ("/inference/v1/generate", {"sampling_params": {"extra_args": {"kv_transfer_params": "boom"}}},
         "sampling_params.extra_args.kv_transfer_params"),
    ],
)  # fmt: skip
def test_a_malformed_engine_field_is_a_400_naming_it_even_from_the_router(
    path: str, body: dict[str, Any], param: str
) -> None:
    """Such a value would reach NixlConnector's scheduler side and kill the engine core (``params.get`` on a
    string, ``params["remote_host"]`` on a dict without it): answered here, before vLLM parses the request."""
    for token in (TOKEN, None):
        status, answer, recorder = call("POST", path, {"model": "m", "prompt": [1], **body}, token=token)
        assert status == 400 and not recorder.seen, (token, answer)
        assert answer["error"]["param"] == param and answer["error"]["code"] == 400


def test_well_formed_transfer_parameters_from_the_router_pass_untouched() -> None:
    body = {"model": "m", "prompt": [1], "kv_transfer_params": WELL_FORMED, "vllm_xargs": {"coserve_class": "offline"}}
    status, _, recorder = call("POST", "/v1/completions", body, token=TOKEN)
    assert status == 200 and recorder.seen == [("/v1/completions", body)]
    decode = {**body, "kv_transfer_params": {"do_remote_decode": True}}
    assert call("POST", "/v1/completions", decode, token=TOKEN)[0] == 200
