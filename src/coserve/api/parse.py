"""Turn an untrusted document (a YAML file, a kopf body) into a CoServePool.

Validation runs in pydantic's strict JSON mode so that it accepts exactly what
the CRD's schema accepts: enum values as strings, no "12" for an integer, no
NaN. Every problem is collected, not just the first.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from coserve.api.problems import InvalidInput, Problem, problems_from_validation_error
from coserve.api.profile import EngineProfile
from coserve.api.resource import API_VERSION, KIND, CoServePool
from coserve.api.spec import SpecModel

__all__ = ["parse_pool", "parse_profile", "parse_spec"]


def parse_pool(document: object) -> CoServePool:
    """Validate a whole CoServePool object; raise ``InvalidInput`` listing every problem."""
    if not isinstance(document, Mapping):
        raise InvalidInput([Problem("", f"expected a {KIND} object (a mapping), got {_kind_of(document)}")])
    problems = _identity_problems(document)
    try:
        pool = CoServePool.model_validate_json(_to_json(document))
    except ValidationError as error:
        found = problems_from_validation_error(error)
        known = {p.path for p in problems}
        raise InvalidInput(problems + [p for p in found if p.path not in known]) from None
    if problems:
        raise InvalidInput(problems)
    return pool


def parse_spec(spec: object, prefix: str = "spec") -> SpecModel:
    """Validate only a spec (the operator's path: kopf hands it ``spec`` alone)."""
    try:
        return SpecModel.model_validate_json(_to_json(spec))
    except ValidationError as error:
        raise InvalidInput(problems_from_validation_error(error, prefix)) from None


def parse_profile(document: object) -> EngineProfile:
    """Validate a measured engine profile (kind CoServeProfile)."""
    try:
        return EngineProfile.model_validate_json(_to_json(document))
    except ValidationError as error:
        raise InvalidInput(problems_from_validation_error(error)) from None


def _identity_problems(document: Mapping[str, Any]) -> list[Problem]:
    """apiVersion and kind get a reason that says what the file is, not just a mismatch."""
    problems = []
    api_version, kind = document.get("apiVersion"), document.get("kind")
    if kind is not None and kind != KIND:
        problems.append(Problem("kind", f"must be {KIND}, got {kind!r}: this file describes another kind of object"))
    if api_version is not None and api_version != API_VERSION:
        hint = (
            " (coserve serves only v1alpha1)"
            if isinstance(api_version, str) and api_version.startswith("coserve.dev/")
            else ""
        )
        problems.append(Problem("apiVersion", f"must be {API_VERSION}, got {api_version!r}{hint}"))
    return problems


def _to_json(document: object) -> str:
    try:
        return json.dumps(document, allow_nan=True)
    except (TypeError, ValueError) as error:
        raise InvalidInput([Problem("", f"holds a value that is not JSON data ({error})")]) from None


def _kind_of(value: object) -> str:
    if value is None:
        return "nothing (an empty document)"
    if isinstance(value, list):
        return "a list"
    return f"a {type(value).__name__} value"
