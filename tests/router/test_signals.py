"""The router's discovery, prefiller deadlines and the workload signals the autoscaler reads, over real HTTP
in front of fast fake engines (test doubles for vLLM's OpenAI server, as in test_app.py)."""

from __future__ import annotations

import socket
import time
from typing import Any

import httpx
import pytest

from coserve.router.app import build_app
from coserve.router.config import parse_router_config
from router_served import MODEL, FakeEngine, Served, ServiceDns


def metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def completion(base: str, prompt: str, conversation: str, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, **extra}
    return httpx.post(f"{base}/v1/completions", json=body, headers={"x-conversation-id": conversation}, timeout=10)


def test_decoders_are_found_through_a_service_name_in_dns() -> None:
    # Kubernetes resolves a headless Service to its ready pods' IPs; "localhost" is the same lookup here.
    decoder = FakeEngine("d")
    config = {"model": MODEL, "decoderService": "localhost", "enginePort": decoder.served.port, "pollS": 0.05}
    router = Served(build_app(parse_router_config(config)))
    try:
        state = router.server.config.app.state.router  # type: ignore[attr-defined]
        assert f"http://127.0.0.1:{decoder.served.port}" in state.decoders
        assert all(url.startswith(("http://127.", "http://[")) for url in state.decoders)  # IPv6 in brackets
        answer = completion(router.url, "hello", "c1")
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "d"
    finally:
        router.stop()
        decoder.served.stop()


def test_a_service_that_does_not_resolve_keeps_the_last_known_engines() -> None:
    decoder = FakeEngine("d")
    config = {"model": MODEL, "decoders": [decoder.url], "decoderService": "no-such-service.invalid", "pollS": 0.05}
    router = Served(build_app(parse_router_config(config)))
    try:
        time.sleep(0.2)  # a few failed lookups
        assert completion(router.url, "hello", "c1").status_code == 200
    finally:
        router.stop()
        decoder.served.stop()


def test_a_prefiller_that_would_miss_the_ttft_slo_is_avoided() -> None:
    # ``queued`` has the lower KV occupancy but 100 requests waiting that this router did not send. Before the
    # router has sent any prompt it knows nothing of their size and takes ``queued`` (the emptier); once it has
    # seen a prompt of 1,000 tokens, those 100 count at that mean and would miss the 10 s SLO: ``calm``. Turn 1
    # stays off the decoder (prefillSite: prefiller).
    calm, queued = FakeEngine("calm", kv_usage=0.7), FakeEngine("queued", kv_usage=0.6, waiting=100)
    decoder = FakeEngine("d")
    standard = {"name": "standard", "weight": 1, "ttftSloMs": 10000, "tpotSloMs": 1000}
    config = {"model": MODEL, "prefillers": [calm.url, queued.url], "decoders": [decoder.url], "pollS": 0.05,
              "prefillSite": "prefiller", "prefillLatency": {"constantS": 0.01, "perTokenS": 1e-4},
              "priorityClasses": [standard]}  # fmt: skip
    router = Served(build_app(parse_router_config(config)))
    try:
        time.sleep(0.1)  # a poll has read the queues
        assert completion(router.url, "x" * 4000, "c-first").status_code == 200
        assert (len(calm.requests), len(queued.requests)) == (0, 1)
        assert completion(router.url, "x" * 4000, "c-second").status_code == 200
        assert (len(calm.requests), len(queued.requests)) == (1, 1)
    finally:
        router.stop()
        for engine in (calm, queued, decoder):
            engine.served.stop()


def test_turn_one_prefills_on_its_decoder_when_that_is_sooner_and_the_metrics_say_why() -> None:
    # The prefiller has 100 requests waiting; the decoder nothing. Turn 1 of the second conversation (the router
    # has seen a prompt by then) is computed on the decoder itself, the prefiller never asked; turn 2 stays.
    prefiller, decoder = FakeEngine("p", waiting=100), FakeEngine("d")
    config = {"model": MODEL, "prefillers": [prefiller.url], "decoders": [decoder.url], "pollS": 0.05,
              "prefillLatency": {"constantS": 0.01, "perTokenS": 1e-4}}  # fmt: skip
    router = Served(build_app(parse_router_config(config)))
    try:
        time.sleep(0.1)  # a poll has read the queues
        assert completion(router.url, "x" * 4000, "seen").status_code == 200
        before = len(prefiller.requests)
        for _ in range(2):
            assert completion(router.url, "y" * 4000, "local").status_code == 200
        assert len(prefiller.requests) == before
        site = 'coserve_router_prefill_site_total{reason="sooner_on_decoder",site="decoder"}'
        assert metric(router.url, site) >= 1
    finally:
        router.stop()
        for engine in (prefiller, decoder):
            engine.served.stop()


def test_the_workload_signals_the_autoscaler_reads() -> None:
    prefiller, decoder = FakeEngine("p"), FakeEngine("d")
    config = {"model": MODEL, "prefillers": [prefiller.url], "decoders": [decoder.url], "pollS": 0.05, "pinTtlS": 1}
    router = Served(build_app(parse_router_config(config)))
    try:
        for conversation in ("a", "b"):
            assert completion(router.url, "x" * 400, conversation).status_code == 200  # turn 1
        assert completion(router.url, "x" * 500, "a", stream=True).status_code == 200  # a's turn 2, streamed
        url = router.url
        assert metric(url, "coserve_router_conversations_total") == 2.0  # R = rate() of this
        assert metric(url, "coserve_router_conversation_input_tokens_count") == 2.0
        assert metric(url, "coserve_router_conversation_input_tokens_sum") == 10.0  # the prefiller's usage: 5 each
        assert metric(url, "coserve_router_prefill_tokens_total") == 10.0
        assert metric(url, "coserve_router_active_conversations") == 2.0
        # L_d: 1 token in each non-streamed answer (usage) and 3 streamed chunks
        assert metric(url, "coserve_router_output_tokens_total") == 5.0
        time.sleep(1.3)  # idle past the pin TTL: both conversations end
        assert metric(url, "coserve_router_conversation_lifetime_seconds_count") == 2.0
        assert metric(url, "coserve_router_active_conversations") == 0.0
        assert 0.0 < metric(url, "coserve_router_conversation_lifetime_seconds_sum") < 1.0  # W: a's two turns
    finally:
        router.stop()
        prefiller.served.stop()
        decoder.served.stop()


def test_the_poll_reads_each_engines_kv_capacity_so_admitted_tokens_count() -> None:
    import asyncio

    from coserve.router.app import Router

    decoders = [FakeEngine("a"), FakeEngine("b")]
    router = Router(parse_router_config({"model": MODEL, "decoders": [d.url for d in decoders]}))

    async def poll_then_admit() -> tuple[int, float]:
        try:
            await router.refresh()
            engine = router.decoders[decoders[0].url]
            engine.admitted_tokens += 800  # what the router sent since the poll: half of 100 blocks of 16
            return engine.kv_capacity_tokens, engine.occupancy()
        finally:
            await router.close()

    try:
        capacity, occupancy = asyncio.run(poll_then_admit())
    finally:
        for engine in decoders:
            engine.served.stop()
    assert capacity == 1600 and occupancy == pytest.approx(0.1 + 0.5)


def test_a_decoder_that_leaves_its_service_drains_and_its_conversations_move_at_the_next_turn() -> None:
    """Kubernetes deletes a decoder pod: it leaves the Service's DNS answer (``ServiceDns``, a test double for
    cluster DNS). No new conversation goes to it, the pins to it are kept until their next turn, which is
    re-placed and counted as a re-placement (not a new conversation: R, L_in and W stay right), and the
    decoder's series leaves /metrics."""
    first = FakeEngine("a", kv_usage=0.1)
    second = FakeEngine("b", kv_usage=0.2, host="127.0.0.2", port=first.served.port)
    dns = ServiceDns("decoders.test", ["127.0.0.1", "127.0.0.2"])
    config = {"model": MODEL, "decoderService": "decoders.test", "enginePort": first.served.port, "pollS": 0.05}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket, "getaddrinfo", dns.getaddrinfo)
        router = Served(build_app(parse_router_config(config)), loop="asyncio")
        try:
            state = router.server.config.app.state.router  # type: ignore[attr-defined]
            assert set(state.decoders) == {first.url, second.url}
            for conversation in ("c1", "c2"):  # both on "a", the lower KV occupancy
                assert completion(router.url, "hello", conversation).json()["choices"][0]["text"] == "a"
            first.kv_usage = 0.9
            time.sleep(0.2)  # polls read the new occupancy (a positive precondition, checked next)
            assert completion(router.url, "hello", "c3").json()["choices"][0]["text"] == "b"
            assert f'decoder="{first.url}"' in httpx.get(f"{router.url}/metrics", timeout=10).text

            dns.addresses = ["127.0.0.2"]  # "a" is terminating: the endpoints controller drops it
            deadline = time.monotonic() + 10
            while first.url in state.decoders:
                assert time.monotonic() < deadline, "the router never saw the Service change"
                time.sleep(0.02)
            served_by_a = len(first.requests)
            assert state.pins.per_decoder().get(first.url) == 2  # pins kept until their next turn
            assert f'decoder="{first.url}"' not in httpx.get(f"{router.url}/metrics", timeout=10).text
            for conversation in ("c1", "c2", "c4"):  # two moved at their turn boundary, one new
                assert completion(router.url, "hello again", conversation).json()["choices"][0]["text"] == "b"
            assert len(first.requests) == served_by_a  # nothing more reached the leaving decoder
            assert metric(router.url, "coserve_router_replacements_total") == 2
            assert metric(router.url, "coserve_router_conversations_total") == 4
        finally:
            router.stop()
            first.served.stop()
            second.served.stop()
