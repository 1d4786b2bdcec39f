"""Generate the CoServePool CustomResourceDefinition from the pydantic models.

The models are the source of truth; this module turns their JSON Schema
(2020-12, with ``$defs``) into the structural OpenAPI v3.0 schema the
Kubernetes API server wants: references inlined, ``Optional`` unwrapped,
``int | quantity`` turned into ``x-kubernetes-int-or-string``, numeric
exclusive bounds in the v3.0 boolean form, and defaults for nested objects
spelled out so that server-side defaulting matches pydantic's.

Who calls it: ``coserve crd`` (which writes ``crds/``), the helm chart's copy
check and ``tests/api/test_crd.py``, which fails when the committed CRD and the
models disagree.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from coserve.api.resource import GROUP, KIND, PLURAL, SHORT_NAME, SINGULAR, VERSION, CoServePool
from coserve.api.spec import SpecModel
from coserve.api.status import StatusModel

__all__ = ["crd_manifest", "openapi_schema", "structural_schema"]

JsonSchema = dict[str, Any]

_DROPPED_KEYS = {"title", "propertyNames", "$defs"}

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {
        "name": "Shape",
        "type": "string",
        "jsonPath": ".status.plan.shapes.shape",
        "description": "Disaggregated (prefillers and decoders) or Aggregated (engines that prefill and decode).",
    },
    {
        "name": "Prefillers",
        "type": "string",
        "jsonPath": ".status.prefillers",
        "description": "Prefiller replicas, ready/desired (none for aggregated engines).",
    },
    {
        "name": "Decoders",
        "type": "string",
        "jsonPath": ".status.decoders",
        "description": "Decoder replicas (every engine when aggregated), ready/desired.",
    },
    {
        "name": "Ready",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
        "description": "Whether every role has its desired replicas ready.",
    },
    {
        "name": "Bottleneck",
        "type": "string",
        "jsonPath": ".status.plan.bottleneck",
        "description": "The resource that saturates first as load rises.",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def structural_schema(model: type[BaseModel]) -> JsonSchema:
    """The structural OpenAPI v3.0 schema of ``model`` (camelCase property names)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs: Mapping[str, JsonSchema] = raw.get("$defs", {})
    schema = _convert(raw, defs)
    _add_object_defaults(schema, model)
    return schema


def openapi_schema() -> JsonSchema:
    """The openAPIV3Schema of the CoServePool CRD."""
    return {
        "type": "object",
        "description": (CoServePool.__doc__ or "").strip(),
        "required": ["spec"],
        "properties": {
            "apiVersion": {
                "type": "string",
                "description": "apiVersion is coserve.dev/v1alpha1.",
            },
            "kind": {"type": "string", "description": "kind is CoServePool."},
            "metadata": {"type": "object"},
            "spec": structural_schema(SpecModel),
            "status": structural_schema(StatusModel),
        },
    }


def crd_manifest() -> dict[str, Any]:
    """The whole CustomResourceDefinition object, ready to dump as YAML."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{PLURAL}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "coserve", "app.kubernetes.io/part-of": "coserve"},
        },
        "spec": {
            "group": GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": [SHORT_NAME],
                "categories": ["coserve"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                }
            ],
        },
    }


def _convert(node: JsonSchema, defs: Mapping[str, JsonSchema]) -> JsonSchema:
    """Recursively rewrite one JSON Schema node into its structural form."""
    node = _inline_ref(dict(node), defs)
    any_of = node.pop("anyOf", None)
    if any_of is not None:
        node = _resolve_any_of(node, any_of, defs)
    out: JsonSchema = {}
    for key, value in node.items():
        _convert_keyword(out, key, value, defs)
    return _tidy(out)


def _inline_ref(node: JsonSchema, defs: Mapping[str, JsonSchema]) -> JsonSchema:
    """``node`` with its ``$ref``, if any, replaced by a copy of the definition it names."""
    ref = node.pop("$ref", None)
    if ref is None:
        return node
    target = copy.deepcopy(defs[ref.rsplit("/", 1)[-1]])
    target.update(node)  # the description at the use site wins over the class docstring
    return target


def _resolve_any_of(node: JsonSchema, any_of: list[JsonSchema], defs: Mapping[str, JsonSchema]) -> JsonSchema:
    """``node`` (its ``anyOf`` popped) as one structural node: an int-or-string, or its one non-null branch."""
    branches = [b for b in any_of if b.get("type") != "null"]
    types = {_convert(b, defs).get("type") for b in branches}
    if types == {"integer", "string"}:
        node["x-kubernetes-int-or-string"] = True
        node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        for branch in branches:  # string rules apply to strings only, so they can sit on the node
            for key in ("pattern", "maxLength", "minimum"):
                if key in branch:
                    node[key] = branch[key]
        return node
    if len(branches) != 1:  # pragma: no cover - a model change that needs a new rule here
        raise ValueError(f"cannot express anyOf {any_of!r} in a structural schema")
    merged = _convert(branches[0], defs)
    merged.update({k: v for k, v in node.items() if k not in merged or k == "description"})
    return merged


def _convert_keyword(out: JsonSchema, key: str, value: Any, defs: Mapping[str, JsonSchema]) -> None:
    """Write one keyword of a node into ``out`` in its structural form, or drop it."""
    if key in _DROPPED_KEYS or (key == "additionalProperties" and value is False):
        return
    if key == "default" and value is None:
        return
    if key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
        out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
        out[key] = True
    elif key == "const":
        out["enum"] = [value]
    elif key == "properties":
        out[key] = {name: _convert(sub, defs) for name, sub in value.items()}
    elif key in ("items", "additionalProperties") and isinstance(value, dict):
        out[key] = _convert(value, defs)
    else:
        out[key] = value


def _tidy(out: JsonSchema) -> JsonSchema:
    """The finishing touches of a converted node: the Kubernetes spelling of free-form maps, sorted ``required``."""
    if out.get("x-kubernetes-preserve-unknown-fields") and out.get("additionalProperties") is True:
        del out["additionalProperties"]  # free-form (a dict[str, Any]): structural schemas say it the Kubernetes way
    if "required" in out:
        out["required"] = sorted(out["required"])
    return out


def _add_object_defaults(schema: JsonSchema, model: type[BaseModel]) -> None:
    """Give fields built by ``default_factory`` the default that pydantic would fill in.

    pydantic leaves factory defaults out of its JSON Schema; without them the API
    server would store a spec with the whole ``engine`` block missing, while
    pydantic would see it filled. An object whose factory is its own class gets
    ``{}`` (the API server then applies the nested defaults); anything else gets
    its full serialised value.
    """
    properties = schema.get("properties", {})
    for name, field in model.model_fields.items():
        prop = properties.get(field.alias or name)
        if prop is None:
            continue
        annotation = _model_type(field)
        if field.default_factory is not None:
            value = field.default_factory()  # type: ignore[call-arg]
            if isinstance(value, BaseModel) and value == type(value)():
                prop["default"] = {}
            elif isinstance(value, BaseModel):
                prop["default"] = value.model_dump(by_alias=True, exclude_none=True, mode="json")
            elif isinstance(value, list):
                prop["default"] = [
                    v.model_dump(by_alias=True, exclude_none=True, mode="json") if isinstance(v, BaseModel) else v
                    for v in value
                ]
        if annotation is not None:
            _add_object_defaults(prop, annotation)


def _model_type(field: FieldInfo) -> type[BaseModel] | None:
    """The BaseModel class inside ``field``'s annotation (``X``, ``X | None``), if any."""
    candidates = [field.annotation, *getattr(field.annotation, "__args__", ())]
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None
