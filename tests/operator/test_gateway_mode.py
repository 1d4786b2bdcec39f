"""Gateway mode (``spec.gateway``): what the operator renders for a Gateway API Inference Extension gateway, and
how it reconciles it.

The InferencePool and the HTTPRoute are checked against the CRDs their projects publish (``e2e/crds``, the
versions README.md names): the schema, and every CEL rule on the defaulted object (cel-python, made to read
``has()`` as the API server does). The picker's port and health services, the route's batch paths and the
InferencePool's selector are checked against what the picker, the router and the decoders actually use.
"""

from __future__ import annotations

import base64
import copy
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from coserve.api import parse_pool
from coserve.cli.main import _parser as cli_parser
from coserve.gaie import HEALTH_PORT, HEALTH_SERVICES, PICKER_PORT
from coserve.operator.reconcile import reconcile
from coserve.operator.resources import (
    GATEWAY_API_KINDS,
    GATEWAY_CHILDREN,
    ROUTER_ONLY_PATHS,
    build_children,
    child_name,
)
from coserve.provisioning import plan_for
from coserve.router.routes import BATCH_ROUTES, HOT_PATHS
from crd_schema import apply_crd_defaults, cel_failures
from operator_kmock import as_stored
from pool_builders import sample_pool

CRDS = Path(__file__).resolve().parents[2] / "e2e" / "crds"
NOW = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
GATEWAY_NAMES = {
    ("Deployment", "chat-picker"),
    ("Service", "chat-picker"),
    ("NetworkPolicy", "chat-gateway-proxies"),
    ("InferencePool", "chat-inference-pool"),
    ("HTTPRoute", "chat-route"),
}


def gateway_pool(**gateway: Any) -> dict[str, Any]:
    document = sample_pool(uid="uid-chat", generation=1)
    document["spec"]["gateway"] = {"enabled": True, **gateway}
    return document


def render(document: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    pool = parse_pool(document)
    return {(c["kind"], c["metadata"]["name"]): c for c in build_children(pool, plan_for(pool.spec))}


def crd_schema(kind: str) -> dict[str, Any]:
    """The openAPIV3Schema of the published CRD of ``kind``, at the version coserve renders."""
    api_version, plural = GATEWAY_API_KINDS[kind]
    group, version = api_version.split("/")
    crd = yaml.safe_load((CRDS / f"{group}_{plural}.yaml").read_text())
    assert crd["spec"]["names"]["kind"] == kind
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert served["served"]
    return served["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]


def server_stored(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` as the API server stores it: its kind's CRD defaults filled in (custom kinds), the built-in kinds'
    stored form (``as_stored``)."""
    stored = as_stored(copy.deepcopy(obj))
    if obj["kind"] in GATEWAY_API_KINDS:
        stored = apply_crd_defaults(crd_schema(obj["kind"]), stored)
    stored["metadata"]["uid"] = f"uid-{obj['kind']}-{obj['metadata']['name']}"
    stored["metadata"]["resourceVersion"] = "7"
    return stored


def world(document: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """Every child the pool's first reconcile creates, as the server stored it (the token as the adapter
    generates it)."""
    stored = {(a.kind, a.name): server_stored(a.body) for a in reconcile(document, {}, NOW).actions}
    stored[("Secret", "chat-router-token")]["data"] = {"token": base64.b64encode(b"t" * 32).decode()}
    return stored


def gateway_ready(result: Any) -> dict[str, Any] | None:
    return next((c for c in result.status["conditions"] if c["type"] == "GatewayReady"), None)


# --- what gateway mode renders ---------------------------------------------------------------------------


def test_gateway_mode_is_off_by_default_and_adds_five_children_when_on() -> None:
    plain = render(sample_pool(uid="uid-chat", generation=1))
    gateway = render(gateway_pool())
    assert not set(plain) & GATEWAY_NAMES
    assert set(gateway) - set(plain) == GATEWAY_NAMES
    assert {(kind, child_name("chat", component)) for kind, component in GATEWAY_CHILDREN} == GATEWAY_NAMES
    # everything else is as in router mode: the router stays (it serves the batch API)
    assert {key: gateway[key] for key in plain} == plain
    assert set(render(gateway_pool(httpRoute=False))) == set(gateway) - {("HTTPRoute", "chat-route")}


@pytest.mark.parametrize(
    "gateway",
    [{}, {"gatewayNamespace": "gateways", "gatewayName": "edge", "requestTimeout": "1h30m"}, {"requestTimeout": "0s"}],
    ids=["defaults", "another-namespace", "no-timeout"],
)
@pytest.mark.parametrize("kind", sorted(GATEWAY_API_KINDS))
def test_the_gateway_objects_pass_the_crds_their_projects_publish(kind: str, gateway: dict[str, Any]) -> None:
    (child,) = [c for (k, _), c in render(gateway_pool(**gateway)).items() if k == kind]
    schema = crd_schema(kind)
    jsonschema.Draft4Validator(schema).validate(child)
    defaulted = apply_crd_defaults(schema, copy.deepcopy(child))
    assert cel_failures(schema, defaulted, "") == []


def test_the_crd_checks_can_fail() -> None:
    """The checks above refuse what the API server refuses: a pool without a picker port, a route rule whose
    backend names no port for a Service."""
    children = render(gateway_pool())
    inference_pool = copy.deepcopy(children[("InferencePool", "chat-inference-pool")])
    del inference_pool["spec"]["endpointPickerRef"]["port"]
    schema = crd_schema("InferencePool")
    assert cel_failures(schema, apply_crd_defaults(schema, inference_pool), "") == [
        (".spec.endpointPickerRef", "port is required when kind is 'Service' or unspecified (defaults to 'Service')")
    ]
    route = copy.deepcopy(children[("HTTPRoute", "chat-route")])
    route["spec"]["rules"][0]["timeouts"] = {"request": "1 minute"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(crd_schema("HTTPRoute")).validate(route)


def test_the_inference_pool_selects_the_decoders_and_names_the_picker_on_its_port() -> None:
    children = render(gateway_pool())
    spec = children[("InferencePool", "chat-inference-pool")]["spec"]
    decoder = children[("Deployment", "chat-decoder")]["spec"]
    prefiller = children[("Deployment", "chat-prefiller")]["spec"]
    labels = decoder["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert not spec["selector"]["matchLabels"].items() <= prefiller["template"]["metadata"]["labels"].items()
    assert spec["targetPorts"] == [
        {"number": decoder["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]}
    ]
    ref = spec["endpointPickerRef"]
    assert ref["failureMode"] == "FailClose"
    service = children[("Service", ref["name"])]
    (grpc,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert grpc["port"] == grpc["targetPort"] == PICKER_PORT
    picker = children[("Deployment", "chat-picker")]["spec"]["template"]
    assert service["spec"]["selector"].items() <= picker["metadata"]["labels"].items()


def test_the_picker_runs_coserve_epp_on_the_port_and_health_services_it_serves() -> None:
    children = render(gateway_pool(pickerReplicas=3))
    deployment = children[("Deployment", "chat-picker")]
    assert deployment["spec"]["replicas"] == 3
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    assert command[:2] == ["coserve", "epp"]
    args = cli_parser().parse_args(command[1:])  # the CLI takes what the operator renders
    assert args.port == PICKER_PORT
    assert args.config == "/etc/coserve/router.json"
    assert {p["containerPort"] for p in container["ports"]} == {PICKER_PORT, args.metrics_port, args.health_port}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):  # the kubelet's probes speak no TLS
        assert container[probe]["grpc"]["port"] == args.health_port == HEALTH_PORT
        assert container[probe]["grpc"]["service"] in HEALTH_SERVICES
    # the router's token, so the engines trust the class the picker sets; no API credentials
    assert {"name": "router-token", "secret": {"secretName": "chat-router-token"}} in deployment["spec"]["template"][
        "spec"
    ]["volumes"]
    assert deployment["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def picker_parts(children: dict[tuple[str, str], dict[str, Any]]) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """The picker's parsed command, its pod spec and its Service's ext_proc port."""
    pod = children[("Deployment", "chat-picker")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (port,) = [p for p in children[("Service", "chat-picker")]["spec"]["ports"] if p["port"] == PICKER_PORT]
    return cli_parser().parse_args(container["command"][1:]), pod, port


def test_the_picker_serves_tls_by_default_with_a_named_secret_mounted_where_it_reads_it() -> None:
    """As GAIE's pickers: TLS unless turned off (gateways following GAIE's charts connect so); the Service's
    appProtocol says which; a named kubernetes.io/tls Secret is mounted whole (no subPath: it rotates) at the
    --cert-path the picker reads."""
    args, pod, port = picker_parts(render(gateway_pool()))
    assert args.secure_serving and args.cert_path is None  # a self-signed certificate
    assert port["appProtocol"] == "http2"
    args, pod, port = picker_parts(render(gateway_pool(secureServing=False)))
    assert not args.secure_serving and port["appProtocol"] == "kubernetes.io/h2c"
    args, pod, port = picker_parts(render(gateway_pool(pickerCertSecret="chat-picker-tls")))
    assert args.secure_serving
    (volume,) = [v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == "chat-picker-tls"]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    assert str(args.cert_path) == mount["mountPath"] and mount["readOnly"] and "subPath" not in mount


def test_the_route_sends_the_batch_api_to_the_router_and_completions_to_the_inference_pool() -> None:
    route = render(gateway_pool())[("HTTPRoute", "chat-route")]["spec"]
    batch_rule, pool_rule = route["rules"]
    assert [m["path"]["value"] for m in batch_rule["matches"]] == list(ROUTER_ONLY_PATHS)
    assert batch_rule["backendRefs"] == [{"kind": "Service", "name": "chat-router", "port": 80}]
    assert pool_rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "chat-inference-pool"}
    ]
    # every batch route of the router is under a path the route sends to it, and no completion path is
    assert [route.path for route in BATCH_ROUTES if not route.path.startswith(ROUTER_ONLY_PATHS)] == []
    assert not [path for path in HOT_PATHS if path.startswith(ROUTER_ONLY_PATHS)]
    assert route["parentRefs"] == [
        {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "inference-gateway"}
    ]


def test_the_decoders_admit_the_gateways_proxies_on_their_port_only() -> None:
    proxies = [{"namespaceLabels": {"kubernetes.io/metadata.name": "gateways"}, "podLabels": {"app": "envoy"}}]
    named = render(gateway_pool(proxies=proxies))[("NetworkPolicy", "chat-gateway-proxies")]["spec"]
    assert named["podSelector"] == {
        "matchLabels": {"app.kubernetes.io/instance": "chat", "coserve.dev/role": "decoder"}
    }
    assert named["ingress"] == [
        {
            "from": [
                {
                    "podSelector": {"matchLabels": {"app": "envoy"}},
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateways"}},
                }
            ],
            "ports": [{"protocol": "TCP", "port": 8000}],
        }
    ]
    anyone = render(gateway_pool())[("NetworkPolicy", "chat-gateway-proxies")]["spec"]
    assert anyone["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8000}]}]


# --- how it is reconciled --------------------------------------------------------------------------------


def test_a_gateway_pool_as_the_server_stores_it_decides_nothing() -> None:
    """The CRDs' defaults (appProtocol, the picker's kind and group, backendRefs' weight, a match's type) that
    the API server fills in are not drift: a converged gateway pool is never patched."""
    document = gateway_pool(gatewayNamespace="gateways")
    observed = world(document)
    assert set(observed) >= GATEWAY_NAMES
    stored_pool = observed[("InferencePool", "chat-inference-pool")]
    assert stored_pool["spec"]["appProtocol"] == "http"  # a default was filled in: the check is not vacuous
    assert reconcile(document, observed, NOW).actions == ()


def test_a_hand_edit_of_the_inference_pool_is_put_back() -> None:
    document = gateway_pool()
    observed = world(document)
    observed[("InferencePool", "chat-inference-pool")]["spec"]["endpointPickerRef"]["failureMode"] = "FailOpen"
    (action,) = reconcile(document, observed, NOW).actions
    assert (action.verb, action.kind, action.name) == ("patch", "InferencePool", "chat-inference-pool")
    assert action.body["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"


def test_kinds_the_api_server_does_not_serve_are_not_created_and_the_condition_says_what_to_install() -> None:
    result = reconcile(gateway_pool(), {}, NOW, unserved=frozenset(GATEWAY_API_KINDS))
    created = {(a.kind, a.name) for a in result.actions}
    assert not {key for key in created if key[0] in GATEWAY_API_KINDS}
    assert {("Deployment", "chat-picker"), ("Service", "chat-picker")} <= created
    condition = gateway_ready(result)
    assert condition is not None
    assert (condition["status"], condition["reason"]) == ("False", "GatewayAPIMissing")
    assert "InferencePool (inference.networking.k8s.io/v1)" in condition["message"]
    assert "HTTPRoute (gateway.networking.k8s.io/v1)" in condition["message"]
    # without the example route, only the Inference Extension is needed
    result = reconcile(gateway_pool(httpRoute=False), {}, NOW, unserved=frozenset({"HTTPRoute"}))
    assert (gateway_ready(result) or {}).get("reason") != "GatewayAPIMissing"


def _ready(observed: dict[tuple[str, str], dict[str, Any]], name: str, replicas: int) -> None:
    observed[("Deployment", name)]["status"] = {"replicas": replicas, "readyReplicas": replicas}


def test_gateway_ready_follows_the_picker_and_the_gateways_verdict() -> None:
    document = gateway_pool()
    observed = world(document)
    assert (gateway_ready(reconcile(document, observed, NOW)) or {}).get("reason") == "PickerNotReady"
    _ready(observed, "chat-picker", 2)
    assert (gateway_ready(reconcile(document, observed, NOW)) or {}).get("reason") == "NotAccepted"
    observed[("InferencePool", "chat-inference-pool")]["status"] = {
        "parents": [
            {
                "parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "inference-gateway",
                              "namespace": "serving"},
                "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted"}],
            }
        ]
    }  # fmt: skip
    condition = gateway_ready(reconcile(document, observed, NOW)) or {}
    assert (condition["status"], condition["reason"]) == ("True", "Accepted")
    assert "Gateway serving/inference-gateway" in condition["message"]


def test_turning_gateway_mode_off_deletes_what_it_added_and_says_so() -> None:
    document = gateway_pool()
    observed = world(document)
    previous = reconcile(document, observed, NOW).status
    document["spec"]["gateway"]["enabled"] = False
    document["status"] = previous
    result = reconcile(document, observed, NOW)
    deleted = {(a.kind, a.name) for a in result.actions if a.verb == "delete"}
    assert deleted == GATEWAY_NAMES
    assert [a for a in result.actions if a.verb != "delete"] == []
    condition = gateway_ready(result) or {}
    assert (condition["status"], condition["reason"]) == ("False", "Disabled")
    # a pool that never had gateway mode gets no such condition
    assert gateway_ready(reconcile(sample_pool(uid="uid-chat", generation=1), {}, NOW)) is None


def test_a_gateway_child_another_owner_holds_is_left_alone() -> None:
    document = gateway_pool()
    observed = world(document)
    observed[("InferencePool", "chat-inference-pool")]["metadata"]["ownerReferences"] = []
    document["spec"]["gateway"]["enabled"] = False
    deleted = {(a.kind, a.name) for a in reconcile(document, observed, NOW).actions if a.verb == "delete"}
    assert ("InferencePool", "chat-inference-pool") not in deleted
