"""A decoder that fails a forwarded request, over real HTTP in front of scripted fake engines.

One 502/503/504 (or a refused connection) is not a lost decoder: the request is retried once on
another decoder and only its own conversation is re-pinned; the decoder's other conversations stay
pinned. Its pins are dropped only after ``pinDropFailures`` failures in a row within
``pinDropWindowS`` (or when it leaves its Service), and a success resets the count.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from coserve.router.app import Router, build_app
from coserve.router.config import parse_router_config
from router_served import MODEL, Served
from scripted_engine import ScriptedEngine, event


@pytest.fixture
def pool() -> Iterator[dict[str, Any]]:
    busy, light = ScriptedEngine("d0", kv_usage=0.6), ScriptedEngine("d1", kv_usage=0.2)
    config = parse_router_config({"model": MODEL, "decoders": [busy.url, light.url], "pollS": 1.0})
    app = build_app(config)
    router = Served(app)
    try:
        yield {"router": router.url, "state": app.router, "busy": busy, "light": light}
    finally:
        router.stop()
        busy.stop()
        light.stop()


def turn(base: str, conversation: str) -> str:
    response = httpx.post(
        f"{base}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
        headers={"x-conversation-id": conversation}, timeout=10,
    )  # fmt: skip
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def pinned(state: Router, url: str) -> int:
    return state.pins.per_decoder().get(url, 0)


@pytest.mark.parametrize("status", [502, 503, 504])
def test_one_failed_forward_re_places_that_conversation_only(pool: dict[str, Any], status: int) -> None:
    state, busy, light = pool["state"], pool["busy"], pool["light"]
    for name in ("a", "b", "c"):
        assert turn(pool["router"], name) == "d1"  # the emptier decoder
    light.fail_next, light.fail_status = 1, status
    assert turn(pool["router"], "a") == "d0"  # retried once elsewhere, not lost
    assert state.pins.get("a", state.clock()).decoder == busy.url  # re-pinned: this conversation only
    assert pinned(state, light.url) == 2  # b and c keep their decoder and its KV
    assert state.decoders[light.url].healthy
    assert turn(pool["router"], "b") == "d1" and turn(pool["router"], "c") == "d1"
    assert "coserve_router_replacements_total 1.0" in httpx.get(f"{pool['router']}/metrics").text


def test_pins_are_dropped_after_failures_in_a_row_and_a_success_resets_the_count(pool: dict[str, Any]) -> None:
    state, light = pool["state"], pool["light"]
    names = [f"c{i}" for i in range(6)]
    for name in names:
        assert turn(pool["router"], name) == "d1"
    light.fail_next = 2
    assert [turn(pool["router"], n) for n in names[:2]] == ["d0", "d0"]  # two failures in a row
    assert turn(pool["router"], names[2]) == "d1"  # a success: the count starts again
    light.fail_next = 2
    assert [turn(pool["router"], n) for n in names[3:5]] == ["d0", "d0"]
    assert pinned(state, light.url) == 2  # c2 and c5: two failures since the success are not a loss
    light.fail_next = 1
    assert turn(pool["router"], names[2]) == "d0"  # the third failure in a row: the decoder is lost
    assert pinned(state, light.url) == 0
    assert state.pins.get(names[5], state.clock()) is None  # its next turn is placed anew


def test_the_failure_threshold_and_window_are_configurable() -> None:
    config = parse_router_config(
        {"model": MODEL, "decoders": ["http://127.0.0.1:9"], "pinDropFailures": 1, "pinDropWindowS": 5}
    )
    assert (config.pin_drop_failures, config.pin_drop_window_s) == (1, 5.0)
    default = parse_router_config({"model": MODEL, "decoders": ["http://127.0.0.1:9"]})
    assert (default.pin_drop_failures, default.pin_drop_window_s) == (3, 30.0)


# --- a stream that fails before its first token ------------------------------------------------------------------

# what vLLM's OpenAI server streams when a request fails inside the engine after it answered 200 (its
# create_streaming_error_response: an ErrorResponse, then [DONE]), e.g. a KV load that failed under
# kv_load_failure_policy 'fail'
VLLM_INTERNAL_ERROR = event(
    {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}}
)
DONE = b"data: [DONE]\n\n"


def streamed_texts(base: str, conversation: str) -> list[str]:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}
    with httpx.Client(timeout=10) as client, client.stream(
        "POST", f"{base}/v1/completions", json=body, headers={"x-conversation-id": conversation}
    ) as response:  # fmt: skip
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    return [str(json.loads(line[6:]).get("choices", [{}])[0].get("text", json.loads(line[6:]))) for line in lines]


@pytest.mark.parametrize(
    "parts",
    [[VLLM_INTERNAL_ERROR, DONE], [event({"error": {"message": "engine dead"}}), DONE], [DONE], []],
    ids=["vllm-internal-error", "error-without-code", "done-only", "empty"],
)  # fmt: skip
def test_a_stream_that_fails_before_its_first_token_is_retried_on_another_decoder(
    pool: dict[str, Any], parts: list[bytes]
) -> None:
    """Nothing reached the client yet, so the turn goes to another decoder instead of ending without a token."""
    state, busy, light = pool["state"], pool["busy"], pool["light"]
    light.stream_parts = parts
    assert streamed_texts(pool["router"], "a") == ["d00", "d01", "d02"]  # the other decoder's answer, whole
    assert len(light.requests) == 1 and len(busy.requests) == 1
    assert state.pins.get("a", state.clock()).decoder == busy.url  # re-pinned where it was answered


def test_a_client_error_streamed_first_is_the_clients_answer_not_retried(pool: dict[str, Any]) -> None:
    """A 4xx error would fail on any decoder: it goes to the client as it came."""
    pool["light"].stream_parts = [event({"error": {"message": "bad logprobs", "code": 400}}), DONE]
    texts = streamed_texts(pool["router"], "a")
    assert texts == ["{'error': {'message': 'bad logprobs', 'code': 400}}"]
    assert pool["busy"].requests == []
