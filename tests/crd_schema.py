"""CRD schemas as the API server applies them, for tests: structural defaulting and CEL rules (cel-go's ``has()``).

Who uses it: ``tests/api/test_crd.py`` (coserve's own CRD) and ``tests/operator/test_gateway.py`` (the Gateway
API and Inference Extension CRDs that gateway mode's objects must pass).
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

import celpy  # a dev dependency: these checks never skip
import lark
from celpy.evaluation import CELEvalError

__all__ = ["CEL", "apply_crd_defaults", "cel_ast", "cel_failures", "cel_program", "selection", "unwrap"]


def apply_crd_defaults(schema: dict[str, Any], value: Any) -> Any:
    """What the API server's structural defaulting does to a stored object."""
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_crd_defaults(sub, value[name])
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key in value:
            value[key] = apply_crd_defaults(schema["additionalProperties"], value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_crd_defaults(schema["items"], item) for item in value]
    return value


# How the API server's CEL (cel-go) differs from cel-python where it matters to these rules: `has(a.b.c)`
# tests only its last field. `a.b` is evaluated like any selection, so where it is absent the rule fails
# with "no such key: b", and a failing rule makes the server refuse the object (or, for a `default`, the
# whole CRD). cel-python answers false instead. `&&` and `||` are the same in both: an error on one side
# is ignored when the other side decides the result (`has(self.a.b) || true` is true).

_SELECTION_WRAPPERS = {"exprlist", "expr", "conditionalor", "conditionaland", "relation", "addition",
                       "multiplication", "unary", "member", "primary", "paren_expr"}  # fmt: skip


def unwrap(tree: lark.Tree) -> lark.Tree:
    """The expression a parse-tree node stands for, below the grammar's one-child levels."""
    while tree.data in _SELECTION_WRAPPERS and len(tree.children) == 1 and isinstance(tree.children[0], lark.Tree):
        tree = tree.children[0]
    return tree


def selection(tree: lark.Tree) -> str | None:
    """``self.a.b`` for that field selection, None for any other expression."""
    tree = unwrap(tree)
    if tree.data == "ident":
        return str(tree.children[0])
    if tree.data == "member_dot":
        base = selection(tree.children[0])
        return None if base is None else f"{base}.{tree.children[1]}"
    return None


class CelGoEvaluator(celpy.evaluation.Evaluator):
    """cel-python's evaluator, with ``has()`` as cel-go evaluates it (in macro bodies too)."""

    def sub_evaluator(self, ast: lark.Tree) -> celpy.evaluation.Evaluator:
        return CelGoEvaluator(ast, activation=self.activation)

    def macro_has_eval(self, exprlist: lark.Tree) -> Any:  # a bool, or the error cel-go evaluates to
        argument = unwrap(exprlist)
        if argument.data != "member_dot":
            return CELEvalError("invalid argument to has() macro", SyntaxError, None, tree=exprlist)
        operand, field = argument.children
        value = self.visit(operand)  # an absent object is "no such key", not false
        if isinstance(value, CELEvalError):
            return value
        if not isinstance(value, celpy.celtypes.MapType):
            return CELEvalError(f"has() of a field of {type(value).__name__}", TypeError, None, tree=exprlist)
        return celpy.celtypes.BoolType(str(field) in value)

    def conditionalor(self, tree: lark.Tree) -> Any:
        return self._logical(tree, "_||_") if len(tree.children) == 2 else super().conditionalor(tree)

    def conditionaland(self, tree: lark.Tree) -> Any:
        return self._logical(tree, "_&&_") if len(tree.children) == 2 else super().conditionaland(tree)

    def _logical(self, tree: lark.Tree, function: str) -> Any:
        """cel-python's ``||`` and ``&&``, but with an error on both sides, the left one's (as cel-go reports)."""
        left, right = self.visit_children(tree)
        if isinstance(left, CELEvalError) and isinstance(right, CELEvalError):
            return left
        try:
            return self.activation.resolve_function(function)(left, right)
        except TypeError as error:
            return CELEvalError(f"no matching overload for {function}", TypeError, error.args, tree=tree)


class CelGoRunner(celpy.InterpretedRunner):
    def evaluate(self, context: Any) -> Any:
        return CelGoEvaluator(self.ast, activation=self.new_activation()).evaluate(context)


CEL = celpy.Environment(runner_class=CelGoRunner)  # the one evaluator of every CEL check in this file


@functools.cache
def cel_ast(rule: str) -> lark.Tree:
    return CEL.compile(rule)


@functools.cache
def cel_program(rule: str) -> celpy.Runner:
    return CEL.program(cel_ast(rule))


def cel_failures(schema: dict[str, Any], value: Any, path: str) -> list[tuple[str, str]]:
    """(path, message) of every CEL rule that ``value`` breaks, each rule evaluated where the API server would.

    A rule that fails to evaluate is a failure too, reported as the server reports it: at the rule's node,
    "<error> evaluating rule: <message>".
    """
    failures = []
    for rule in schema.get("x-kubernetes-validations", []):
        try:
            passed = cel_program(rule["rule"]).evaluate({"self": celpy.json_to_cel(value)})
        except CELEvalError as error:
            failures.append((path, f"{error.args[0]} evaluating rule: {rule['message']}"))
        else:
            if not passed:
                failures.append((path + rule.get("fieldPath", ""), rule["message"]))
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name in value:
                failures += cel_failures(sub, value[name], f"{path}.{name}")
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, item in value.items():
            failures += cel_failures(schema["additionalProperties"], item, f"{path}[{json.dumps(key)}]")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            failures += cel_failures(schema["items"], item, f"{path}[{index}]")
    return failures
