"""The PinTable's order, as a property: whatever timestamps pins are given (a pin kept with a past last
use, a request's clock read before an await), expiry and eviction remove exactly the least recently used.

The table is checked against a plain dict model after every operation. Each conversation is pinned to a
decoder of its own, so ``per_decoder`` tells which conversations the table holds.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from coserve.router.policy import PinTable

TTL = 10.0
MAX_PINS = 3
NAMES = st.sampled_from(["a", "b", "c", "d", "e"])
TIMES = st.integers(min_value=0, max_value=40).map(float)  # integers: ties happen, and must be handled

OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("pin"), NAMES, TIMES),
        st.tuples(st.just("get"), NAMES, TIMES),
        st.tuples(st.just("expire"), st.just(""), TIMES),
        st.tuples(st.just("drop"), NAMES, st.just(0.0)),
    ),
    max_size=60,
)


def held(pins: PinTable) -> set[str]:
    return {decoder.removeprefix("d-") for decoder in pins.per_decoder()}


@settings(max_examples=400, deadline=None)
@given(OPERATIONS)
def test_expiry_and_eviction_remove_exactly_the_least_recently_used(operations: list[tuple[str, str, float]]) -> None:
    pins = PinTable(ttl_s=TTL, max_pins=MAX_PINS)
    model: dict[str, float] = {}  # conversation -> last use
    ended_on_lookup: list[str] = []
    for op, name, now in operations:
        if op == "pin":
            before = dict(model)
            model[name] = now
            pins.pin(name, f"d-{name}", now)
            if len(model) > MAX_PINS:
                evicted = set(model) - held(pins)
                assert len(evicted) == 1, (op, name, now, before, held(pins))
                victim = evicted.pop()
                assert model[victim] == min(model.values()), ("evicted a pin that was not the least recent", before)
                del model[victim]
        elif op == "get":
            found: Any = pins.get(name, now)
            if name not in model:
                assert found is None
            elif now - model[name] > TTL:
                assert found is None
                ended_on_lookup.append(name)
                del model[name]
            else:
                assert found is not None and found.decoder == f"d-{name}"
                model[name] = max(model[name], now)
                assert found.last_used_s == model[name]
        elif op == "expire":
            names, ended = pins.expire_named(now)
            due = sorted(n for n, last in model.items() if now - last > TTL)
            assert sorted(names) == sorted([*ended_on_lookup, *due]), (now, model)
            assert len(ended) == len(names)
            ended_on_lookup = []
            for n in due:
                del model[n]
        else:
            pins.drop_decoder(f"d-{name}")
            model.pop(name, None)
        assert held(pins) == set(model) and len(pins) == len(model), (op, name, now)


def test_a_pin_kept_with_a_past_last_use_expires_first() -> None:
    """What the router does when a decoder says an expiring conversation is still live elsewhere: it
    pins it again with the decoder's last use, older than pins made since."""
    pins = PinTable(ttl_s=TTL, max_pins=2)
    pins.pin("new", "d-new", now_s=20.0)
    pins.pin("kept", "d-kept", now_s=12.0)  # last used 8 s ago
    assert pins.expire_named(23.0)[0] == ["kept"]  # idle 11 s, while "new" is idle 3 s
    pins.pin("kept", "d-kept", now_s=15.0)
    pins.pin("third", "d-third", now_s=21.0)  # over the bound: the least recently used goes
    assert held(pins) == {"new", "third"}
