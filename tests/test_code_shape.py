"""The shape CI holds ``src/`` to: no function longer than ``[tool.coserve.function-length] max-lines`` in
pyproject.toml (def line to last line, docstring included), unless the table's ``exempt`` names it with a reason.

ruff holds the complexity (C901, ``[tool.ruff.lint.mccabe]``); this holds the length, which ruff has no rule for.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["coserve"]["function-length"]


def function_lengths(source: str, module: str) -> dict[str, int]:
    """``module:qualified.name`` -> lines, for every function and method in ``source`` (nested ones included)."""
    lengths: dict[str, int] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                lengths[f"{module}:{name}"] = (child.end_lineno or child.lineno) - first + 1
                walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(ast.parse(source), "")
    return lengths


def src_function_lengths() -> dict[str, int]:
    lengths: dict[str, int] = {}
    for path in sorted((ROOT / "src").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT / "src").with_suffix("").parts).removesuffix(".__init__")
        lengths |= function_lengths(path.read_text(), module)
    return lengths


def test_no_function_in_src_is_longer_than_the_limit_unless_exempt_with_a_reason() -> None:
    limit, exempt = SHAPE["max-lines"], SHAPE.get("exempt", {})
    lengths = src_function_lengths()
    too_long = {name: lines for name, lines in lengths.items() if lines > limit and name not in exempt}
    assert not too_long, f"functions over {limit} lines (split them, or exempt them with a reason): {too_long}"
    assert all(reason.strip() for reason in exempt.values()), "every exemption gives its reason"
    stale = sorted(name for name in exempt if lengths.get(name, 0) <= limit)
    assert not stale, f"exempt but no longer over {limit} lines (remove them from the exemptions): {stale}"


def test_the_length_counts_decorators_and_nested_functions() -> None:
    source = "class A:\n    @staticmethod\n    def f():\n        def g():\n            return 1\n        return g\n"
    assert function_lengths(source, "m") == {"m:A.f": 5, "m:A.f.g": 2}
