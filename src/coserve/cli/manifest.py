"""Read CoServePool manifests and profile files from disk, safely.

Untrusted bytes become either a validated object or ``InvalidInput`` with one
``Problem`` per defect: not UTF-8, not YAML, several documents, duplicate keys,
alias bombs, and every schema violation. YAML timestamps stay strings (the API
server sees JSON, where a date is a string).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node

from coserve.api.parse import parse_pool, parse_profile
from coserve.api.problems import InvalidInput, Problem
from coserve.api.profile import EngineProfile
from coserve.api.resource import CoServePool
from coserve.api.status import Plan
from coserve.provisioning import plan_for

__all__ = [
    "MAX_MANIFEST_BYTES",
    "load_documents",
    "load_planned",
    "load_pool",
    "load_profile",
    "read_file",
    "read_text",
]

# The API server refuses objects above ~1.5 MiB; a manifest anywhere near it is a mistake.
MAX_MANIFEST_BYTES = 1 << 20
_MAX_ALIASES = 64
# A document's size once aliases are expanded (what JSON serialisation would produce).
_MAX_EXPANDED_NODES = 100_000


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys and alias bombs and keeps timestamps as strings."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._aliases_seen = 0

    def compose_node(self, parent: Node | None, index: int) -> Node | None:
        if self.check_event(yaml.AliasEvent):
            self._aliases_seen += 1
            if self._aliases_seen > _MAX_ALIASES:
                event = self.peek_event()  # type: ignore[no-untyped-call]
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"more than {_MAX_ALIASES} YAML aliases (refusing a possible alias bomb)",
                    event.start_mark,
                )
        return super().compose_node(parent, index)

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        """Attach a line and column to values PyYAML cannot convert (``!!int many``, 5000-digit integers)."""
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, TypeError, AttributeError) as error:
            shown = repr(node.value)[:40] if isinstance(node.value, str) else node.tag
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"cannot read {shown} as {node.tag.rsplit(':', 1)[-1]} ({type(error).__name__})",
                node.start_mark,
            ) from None

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` merges; keys written after it may override the merged ones
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (dict, list)):
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, "a key must be a scalar", key_node.start_mark
                )
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
# YAML 1.2 floats, as kubectl (go-yaml) reads them: 1e3 and 1.0e3 are numbers, not strings.
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+|\.[0-9_]+[eE][-+]?[0-9]+)$"),
    list("-+0123456789."),
)


def read_text(data: bytes) -> str:
    """Decode a manifest's bytes; raise ``InvalidInput`` for binary or oversized input."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise InvalidInput([Problem("", f"is larger than the {MAX_MANIFEST_BYTES} bytes a manifest may be")])
    if b"\x00" in data:
        raise InvalidInput([Problem("", "is binary data (it holds NUL bytes), not a YAML manifest")])
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise InvalidInput([Problem("", f"is not UTF-8 text (byte {error.start} cannot be decoded)")]) from None


def load_documents(text: str) -> list[object]:
    """All non-empty YAML documents in ``text``; ``InvalidInput`` with line and column on a syntax error."""
    try:
        documents = list(yaml.load_all(text, Loader=_StrictLoader))
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        what = " ".join(part for part in (error.context, error.problem) if part)
        raise InvalidInput([Problem("", f"is not valid YAML: {where}{what}")]) from None
    except yaml.YAMLError as error:
        raise InvalidInput([Problem("", f"is not valid YAML: {error}")]) from None
    except RecursionError:
        raise InvalidInput([Problem("", "is not a usable manifest: it nests too deeply")]) from None
    except (ValueError, TypeError, AttributeError) as error:
        # An explicit tag on a value it cannot convert (`!!int many`), or an integer of thousands of digits.
        raise InvalidInput([Problem("", f"is not valid YAML: a value cannot be converted ({error})")]) from None
    documents = [doc for doc in documents if doc is not None]
    for document in documents:
        if _expanded_size(document, {}, 0) > _MAX_EXPANDED_NODES:
            raise InvalidInput(
                [
                    Problem(
                        "",
                        f"expands to more than {_MAX_EXPANDED_NODES} values through YAML aliases "
                        "(refusing a possible alias bomb)",
                    )
                ]
            )
    return documents


def _expanded_size(value: object, memo: dict[int, int], depth: int) -> int:
    """Node count with every alias expanded; linear in the document's real size thanks to ``memo``."""
    if depth > 200:
        raise InvalidInput([Problem("", "is not a usable manifest: it nests too deeply")])
    if not isinstance(value, (dict, list)):
        return 1
    key = id(value)
    if key not in memo:
        children = value.values() if isinstance(value, dict) else value
        memo[key] = 1 + sum(_expanded_size(child, memo, depth + 1) for child in children)
    return memo[key]


def _single_document(data: bytes, what: str) -> object:
    documents = load_documents(read_text(data))
    if not documents:
        raise InvalidInput([Problem("", f"is empty: expected one {what}")])
    if len(documents) > 1:
        raise InvalidInput([Problem("", f"holds {len(documents)} YAML documents: expected exactly one {what}")])
    return documents[0]


def load_pool(data: bytes) -> CoServePool:
    """Parse and validate one CoServePool manifest."""
    return parse_pool(_single_document(data, "CoServePool"))


def load_profile(data: bytes) -> EngineProfile:
    """Parse a profile file written by `coserve profile`."""
    return parse_profile(_single_document(data, "CoServeProfile"))


def read_file(path: str) -> bytes:
    """Read ``path`` (``-`` for stdin); ``InvalidInput`` when it cannot be read."""
    try:
        if path == "-":
            return sys.stdin.buffer.read(MAX_MANIFEST_BYTES + 1)
        file = Path(path)
        if file.is_dir():
            raise InvalidInput([Problem("", "is a directory, not a manifest file")])
        with file.open("rb") as handle:
            return handle.read(MAX_MANIFEST_BYTES + 1)
    except OSError as error:
        raise InvalidInput([Problem("", f"cannot be read: {error.strerror or error}")]) from None


def load_planned(pool_file: str, profile_file: str | None) -> tuple[CoServePool, EngineProfile | None, Plan]:
    """A pool manifest, the measured profile it may be given, and the plan for them: what ``coserve plan``,
    ``render`` and ``simulate`` all start from. A bad profile is reported against its own file."""
    pool = load_pool(read_file(pool_file))
    measured = None
    if profile_file is not None:
        try:
            measured = load_profile(read_file(profile_file))
        except InvalidInput as error:
            raise InvalidInput(error.problems, source=profile_file) from None
    return pool, measured, plan_for(pool.spec, measured)
