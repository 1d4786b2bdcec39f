"""The request path's JSON (coserve.router.fastjson) is json's: the same values, errors and documents."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coserve.router import fastjson
from coserve.router.policy import conversation_id

# Any JSON value, with the numbers orjson reads differently from json (beyond 64 bits) and non-ASCII text.
SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4), max_leaves=20
)


def outcome(parse: Any, raw: Any) -> tuple[str, Any]:
    try:
        return "value", parse(raw)
    except Exception as error:  # noqa: BLE001 - the exception's type and message are what is compared
        return "error", (type(error), str(error))


def same(a: Any, b: Any) -> bool:
    """Equal, and of the same types all the way down (1 is not 1.0; nan is nan)."""
    if type(a) is not type(b) and not (isinstance(a, float) and isinstance(b, float)):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@given(VALUES)
def test_loads_reads_every_json_document_as_json_does(value: Any) -> None:
    for raw in (json.dumps(value).encode(), json.dumps(value, ensure_ascii=False).encode(), json.dumps(value)):
        assert same(fastjson.loads(raw), json.loads(raw))


@given(VALUES)
def test_dumps_writes_what_json_reads_back_as_the_value(value: Any) -> None:
    """A body as the router reads it (a client's infinities are NonFinite) goes out as json would send it."""
    read = fastjson.loads(json.dumps(value).encode())
    assert same(json.loads(fastjson.dumps(read)), json.loads(json.dumps(value)))


@pytest.mark.parametrize(
    "raw",
    [
        b'{"temperature": NaN, "top_p": Infinity, "x": -Infinity}',  # not JSON, but json reads them
        b'{"ttft_slo_ms": 1e400}',  # overflows to inf
        b'{"seed": 123456789012345678901234567890}',  # beyond 64 bits: orjson would read a float
        b'{"seed": -9223372036854775809}',
        b'{"prompt": "\\ud800"}',  # a lone surrogate escape
        b'\xef\xbb\xbf{"a": 1}',  # a UTF-8 byte-order mark
        '{"a": 1}'.encode("utf-16"),
        b'{"a": 1, "a": 2}',
        b"[1,",
        b"\xff\xfe\xfd",
        b"",
        b'{"a": "\xc3\xa9"}',
    ],
)
def test_what_orjson_does_not_read_as_json_does_is_read_by_json(raw: bytes) -> None:
    ours, theirs = outcome(fastjson.loads, raw), outcome(json.loads, raw)
    assert ours[0] == theirs[0]
    if ours[0] == "error":
        assert ours[1] == theirs[1]  # the client's 400 says what json would have said
    else:
        assert same(ours[1], theirs[1])
        assert json.dumps(json.loads(fastjson.dumps(ours[1]))) == json.dumps(theirs[1])


def test_a_clients_non_finite_number_is_forwarded_as_it_came() -> None:
    body = fastjson.loads(b'{"a": NaN, "b": Infinity, "c": 1e400, "d": [-Infinity]}')
    assert fastjson.dumps(body) == b'{"a": NaN, "b": Infinity, "c": Infinity, "d": [-Infinity]}'
    assert fastjson.dumps({"seed": 2**70}) == b'{"seed": 1180591620717411303424}'


@given(st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user"]), "content": VALUES}), min_size=1))
def test_a_conversations_name_is_the_hash_of_json_dumps_text(messages: list[dict[str, Any]]) -> None:
    """The C encoder built once writes what json.dumps wrote, so every replica and version names it alike."""
    leading = []
    for message in messages:
        leading.append(message)
        if message["role"] == "user":
            break
    text = json.dumps(["chat", "m", leading], sort_keys=True, separators=(",", ":"), default=str)
    assert conversation_id({}, {"model": "m", "messages": messages}) == (
        "h-" + hashlib.blake2b(text.encode(), digest_size=12).hexdigest()
    )
