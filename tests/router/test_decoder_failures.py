"""A decoder that fails a forwarded request, over real HTTP in front of scripted fake engines.

One 502/503/504 (or a refused connection) is not a lost decoder: the request is retried once on
another decoder and only its own conversation is re-pinned; the decoder's other conversations stay
pinned. Its pins are dropped only after ``pinDropFailures`` failures in a row within
``pinDropWindowS`` (or when it leaves its Service), and a success resets the count.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from coserve.router.app import Router, build_app
from coserve.router.config import parse_router_config
from router_served import MODEL, Served
from scripted_engine import ScriptedEngine


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
