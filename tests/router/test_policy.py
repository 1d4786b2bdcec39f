"""The router's pure decisions (coserve.router.policy), table-driven."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coserve.router.policy import (
    MAX_CONVERSATION_ID_BYTES,
    OCCUPANCY_TIE,
    EngineLoad,
    InvalidConversationId,
    PinTable,
    canonical_conversation_id,
    choose_decoder,
    choose_gain_oriented,
    conversation_id,
    prefill_deadlines,
    resolve_class,
)
from coserve.scheduling.config import DEFAULT_CLASSES
from coserve.scheduling.requests import ClassRegistry, InvalidRequestClass

CLASSES = ClassRegistry(DEFAULT_CLASSES)  # interactive > standard > offline

SYSTEM = {"role": "system", "content": "be brief"}
TURN1 = [SYSTEM, {"role": "user", "content": "plan a trip"}]
TURN2 = [*TURN1, {"role": "assistant", "content": "where to?"}, {"role": "user", "content": "Rome"}]


@pytest.mark.parametrize(
    ("headers", "a", "b", "same"),
    [
        ({}, {"model": "m", "messages": TURN1}, {"model": "m", "messages": TURN2}, True),  # turns of one chat
        ({}, {"model": "m", "messages": TURN1}, {"model": "m", "messages": [SYSTEM, {"role": "user", "content": "x"}]},
         False),
        ({}, {"model": "m", "prompt": "p" * 600}, {"model": "m", "prompt": "p" * 600 + " more"}, True),
        ({}, {"model": "m", "prompt": list(range(200))}, {"model": "m", "prompt": [*range(200), 5]}, True),
        ({}, {"model": "m", "prompt": "a"}, {"model": "other", "prompt": "a"}, False),
        ({"x-conversation-id": "c1"}, {"model": "m", "prompt": "a"}, {"model": "m", "prompt": "b"}, True),
    ],
)  # fmt: skip
def test_conversation_identity(headers: dict[str, str], a: dict[str, Any], b: dict[str, Any], same: bool) -> None:
    assert (conversation_id(headers, a) == conversation_id(headers, b)) is same


def test_an_explicit_id_wins_over_the_hash() -> None:
    assert conversation_id({}, {"conversation_id": "abc", "messages": TURN1}) == "abc"
    assert conversation_id({"x-conversation-id": "h"}, {"conversation_id": "abc"}) == "h"
    assert conversation_id({}, {"conversation_id": None, "prompt": "a"}).startswith("h-")  # null: no id


@pytest.mark.parametrize(
    ("headers", "body", "field"),
    [
        ({}, {"conversation_id": 7}, "conversation_id"),
        ({}, {"conversation_id": ["a"]}, "conversation_id"),
        ({}, {"conversation_id": False}, "conversation_id"),
        ({}, {"conversation_id": ""}, "conversation_id"),
        ({"x-conversation-id": ""}, {"conversation_id": "abc"}, "x-conversation-id"),
    ],
)
def test_an_id_that_names_nothing_is_an_error_naming_where_it_was(
    headers: dict[str, str], body: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidConversationId) as raised:
        conversation_id(headers, body)
    assert raised.value.field == field and field in str(raised.value)


PRINTABLE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=300)


@given(st.one_of(PRINTABLE, st.text(max_size=400), st.binary(max_size=400).map(lambda b: b.decode("latin-1"))))
def test_ids_are_bounded_printable_ascii_and_the_same_bytes_give_the_same_id(text: str) -> None:
    raw = text.encode("utf-8", "surrogatepass")
    if not raw:
        return
    from_body = conversation_id({}, {"conversation_id": text})
    # the header as an ASGI server hands it over: the same bytes, decoded latin-1
    from_header = conversation_id({"x-conversation-id": raw.decode("latin-1")}, {})
    assert from_body == from_header == canonical_conversation_id(raw)
    assert len(from_body) <= MAX_CONVERSATION_ID_BYTES and from_body.isascii() and from_body.isprintable()
    assert from_body == from_body.strip()  # what an HTTP server hands the engine is what the router looks up
    kept = len(raw) <= MAX_CONVERSATION_ID_BYTES and text.isascii() and text.isprintable() and text == text.strip()
    assert from_body == (text if kept else "sha256:" + hashlib.sha256(raw).hexdigest())
    assert canonical_conversation_id(from_body.encode()) == from_body  # canonical ids are fixed points


@pytest.mark.parametrize(
    ("tenant", "asked", "priority", "expected"),
    [
        ("interactive", None, None, "interactive"),  # a tenant's own class by default
        ("interactive", "offline", None, "offline"),  # lowering is always allowed
        ("offline", "interactive", None, "offline"),  # raising is capped at the tenant's class
        ("standard", None, 2, "offline"),  # priority integers map onto classes by rank
        ("standard", None, 0, "standard"),
    ],
)
def test_a_request_never_runs_above_its_tenant(
    tenant: str, asked: str | None, priority: int | None, expected: str
) -> None:
    assert resolve_class(CLASSES, tenant, asked, priority).name == expected


def test_an_unknown_class_is_an_error_naming_it() -> None:
    with pytest.raises(InvalidRequestClass, match="gold"):
        resolve_class(CLASSES, "standard", "gold", None)


def load(url: str, usage: float, healthy: bool = True, waiting: int = 0) -> EngineLoad:
    engine = EngineLoad(url, kv_capacity_tokens=1000, waiting=waiting, healthy=healthy)
    engine.kv_usage = usage
    return engine


@pytest.mark.parametrize(
    ("decoders", "expected"),
    [
        ([load("a", 0.5), load("b", 0.2)], "b"),
        ([load("a", 0.5), load("b", 0.2, healthy=False)], "a"),
        ([load("a", 0.95), load("b", 0.92)], None),  # every decoder is full
        ([], None),
    ],
)
def test_turn_one_goes_to_the_decoder_with_the_lowest_occupancy(decoders: list[EngineLoad], expected: str) -> None:
    chosen = choose_decoder(decoders, full=0.9)
    assert (chosen.url if chosen else None) == expected


@pytest.mark.parametrize(
    ("occupancies", "first_token", "expected"),
    [
        ((0.20, 0.25), {"a": 3.0, "b": 1.0}, "b"),  # about as occupied: the sooner first token
        ((0.20, 0.35), {"a": 3.0, "b": 1.0}, "a"),  # b is fuller by more than the tie: KV decides
        ((0.20, 0.25), {"a": 1.0, "b": 1.0}, "a"),  # the same estimate: the emptier
        ((0.20, 0.95), {"a": 3.0, "b": 0.0}, "a"),  # b is full whatever its queue
    ],
)
def test_among_decoders_about_as_occupied_the_first_token_soonest_wins(
    occupancies: tuple[float, float], first_token: dict[str, float], expected: str
) -> None:
    a, b = load("a", occupancies[0]), load("b", occupancies[1])
    assert OCCUPANCY_TIE == 0.1
    chosen = choose_decoder([a, b], full=0.9, first_token=first_token)
    assert chosen is not None and chosen.url == expected


def test_admitted_tokens_count_until_the_next_poll() -> None:
    a, b = load("a", 0.2), load("b", 0.3)
    a.admitted_tokens = 200  # 20 % of its capacity since the last poll
    assert choose_decoder([a, b]) is b
    a.polled(0.25, 0)
    assert choose_decoder([a, b]) is a and a.admitted_tokens == 0


@pytest.mark.parametrize(
    ("loads", "deadline", "expected"),
    [
        ([0.3, 0.1, 0.7], {}, "1"),  # lightly loaded candidates: the least loaded
        ([0.6, 0.8, 0.9], {}, "1"),  # in between: the busiest that still meets the deadline
        ([0.6, 0.8, 0.9], {"1": False}, "0"),  # ... skipping one that would miss it
        ([0.9, 0.95], {}, "0"),  # all heavy: the least loaded
    ],
)
def test_gain_oriented_dual_threshold(loads: list[float], deadline: dict[str, bool], expected: str) -> None:
    candidates = [load(str(i), usage) for i, usage in enumerate(loads)]
    chosen = choose_gain_oriented(candidates, deadline, light=0.5, heavy=0.85)
    assert chosen is not None and chosen.url == expected


def test_pins_expire_when_idle_and_the_table_is_bounded() -> None:
    pins = PinTable(ttl_s=10, max_pins=2)
    pins.pin("a", "d1", now_s=0)
    pins.pin("b", "d1", now_s=1)
    assert pins.get("a", now_s=5) is not None  # a is now the most recently used
    pins.pin("c", "d2", now_s=6)  # over the bound: b (least recently used) goes
    assert pins.get("b", 6) is None and len(pins) == 2
    assert pins.get("a", now_s=16) is None  # idle 11 s > 10 s
    assert pins.per_decoder() == {"d2": 1}
    assert pins.drop_decoder("d2") == 1 and len(pins) == 0
    with pytest.raises(ValueError):
        PinTable(ttl_s=0)


def test_ended_conversations_are_reported_once_with_their_span() -> None:
    pins = PinTable(ttl_s=10)
    pins.pin("a", "d1", now_s=0)
    pins.get("a", now_s=8)  # turn 2
    pins.pin("b", "d1", now_s=9)
    assert pins.get("b", now_s=20) is None  # b expired on lookup
    ended = pins.expire(now_s=20)  # ... and a expires now
    assert sorted((p.first_arrival_s, p.last_used_s) for p in ended) == [(0, 8), (9, 9)]
    assert pins.expire(now_s=21) == []


def test_expiry_and_counts_cost_what_they_touch_not_the_table() -> None:
    """With 100,000 live pins, a poll's expiry looks at the pins that expire (and the first that does not),
    a dead decoder's drop at its own pins; per-decoder counts are kept, not recounted. A return to scanning
    every pin fails this."""
    pins = PinTable(ttl_s=100, max_pins=200_000)
    for i in range(100_000):
        pins.pin(f"c{i}", f"d{i % 4}", now_s=i * 0.001)  # pinned over 100 s
    pins.touched = 0
    assert pins.expire(now_s=100.0) == []  # none idle for 100 s yet
    assert pins.touched == 1
    ended = pins.expire(now_s=100.0105)  # the first ten (pinned before 0.0105 s) are now idle for too long
    assert len(ended) == 11 and pins.touched == 1 + 12
    assert pins.per_decoder() == {"d0": 24_997, "d1": 24_997, "d2": 24_997, "d3": 24_998}
    pins.touched = 0
    assert pins.drop_decoder("d1") == 24_997 and pins.touched == 24_997
    assert "d1" not in pins.per_decoder() and len(pins) == 100_000 - 11 - 24_997


def test_an_engine_is_down_after_consecutive_failed_polls_only() -> None:
    engine = load("d", 0.1)
    engine.failed(allowed=3)
    engine.failed(allowed=3)
    assert engine.healthy  # two slow answers in a row: still up
    engine.polled(0.2, 0)
    assert engine.failures == 0
    for _ in range(3):
        engine.failed(allowed=3)
    assert not engine.healthy


@pytest.mark.parametrize(
    ("failures_at", "answered_after", "lost_at"),
    [
        ([0, 1, 2], None, 2),  # three in a row within 30 s: lost at the third
        ([0, 1, 2], 1, None),  # an answer after the second: the count starts again
        ([0, 20, 40, 45], None, 3),  # 0 has left the window by 40: lost at 45 (20, 40, 45)
        ([0, 31, 62, 93], None, None),  # never three within 30 s
        ([0, 10, 30], None, 2),  # 30 s apart exactly is within the window
    ],
)
def test_a_decoder_is_lost_after_failed_forwards_in_a_row_within_the_window(
    failures_at: list[float], answered_after: int | None, lost_at: int | None
) -> None:
    engine = load("d", 0.1)
    lost = None
    for index, now in enumerate(failures_at):
        if engine.forward_failed(now, allowed=3, window_s=30.0) and lost is None:
            lost = index
        if index == answered_after:
            engine.forward_answered()
    assert lost == lost_at
    assert engine.healthy is (lost_at is None)


@pytest.mark.parametrize(
    ("waiting", "tokens", "slo_s", "meets"),
    [
        (0, 1000, 1.0, True),  # 0.01 + 0.1 = 0.11 s
        (8, 1000, 1.0, True),  # 9,000 tokens in 5 steps: 0.05 + 0.9 = 0.95 s
        (9, 1000, 1.0, False),  # 10,000 tokens in 5 steps: 0.05 + 1.0 = 1.05 s
        (0, 10_000, 1.0, False),  # one long prompt alone misses it
    ],
)
def test_prefill_deadlines_cost_the_queue_at_the_mean_prompt_sent_there(
    waiting: int, tokens: int, slo_s: float, meets: bool
) -> None:
    prefiller = EngineLoad("p", waiting=waiting)
    prefiller.sent("earlier", 1000, 1)  # what the router sent there: 1,000-token prompts
    prefiller.answered("earlier")
    assert prefill_deadlines([prefiller], tokens, slo_s, (0.01, 1e-4, 0.0)) == {"p": meets}
    assert prefill_deadlines([prefiller], tokens, slo_s, None) == {}  # no profile: no estimate
