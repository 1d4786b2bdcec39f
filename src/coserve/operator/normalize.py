"""How the API server stores what the operator sends, as the comparisons ``drift`` needs. Pure.

A kube-apiserver does not hand back the object it was sent byte for byte:

- resource quantities are canonicalised: ``nvidia.com/gpu: 1`` comes back as
  ``"1"``, ``"0.5"`` as ``"500m"``, ``"1024Mi"`` as ``"1Gi"``; the core API also
  rounds every resource-list amount up to a multiple of 1m (``"0.1m"`` is ``"1m"``);
- a ``false`` boolean, an empty string, list or map may be left out;
- items of a LIST (and of some watches) carry no ``apiVersion`` or ``kind``.

This module says when a desired value and an observed one are the same value as
the server stores it. It imports nothing but the standard library.

NOTE: lightkube ships a quantity parser (``lightkube.utils.quantity``), and the
operator depends on lightkube; it is not used here because it departs from the
API server's grammar: it refuses the ``n`` and ``u`` suffixes, reads ``1E3`` as
a bad suffix rather than 1000, and accepts ``Z``/``Y`` suffixes the server
refuses (``tests/operator/test_reconcile.py`` checks that it still does, so
the day it follows the grammar this module can use it). It would also bring
lightkube's models into this pure module.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any

__all__ = ["is_blank", "parse_quantity", "same_quantity", "stored_quantity"]

# <sign>? <digits>[.<digits>] | .<digits>, then a binary suffix, a decimal exponent, or a decimal suffix.
# The exponent goes before the suffixes so that "1E3" is 1000 and "1E" is one exa.
_QUANTITY_RE = re.compile(
    r"(?P<number>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?:[eE](?P<exponent>[+-]?[0-9]+)|(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]))?"
)
_DECIMAL_SUFFIXES = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BINARY_SUFFIXES = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_MULTIPLIERS = {suffix: Fraction(10) ** power for suffix, power in _DECIMAL_SUFFIXES.items()} | {
    suffix: Fraction(1 << power) for suffix, power in _BINARY_SUFFIXES.items()
}
# Beyond this the number is not a quantity any real object holds; it is compared as written.
_MAX_EXPONENT = 1000
_MILLI = Fraction(1, 1000)
_MAX_AMOUNT = Fraction(2**63 - 1)  # the API server caps larger amounts at this


def parse_quantity(value: object) -> Fraction | None:
    """The exact value of a Kubernetes quantity (``"500m"``, ``"1Gi"``, ``"1e3"``, ``8``), or ``None``.

    Accepts what a manifest may hold: an ``int``, a finite ``float`` (as written,
    ``0.1`` is one tenth), or a string in the Kubernetes quantity grammar (a plain
    or decimal number; decimal SI suffixes n u m k M G T P E; binary Ki Mi Gi Ti Pi
    Ei; an ``e``/``E`` integer exponent). Booleans and anything else are ``None``.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return Fraction(value)
    if isinstance(value, float):
        return Fraction(Decimal(repr(value))) if math.isfinite(value) else None
    if not isinstance(value, str):
        return None
    match = _QUANTITY_RE.fullmatch(value)
    if match is None:
        return None
    try:
        number = Fraction(Decimal(match["number"]))
    except (InvalidOperation, ValueError):
        return None
    if match["exponent"] is not None:
        exponent = int(match["exponent"])
        if abs(exponent) > _MAX_EXPONENT:
            return None
        return number * Fraction(10) ** exponent
    return number * _MULTIPLIERS[match["suffix"] or ""]


def stored_quantity(value: object) -> Fraction | None:
    """The amount the API server stores for a resource-list ``value``: rounded away from zero to 1m, capped.

    ``None`` when ``value`` is not a quantity.
    """
    amount = parse_quantity(value)
    if amount is None:
        return None
    millis = amount / _MILLI
    rounded = math.ceil(millis) if millis >= 0 else math.floor(millis)
    return min(rounded * _MILLI, _MAX_AMOUNT)


def same_quantity(desired: object, observed: object) -> bool:
    """True when both are quantities the server stores as one amount: ``1`` and ``"1"``, ``"1024Mi"`` and ``"1Gi"``."""
    want, have = stored_quantity(desired), stored_quantity(observed)
    return want is not None and want == have


def is_blank(value: Any) -> bool:
    """True for what the API server may leave out of an object it returns: ``false``, ``""``, ``[]``, ``{}``.

    ``None`` (null) counts too. ``0`` does not: the fields the operator sets keep it.
    """
    if value is None or value is False:
        return True
    if isinstance(value, str | list | Mapping):
        return len(value) == 0
    return False
