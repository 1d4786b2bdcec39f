"""The committed CRD and the pydantic models agree, and the CRD is a valid structural schema."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jsonschema
import lark
import pytest
import yaml
from pydantic import BaseModel

from conftest import CRD_FILE, EXAMPLES
from coserve.api import CoServePool, InvalidInput, Problem, SpecModel, StatusModel, parse_pool
from coserve.api.crd import _model_type, crd_manifest, openapi_schema
from coserve.api.parse import parse_profile
from crd_schema import apply_crd_defaults, cel_ast, cel_failures, selection, unwrap

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
    assert columns == ["Shape", "Prefillers", "Decoders", "Ready", "Bottleneck", "Age"]


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
        StatusModel(plan=plan_for(pool.spec), prefillers="0/1", decoders="0/3", observed_generation=1).model_dump_json(
            by_alias=True, exclude_none=True
        )
    )
    jsonschema.Draft4Validator(openapi_schema()["properties"]["status"]).validate(status.to_wire())


def test_an_autoscaling_status_validates_against_the_crd_schema() -> None:
    # what coserve.operator.autoscaler writes: signals (some absent), counts, the reason
    written = {
        "lastEvaluationTime": "2026-12-03T06:30:52Z",
        "signals": {"arrivalRatePerS": 0.5, "inputTokens": 2000.0, "decoderKvUsage": 0.3},
        "recommended": {"prefillers": 1, "decoders": 1},
        "desired": {"prefillers": 1, "decoders": 2},
        "reason": "decoders held at 2: 1 recommended, waiting out the stabilization window",
    }
    status = StatusModel.model_validate_json(json.dumps({"autoscaling": written}))
    assert status.to_wire()["autoscaling"] == written
    jsonschema.Draft4Validator(openapi_schema()["properties"]["status"]).validate(status.to_wire())
    # what an earlier version wrote, the window's history with it: a stored status like this still parses
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


# --- CEL rules and their pydantic twins ---------------------------------------------------------------
#
# What a structural schema cannot say (one field of two, names the operator keeps, references between
# lists) the CRD says with CEL rules, which only the API server runs; the pydantic models refuse the same
# input, so `coserve render` and the operator name the same field. Each case below is checked three ways:
# pydantic refuses it at the field path, the CRD holds a rule for it at that place, and that rule,
# evaluated on the defaulted document by cel-python (a CEL interpreter, made to evaluate `has()` as the API
# server's cel-go does; the server's type-check is not exercised here), refuses it too.


def minimal_document(**spec: Any) -> dict[str, Any]:
    base = {
        "model": {"name": "Qwen/Qwen3-8B"},
        "workload": {"arrivalRatePerS": 1, "inputTokens": 1000, "outputTokens": 100, "lifetimeS": 10},
        "profile": {
            "prefillLatency": {"perTokenS": 1e-4},
            "decodeThroughputTokensPerS": 1000,
            "kvCapacityTokens": 10**6,
        },
    }
    return {"apiVersion": "coserve.dev/v1alpha1", "kind": "CoServePool", "metadata": {"name": "m"},
            "spec": {**base, **copy.deepcopy(spec)}}  # fmt: skip


VOLUME = {"name": "data", "emptyDir": {}}


@dataclass(frozen=True)
class RuleCase:
    """A spec one CEL rule refuses: where pydantic and the API server say so, and what they say."""

    id: str
    spec: dict[str, Any]
    path: str  # pydantic's field path
    reason: str  # a part of pydantic's reason
    cel_path: str  # where the API server reports it: the rule's node plus its fieldPath
    message: str  # a part of the rule's message


RULE_CASES = [
    RuleCase("env-operator-prefix", {"engine": {"env": [{"name": "COSERVE_ROLE", "value": "x"}]}},
             "spec.engine.env[0].name", "is set by the operator", "spec.engine.env[0].name", "is set by the operator"),
    RuleCase("env-operator-name-router", {"router": {"env": [{"name": "POD_NAMESPACE", "value": "x"}]}},
             "spec.router.env[0].name", "is set by the operator", "spec.router.env[0].name", "is set by the operator"),
    RuleCase("env-operator-model-runner",
             {"engine": {"decoder": {"env": [{"name": "VLLM_USE_V2_MODEL_RUNNER", "value": "1"}]}}},
             "spec.engine.decoder.env[0].name", "VLLM_USE_V2_MODEL_RUNNER",
             "spec.engine.decoder.env[0].name", "VLLM_USE_V2_MODEL_RUNNER"),
    RuleCase("env-value-and-value-from",
             {"engine": {"decoder": {"env": [{"name": "A", "value": "1",
                                              "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]}}},
             "spec.engine.decoder.env[0]", "value and valueFrom are exclusive",
             "spec.engine.decoder.env[0]", "value and valueFrom are exclusive"),
    RuleCase("env-two-sources",
             {"engine": {"env": [{"name": "A", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"},
                                                             "secretKeyRef": {"name": "s", "key": "k"}}}]}},
             "spec.engine.env[0].valueFrom", "exactly one of secretKeyRef",
             "spec.engine.env[0].valueFrom", "exactly one of secretKeyRef"),
    RuleCase("env-no-source", {"router": {"env": [{"name": "A", "valueFrom": {}}]}},
             "spec.router.env[0].valueFrom", "exactly one of secretKeyRef",
             "spec.router.env[0].valueFrom", "exactly one of secretKeyRef"),
    RuleCase("env-from-both",
             {"engine": {"envFrom": [{"configMapRef": {"name": "a"}, "secretRef": {"name": "b"}}]}},
             "spec.engine.envFrom[0]", "exactly one of configMapRef and secretRef",
             "spec.engine.envFrom[0]", "exactly one of configMapRef and secretRef"),
    RuleCase("volume-operator-name", {"engine": {"volumes": [{"name": "dshm", "emptyDir": {}}]}},
             "spec.engine.volumes[0].name", "is a volume of the operator's",
             "spec.engine.volumes[0].name", "is a volume of the operator's"),
    RuleCase("mount-operator-path",
             {"engine": {"volumes": [VOLUME], "volumeMounts": [{"name": "data", "mountPath": "/etc/coserve"}]}},
             "spec.engine.volumeMounts[0].mountPath", "is a mount of the operator's",
             "spec.engine.volumeMounts[0].mountPath", "is a mount of the operator's"),
    RuleCase("mount-names-no-volume", {"engine": {"volumeMounts": [{"name": "data", "mountPath": "/data"}]}},
             "spec.engine.volumeMounts[0].name", "names no volume of these pod options",
             "spec.engine.volumeMounts", "volumeMounts name volumes of the same pod options"),
    RuleCase("role-mount-names-no-volume",
             {"engine": {"decoder": {"volumes": [VOLUME], "volumeMounts": [{"name": "other", "mountPath": "/o"}]}}},
             "spec.engine.decoder.volumeMounts[0].name", "names no volume of these pod options",
             "spec.engine.decoder.volumeMounts", "volumeMounts name volumes of the same pod options"),
    RuleCase("router-mount-names-an-engine-volume",
             {"engine": {"volumes": [VOLUME]}, "router": {"volumeMounts": [{"name": "data", "mountPath": "/d"}]}},
             "spec.router.volumeMounts[0].name", "names no volume of these pod options",
             "spec.router.volumeMounts", "volumeMounts name volumes of the same pod options"),
    RuleCase("router-mount-router-path",
             {"router": {"volumes": [VOLUME], "volumeMounts": [{"name": "data", "mountPath": "/tmp"}]}},  # noqa: S108
             "spec.router.volumeMounts[0].mountPath", "are mounts of the router's own",
             "spec.router.volumeMounts", "are mounts of the router's own"),
    RuleCase("pod-label-operator-key", {"router": {"podLabels": {"coserve.dev/role": "decoder"}}},
             'spec.router.podLabels["coserve.dev/role"]', "is a label of the operator's",
             "spec.router.podLabels", "the operator's labels"),
    RuleCase("role-pod-label-operator-key",
             {"engine": {"prefiller": {"podLabels": {"app.kubernetes.io/instance": "x"}}}},
             'spec.engine.prefiller.podLabels["app.kubernetes.io/instance"]', "is a label of the operator's",
             "spec.engine.prefiller.podLabels", "the operator's labels"),
    RuleCase("pod-annotation-key-too-long", {"engine": {"podAnnotations": {"a" * 318: "x"}}},
             "spec.engine.podAnnotations." + "a" * 318, "keys are at most 317 characters",
             "spec.engine.podAnnotations", "annotation keys are at most 317 characters"),
    RuleCase("hf-token-env-beside-the-secret",
             {"model": {"name": "m", "hfTokenSecretRef": {"name": "hf"}},
              "engine": {"decoder": {"env": [{"name": "HF_TOKEN", "value": "hf_x"}]}}},
             "spec.engine.decoder.env[0].name", "the operator sets HF_TOKEN from model.hfTokenSecretRef",
             "spec.engine.decoder.env", "the operator sets HF_TOKEN from model.hfTokenSecretRef"),
    RuleCase("mount-at-the-cache",
             {"model": {"name": "m", "cache": {"claimName": "w", "mountPath": "/data"}},
              "engine": {"volumes": [VOLUME], "volumeMounts": [{"name": "data", "mountPath": "/data"}]}},
             "spec.engine.volumeMounts[0].mountPath", "model.cache.mountPath is where the operator mounts",
             "spec.engine.volumeMounts", "model.cache.mountPath is where the operator mounts"),
    RuleCase("cache-operator-path", {"model": {"name": "m", "cache": {"claimName": "w", "mountPath": "/dev/shm"}}},  # noqa: S108
             "spec.model.cache.mountPath", "is a mount of the operator's",
             "spec.model.cache.mountPath", "is a mount of the operator's"),
    RuleCase("cache-claim-and-size", {"model": {"name": "m", "cache": {"claimName": "w", "size": "1Ti"}}},
             "spec.model.cache", "exactly one of claimName and size",
             "spec.model.cache", "exactly one of claimName and size"),
    RuleCase("cache-neither", {"model": {"name": "m", "cache": {}}},
             "spec.model.cache", "exactly one of claimName and size",
             "spec.model.cache", "exactly one of claimName and size"),
    RuleCase("cache-class-with-a-claim",
             {"model": {"name": "m", "cache": {"claimName": "w", "storageClassName": "fast"}}},
             "spec.model.cache.storageClassName", "storageClassName goes with size",
             "spec.model.cache.storageClassName", "storageClassName goes with size"),
    RuleCase("local-and-cache", {"model": {"name": "org/m", "local": True, "cache": {"size": "1Ti"}}},
             "spec.model.cache", "local excludes cache", "spec.model.cache", "local excludes cache"),
    RuleCase("cache-of-a-path", {"model": {"name": "/weights/qwen", "cache": {"size": "1Ti"}}},
             "spec.model.name", "not a path", "spec.model.name", "not a path"),
    RuleCase("budget-both", {"disruption": {"decoder": {"minAvailable": 1, "maxUnavailable": 1}}},
             "spec.disruption.decoder", "exactly one of minAvailable and maxUnavailable",
             "spec.disruption.decoder", "exactly one of minAvailable and maxUnavailable"),
    RuleCase("budget-neither", {"disruption": {"router": {}}},
             "spec.disruption.router", "exactly one of minAvailable and maxUnavailable",
             "spec.disruption.router", "exactly one of minAvailable and maxUnavailable"),
    RuleCase("spread-min-domains-anyway",
             {"engine": {"topologySpreadConstraints": [{"topologyKey": "zone", "minDomains": 2}]}},
             "spec.engine.topologySpreadConstraints[0].minDomains", "minDomains needs whenUnsatisfiable DoNotSchedule",
             "spec.engine.topologySpreadConstraints[0].minDomains", "minDomains needs whenUnsatisfiable DoNotSchedule"),
    RuleCase("selector-in-without-values",
             {"router": {"topologySpreadConstraints": [
                 {"topologyKey": "zone", "labelSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}]}},
             "spec.router.topologySpreadConstraints[0].labelSelector.matchExpressions[0]", "values are required",
             "spec.router.topologySpreadConstraints[0].labelSelector.matchExpressions[0]", "values are required"),
    RuleCase("selector-exists-with-values",
             {"router": {"topologySpreadConstraints": [{"topologyKey": "zone", "labelSelector": {
                 "matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]}}]}},
             "spec.router.topologySpreadConstraints[0].labelSelector.matchExpressions[0]", "values are required",
             "spec.router.topologySpreadConstraints[0].labelSelector.matchExpressions[0]", "values are required"),
    RuleCase("resource-name-empty", {"engine": {"resources": {"limits": {"": 1}}}},
             'spec.engine.resources.limits[""]', "key:", "spec.engine.resources.limits", "resource names are 1 to 253"),
    RuleCase("picker-cert-without-tls",
             {"gateway": {"enabled": True, "secureServing": False, "pickerCertSecret": "picker-tls"}},
             "spec.gateway.pickerCertSecret", "served only with secureServing",
             "spec.gateway.pickerCertSecret", "served only with secureServing"),
]  # fmt: skip


def refusal(document: dict[str, Any]) -> list[Problem]:
    with pytest.raises(InvalidInput) as raised:
        parse_pool(document)
    return raised.value.problems


def schema_at(path: str) -> dict[str, Any]:
    """The schema node of a document path (``spec.engine.env[0].name``; list indexes and map keys follow items)."""
    node = openapi_schema()
    for part in re.findall(r"\[[^\]]*\]|[^.\[]+", path):
        if part.startswith("["):
            node = node["items"] if "items" in node else node["additionalProperties"]
        else:
            node = node["properties"][part]
    return node


def defaulted_spec(document: dict[str, Any]) -> dict[str, Any]:
    return apply_crd_defaults(openapi_schema()["properties"]["spec"], copy.deepcopy(document["spec"]))  # type: ignore[no-any-return]


def test_rule_cases_are_distinct_and_cover_every_cel_rule() -> None:
    assert len({case.id for case in RULE_CASES}) == len(RULE_CASES)
    messages = {
        rule["message"]
        for _, node in schema_nodes(openapi_schema())
        for rule in node.get("x-kubernetes-validations", [])
    }
    uncovered = [message for message in messages if not any(case.message in message for case in RULE_CASES)]
    assert uncovered == []


@pytest.mark.parametrize("case", RULE_CASES, ids=lambda case: case.id)
def test_pydantic_refuses_what_a_cel_rule_refuses_with_the_field_path(case: RuleCase) -> None:
    problems = refusal(minimal_document(**case.spec))

    assert [(p.path, case.reason in p.reason) for p in problems] == [(case.path, True)], problems


@pytest.mark.parametrize("case", RULE_CASES, ids=lambda case: case.id)
def test_the_crd_holds_the_rule_where_the_api_server_reports_it(case: RuleCase) -> None:
    parts = case.cel_path.split(".")
    candidates = [".".join(parts[:n]) for n in range(len(parts), 0, -1)]  # the field, then each object above it
    found = [
        rule
        for node_path in candidates
        if node_path.startswith("spec")
        for rule in schema_at(node_path).get("x-kubernetes-validations", [])
        if case.message in rule["message"] and node_path + rule.get("fieldPath", "") == case.cel_path
    ]
    assert found, f"no CEL rule reports {case.message!r} at {case.cel_path}"
    assert case.path.startswith(case.cel_path)  # pydantic names the same field, or an item or key inside it


@pytest.mark.parametrize("case", RULE_CASES, ids=lambda case: case.id)
def test_the_cel_rule_refuses_the_same_input(case: RuleCase) -> None:
    failures = cel_failures(
        openapi_schema()["properties"]["spec"], defaulted_spec(minimal_document(**case.spec)), "spec"
    )

    assert [(path, case.message in message) for path, message in failures] == [(case.cel_path, True)], failures


KITCHEN_SINK_SPEC: dict[str, Any] = {
    "model": {"name": "meta-llama/Llama-3.1-8B", "hfTokenSecretRef": {"name": "hf"},
              "cache": {"size": "500Gi", "storageClassName": "nfs", "mountPath": "/weights"}},
    "engine": {
        "env": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"},
                {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
        "envFrom": [{"secretRef": {"name": "engine"}, "prefix": "E_"}],
        "volumes": [{"name": "ca", "configMap": {"name": "ca"}}],
        "volumeMounts": [{"name": "ca", "mountPath": "/etc/ssl/corp", "readOnly": True}],
        "imagePullSecrets": [{"name": "registry"}],
        "serviceAccountName": "engines",
        "priorityClassName": "serving",
        "podLabels": {"team": "inference", "example.com/tier": "gpu"},
        "podAnnotations": {"example.com/owner": "inference"},
        "topologySpreadConstraints": [{"topologyKey": "topology.kubernetes.io/zone",
                                       "whenUnsatisfiable": "DoNotSchedule", "minDomains": 2}],
        "drainTimeoutS": 600,
        "decoder": {"volumes": [{"name": "scratch", "emptyDir": {}}],
                    "volumeMounts": [{"name": "ca", "mountPath": "/ca"}, {"name": "scratch", "mountPath": "/s"}],
                    "env": [{"name": "NCCL_DEBUG", "value": "INFO"}], "topologySpreadConstraints": []},
    },
    "router": {"env": [{"name": "LOG_LEVEL", "value": "debug"}], "podLabels": {"team": "edge"},
               "topologySpreadConstraints": [{"topologyKey": "kubernetes.io/hostname", "labelSelector": {
                   "matchExpressions": [{"key": "coserve.dev/role", "operator": "In", "values": ["router"]}]}}]},
    "disruption": {"decoder": {"maxUnavailable": "25%"}, "prefiller": {"minAvailable": 1}},
}  # fmt: skip


@pytest.mark.parametrize(
    "spec", [{}, KITCHEN_SINK_SPEC, {"model": {"name": "/w", "local": True}}], ids=["minimal", "everything", "local"]
)
def test_valid_options_pass_the_schema_every_cel_rule_and_pydantic(spec: dict[str, Any]) -> None:
    document = minimal_document(**spec)

    jsonschema.Draft4Validator(openapi_schema()).validate(document)
    pool = parse_pool(document)
    assert (
        apply_crd_defaults(openapi_schema()["properties"]["spec"], copy.deepcopy(document["spec"]))
        == pool.spec.to_wire()
    )
    assert cel_failures(openapi_schema()["properties"]["spec"], defaulted_spec(document), "spec") == []


LIST_MAPS = {
    "env": ["name"],
    "volumes": ["name"],
    "volumeMounts": ["mountPath"],
    "imagePullSecrets": ["name"],
    "topologySpreadConstraints": ["topologyKey", "whenUnsatisfiable"],
}


@pytest.mark.parametrize("options", ["spec.engine", "spec.engine.prefiller", "spec.engine.decoder", "spec.router"])
def test_pod_option_lists_are_maps_keyed_as_kubernetes_keys_them(options: str) -> None:
    """The API server refuses two items with the same key (x-kubernetes-list-type: map); so does pydantic."""
    node = schema_at(options)
    for field, keys in LIST_MAPS.items():
        assert node["properties"][field]["x-kubernetes-list-type"] == "map"
        assert node["properties"][field]["x-kubernetes-list-map-keys"] == keys
        items = node["properties"][field]["items"]
        for key in keys:  # a map key must be required or defaulted
            assert key in items.get("required", []) or "default" in items["properties"][key], (field, key)


@pytest.mark.parametrize(
    ("field", "items", "reason"),
    [
        ("env", [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}], "env names must be unique"),
        ("volumes", [VOLUME, {"name": "data", "secret": {"secretName": "s"}}], "volume names must be unique"),
        ("volumeMounts", [{"name": "data", "mountPath": "/d"}, {"name": "data", "mountPath": "/d"}],
         "mount paths must be unique"),
        ("imagePullSecrets", [{"name": "r"}, {"name": "r"}], "image pull secrets must be unique"),
        ("topologySpreadConstraints", [{"topologyKey": "zone"}, {"topologyKey": "zone", "maxSkew": 2}],
         "topologyKey and whenUnsatisfiable pairs must be unique"),
    ],
)  # fmt: skip
def test_pydantic_refuses_duplicate_keys_at_the_second_item(field: str, items: list[Any], reason: str) -> None:
    spec = {"router": {"volumes": [VOLUME], field: items}} if field != "volumes" else {"router": {field: items}}
    problems = refusal(minimal_document(**spec))

    assert [p.path for p in problems] == [f"spec.router.{field}[1].{LIST_MAPS[field][0]}"]
    assert reason in problems[0].reason


@pytest.mark.parametrize(
    ("spec", "path", "reason"),
    [
        ({"engine": {"volumes": [{"name": "v"}]}}, "spec.engine.volumes[0]", "exactly one volume source"),
        ({"engine": {"volumes": [{"name": "v", "emptyDir": {}, "configMap": {"name": "c"}}]}},
         "spec.engine.volumes[0]", "exactly one volume source"),
        ({"engine": {"volumes": [{"name": "v", "persistentVolume": {"claimName": "c"}}]}},
         "spec.engine.volumes[0].persistentVolume", "unknown volume source"),
        ({"engine": {"volumes": [{"name": "v", "emptyDir": "yes"}]}}, "spec.engine.volumes[0].emptyDir",
         "a volume source is an object"),
        ({"router": {"podLabels": {"Example.com/team": "a"}}}, 'spec.router.podLabels["Example.com/team"]',
         "prefix must be a lowercase DNS subdomain"),
        ({"router": {"podAnnotations": {"team/": "a"}}}, 'spec.router.podAnnotations["team/"]', "a key's name"),
    ],
)  # fmt: skip
def test_what_only_the_pod_template_would_refuse_is_refused_before_it_is_applied(
    spec: dict[str, Any], path: str, reason: str
) -> None:
    """Volume sources are kept as written in the CRD (and label keys are only bounded there): the API server
    would refuse them only when the operator applies the pod template, so coserve names them first."""
    problems = refusal(minimal_document(**spec))

    assert [p.path for p in problems] == [path] and reason in problems[0].reason
    jsonschema.Draft4Validator(openapi_schema()).validate(minimal_document(**spec))  # the CRD lets them through


@pytest.mark.parametrize(
    ("peer", "field", "validator"),
    [
        ({"podLabels": {"app.kubernetes.io/name": "prometheus"}, "namespaceLabels": {}}, "namespaceLabels",
         "minProperties"),
        ({"podLabels": {}, "namespaceLabels": {"kubernetes.io/metadata.name": "monitoring"}}, "podLabels",
         "minProperties"),
        ({"podLabels": {"app.kubernetes.io/name": "prometheus"}}, "namespaceLabels", "required"),
        ({"namespaceLabels": {"kubernetes.io/metadata.name": "monitoring"}}, "podLabels", "required"),
    ],
)  # fmt: skip
def test_a_metrics_scraper_that_would_select_everyone_is_refused_by_the_schema_and_pydantic(
    peer: dict[str, Any], field: str, validator: str
) -> None:
    """An empty selector selects every namespace (or every pod): a scraper names both its namespaces and its pods,
    which the schema requires without CEL (required, minProperties), and pydantic too."""
    document = minimal_document(engine={"metricsScrapers": [peer]})
    errors = list(jsonschema.Draft4Validator(openapi_schema()).iter_errors(document))
    assert [(error.validator, field in ".".join(map(str, error.absolute_path)) or field in error.message)
            for error in errors] == [(validator, True)]  # fmt: skip
    assert [p.path for p in refusal(document)] == [f"spec.engine.metricsScrapers[0].{field}"]
    assert defaulted_spec(minimal_document())["engine"]["metricsScrapers"] == []  # by default nobody


def test_cel_field_paths_name_fields_of_their_node() -> None:
    for path, node in schema_nodes(openapi_schema()):
        for rule in node.get("x-kubernetes-validations", []):
            assert rule["rule"] and rule["message"], path
            if "fieldPath" in rule:
                target = node
                for part in rule["fieldPath"].lstrip(".").split("."):
                    target = target["properties"][part]


def test_every_list_in_the_spec_is_bounded() -> None:
    """The API server estimates a CEL rule's cost from the sizes of the lists it walks; unbounded ones fail."""
    unbounded = [path for path, node in schema_nodes(openapi_schema()["properties"]["spec"], "spec")
                 if node.get("type") == "array" and "maxItems" not in node]  # fmt: skip
    assert unbounded == []
    for options in ("spec.engine", "spec.router"):
        for field in ("podLabels", "podAnnotations"):
            assert "maxProperties" in schema_at(options)["properties"][field]


# --- What the API server checks when the CRD is created -----------------------------------------------


def crd_schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]


def default_failures(schema: dict[str, Any]) -> list[tuple[str, str]]:
    """What the API server finds wrong with the schema's defaults, each as (node, message).

    When a CRD is created or updated, the server validates every ``default`` against its node's schema and
    evaluates on it the CEL rules of that node and of every node below it that the value reaches; one
    failure, or one rule that fails to evaluate, and the whole CRD is refused (`kubectl apply`, `helm
    install`). It checks the default as written, without the defaults nested under it: that is how
    ``engine: {}`` reaches the engine's rules with no ``prefiller``. An object that omits the field gets the
    default with the nested defaults applied, so that value is checked as well.
    """
    failures = []
    for path, node in schema_nodes(schema):
        if "default" not in node:
            continue
        schema_errors = jsonschema.Draft4Validator(node).iter_errors(node["default"])
        failures += [(f"{path}.default", error.message) for error in schema_errors]
        defaulted = apply_crd_defaults(node, copy.deepcopy(node["default"]))
        for value in [node["default"]] + ([defaulted] if defaulted != node["default"] else []):
            failures += cel_failures(node, copy.deepcopy(value), f"{path}.default")
    return failures


def test_the_api_server_accepts_the_crds_defaults() -> None:
    assert default_failures(crd_schema(committed_crd())) == []


def _tiny_schema(rule: str, inner_default: bool = False) -> dict[str, Any]:
    """An object defaulting to {} with one rule; ``a`` (optional, an object) holds ``b``."""
    a: dict[str, Any] = {"type": "object", "properties": {"b": {"type": "string", "maxLength": 1}}}
    if inner_default:
        a["default"] = {}
    node = {"type": "object", "default": {}, "properties": {"a": a},
            "x-kubernetes-validations": [{"rule": rule, "message": "m"}]}  # fmt: skip
    return {"type": "object", "properties": {"o": node}}


@pytest.mark.parametrize(
    ("rule", "inner_default", "refused"),
    [
        ("!has(self.a.b)", False, True),  # "no such key: a"
        ("!has(self.a.b)", True, True),  # a's own default is not applied to o's
        ("has(self.a.b) || true", False, False),  # the error is ignored: the other side decides
        ("!has(self.a) || !has(self.a.b)", False, False),
        ("!(has(self.a) && has(self.a.b))", False, False),
    ],
)
def test_a_default_that_a_rule_fails_to_evaluate_on_is_refused(rule: str, inner_default: bool, refused: bool) -> None:
    failures = default_failures(_tiny_schema(rule, inner_default))

    assert [message.endswith("evaluating rule: m") for _, message in failures] == ([True] if refused else [])


POOL_DOCUMENTS = [
    pytest.param(document, id=f"{path.name}:{document['metadata']['name']}")
    for path in sorted(EXAMPLES.glob("*.yaml"))
    for document in yaml.safe_load_all(path.read_text())
    if isinstance(document, dict) and document.get("kind") == "CoServePool"
]


def test_every_pool_example_is_checked() -> None:
    assert len(POOL_DOCUMENTS) >= len(POOL_EXAMPLES) > 0


@pytest.mark.parametrize("document", POOL_DOCUMENTS)
def test_every_cel_rule_passes_the_examples_as_the_api_server_stores_them(document: dict[str, Any]) -> None:
    schema = crd_schema(committed_crd())
    assert cel_failures(schema, apply_crd_defaults(schema, copy.deepcopy(document)), "") == []


def has_guards(tree: lark.Tree, present: frozenset[str], unguarded: list[str]) -> tuple[frozenset[str], frozenset[str]]:
    """The fields an expression shows present when it is true, and when it is false.

    Each ``has(x.f)`` whose ``x`` is a field not shown present by what is evaluated before it (``has(x)``
    on the left of ``&&``, ``!has(x)`` on the left of ``||``, a ternary's condition) goes to ``unguarded``.
    """
    tree = unwrap(tree)
    trees = [child for child in tree.children if isinstance(child, lark.Tree)]
    if tree.data == "ident_arg" and tree.children[0] == "has":
        field = selection(trees[0]) if trees else None
        assert field is not None, f"has() of something other than a field: {tree}"
        parts = field.split(".")
        if len(parts) > 2 and ".".join(parts[:-1]) not in present:
            unguarded.append(f"has({field})")
        return frozenset(".".join(parts[:n]) for n in range(2, len(parts) + 1)), frozenset()
    if tree.data in ("conditionaland", "conditionalor") and len(trees) == 2:
        left_true, left_false = has_guards(trees[0], present, unguarded)
        if tree.data == "conditionaland":
            right_true, right_false = has_guards(trees[1], present | left_true, unguarded)
            return left_true | right_true, left_false & right_false
        right_true, right_false = has_guards(trees[1], present | left_false, unguarded)
        return left_true & right_true, left_false | right_false
    if tree.data == "unary" and trees[0].data == "unary_not":
        when_true, when_false = has_guards(trees[1], present, unguarded)
        return when_false, when_true
    if tree.data == "expr" and len(trees) == 3:
        when_true, when_false = has_guards(trees[0], present, unguarded)
        has_guards(trees[1], present | when_true, unguarded)
        has_guards(trees[2], present | when_false, unguarded)
        return frozenset(), frozenset()
    for child in trees:
        has_guards(child, present, unguarded)
    return frozenset(), frozenset()


def unguarded_has(schema: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(node, ``has(x.f)``, rule) of every rule that evaluates ``x`` without first testing that it is there."""
    found = []
    for path, node in schema_nodes(schema):
        for rule in node.get("x-kubernetes-validations", []):
            unguarded: list[str] = []
            has_guards(cel_ast(rule["rule"]), frozenset(), unguarded)
            found += [(path, call, rule["rule"]) for call in unguarded]
    return found


@pytest.mark.parametrize(
    ("rule", "unguarded"),
    [
        ("!has(self.a.b)", ["has(self.a.b)"]),
        # stricter than cel-go, whose && ignores the error where has(self.a) is false: the guard comes first
        ("has(self.a.b.c) && has(self.a)", ["has(self.a.b.c)"]),
        ("has(self.a) && has(self.a.b) && has(self.a.b.c)", []),
        ("!has(self.a) || !has(self.a.b) || self.a.b == ''", []),
        ("!(has(self.a) && has(self.a.b)) || self.a.all(x, has(self.a.b) && has(x.y))", []),
        ("has(self.a) ? has(self.a.b) : has(self.c.d)", ["has(self.c.d)"]),
    ],
)
def test_unguarded_has_finds_a_has_of_a_field_of_an_absent_object(rule: str, unguarded: list[str]) -> None:
    found = unguarded_has({"x-kubernetes-validations": [{"rule": rule, "message": "m"}]})

    assert [call for _, call, _ in found] == unguarded


def test_every_has_of_a_nested_field_tests_the_object_first() -> None:
    """A default or a stored object without the object would make the rule fail to evaluate (see above)."""
    assert unguarded_has(crd_schema(committed_crd())) == []


# --- The API server's CEL cost budget ---------------------------------------------------------------------

_ITERATING_MACROS = {"all", "exists", "exists_one", "map", "filter"}
_BOUNDS = ("maxItems", "maxProperties", "maxLength", "enum")


def schema_of(tree: lark.Tree, scope: dict[str, Any]) -> dict[str, Any] | None:
    """The schema node of the field an expression selects (``self.a``, ``m.name`` in a macro), else None."""
    tree = unwrap(tree)
    if tree.data == "ident":
        return scope.get(str(tree.children[0]))  # type: ignore[no-any-return]
    if tree.data == "member_dot":
        base = schema_of(tree.children[0], scope)
        if base is None or base.get("x-kubernetes-preserve-unknown-fields"):
            return None
        name = str(tree.children[1])
        assert name in base.get("properties", {}), f"{tree} selects a field the schema does not have"
        return base["properties"][name]  # type: ignore[no-any-return]
    return None


def read_nodes(tree: lark.Tree, scope: dict[str, Any], found: list[dict[str, Any]]) -> None:
    """Schema nodes whose values the expression reads (iterates, measures, compares), into ``found``.

    A macro's variable stands for the list's items (a map's keys have no schema); ``has()`` reads nothing.
    """
    tree = unwrap(tree)
    node = schema_of(tree, scope) if tree.data in ("ident", "member_dot") else None
    if node is not None:
        found.append(node)
        return
    if tree.data == "ident_arg" and tree.children[0] == "has":
        return
    if tree.data == "member_dot_arg" and str(tree.children[1]) in _ITERATING_MACROS:
        target, _, arguments = tree.children
        read_nodes(target, scope, found)
        iterated = schema_of(target, scope)
        variable, *bodies = arguments.children
        items = iterated.get("items") if iterated is not None else None
        for body in bodies:
            read_nodes(body, {**scope, str(selection(variable)): items}, found)
        return
    for child in tree.children:
        if isinstance(child, lark.Tree):
            read_nodes(child, scope, found)


def rule_reads(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(schema path, node) of every list, map and string that a CEL rule of the schema reads."""
    paths = {id(node): path for path, node in schema_nodes(schema)}
    read: dict[int, dict[str, Any]] = {}
    for _, node in schema_nodes(schema):
        for rule in node.get("x-kubernetes-validations", []):
            found: list[dict[str, Any]] = []
            read_nodes(cel_ast(rule["rule"]), {"self": node}, found)
            read.update((id(sub), sub) for sub in found)
    return [(paths[key], sub) for key, sub in read.items()
            if sub.get("type") in ("array", "string") or "additionalProperties" in sub
            or sub.get("x-kubernetes-int-or-string")]  # fmt: skip


def unbounded_reads(schema: dict[str, Any]) -> list[str]:
    return [path for path, node in rule_reads(schema) if not any(bound in node for bound in _BOUNDS)]


def test_every_list_map_and_string_a_cel_rule_reads_is_bounded() -> None:
    """The API server estimates each rule's worst-case cost when the CRD is created, from the maxItems,
    maxProperties and maxLength (or enum) of what the rule walks and compares, and refuses a CRD whose rule
    could exceed its budget; without a bound it assumes a value as large as a whole request."""
    schema = crd_schema(committed_crd())
    assert unbounded_reads(schema) == []


def test_removing_any_bound_a_cel_rule_relies_on_is_noticed() -> None:
    schema = copy.deepcopy(crd_schema(committed_crd()))
    read = rule_reads(schema)
    assert {node["type"] for _, node in read if "type" in node} == {"array", "object", "string"}
    for path, node in read:
        removed = {bound: node.pop(bound) for bound in _BOUNDS if bound in node}
        assert path in unbounded_reads(schema), f"{path} unbounded ({removed}) goes unnoticed"
        node.update(removed)
