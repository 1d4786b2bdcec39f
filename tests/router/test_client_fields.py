"""What a client may name in a request, over real HTTP in front of scripted fake engines.

Engine-internal fields are the router's alone: a client's ``kv_transfer_params`` (with vLLM's
NixlConnector they name the host, port and blocks a decoder pulls KV from) and ``coserve_*`` keys in
``vllm_xargs`` never reach an engine; the only transfer parameters an engine sees are the ones the
router creates for the prefill or copies from the prefiller's answer. Conversation ids are bounded
and canonical: the same bytes give the same id on the router and on the engine's ConversationLog.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from coserve.router.app import Router, build_app
from coserve.router.config import RouterConfig, parse_router_config
from epp_gateway import Gateway, Picker
from router_served import MODEL, Served
from scripted_engine import ScriptedEngine

EVIL = {"remote_host": "169.254.169.254", "remote_port": 80, "remote_engine_id": "evil", "remote_block_ids": [0]}
PREFILLED = {"remote_host": "10.0.0.7", "remote_port": 5600, "remote_engine_id": "p0", "remote_block_ids": [3, 4],
             "remote_request_id": "p0-r1",
             "do_remote_prefill": True}  # fmt: skip
CLIENT_XARGS = {"coserve_from_router": True, "coserve_board": "board-x", "COSERVE_CLASS_OVERRIDE": "interactive",
                "repetition_window": 4}  # fmt: skip
ROUTER_XARGS = {"coserve_class", "ttft_slo_ms", "tpot_slo_ms"}


@pytest.fixture(params=["router", "gateway"])
def pool(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """The pool's front: coserve's router, or a real Envoy whose endpoint picker is coserve's (``gateway``):
    every request shape here holds for both."""
    prefiller = ScriptedEngine("p")
    prefiller.answer_kv_params = PREFILLED
    decoder = ScriptedEngine("d", conversations=True)
    config = parse_router_config(
        {"model": MODEL, "prefillers": [prefiller.url], "decoders": [decoder.url], "kvTransferParams": True,
         "pollS": 0.05}
    )  # fmt: skip
    fronts: list[Any] = []
    try:
        if request.param == "router":
            fronts.append(Served(build_app(config)))
            url = fronts[0].url
        else:
            fronts.append(Picker(config))
            fronts.insert(0, Gateway(fronts[0].port))
            url = fronts[0].url
        yield {"router": url, "prefiller": prefiller, "decoder": decoder, "config": config}
    finally:
        for front in fronts:
            front.stop()
        prefiller.stop()
        decoder.stop()


def post(base: str, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=10, **kwargs)


def assert_no_client_fields(engine: ScriptedEngine) -> None:
    for request in engine.requests:
        assert "169.254.169.254" not in json.dumps(request) and "ec_transfer_params" not in request
        xargs = request.get("vllm_xargs") or {}
        assert {k for k in xargs if k.lower().startswith("coserve_")} <= {"coserve_class"}
        assert xargs.get("repetition_window") == 4  # a client's other xargs pass


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_clients_transfer_parameters_never_reach_an_engine_and_the_prefillers_do(
    pool: dict[str, Any], endpoint: str
) -> None:
    prefiller, decoder = pool["prefiller"], pool["decoder"]
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    turn1: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "kv_transfer_params": EVIL,
                             "ec_transfer_params": EVIL, "vllm_xargs": CLIENT_XARGS}  # fmt: skip
    if endpoint == "chat":
        turn1["messages"] = [{"role": "user", "content": "hi"}]
    else:
        turn1["prompt"] = "hi"
    headers = {"x-conversation-id": f"fields-{endpoint}"}
    assert post(pool["router"], path, turn1, headers=headers).status_code == 200
    # the prefill carries the router's own request for a remote decode, nothing of the client's
    assert prefiller.requests[-1]["kv_transfer_params"] == {"do_remote_decode": True}
    # the decoder pulls from where the prefiller says, not where the client said
    assert decoder.requests[-1]["kv_transfer_params"] == PREFILLED
    assert set(decoder.requests[-1]["vllm_xargs"]) == ROUTER_XARGS | {"repetition_window"}
    # turn 2 goes straight to the pinned decoder: no transfer parameters at all
    turn2 = {**turn1, "stream": True}
    with httpx.stream("POST", f"{pool['router']}{path}", json=turn2, headers=headers, timeout=10) as response:
        assert response.status_code == 200
        response.read()
    assert len(prefiller.requests) == 1 and len(decoder.requests) == 2
    assert "kv_transfer_params" not in decoder.requests[-1]
    assert_no_client_fields(prefiller)
    assert_no_client_fields(decoder)


def test_without_transfer_parameters_configured_a_prefill_carries_none() -> None:
    prefiller, decoder = ScriptedEngine("p"), ScriptedEngine("d")
    config = parse_router_config({"model": MODEL, "prefillers": [prefiller.url], "decoders": [decoder.url]})
    router = Served(build_app(config))
    try:
        body = {"model": MODEL, "prompt": "hi", "kv_transfer_params": EVIL, "vllm_xargs": CLIENT_XARGS}
        assert post(router.url, "/v1/completions", body).status_code == 200
        assert "kv_transfer_params" not in prefiller.requests[-1]
        assert "kv_transfer_params" not in decoder.requests[-1]
        assert_no_client_fields(decoder)
    finally:
        router.stop()
        prefiller.stop()
        decoder.stop()


@pytest.mark.parametrize(
    "nested",
    [{"vllm_xargs": {**CLIENT_XARGS, "kv_transfer_params": "boom", "ec_transfer_params": [1]}},
     {"vllm_xargs": {**CLIENT_XARGS, "kv_transfer_params": ["169.254.169.254", 80]}},
     {"vllm_xargs": CLIENT_XARGS, "extra_body": {"kv_transfer_params": EVIL, "top_k": 3}}],
)  # fmt: skip
def test_nested_engine_fields_never_reach_an_engine(pool: dict[str, Any], nested: dict[str, Any]) -> None:
    """vLLM copies ``vllm_xargs`` into the request's extra args, where the engine core reads its transfer
    parameters: a string there would reach NixlConnector and kill the decoder's engine core."""
    prefiller, decoder = pool["prefiller"], pool["decoder"]
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, **nested}
    headers = {"x-conversation-id": "nested"}
    for _ in range(2):  # turn 1 through the prefiller, turn 2 straight to the pinned decoder
        assert post(pool["router"], "/v1/completions", body, headers=headers).status_code == 200
    status, _ = run_offline(pool["config"], "completions", {**body, "conversation_id": "nested-batch"})
    assert status == 200
    for engine in (prefiller, decoder):
        for request in engine.requests:
            for inner in (request.get("vllm_xargs") or {}, request.get("extra_body") or {}):
                assert "kv_transfer_params" not in inner and "ec_transfer_params" not in inner, request
    assert decoder.requests[-1]["vllm_xargs"]["repetition_window"] == 4
    assert_no_client_fields(decoder)


def run_offline(config: RouterConfig, endpoint: str, body: dict[str, Any]) -> tuple[int, bytes]:
    async def one() -> tuple[int, bytes]:
        router = Router(config)
        try:
            return await router.run_offline(endpoint, body)
        finally:
            await router.close()

    return asyncio.run(one())


def test_offline_batch_lines_lose_the_clients_transfer_parameters_too(pool: dict[str, Any]) -> None:
    prefiller, decoder = pool["prefiller"], pool["decoder"]
    line = {"model": MODEL, "prompt": "a batch line", "kv_transfer_params": EVIL, "vllm_xargs": CLIENT_XARGS}
    status, _ = run_offline(pool["config"], "completions", line)
    assert status == 200
    assert prefiller.requests[-1]["kv_transfer_params"] == {"do_remote_decode": True}
    assert decoder.requests[-1]["kv_transfer_params"] == PREFILLED
    assert decoder.requests[-1]["vllm_xargs"]["coserve_class"] == "offline"
    assert_no_client_fields(prefiller)
    assert_no_client_fields(decoder)
    status, answer = run_offline(pool["config"], "completions", {"model": MODEL, "prompt": "x", "conversation_id": 7})
    assert status == 400 and json.loads(answer)["error"]["param"] == "conversation_id"


# -- conversation ids ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "extra", "param"),
    [
        ({}, {"conversation_id": 42}, "conversation_id"),
        ({}, {"conversation_id": ["a"]}, "conversation_id"),
        ({}, {"conversation_id": {"id": "a"}}, "conversation_id"),
        ({}, {"conversation_id": True}, "conversation_id"),
        ({}, {"conversation_id": ""}, "conversation_id"),
        ({"x-conversation-id": ""}, {}, "x-conversation-id"),
    ],
)
def test_a_conversation_id_that_is_not_a_non_empty_string_is_a_400(
    pool: dict[str, Any], headers: dict[str, str], extra: dict[str, Any], param: str
) -> None:
    response = post(pool["router"], "/v1/completions", {"model": MODEL, "prompt": "x", **extra}, headers=headers)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == 400 and param in error["message"]
    assert not pool["decoder"].requests


def sha(raw: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw).hexdigest()


@pytest.mark.parametrize(
    ("given", "sent"),
    [
        ("plain-id_1.2:3", "plain-id_1.2:3"),
        ("a" * 256, "a" * 256),
        ("a" * 257, sha(b"a" * 257)),
        ("line\nbreak", sha(b"line\nbreak")),
        ("tab\there", sha(b"tab\there")),
        ("caf\u00e9 \u2615", sha("caf\u00e9 \u2615".encode())),
        ("x" * 100_000, sha(b"x" * 100_000)),
    ],
)
def test_body_conversation_ids_reach_the_decoder_bounded_and_canonical(
    pool: dict[str, Any], given: str, sent: str
) -> None:
    body = {"model": MODEL, "prompt": "hi", "conversation_id": given}
    response = post(pool["router"], "/v1/completions", body)
    assert response.status_code == 200, response.text
    assert pool["decoder"].headers[-1]["x-coserve-conversation"] == sent
    assert "conversation_id" not in pool["decoder"].requests[-1]


def test_the_same_bytes_in_the_header_or_the_body_name_the_same_conversation(pool: dict[str, Any]) -> None:
    name = "caf\u00e9 \u2615"
    post(pool["router"], "/v1/completions", {"model": MODEL, "prompt": "a", "conversation_id": name})
    post(pool["router"], "/v1/completions", {"model": MODEL, "prompt": "b"},
         headers={"x-conversation-id": name.encode()})  # fmt: skip
    sent = [h["x-coserve-conversation"] for h in pool["decoder"].headers]
    assert sent == [sha(name.encode())] * 2


def test_a_non_ascii_conversation_is_found_by_another_router_replica() -> None:
    """Replica A places turn 1; replica B, which holds no pin, asks the decoders (their real coserve
    middleware and ConversationLog) and must find the decoder A chose, although B alone would pick the
    other one now."""
    decoders = [ScriptedEngine("d0", kv_usage=0.6, conversations=True),
                ScriptedEngine("d1", kv_usage=0.2, conversations=True)]  # fmt: skip
    config = parse_router_config({"model": MODEL, "decoders": [d.url for d in decoders], "pollS": 0.05})
    b_app = build_app(config)
    a, b = Served(build_app(config)), Served(b_app)
    try:
        name = "\u4f1a\u8bdd-" + "\u00e9" * 10
        turn = {"model": MODEL, "prompt": "turn 1", "conversation_id": name}
        assert post(a.url, "/v1/completions", turn).json()["choices"][0]["text"] == "d1"
        decoders[0].kv_usage, decoders[1].kv_usage = 0.1, 0.8
        b_router = b_app.router
        deadline = time.monotonic() + 10
        while b_router.decoders[decoders[1].url].kv_usage != 0.8:  # B has polled the new loads
            assert time.monotonic() < deadline
            time.sleep(0.02)
        again = post(b.url, "/v1/completions", {**turn, "prompt": "turn 2"})
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == "d1"
        assert "coserve_router_found_conversations_total 1.0" in httpx.get(f"{b.url}/metrics").text
    finally:
        a.stop()
        b.stop()
        for decoder in decoders:
            decoder.stop()


def test_numbers_json_reads_but_orjson_does_not_reach_the_decoder_as_they_came(pool: dict[str, Any]) -> None:
    """The router reads and writes bodies with orjson where that is json's result (coserve.router.fastjson):
    a client's NaN, Infinity and integers beyond 64 bits still go on as json sent them."""
    raw = (
        b'{"model": "%s", "prompt": "hi", "max_tokens": 2, "temperature": NaN, "top_p": 1e400, '
        b'"seed": 123456789012345678901234567890}'
    ) % MODEL.encode()
    answer = httpx.post(f"{pool['router']}/v1/completions", content=raw, timeout=10,
                        headers={"content-type": "application/json", "x-conversation-id": "numbers"})  # fmt: skip
    assert answer.status_code == 200, answer.text
    sent = pool["decoder"].requests[-1]
    assert sent["temperature"] != sent["temperature"]  # NaN
    assert sent["top_p"] == float("inf")
    assert sent["seed"] == 123456789012345678901234567890
