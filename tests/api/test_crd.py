"""The committed CRD and the pydantic models agree, and the CRD is a valid structural schema."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import yaml
from pydantic import BaseModel

from conftest import CRD_FILE, EXAMPLES
from coserve.api import CoServePool, SpecModel, StatusModel, parse_pool
from coserve.api.crd import _model_type, crd_manifest, openapi_schema
from coserve.api.parse import parse_profile

POOL_EXAMPLES = sorted(EXAMPLES.glob("pool*.yaml"))


def committed_crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_FILE.read_text())


def schema_nodes(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from schema_nodes(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from schema_nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from schema_nodes(node["additionalProperties"], f"{path}{{}}")


def test_committed_crd_is_generated_from_the_models() -> None:
    assert committed_crd() == crd_manifest(), "crds/ is stale: run `coserve crd > crds/coserve.dev_coservepools.yaml`"


def test_crd_identity() -> None:
    crd = committed_crd()
    assert crd["metadata"]["name"] == "coservepools.coserve.dev"
    spec = crd["spec"]
    assert spec["group"] == "coserve.dev"
    assert spec["scope"] == "Namespaced"
    assert spec["names"] == {
        "kind": "CoServePool",
        "listKind": "CoServePoolList",
        "plural": "coservepools",
        "singular": "coservepool",
        "shortNames": ["csp"],
        "categories": ["coserve"],
    }
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Prefillers", "Decoders", "Ready", "Bottleneck", "Age"]


def test_printer_columns_point_at_status_fields() -> None:
    status_fields = {f.alias for f in StatusModel.model_fields.values()}
    for column in crd_manifest()["spec"]["versions"][0]["additionalPrinterColumns"]:
        path = column["jsonPath"]
        if path.startswith(".status."):
            assert path.split(".")[2].split("[")[0] in status_fields, path


def test_schema_is_structural_and_documented() -> None:
    schema = openapi_schema()
    for path, node in schema_nodes(schema):
        assert "$ref" not in node and "$defs" not in node, path
        if node.get("x-kubernetes-int-or-string"):
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
        else:
            assert "anyOf" not in node and "oneOf" not in node, path
            assert node.get("type") in {"object", "array", "string", "integer", "number", "boolean"}, path
        assert not ("properties" in node and "additionalProperties" in node), path
        if isinstance(node.get("exclusiveMinimum"), (int, float)) and not isinstance(node["exclusiveMinimum"], bool):
            pytest.fail(f"{path}: OpenAPI v3.0 wants a boolean exclusiveMinimum")
        if path.count(".") >= 2 and not path.endswith(("[]", "{}")) and ".metadata" not in path:
            assert node.get("description"), f"{path} has no description (kubectl explain would be empty)"


def model_fields_match(model: type[BaseModel], node: dict[str, Any], path: str) -> None:
    aliases = {field.alias or name for name, field in model.model_fields.items()}
    assert set(node.get("properties", {})) == aliases, path
    required = {field.alias or name for name, field in model.model_fields.items() if field.is_required()}
    assert set(node.get("required", [])) == required, path
    for name, field in model.model_fields.items():
        alias = field.alias or name
        sub = node["properties"][alias]
        inner = _model_type(field)
        if inner is None:
            continue
        if sub.get("type") == "array":
            model_fields_match(inner, sub["items"], f"{path}.{alias}[]")
        else:
            model_fields_match(inner, sub, f"{path}.{alias}")


def test_every_model_field_is_in_the_crd_and_nothing_else() -> None:
    schema = openapi_schema()
    model_fields_match(SpecModel, schema["properties"]["spec"], "spec")
    model_fields_match(StatusModel, schema["properties"]["status"], "status")


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


@pytest.mark.parametrize("example", POOL_EXAMPLES, ids=lambda p: p.name)
def test_server_side_defaults_equal_pydantic_defaults(example: Any) -> None:
    document = yaml.safe_load(example.read_text())
    spec_schema = openapi_schema()["properties"]["spec"]
    defaulted = apply_crd_defaults(spec_schema, copy.deepcopy(document["spec"]))
    assert defaulted == parse_pool(document).spec.to_wire()


def test_minimal_spec_defaults_agree() -> None:
    minimal = {
        "model": {"name": "m"},
        "workload": {"arrivalRatePerS": 1, "inputTokens": 10, "outputTokens": 10, "lifetimeS": 1},
        "profile": {},
    }
    defaulted = apply_crd_defaults(openapi_schema()["properties"]["spec"], copy.deepcopy(minimal))
    document = {"apiVersion": "coserve.dev/v1alpha1", "kind": "CoServePool", "metadata": {"name": "m"}, "spec": minimal}
    assert defaulted == parse_pool(document).spec.to_wire()
    assert defaulted["engine"]["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    assert [c["name"] for c in defaulted["priorityClasses"]] == ["interactive", "standard", "offline"]


@pytest.mark.parametrize("example", POOL_EXAMPLES, ids=lambda p: p.name)
def test_examples_validate_against_crd_and_models(example: Any) -> None:
    document = yaml.safe_load(example.read_text())
    jsonschema.Draft4Validator(openapi_schema()).validate(document)
    pool = parse_pool(document)
    assert isinstance(pool, CoServePool)
    # A round trip through the wire format is lossless.
    assert parse_pool({**document, "spec": pool.spec.to_wire()}).spec == pool.spec


def test_status_round_trips_through_the_crd_schema() -> None:
    from coserve.provisioning import plan_for

    pool = parse_pool(yaml.safe_load((EXAMPLES / "pool.yaml").read_text()))
    status = StatusModel.model_validate_json(
        StatusModel(plan=plan_for(pool.spec), prefillers="1/0", decoders="3/0", observed_generation=1).model_dump_json(
            by_alias=True, exclude_none=True
        )
    )
    jsonschema.Draft4Validator(openapi_schema()["properties"]["status"]).validate(status.to_wire())


def test_an_autoscaling_status_validates_against_the_crd_schema() -> None:
    # what coserve.operator.autoscaler writes: signals (some absent), counts, the window's history
    autoscaling = {
        "lastEvaluationTime": "2026-12-03T06:30:52Z",
        "signals": {"arrivalRatePerS": 0.5, "inputTokens": 2000.0, "decoderKvUsage": 0.3},
        "recommended": {"prefillers": 1, "decoders": 1},
        "desired": {"prefillers": 1, "decoders": 2},
        "reason": "decoders held at 2: 1 recommended, waiting out the stabilization window",
        "history": [{"at": 1796279452.9, "prefillers": 1, "decoders": 1}],
        "kvHighEvaluations": 0,
        "prefillerQueue": 0.0,
    }
    status = StatusModel.model_validate_json(json.dumps({"autoscaling": autoscaling}))
    assert status.to_wire()["autoscaling"] == autoscaling
    jsonschema.Draft4Validator(openapi_schema()["properties"]["status"]).validate(status.to_wire())


def test_profile_example_validates() -> None:
    profile = parse_profile(yaml.safe_load((EXAMPLES / "profile.yaml").read_text()))
    assert profile.decode_throughput_tokens_per_s == 1100


def test_resource_maps_validate_their_keys_with_cel() -> None:
    """Structural schemas cannot constrain map keys; a CEL rule does (run by the API server, see e2e)."""
    resources = openapi_schema()["properties"]["spec"]["properties"]["engine"]["properties"]["resources"]
    for name in ("limits", "requests"):
        rules = resources["properties"][name]["x-kubernetes-validations"]
        assert rules == [
            {"rule": "self.all(k, size(k) >= 1 && size(k) <= 253)", "message": "resource names are 1 to 253 characters"}
        ]
