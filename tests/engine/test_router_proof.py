"""Only the pool's router may claim a class and trigger preemption (coserve.engine.validation).

The middleware runs here as the real ASGI class in front of a recording app that plays vLLM's API server:
it accepts a request by handing an ``EngineCoreRequest``-shaped object to ``engine_client.engine_core
.add_request_async`` (as vLLM does once it has tokenized and admitted it) or rejects it with a 400 without
the hand-off. The safepoint board is a stand-in (the board itself is shared memory written by a running
engine's scheduler; the real board, the real hand-off and a real rejection run in test_render_parity.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from coserve.engine.safepoint import PostedStep
from coserve.engine.validation import ROUTER_TOKEN_HEADER, RequestClassValidator, demote, load_router_token
from coserve.scheduling.config import load_engine_config

CONFIG = {
    "priorityClasses": [
        {"name": "interactive", "weight": 10, "ttftSloMs": 2000, "tpotSloMs": 200},
        {"name": "standard", "weight": 3, "ttftSloMs": 10000, "tpotSloMs": 500},
        {"name": "offline", "weight": 1, "ttftSloMs": 3600000, "tpotSloMs": 10000},
    ],
    "offline": {"enabled": True, "className": "offline", "share": 0.5},
    "costModel": {"k1": 2e-3, "k2": 0.0, "k3": 0.0, "k4": 0.0, "k5": 0.001},
}
TOKEN = b"pool-router-token-123"
URGENT = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, "priority": 0,
          "vllm_xargs": {"coserve_class": "interactive", "ttft_slo_ms": 1}}  # fmt: skip


class Board:
    """Stand-in for the safepoint board: an offline step is in flight; aborts are recorded."""

    def __init__(self) -> None:
        self.aborts: list[int] = []

    def posted_step(self) -> PostedStep:
        return PostedStep(step_id=7, started_s=time.time(), predicted_s=0.5, min_rank=2, num_layers=16)

    def request_abort(self, step_id: int) -> None:
        self.aborts.append(step_id)


class EngineCore:
    """Stand-in for the API server's engine-core client: records the requests handed to it."""

    def __init__(self) -> None:
        self.handed: list[Any] = []

    async def add_request_async(self, request: Any) -> None:
        self.handed.append(request)


MAX_PROMPT = 100  # the stand-in API server rejects longer prompts, as vLLM does past max_model_len


def vllm_app(seen: list[dict[str, Any]]) -> Any:
    """An ASGI app that accepts or rejects a completion as vLLM's API server would, handing accepted ones over."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        headers = dict(scope["headers"])
        body = json.loads(message["body"])
        seen.append({"body": body, "length": int(headers[b"content-length"])})
        if len(body["prompt"]) > MAX_PROMPT:
            await send({"type": "http.response.start", "status": 400, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        request = SimpleNamespace(
            request_id=f"cmpl-{len(seen)}",
            prompt_token_ids=body["prompt"],
            sampling_params=SimpleNamespace(extra_args=body.get("vllm_xargs")),
            priority=body.get("priority") or 0,
            arrival_time=time.time(),
        )
        await scope["app"].state.engine_client.engine_core.add_request_async(request)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    return app


def validator(tmp_path: Path, token: bytes | None) -> tuple[RequestClassValidator, Board, list[dict[str, Any]]]:
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(CONFIG))
    seen: list[dict[str, Any]] = []
    middleware = RequestClassValidator(vllm_app(seen), load_engine_config(str(path), 256), router_token=token)
    global SERVER  # a fresh API server per middleware: each wraps the hand-off of the first it serves
    SERVER = api_server()
    board = Board()
    middleware._board, middleware._board_checked = board, True  # type: ignore[assignment]
    return middleware, board, seen


def api_server() -> Any:
    """What the middleware finds at ``scope["app"]``: vLLM's app with ``state.engine_client.engine_core``."""
    return SimpleNamespace(state=SimpleNamespace(engine_client=SimpleNamespace(engine_core=EngineCore())))


SERVER = api_server()


def call(
    middleware: RequestClassValidator, body: dict[str, Any], proof: bytes | None = None, server: Any = None
) -> int:
    raw = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    if proof is not None:
        headers.append((ROUTER_TOKEN_HEADER.encode(), proof))
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers, "app": server or SERVER}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(middleware(scope, receive, send))
    return int(sent[0]["status"])


@pytest.mark.parametrize("proof", [None, b"", b"wrong-token", TOKEN + b"x"], ids=["none", "empty", "wrong", "longer"])
def test_a_direct_client_claiming_the_top_class_cannot_raise_the_flag(tmp_path: Path, proof: bytes | None) -> None:
    middleware, board, seen = validator(tmp_path, TOKEN)
    assert call(middleware, URGENT, proof) == 200
    assert board.aborts == []  # never stalls another class's step
    served = seen[0]["body"]
    # served at the lowest class, with that class's own SLOs and no priority: it cannot jump the queue either
    assert served["vllm_xargs"] == {"coserve_class": "offline"}
    assert "priority" not in served and served["prompt"] == URGENT["prompt"]
    assert seen[0]["length"] == len(json.dumps(served).encode())


def test_the_router_can(tmp_path: Path) -> None:
    middleware, board, seen = validator(tmp_path, TOKEN)
    assert call(middleware, URGENT, TOKEN) == 200
    assert board.aborts == [7]
    assert seen[0]["body"] == URGENT  # untouched


def test_a_request_vllm_rejects_never_raises_the_flag(tmp_path: Path) -> None:
    """The router's token is not enough: the flag goes up only once vLLM has accepted the request."""
    middleware, board, seen = validator(tmp_path, TOKEN)
    assert call(middleware, {**URGENT, "prompt": [1] * (MAX_PROMPT + 1)}, TOKEN) == 400
    assert len(seen) == 1 and board.aborts == []  # vLLM saw it and said no: nothing was stalled
    assert call(middleware, URGENT, TOKEN) == 200
    assert board.aborts == [7]  # the same middleware, an accepted request: the flag goes up


def test_a_hand_off_outside_a_routed_request_never_raises_the_flag(tmp_path: Path) -> None:
    """The wrapped hand-off serves every request of the API server; only the router's arrivals may preempt."""
    middleware, board, _ = validator(tmp_path, TOKEN)
    server = api_server()
    assert call(middleware, URGENT, b"wrong", server) == 200  # demoted: handed over, no flag
    core = server.state.engine_client.engine_core
    request = SimpleNamespace(request_id="x", prompt_token_ids=[1], sampling_params=None, priority=0, arrival_time=0)
    asyncio.run(core.add_request_async(request))  # e.g. a request from another entry point
    assert board.aborts == []
    assert call(middleware, URGENT, TOKEN, server) == 200
    assert board.aborts == [7]


def test_without_an_engine_client_to_wrap_nothing_preempts(tmp_path: Path) -> None:
    """An API server the middleware cannot hook still serves; it just never preempts (safe, and logged)."""
    middleware, board, seen = validator(tmp_path, TOKEN)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        seen.append({})
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    middleware.app = app
    assert call(middleware, URGENT, TOKEN, SimpleNamespace(state=SimpleNamespace())) == 200
    assert seen and board.aborts == []


def test_without_a_mounted_token_every_request_is_trusted(tmp_path: Path) -> None:
    middleware, board, seen = validator(tmp_path, None)
    assert call(middleware, URGENT) == 200
    assert board.aborts == [7] and seen[0]["body"] == URGENT


def test_a_bad_class_is_still_a_400_before_any_proof_is_judged(tmp_path: Path) -> None:
    middleware, board, seen = validator(tmp_path, TOKEN)
    assert call(middleware, {**URGENT, "vllm_xargs": {"coserve_class": "nope"}}) == 400
    assert board.aborts == [] and seen == []


def test_a_token_file_that_is_set_must_be_readable_and_not_empty(tmp_path: Path) -> None:
    assert load_router_token(None) is None
    with pytest.raises(ValueError, match="cannot read"):
        load_router_token(str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        load_router_token(str(tmp_path / "empty"))
    (tmp_path / "token").write_text(TOKEN.decode() + "\n")
    assert load_router_token(str(tmp_path / "token")) == TOKEN


def test_demote_keeps_everything_but_the_class_claims() -> None:
    body = {"prompt": "x", "priority": -5, "vllm_xargs": {"coserve_class": "interactive", "tpot_slo_ms": 5, "k": 1}}
    assert demote(body, "offline") == {"prompt": "x", "vllm_xargs": {"k": 1, "coserve_class": "offline"}}
    assert demote({"prompt": "x"}, "offline") == {"prompt": "x", "vllm_xargs": {"coserve_class": "offline"}}


def test_the_engine_follows_a_rotated_token_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator regenerates an emptied token; the kubelet swaps the mounted file: no engine restart."""
    token_file = tmp_path / "token"
    token_file.write_bytes(b"first-token")
    monkeypatch.setenv("COSERVE_ROUTER_TOKEN_FILE", str(token_file))
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(CONFIG))
    middleware = RequestClassValidator(vllm_app([]), load_engine_config(str(path), 256))
    now = [0.0]
    assert middleware._token_file is not None
    middleware._token_file._clock = lambda: now[0]  # the file's clock, not the wall's: no sleeps
    middleware._token_file._checked = 0.0

    def trusted(token: bytes) -> bool:
        return middleware._from_router({"headers": [(ROUTER_TOKEN_HEADER.encode(), token)]})

    assert trusted(b"first-token") and not trusted(b"second-token")
    fresh = tmp_path / "token.new"
    fresh.write_bytes(b"second-token")
    fresh.replace(token_file)
    now[0] = 5.0
    assert trusted(b"second-token") and trusted(b"first-token")  # the old one for its grace
    now[0] = 500.0
    assert trusted(b"second-token") and not trusted(b"first-token")
