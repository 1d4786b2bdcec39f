"""The engine's ConversationLog (which conversations this decoder holds) and its lookup endpoint."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from coserve.engine.conversations import ConversationLog
from coserve.engine.validation import CONVERSATION_HEADER, LOOKUP_PATH, ROUTER_TOKEN_HEADER, RequestClassValidator
from coserve.scheduling.config import load_engine_config


def test_a_conversation_is_held_until_idle_for_the_ttl() -> None:
    log = ConversationLog(ttl_s=10, max_entries=100)
    log.record("a", 0.0)
    log.record("b", 1.0)
    log.record("a", 5.0)
    assert log.lookup(["a", "b", "c"], 6.0) == {
        "a": {"age_s": 6.0, "idle_s": 1.0, "turns": 2},
        "b": {"age_s": 5.0, "idle_s": 5.0, "turns": 1},
    }
    assert list(log.lookup(["a", "b"], 11.5)) == ["a"]  # b idle 10.5 s: gone
    assert len(log) == 1


def test_the_log_is_bounded_least_recently_served_first_out() -> None:
    log = ConversationLog(ttl_s=100, max_entries=2)
    for index, name in enumerate(["a", "b", "a", "c"]):
        log.record(name, float(index))
    assert set(log.lookup(["a", "b", "c"], 4.0)) == {"a", "c"}


def middleware(tmp_path: Path, token: bytes | None) -> RequestClassValidator:
    path = tmp_path / "engine.json"
    path.write_text(json.dumps({}))

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    return RequestClassValidator(app, load_engine_config(str(path), 256), router_token=token)


def call(app: RequestClassValidator, path: str, body: Any, headers: dict[str, str]) -> tuple[int, Any]:
    raw = json.dumps(body).encode()
    scope = {"type": "http", "method": "POST", "path": path,
             "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}  # fmt: skip
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = int(sent[0]["status"])
    return status, json.loads(sent[1]["body"]) if status != 200 or path == LOOKUP_PATH else None


@pytest.mark.parametrize("token", [None, b"secret"], ids=["local", "with-token"])
def test_routed_turns_are_recorded_and_the_router_can_ask(tmp_path: Path, token: bytes | None) -> None:
    app = middleware(tmp_path, token)
    proof = {ROUTER_TOKEN_HEADER: token.decode()} if token else {}
    completion = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1}
    assert call(app, "/v1/completions", completion, {**proof, CONVERSATION_HEADER: "conv-1"})[0] == 200
    assert call(app, "/v1/completions", completion, {**proof, CONVERSATION_HEADER: "conv-1"})[0] == 200
    status, answer = call(app, LOOKUP_PATH, {"ids": ["conv-1", "conv-2"]}, proof)
    assert status == 200 and set(answer["found"]) == {"conv-1"} and answer["found"]["conv-1"]["turns"] == 2


def test_without_the_router_token_nothing_is_recorded_and_nothing_answered(tmp_path: Path) -> None:
    app = middleware(tmp_path, b"secret")
    completion = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 1}
    assert call(app, "/v1/completions", completion, {CONVERSATION_HEADER: "conv-9"})[0] == 200  # served, demoted
    assert call(app, LOOKUP_PATH, {"ids": ["conv-9"]}, {})[0] == 403
    status, answer = call(app, LOOKUP_PATH, {"ids": ["conv-9"]}, {ROUTER_TOKEN_HEADER: "secret"})
    assert status == 200 and answer["found"] == {}  # the direct client's claim was not recorded


def test_a_malformed_lookup_is_a_400_naming_the_field(tmp_path: Path) -> None:
    app = middleware(tmp_path, None)
    status, answer = call(app, LOOKUP_PATH, {"ids": "conv-1"}, {})
    assert status == 400 and answer["error"]["param"] == "ids"
