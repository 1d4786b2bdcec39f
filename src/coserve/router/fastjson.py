"""The router's JSON on the request path: ``json``'s results, computed by orjson wherever they are the same.

Who calls it: the router (``coserve.router.admission``, ``coserve.router.upstream``), for every request
body it reads, every body it sends an engine and every answer it reads the usage of. orjson parses and
writes a request several times faster than the standard library (profiled: about a tenth of the router's
CPU per request went to ``json``), but it does not accept everything ``json`` does, and reads some things
differently. So:

- ``loads`` gives exactly what ``json.loads`` gives, and raises what it raises: orjson parses strict
  JSON (RFC 8259, UTF-8) without a run of 19 or more digits (orjson reads an integer beyond 64 bits as a
  float); anything else (``NaN``, ``Infinity``, a lone surrogate escape, a byte-order mark, UTF-16, an
  invalid document) goes to ``json.loads``, whose error a client sees. A non-finite float only ever comes
  from that path (an overflowing literal such as ``1e400`` too), and it is read as ``NonFinite``, a
  ``float`` that orjson refuses to write.
- ``dumps`` gives the bytes of a document ``json.loads`` reads back as ``json.dumps``'s: orjson's compact
  UTF-8 for what it writes exactly, ``json.dumps`` for what it cannot (an integer beyond 64 bits, a
  ``NonFinite``). orjson writes a plain ``nan`` or ``inf`` as ``null``, so none may reach ``dumps``: on
  the request path a non-finite number is a client's, read by ``loads`` as a ``NonFinite`` (and kept one:
  the router's arithmetic on a client's SLO keeps the float it read).

Pure: no I/O.
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson

__all__ = ["NonFinite", "dumps", "loads"]

# orjson reads an integer beyond 64 bits (20 digits at most) as a float: any run of 19 digits goes to
# ``json``. Found by mapping digits to "1" and every other byte to "0" and looking for 19 ones (a tenth of
# the time ``re`` takes, and a fraction of the parse's).
_DIGITS_AS_ONES = bytes(0x31 if 0x30 <= byte <= 0x39 else 0x30 for byte in range(256))
_LONG_RUN = b"1" * 19


class NonFinite(float):
    """A non-finite number a client wrote (``NaN``, ``Infinity``, ``1e400``): orjson refuses to write it
    (a plain float ``nan`` it writes as ``null``), so ``dumps`` writes it as ``json`` does."""

    __slots__ = ()


def _constant(name: str) -> float:
    return NonFinite(name)  # "NaN", "Infinity", "-Infinity": what float() reads them as


def _float(text: str) -> float:
    value = float(text)
    return value if math.isfinite(value) else NonFinite(value)


def loads(raw: bytes | bytearray | str) -> Any:
    """``json.loads(raw)``: the same value, or the same exception."""
    encoded = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if encoded.translate(_DIGITS_AS_ONES).find(_LONG_RUN) < 0:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(raw, parse_constant=_constant, parse_float=_float)


def dumps(value: Any) -> bytes:
    """A document ``json.loads`` reads back as ``json.dumps(value)``, as UTF-8 bytes."""
    try:
        return orjson.dumps(value)
    except TypeError:  # an integer beyond 64 bits, a NonFinite: what only json writes as it should
        return json.dumps(value).encode()
