"""The router's relay of a decoder's SSE stream, over real HTTP in front of a scripted fake engine.

Events pass through as each completes (a token event never waits for the next read), vLLM's closing
usage event is read for the token counts wherever the decoder's writes split it, and it reaches only
clients that asked for it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from httpx_sse import connect_sse

from coserve.router.app import build_app
from coserve.router.config import parse_router_config
from router_served import MODEL, Served
from scripted_engine import USAGE, ScriptedEngine, event

TOKENS = [event({"choices": [{"text": f"t{i}"}]}) for i in range(2)]
USAGE_EVENT = event({"id": "cmpl-1", "choices": [], "usage": USAGE})
DONE = b"data: [DONE]\n\n"


@pytest.fixture
def pool() -> Iterator[dict[str, Any]]:
    decoder = ScriptedEngine("d")
    decoder.pause_s = 0.002
    app = build_app(parse_router_config({"model": MODEL, "decoders": [decoder.url], "pollS": 1.0}))
    router = Served(app)
    try:
        yield {"router": router.url, "decoder": decoder}
    finally:
        router.stop()
        decoder.stop()


def stream(base: str, include_usage: bool) -> list[Any]:
    body: dict[str, Any] = {"model": MODEL, "prompt": "tell me", "stream": True, "max_tokens": 2}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    with httpx.Client(timeout=10) as client, connect_sse(client, "POST", f"{base}/v1/completions", json=body) as source:
        assert source.response.status_code == 200
        data = [sse.data for sse in source.iter_sse()]
    return [item if item == "[DONE]" else json.loads(item) for item in data]


def output_tokens(base: str) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith('coserve_router_output_tokens_total{cls="standard"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_usage_event_split_anywhere_is_counted_and_dropped_unless_asked_for(pool: dict[str, Any]) -> None:
    """The decoder's stream reaches the router with its usage event cut at every byte position (the
    `"usage"` marker included), with the cut at the end of a token event and inside one too."""
    decoder, base = pool["decoder"], pool["router"]
    expected_tokens = 0.0
    for cut in range(1, len(USAGE_EVENT)):
        for include_usage in (False, True):
            head, tail = USAGE_EVENT[:cut], USAGE_EVENT[cut:]
            token_cut = cut % len(TOKENS[1])  # and a token event cut somewhere else each time
            decoder.stream_parts = [TOKENS[0], TOKENS[1][:token_cut], TOKENS[1][token_cut:] + head, tail, DONE]
            events = stream(base, include_usage)
            expected_tokens += USAGE["completion_tokens"]
            usage = [e for e in events if isinstance(e, dict) and "usage" in e]
            assert usage == ([{"id": "cmpl-1", "choices": [], "usage": USAGE}] if include_usage else []), cut
            assert [e["choices"][0]["text"] for e in events if isinstance(e, dict) and e["choices"]] == ["t0", "t1"]
            assert events[-1] == "[DONE]"
    assert output_tokens(base) == expected_tokens  # every usage event was read, wherever it was cut


def test_events_pass_as_they_complete_without_waiting_for_the_next_read(pool: dict[str, Any]) -> None:
    """The decoder sends a token event (itself in two writes), then waits until the client has it: a relay
    that held a complete event back for the next read would keep the decoder waiting (it gives up after
    10 s and records that)."""
    decoder = pool["decoder"]
    first = TOKENS[0]
    decoder.stream_parts = [first[:9], first[9:], TOKENS[1], USAGE_EVENT, DONE]
    decoder.hold_after = 1
    body = {"model": MODEL, "prompt": "hold", "stream": True}
    with httpx.stream("POST", f"{pool['router']}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        line = next(line for line in lines if line)
        assert json.loads(line[6:])["choices"][0]["text"] == "t0"
        decoder.release.set()  # the client has the first event: let the decoder go on
        rest = [line for line in lines if line]
    assert decoder.released_in_time is True
    assert rest[-1] == "data: [DONE]" and len(rest) == 2  # t1 and [DONE]; the usage event was not asked for


def test_a_stream_with_crlf_framing_and_multi_line_data_passes_through(pool: dict[str, Any]) -> None:
    decoder = pool["decoder"]
    token = json.dumps({"choices": [{"text": "t0"}]})
    multi_line = b'data: {"choices": [{"text":\r\ndata: "t1"}]}\r\n\r\n'  # one event, its data on two lines
    crlf_usage = USAGE_EVENT.replace(b"\n", b"\r\n")
    decoder.stream_parts = [f"data: {token}\r\n\r".encode(), b"\n", multi_line, crlf_usage, DONE]
    events = stream(pool["router"], include_usage=False)
    assert not [e for e in events if isinstance(e, dict) and "usage" in e]  # not asked for: dropped
    assert [e["choices"][0]["text"] for e in events if isinstance(e, dict)] == ["t0", "t1"]
    assert events[-1] == "[DONE]"
    assert output_tokens(pool["router"]) == USAGE["completion_tokens"]


def test_a_decoder_that_breaks_off_mid_stream_ends_the_clients_stream_with_an_error_event(
    pool: dict[str, Any],
) -> None:
    pool["decoder"].stream_parts = [TOKENS[0], TOKENS[1][:12], RuntimeError("the decoder died")]
    events = stream(pool["router"], include_usage=False)
    assert events[0]["choices"][0]["text"] == "t0"
    assert events[-1]["error"]["code"] == 502 and "mid-answer" in events[-1]["error"]["message"]
