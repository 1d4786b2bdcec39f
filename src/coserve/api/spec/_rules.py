"""CEL rules and their pydantic twins, shared by the models of the spec.

The API server checks what a structural schema cannot (one of two fields, names the operator keeps
for itself, references between lists) with CEL rules (``x-kubernetes-validations``). Each rule that a
model of ``coserve.api.spec`` declares has a pydantic validator that refuses the same input with the
same field path, so ``coserve render`` and the operator report it as the API server would. The helpers
here serve both sides: they build rules (``_cel``, ``_has``, ``_list_map``) and raise the twins'
errors (``_fail``, ``_one_of``, ``_check_unique``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from coserve.api._base import ApiModel


def _cel(*rules: tuple[str, str] | tuple[str, str, str]) -> dict[str, Any]:
    """``x-kubernetes-validations`` from (rule, message[, fieldPath]) triples."""
    validations = []
    for rule in rules:
        entry = {"rule": rule[0], "message": rule[1]}
        if len(rule) == 3:
            entry["fieldPath"] = rule[2]
        validations.append(entry)
    return {"x-kubernetes-validations": validations}


def _cel_list(values: Iterable[str]) -> str:
    return "[" + ", ".join(f"'{value}'" for value in values) + "]"


def _has(field: str) -> str:
    """CEL that ``field`` (``self.a.b.c``) is set, each object on the way tested first.

    The API server's CEL tests only the last field of ``has(self.a.b)``: where ``self.a`` is absent, the
    rule fails to evaluate ("no such key: a") rather than answer false, and the object, or a CRD whose
    default reaches the rule, is refused.
    """
    parts = field.split(".")
    tests = [f"has({'.'.join(parts[:n])})" for n in range(2, len(parts) + 1)]
    return tests[0] if len(tests) == 1 else "(" + " && ".join(tests) + ")"


def _fail(problems: Sequence[tuple[tuple[str | int, ...], str, object]]) -> NoReturn:
    """Raise pydantic's error for each (loc, reason, input), ``loc`` relative to the model being validated.

    NOTE: a ValidationError raised inside a validator keeps its locations, so a rule checked on a parent
    object can still name the list item or map key at fault (``spec.engine.env[2].name``).
    """
    raise ValidationError.from_exception_data(
        "CoServePool",
        [
            InitErrorDetails(type=PydanticCustomError("coserve", "{reason}", {"reason": reason}), loc=loc, input=value)
            for loc, reason, value in problems
        ],
    )


def _one_of(model: ApiModel, fields: Sequence[str], what: str) -> None:
    """Pydantic twin of ``[has(a), has(b), ...].exists_one(x, x)``."""
    if sum(getattr(model, name) is not None for name in fields) != 1:
        raise ValueError(what)


def _check_unique(items: Sequence[ApiModel] | None, keys: Sequence[str], what: str) -> None:
    """Pydantic twin of ``x-kubernetes-list-type: map``: no two items share their ``keys``."""
    seen: set[tuple[object, ...]] = set()
    problems: list[tuple[tuple[str | int, ...], str, object]] = []
    for index, item in enumerate(items or ()):
        key = tuple(getattr(item, name) for name in keys)
        if key in seen:
            shown = "/".join(str(part) for part in key)
            alias = type(item).model_fields[keys[0]].alias or keys[0]
            problems.append(((index, alias), f"{what} must be unique: {shown} appears twice", key[0]))
        seen.add(key)
    if problems:
        _fail(problems)


def _preserve_unknown_fields(schema: dict[str, Any]) -> None:
    schema.pop("additionalProperties", None)
    schema["x-kubernetes-preserve-unknown-fields"] = True


def _list_map(*keys: str) -> dict[str, Any]:
    """A list whose items are unique by ``keys``, checked by the API server (and merged by key under apply)."""
    return {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": list(keys)}
