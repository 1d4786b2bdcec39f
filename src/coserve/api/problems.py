"""Problems with user input: a field path and a reason, never a traceback.

Every layer that rejects input (the YAML loader, the pydantic models, the
semantic checks of ``coserve.provisioning.validation``) reports
``Problem`` objects; the CLI prints one per line and exits 2, the operator puts
them into the PlanValid condition's message.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

__all__ = ["InvalidInput", "Problem", "format_path", "problems_from_validation_error"]

_MAX_INPUT_REPR = 60


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the input: where (``path``) and why (``reason``)."""

    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}" if self.path else self.reason


class InvalidInput(ValueError):
    """Raised when input has one or more problems; ``problems`` lists them all.

    ``source`` names the input (a file) when the raiser knows it.
    """

    def __init__(self, problems: Sequence[Problem], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        super().__init__("; ".join(str(p) for p in self.problems))


_PLAIN_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# pydantic's own loc entries: "function-before[...]", "union[int,str]", "[key]".
_VALIDATOR_TAG = re.compile(r"^([a-z][a-z-]*)?\[.*\]$")


def format_path(loc: Iterable[str | int], prefix: str = "") -> str:
    """``("spec", "priorityClasses", 0, "name")`` -> ``spec.priorityClasses[0].name``.

    Map keys that are not plain names (``nvidia.com/gpu``, an empty key) are
    quoted in brackets: ``spec.engine.resources.limits["nvidia.com/gpu"]``.
    """
    out = prefix
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _PLAIN_NAME.match(part):
            out += f"[{json.dumps(part)}]"
        else:
            out += f".{part}" if out else part
    return out


def problems_from_validation_error(error: ValidationError, prefix: str = "") -> list[Problem]:
    """Translate pydantic's errors into Problems with camelCase field paths."""
    problems = []
    for item in error.errors(include_url=False):
        # Unions and validators add their own tags ("function-before[...]", "int") to loc;
        # "[key]" marks an error in a map's key rather than its value.
        about_key = "[key]" in item["loc"]
        loc = [
            part
            for part in item["loc"]
            if not (isinstance(part, str) and (_VALIDATOR_TAG.match(part) or part in _UNION_TAGS))
        ]
        reason = _reason(item)
        problems.append(Problem(format_path(loc, prefix), f"key: {reason}" if about_key else reason))
    return _dedupe(problems)


_UNION_TAGS = {"int", "str", "float", "bool", "function-after", "constrained-str"}


def _reason(item: Mapping[str, Any]) -> str:
    kind = item["type"]
    if kind == "missing":
        return "required field is missing"
    if kind == "extra_forbidden":
        return "unknown field (check its spelling and nesting)"
    message = str(item["msg"]).removeprefix("Value error, ")
    return f"{message[0].lower()}{message[1:]}{_got(item)}"


def _got(item: Mapping[str, Any]) -> str:
    if "input" not in item or isinstance(item["input"], (dict, list)):
        return ""
    text = repr(item["input"])
    if len(text) > _MAX_INPUT_REPR:
        text = text[: _MAX_INPUT_REPR - 3] + "..."
    return f" (got {text})"


def _dedupe(problems: list[Problem]) -> list[Problem]:
    """Keep the first reason per path: a union reports one failure per member otherwise."""
    seen: dict[str, Problem] = {}
    for problem in problems:
        seen.setdefault(problem.path, problem)
    return list(seen.values())
