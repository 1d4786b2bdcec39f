"""Tests of coserve.operator.resources: the objects `coserve render` prints and the operator applies."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from coserve.api import CoServePool, Plan, parse_pool
from coserve.api.problems import InvalidInput
from coserve.api.profile import EngineProfile
from coserve.api.spec import (
    OPERATOR_ENV_NAMES,
    OPERATOR_ENV_PREFIX,
    OPERATOR_LABELS,
    OPERATOR_MOUNT_PATHS,
    OPERATOR_VOLUMES,
    ROUTER_MOUNT_PATHS,
)
from coserve.api.status import PlanUtilization
from coserve.operator.resources import (
    CHILDREN,
    CONFIG_HASH_ANNOTATION,
    OPTIONAL_CHILDREN,
    ROLE_LABEL,
    build_children,
    child_keys,
    child_name,
    config_data,
    config_hash,
    decoders_before_headroom,
    drain_command,
    engine_args,
    kv_transfer_config,
    router_image,
)
from coserve.provisioning import plan_for
from pool_builders import sample_pool

# coserve.scheduling.preemption.safepoint_min_step_s for the default classes: 2 % of interactive's 1 s TTFT objective
MIN_STEP_S = 0.02
EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"

BASE_POOL: dict[str, Any] = sample_pool()

# What the operator sets for NixlConnector's side channel in both engines of a GPU pool, such as the sample pool.
NIXL_ENV = [
    {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": "5600"},
]

# What the sample pool renders: every child but the model cache's claim (it has no spec.model.cache).
EXPECTED_ORDER = [
    ("ConfigMap", "chat-config"),
    ("Deployment", "chat-prefiller"),
    ("Deployment", "chat-decoder"),
    ("Deployment", "chat-router"),
    ("Service", "chat-router"),
    ("Service", "chat-prefiller"),
    ("Service", "chat-decoder"),
    ("Secret", "chat-router-token"),
    ("NetworkPolicy", "chat-engines"),
    ("ServiceAccount", "chat-router"),
    ("Role", "chat-router"),
    ("RoleBinding", "chat-router"),
    ("PodDisruptionBudget", "chat-router"),
    ("PodDisruptionBudget", "chat-prefiller"),
    ("PodDisruptionBudget", "chat-decoder"),
]
# Every child a pool may have, in apply order: what the operator reads before each reconcile.
# Gateway mode's children (spec.gateway.enabled): the endpoint picker, the proxies' policy, the InferencePool and route.
GATEWAY_ORDER = [
    ("Deployment", "chat-picker"),
    ("Service", "chat-picker"),
    ("NetworkPolicy", "chat-gateway-proxies"),
    ("InferencePool", "chat-inference-pool"),
    ("HTTPRoute", "chat-route"),
]
EVERY_CHILD = [EXPECTED_ORDER[0], ("PersistentVolumeClaim", "chat-model-cache"), *EXPECTED_ORDER[1:], *GATEWAY_ORDER]


def make_pool(**spec_updates: Any) -> dict[str, Any]:
    document = copy.deepcopy(BASE_POOL)
    document["spec"].update(copy.deepcopy(spec_updates))
    return document


def render(document: dict[str, Any], **kwargs: Any) -> list[dict[str, Any]]:
    pool = parse_pool(document)
    return build_children(pool, plan_for(pool.spec), **kwargs)


def by_key(children: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(child["kind"], child["metadata"]["name"]): child for child in children}


def deployment(children: list[dict[str, Any]], component: str) -> dict[str, Any]:
    return by_key(children)[("Deployment", f"chat-{component}")]


def container(children: list[dict[str, Any]], component: str) -> dict[str, Any]:
    containers = deployment(children, component)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]  # type: ignore[no-any-return]


def arg_value(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, f"{flag} appears {args.count(flag)} times"
    return args[args.index(flag) + 1]


def kv_config(children: list[dict[str, Any]], role: str) -> dict[str, Any]:
    return json.loads(arg_value(container(children, role)["args"], "--kv-transfer-config"))  # type: ignore[no-any-return]


def walk(value: Any, path: str = "") -> list[tuple[str, Any]]:
    """Every (path, leaf-or-container) pair of a JSON-like tree."""
    found = [(path, value)]
    if isinstance(value, dict):
        for key, item in value.items():
            found += walk(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += walk(item, f"{path}[{index}]")
    return found


# --- shape ------------------------------------------------------------------------------------


def test_children_have_the_documented_kinds_names_and_order() -> None:
    children = render(make_pool())

    assert [(c["kind"], c["metadata"]["name"]) for c in children] == EXPECTED_ORDER
    assert child_keys("chat") == EVERY_CHILD  # what the operator reads before each reconcile
    assert [c["apiVersion"] for c in children] == [
        "v1", "apps/v1", "apps/v1", "apps/v1", "v1", "v1", "v1", "v1", "networking.k8s.io/v1", "v1",
        "rbac.authorization.k8s.io/v1", "rbac.authorization.k8s.io/v1", "policy/v1", "policy/v1", "policy/v1"
    ]  # fmt: skip


def test_only_the_optional_children_are_ever_left_out() -> None:
    """The operator creates what build_children renders; a child in CHILDREN it leaves out must be optional."""
    bare = make_pool(disruption={"enabled": False}, router={"replicas": 1})
    full = make_pool(model={"name": "Qwen/Qwen3-8B", "cache": {"size": "100Gi"}}, gateway={"enabled": True})

    rendered_bare = {(c["kind"], c["metadata"]["labels"]["app.kubernetes.io/component"]) for c in render(bare)}
    rendered_full = [(c["kind"], c["metadata"]["labels"]["app.kubernetes.io/component"]) for c in render(full)]

    assert set(CHILDREN) - rendered_bare == OPTIONAL_CHILDREN
    assert rendered_full == list(CHILDREN)  # everything, in CHILDREN's order


def test_engine_replicas_follow_the_plan_and_router_replicas_follow_the_spec() -> None:
    pool = parse_pool(make_pool(router={"replicas": 3}))
    plan = plan_for(pool.spec).model_copy(update={"prefillers": 4, "decoders": 11})

    children = build_children(pool, plan)

    assert deployment(children, "prefiller")["spec"]["replicas"] == 4
    assert deployment(children, "decoder")["spec"]["replicas"] == 11
    assert deployment(children, "router")["spec"]["replicas"] == 3
    assert all(type(deployment(children, c)["spec"]["replicas"]) is int for c in ("prefiller", "decoder", "router"))


@pytest.mark.parametrize("namespace", ["serving", None])
def test_every_object_carries_the_labels_and_the_pool_namespace(namespace: str | None) -> None:
    document = make_pool()
    document["metadata"]["namespace"] = namespace
    if namespace is None:
        del document["metadata"]["namespace"]

    children = render(document)

    components = ["config", "prefiller", "decoder", "router", "router", "prefiller", "decoder", "router-token",
                  "engines", "router", "router", "router", "router", "prefiller", "decoder"]  # fmt: skip
    for child, component in zip(children, components, strict=True):
        assert child["metadata"]["labels"] == {
            "app.kubernetes.io/name": "coserve",
            "app.kubernetes.io/instance": "chat",
            "app.kubernetes.io/component": component,
            "app.kubernetes.io/managed-by": "coserve-operator",
            "coserve.dev/role": component,
        }
        if namespace is None:
            assert "namespace" not in child["metadata"]
        else:
            assert child["metadata"]["namespace"] == namespace


def test_owner_references_appear_only_when_the_pool_has_a_uid() -> None:
    without_uid = render(make_pool())
    document = make_pool()
    document["metadata"]["uid"] = "6f1c1c9e-0000-4000-8000-000000000001"
    with_uid = render(document)

    assert all("ownerReferences" not in child["metadata"] for child in without_uid)
    for child in with_uid:
        assert child["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "coserve.dev/v1alpha1",
                "kind": "CoServePool",
                "name": "chat",
                "uid": "6f1c1c9e-0000-4000-8000-000000000001",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]


def test_no_value_anywhere_is_none() -> None:
    document = make_pool(
        engine={"decoder": {"tolerations": [{"operator": "Exists"}]}},
        router={"resources": {"limits": {"memory": "1Gi"}}},
    )
    children = render(document)

    assert [path for child in children for path, value in walk(child) if value is None] == []


def test_two_builds_of_the_same_pool_are_equal() -> None:
    pool = parse_pool(make_pool(kvOffload={"enabled": True}))
    plan = plan_for(pool.spec)

    first = build_children(pool, plan, operator_image_tag="0.2.0")
    second = build_children(pool, plan, operator_image_tag="0.2.0")

    assert first == second
    assert json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)


def test_callers_mutating_the_output_do_not_change_the_next_build() -> None:
    pool = parse_pool(make_pool())
    plan = plan_for(pool.spec)
    first = build_children(pool, plan)
    container(first, "prefiller")["command"].append("--oops")
    container(first, "router")["command"].append("--oops")

    second = build_children(pool, plan)

    assert container(second, "prefiller")["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--oops" not in container(second, "router")["command"]


# --- selectors --------------------------------------------------------------------------------


@pytest.mark.parametrize("component", ["prefiller", "decoder", "router"])
def test_deployment_selector_matches_its_pod_template_labels(component: str) -> None:
    spec = deployment(render(make_pool()), component)["spec"]
    match_labels = spec["selector"]["matchLabels"]
    template_labels = spec["template"]["metadata"]["labels"]

    assert match_labels == {"app.kubernetes.io/instance": "chat", ROLE_LABEL: component}
    assert match_labels.items() <= template_labels.items()


@pytest.mark.parametrize("component", ["prefiller", "decoder", "router"])
def test_service_selects_exactly_its_role_pods(component: str) -> None:
    children = render(make_pool())
    selector = by_key(children)[("Service", f"chat-{component}")]["spec"]["selector"]
    template_labels = {
        c: deployment(children, c)["spec"]["template"]["metadata"]["labels"] for c in ("prefiller", "decoder", "router")
    }

    assert [c for c, labels in template_labels.items() if selector.items() <= labels.items()] == [component]


def test_router_service_is_cluster_ip_from_80_to_the_router_port() -> None:
    service = by_key(render(make_pool()))[("Service", "chat-router")]

    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]
    assert container(render(make_pool()), "router")["ports"] == [
        {"name": "http", "containerPort": 8080, "protocol": "TCP"}
    ]


@pytest.mark.parametrize("role", ["prefiller", "decoder"])
def test_engine_services_are_headless_and_publish_only_ready_pods(role: str) -> None:
    service = by_key(render(make_pool()))[("Service", f"chat-{role}")]

    assert service["spec"]["clusterIP"] == "None"  # the string: Python None would mean "allocate an IP"
    assert service["spec"]["publishNotReadyAddresses"] is False
    assert service["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": 8000, "protocol": "TCP"}]
    assert "type" not in service["spec"]


# --- the ConfigMap ----------------------------------------------------------------------------


def test_config_map_holds_engine_and_router_config() -> None:
    document = make_pool(
        model={"name": "Qwen/Qwen3-8B", "servedModelName": "qwen"},
        offline={"enabled": True, "share": 0.25},
        kvOffload={"enabled": True, "backend": "lmcache", "hostMemoryBytes": 1024},
    )
    config_map = render(document)[0]

    engine = json.loads(config_map["data"]["engine.json"])
    router = json.loads(config_map["data"]["router.json"])

    assert sorted(config_map["data"]) == ["engine.json", "router.json"]
    assert engine["priorityClasses"][0] == {
        "name": "interactive",
        "weight": 10.0,
        "ttftSloMs": 1000.0,
        "tpotSloMs": 100.0,
    }
    assert [c["name"] for c in engine["priorityClasses"]] == ["interactive", "standard", "offline"]
    assert engine["offline"] == {"enabled": True, "share": 0.25, "className": "offline"}
    assert engine["kvOffload"] == {"enabled": True, "backend": "lmcache", "hostMemoryBytes": 1024}
    assert engine["prefillLatency"] == {"constantS": 0.01, "perTokenS": 0.0001, "perTokenSquaredS": 0.0}
    assert router == {
        "model": "qwen",
        "prefillerService": "chat-prefiller.serving.svc",
        "decoderService": "chat-decoder.serving.svc",
        "enginePort": 8000,
        "priorityClasses": engine["priorityClasses"],
        "offline": engine["offline"],
        "batchDir": "/var/lib/coserve/batches",
        "batchLock": "lease",
        "prefillLatency": engine["prefillLatency"],  # the router avoids prefillers that would miss a TTFT SLO
        "kvTransferParams": True,  # GPU engines hand KV over through NixlConnector: the router asks for it
    }


def test_the_router_asks_for_a_handoff_exactly_when_the_engines_render_one() -> None:
    """One decision, ``pool_handoff``: NixlConnector on both engines and the router's P/D protocol, or neither."""
    gpu = make_pool()
    cpu = make_pool(engine={"resources": {"limits": {"cpu": "4"}}})
    for document, expected in ((gpu, True), (cpu, False)):
        objects = render(document)
        router = json.loads(objects[0]["data"]["router.json"])
        connectors = {
            role: json.dumps(kv_transfer_config(parse_pool(document).spec, role)) for role in ("prefiller", "decoder")
        }
        assert router.get("kvTransferParams", False) is expected
        assert all(("NixlConnector" in text) is expected for text in connectors.values())


def test_router_config_uses_the_default_namespace_and_the_model_name_when_unset() -> None:
    document = make_pool()
    del document["metadata"]["namespace"]

    router = json.loads(render(document)[0]["data"]["router.json"])

    assert router["model"] == "Qwen/Qwen3-8B"
    assert router["prefillerService"] == "chat-prefiller.default.svc"
    assert router["decoderService"] == "chat-decoder.default.svc"


def test_engine_config_has_no_prefill_curve_when_the_profile_comes_only_from_a_config_map() -> None:
    document = make_pool(profile={"configMapRef": {"name": "measured"}})
    pool = parse_pool(document)
    measured = EngineProfile.model_validate_json(
        json.dumps(
            {
                "prefillLatency": {"perTokenS": 0.0001},
                "decodeThroughputTokensPerS": 2000.0,
                "kvCapacityTokens": 400000,
            }
        )
    )

    engine = json.loads(build_children(pool, plan_for(pool.spec, measured))[0]["data"]["engine.json"])

    assert "prefillLatency" not in engine


# --- the config hash --------------------------------------------------------------------------


def pod_hashes(children: list[dict[str, Any]]) -> set[str]:
    return {
        deployment(children, c)["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]
        for c in ("prefiller", "decoder", "router")
    }


def test_every_pod_template_carries_the_hash_of_the_config_map_data() -> None:
    children = render(make_pool())
    digest = config_hash(children[0]["data"])

    assert pod_hashes(children) == {digest}
    assert len(digest) == 16 and int(digest, 16) >= 0


def test_config_hash_changes_when_a_priority_class_slo_changes() -> None:
    classes = [{"name": "interactive", "weight": 10.0, "ttftSloMs": 1000.0, "tpotSloMs": 100.0}]
    tighter = [{**classes[0], "ttftSloMs": 500.0}]

    before = pod_hashes(render(make_pool(priorityClasses=classes)))
    after = pod_hashes(render(make_pool(priorityClasses=tighter)))

    assert len(before) == len(after) == 1
    assert before != after


def test_config_hash_does_not_change_when_only_replicas_change() -> None:
    pool = parse_pool(make_pool())
    plan = plan_for(pool.spec)
    scaled_pool = parse_pool(make_pool(router={"replicas": 5}))
    scaled_plan = plan.model_copy(update={"prefillers": plan.prefillers + 3, "decoders": plan.decoders + 9})

    before = build_children(pool, plan)
    after = build_children(scaled_pool, scaled_plan)

    assert pod_hashes(before) == pod_hashes(after)
    assert deployment(after, "decoder")["spec"]["replicas"] == plan.decoders + 9


@settings(max_examples=50, deadline=None)
@given(
    ttft_slo_ms=st.floats(min_value=100, max_value=1e6, allow_nan=False),
    num_prefillers=st.integers(min_value=1, max_value=10_000),
    num_decoders=st.integers(min_value=1, max_value=10_000),
)
def test_config_hash_depends_on_config_only(ttft_slo_ms: float, num_prefillers: int, num_decoders: int) -> None:
    classes = [{"name": "interactive", "weight": 1.0, "ttftSloMs": ttft_slo_ms, "tpotSloMs": 100.0}]
    pool = parse_pool(make_pool(priorityClasses=classes))
    plan = plan_for(pool.spec)

    scaled = build_children(pool, plan.model_copy(update={"prefillers": num_prefillers, "decoders": num_decoders}))

    assert pod_hashes(scaled) == {config_hash(config_data(pool))}
    assert json.loads(scaled[0]["data"]["engine.json"])["priorityClasses"][0]["ttftSloMs"] == ttft_slo_ms


def test_config_hash_ignores_key_order() -> None:
    assert config_hash({"a": "1", "b": "2"}) == config_hash({"b": "2", "a": "1"})
    assert config_hash({"a": "1", "b": "2"}) != config_hash({"a": "2", "b": "1"})


# --- engine pods ------------------------------------------------------------------------------


COSERVE_CONNECTOR = {"kv_connector": "CoServeConnector", "kv_connector_module_path": "coserve.engine.connector"}
CPU_ENGINE = {"resources": {"limits": {"cpu": "8"}}}
GPU_ENGINE = {"resources": {"limits": {"nvidia.com/gpu": 1}}}


@pytest.mark.parametrize(("role", "kv_role"), [("prefiller", "kv_producer"), ("decoder", "kv_consumer")])
def test_gpu_engines_hand_kv_over_with_nixl_beside_coserves_connector(role: str, kv_role: str) -> None:
    assert kv_config(render(make_pool(engine=GPU_ENGINE)), role) == {
        "kv_connector": "MultiConnector",
        "kv_role": kv_role,
        "kv_load_failure_policy": "recompute",  # read at the top level only
        "kv_connector_extra_config": {
            "connectors": [
                {
                    **COSERVE_CONNECTOR,
                    "kv_role": kv_role,
                    "kv_connector_extra_config": {
                        "coserve_config": "/etc/coserve/engine.json",
                        "safepoint_min_step_s": MIN_STEP_S,
                    },
                },
                {"kv_connector": "NixlConnector", "kv_role": kv_role},
            ]
        },
    }


@pytest.mark.parametrize(("role", "kv_role"), [("prefiller", "kv_producer"), ("decoder", "kv_consumer")])
def test_cpu_engines_get_coserves_connector_alone(role: str, kv_role: str) -> None:
    assert kv_config(render(make_pool(engine=CPU_ENGINE)), role) == {
        **COSERVE_CONNECTOR,
        "kv_role": kv_role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"coserve_config": "/etc/coserve/engine.json", "safepoint_min_step_s": MIN_STEP_S},
    }


@pytest.mark.parametrize("role", ["prefiller", "decoder"])
def test_the_host_pool_size_reaches_coserves_connector_only_when_enabled(role: str) -> None:
    enabled = make_pool(engine=CPU_ENGINE, kvOffload={"enabled": True, "hostMemoryBytes": 4 * 2**30})
    extra = kv_config(render(enabled), role)["kv_connector_extra_config"]
    assert extra == {
        "coserve_config": "/etc/coserve/engine.json",
        "host_memory_bytes": 4 * 2**30,
        "safepoint_min_step_s": MIN_STEP_S,
    }
    assert type(extra["host_memory_bytes"]) is int
    disabled = make_pool(engine=CPU_ENGINE, kvOffload={"enabled": False, "hostMemoryBytes": 4 * 2**30})
    assert "host_memory_bytes" not in kv_config(render(disabled), role)["kv_connector_extra_config"]


@pytest.mark.parametrize(
    ("backend", "connector", "env"),
    [
        ("native", {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"cpu_bytes_to_use": 4 * 2**30}}, {}),
        ("lmcache", {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"},
         {"LMCACHE_LOCAL_CPU": "True", "LMCACHE_MAX_LOCAL_CPU_SIZE": "4"}),
    ],
)  # fmt: skip
def test_gpu_offload_backends_are_their_own_connectors(
    backend: str, connector: dict[str, Any], env: dict[str, str]
) -> None:
    document = make_pool(
        engine=GPU_ENGINE, kvOffload={"enabled": True, "backend": backend, "hostMemoryBytes": 4 * 2**30}
    )
    children = render(document)
    connectors = kv_config(children, "decoder")["kv_connector_extra_config"]["connectors"]
    assert connectors[-1] == connector
    assert "host_memory_bytes" not in connectors[0]["kv_connector_extra_config"]  # coserve's own pool stays off
    rendered_env = {item["name"]: item.get("value") for item in container(children, "decoder")["env"]}
    assert env.items() <= rendered_env.items()


def test_engine_args_put_coserve_flags_first_then_engine_then_role_extra_args() -> None:
    document = make_pool(
        model={"name": "Qwen/Qwen3-8B", "servedModelName": "qwen"},
        engine={
            "tensorParallelSize": 2,
            "extraArgs": ["--max-model-len", "32768"],
            "decoder": {"extraArgs": ["--gpu-memory-utilization", "0.95"]},
        },
    )
    children = render(document)
    prefiller_args = container(children, "prefiller")["args"]
    decoder_args = container(children, "decoder")["args"]

    common = [
        "--model",
        "Qwen/Qwen3-8B",
        "--served-model-name",
        "qwen",
        "--port",
        "8000",
        "--tensor-parallel-size",
        "2",
        "--scheduler-cls",
        "coserve.engine.scheduler.TDGScheduler",
        "--no-async-scheduling",
        "--worker-cls",
        "coserve.engine.worker.SafepointGPUWorker",
        "--middleware",
        "coserve.engine.validation.RequestClassValidator",
        "--kv-transfer-config",
    ]
    assert prefiller_args[:-3] == common and decoder_args[:-5] == common
    assert prefiller_args[-2:] == ["--max-model-len", "32768"]
    assert decoder_args[-4:] == ["--max-model-len", "32768", "--gpu-memory-utilization", "0.95"]
    assert all(isinstance(arg, str) for arg in prefiller_args + decoder_args)


def test_role_overrides_apply_only_to_their_role() -> None:
    document = make_pool(
        engine={
            "resources": {"limits": {"nvidia.com/gpu": 1}},
            "decoder": {
                "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-L40S"},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "48Gi"}, "requests": {"cpu": "8"}},
            },
        }
    )
    children = render(document)
    prefiller_pod = deployment(children, "prefiller")["spec"]["template"]["spec"]
    decoder_pod = deployment(children, "decoder")["spec"]["template"]["spec"]

    assert decoder_pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L40S"}
    assert decoder_pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert decoder_pod["containers"][0]["resources"] == {
        "limits": {"nvidia.com/gpu": 1, "memory": "48Gi"},
        "requests": {"cpu": "8"},
    }
    assert "nodeSelector" not in prefiller_pod and "tolerations" not in prefiller_pod
    assert prefiller_pod["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    assert type(prefiller_pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]) is int


@pytest.mark.parametrize("role", ["prefiller", "decoder"])
def test_engine_container_runs_vllm_with_the_coserve_plugin(role: str) -> None:
    document = make_pool(engine={"image": "registry.example/vllm:1", "imagePullPolicy": "Always"})
    children = render(document)
    engine = container(children, role)
    pod = deployment(children, role)["spec"]["template"]

    assert engine["name"] == "vllm"
    assert engine["image"] == "registry.example/vllm:1"
    assert engine["imagePullPolicy"] == "Always"
    assert engine["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert engine["env"] == [
        {"name": "COSERVE_ROLE", "value": role},
        {"name": "COSERVE_CONFIG", "value": "/etc/coserve/engine.json"},
        {"name": "VLLM_PLUGINS", "value": "coserve"},
        {"name": "VLLM_USE_V2_MODEL_RUNNER", "value": "0"},
        {"name": "COSERVE_ROUTER_TOKEN_FILE", "value": "/etc/coserve-token/token"},
        *NIXL_ENV,  # the default resources ask for a GPU: NixlConnector hands turn 1's KV over
    ]
    assert engine["ports"] == [
        {"name": "http", "containerPort": 8000, "protocol": "TCP"},
        {"name": "nixl-side", "containerPort": 5600, "protocol": "TCP"},
    ]
    assert engine["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    # restricted; no runAsUser: coserve's engine images run as the numeric user 65532, which the kubelet checks
    assert pod["spec"]["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "8000"
    assert pod["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"


@pytest.mark.parametrize("role", ["prefiller", "decoder"])
@pytest.mark.parametrize(
    ("model", "startup_s"),
    [
        ({"cache": {"claimName": "weights"}}, 600),  # the download ran in the init container, before any probe
        ({"local": True}, 600),  # nothing to download
        ({}, 600 + 3600),  # every start downloads in the vLLM container: downloadTimeoutS on top
        ({"downloadTimeoutS": 7205}, 600 + 7210),  # whole probe periods, never less than asked
        ({"downloadTimeoutS": 0}, 600),
    ],
)
def test_engine_startup_probe_allows_loading_and_any_download_at_start(
    role: str, model: dict[str, Any], startup_s: int
) -> None:
    engine = container(render(make_pool(model={"name": "Qwen/Qwen3-8B", **model})), role)

    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert engine[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert engine["startupProbe"]["periodSeconds"] == 10
    assert engine["startupProbe"]["periodSeconds"] * engine["startupProbe"]["failureThreshold"] == startup_s
    assert (engine["livenessProbe"]["periodSeconds"], engine["livenessProbe"]["failureThreshold"]) == (10, 3)
    assert engine["readinessProbe"]["periodSeconds"] == 5


@pytest.mark.parametrize("role", ["prefiller", "decoder"])
def test_engine_pods_mount_the_config_read_only_and_shared_memory(role: str) -> None:
    children = render(make_pool())
    pod = deployment(children, role)["spec"]["template"]["spec"]

    assert pod["volumes"] == [
        {"name": "config", "configMap": {"name": "chat-config"}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        {"name": "router-token", "secret": {"secretName": "chat-router-token"}},
    ]
    assert pod["containers"][0]["volumeMounts"] == [
        {"name": "config", "mountPath": "/etc/coserve", "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},  # noqa: S108 (a path in the pod)
        {"name": "router-token", "mountPath": "/etc/coserve-token", "readOnly": True},
    ]


# --- the router -------------------------------------------------------------------------------


def test_router_runs_coserve_router_with_restricted_security() -> None:
    document = make_pool(router={"replicas": 2, "resources": {"requests": {"cpu": "1"}, "limits": {"memory": "2Gi"}}})
    children = render(document)
    router = container(children, "router")
    pod = deployment(children, "router")["spec"]["template"]["spec"]

    assert router["image"] == "ghcr.io/coserve/coserve:0.1.0"
    assert router["command"] == ["coserve", "router", "--config", "/etc/coserve/router.json", "--port", "8080"]
    assert router["resources"] == {"requests": {"cpu": "1"}, "limits": {"memory": "2Gi"}}
    assert router["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http"}  # the process serves
    assert router["startupProbe"]["httpGet"] == {"path": "/live", "port": "http"}
    assert router["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}  # it can place a request
    assert router["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": 65532,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 65532,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert {"name": "config", "configMap": {"name": "chat-config"}} in pod["volumes"]
    assert {"name": "config", "mountPath": "/etc/coserve", "readOnly": True} in router["volumeMounts"]
    assert {"name": "batches", "mountPath": "/var/lib/coserve/batches"} in router["volumeMounts"]
    assert {"name": "batches", "emptyDir": {}} in pod["volumes"]  # no claim: batches live as long as the pod
    # the router proves itself to the engines with the pool's token
    assert {"name": "router-token", "secret": {"secretName": "chat-router-token"}} in pod["volumes"]
    assert {"name": "router-token", "mountPath": "/etc/coserve-token", "readOnly": True} in router["volumeMounts"]
    assert router["env"] == [
        {"name": "COSERVE_ROUTER_TOKEN_FILE", "value": "/etc/coserve-token/token"},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    assert pod["serviceAccountName"] == "chat-router"  # its Role: the Leases that run each batch once


def test_offline_batches_live_on_the_named_claim() -> None:
    children = render(make_pool(router={"batchVolumeClaim": "chat-batches"}))
    pod = next(c for c in children if c["kind"] == "Deployment" and c["metadata"]["name"] == "chat-router")
    volumes = pod["spec"]["template"]["spec"]["volumes"]
    assert {"name": "batches", "persistentVolumeClaim": {"claimName": "chat-batches"}} in volumes


@pytest.mark.parametrize(
    ("router", "tag", "expected"),
    [
        ({}, None, "ghcr.io/coserve/coserve:0.1.0"),
        ({}, "0.2.0", "ghcr.io/coserve/coserve:0.2.0"),
        ({"image": "registry.example/router:7"}, "0.2.0", "registry.example/router:7"),
        ({"image": "registry.example/router:7"}, None, "registry.example/router:7"),
    ],
)
def test_only_a_router_on_the_default_image_follows_the_operator_tag(
    router: dict[str, Any], tag: str | None, expected: str
) -> None:
    children = render(make_pool(router=router), operator_image_tag=tag)

    assert container(children, "router")["image"] == expected
    assert container(children, "prefiller")["image"] == "ghcr.io/coserve/vllm:0.1.0"


@pytest.mark.parametrize("tag", ["", "-leading-dash", "has space", "x" * 129, "a:b"])
def test_invalid_operator_tag_is_refused(tag: str) -> None:
    pool = parse_pool(make_pool())
    with pytest.raises(ValueError, match="operator_image_tag"):
        router_image(pool.spec.router, tag)


# --- names ------------------------------------------------------------------------------------


@pytest.mark.parametrize("component", ["prefiller", "decoder", "router", "config"])
def test_child_name_is_pool_dash_component(component: str) -> None:
    assert child_name("chat", component) == f"chat-{component}"


def test_child_name_refuses_an_unknown_component() -> None:
    with pytest.raises(ValueError, match="unknown component 'worker'"):
        child_name("chat", "worker")


# --- the shipped examples render --------------------------------------------------------------


def load_example(path: Path) -> tuple[CoServePool, Plan]:
    pool = parse_pool(yaml.safe_load(path.read_text()))
    measured = None
    if pool.spec.profile.config_map_ref is not None:
        profile_document = yaml.safe_load((EXAMPLES_DIR / "profile.yaml").read_text())
        measured = EngineProfile.model_validate_json(json.dumps(profile_document))
    return pool, plan_for(pool.spec, measured)


@pytest.mark.parametrize("path", sorted(EXAMPLES_DIR.glob("pool*.yaml")), ids=lambda p: p.name)
def test_every_example_pool_renders_valid_children(path: Path) -> None:
    pool, plan = load_example(path)

    children = build_children(pool, plan)

    name = pool.metadata.name
    rendered = [(c["kind"], c["metadata"]["name"]) for c in children]
    every = child_keys(name)
    optional = {(kind, child_name(name, component)) for kind, component in OPTIONAL_CHILDREN}
    assert rendered == [key for key in every if key in rendered]  # CHILDREN's order
    assert set(every) - set(rendered) <= optional
    assert [p for child in children for p, value in walk(child) if value is None] == []
    json.dumps(children, allow_nan=False)  # JSON-ready: nothing an API server would refuse to decode


@pytest.mark.parametrize(
    ("engine", "prefiller_worker", "decoder_worker"),
    [
        ({}, "SafepointGPUWorker", "SafepointGPUWorker"),  # the default asks for one GPU
        ({"resources": {"limits": {"cpu": "8"}}}, "SafepointCPUWorker", "SafepointCPUWorker"),
        (  # CPU prefillers, GPU decoders: each role gets the worker of its own resources
            {"resources": {"limits": {"nvidia.com/gpu": 1}}, "prefiller": {"resources": {"requests": {"cpu": "4"}}}},
            "SafepointCPUWorker",
            "SafepointGPUWorker",
        ),
    ],
)
def test_the_worker_class_follows_the_gpu_request(
    engine: dict[str, Any], prefiller_worker: str, decoder_worker: str
) -> None:
    spec = parse_pool(make_pool(engine=engine)).spec
    for role, expected in (("prefiller", prefiller_worker), ("decoder", decoder_worker)):
        args = engine_args(spec, role)  # type: ignore[arg-type]
        assert args[args.index("--worker-cls") + 1] == f"coserve.engine.worker.{expected}"


def test_the_router_token_secret_carries_no_data_the_operator_generates_it() -> None:
    (secret,) = [c for c in render(make_pool()) if c["kind"] == "Secret"]
    assert secret["type"] == "Opaque" and "data" not in secret and "stringData" not in secret


def test_engines_admit_only_the_pools_own_pods_and_the_metrics_scrapers() -> None:
    document = make_pool(engine={"metricsScrapers": [
        {"podLabels": {"app": "vm"}, "namespaceLabels": {"team": "obs"}},
        {"podLabels": {"app.kubernetes.io/name": "prometheus"},
         "namespaceLabels": {"kubernetes.io/metadata.name": "monitoring"}},
    ]})  # fmt: skip
    (policy,) = [c for c in render(document) if c["kind"] == "NetworkPolicy"]
    spec = policy["spec"]
    assert spec["podSelector"] == {
        "matchLabels": {"app.kubernetes.io/instance": "chat"},
        "matchExpressions": [{"key": "coserve.dev/role", "operator": "In", "values": ["prefiller", "decoder"]}],
    }
    assert spec["policyTypes"] == ["Ingress"]
    own, scrapers = spec["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/instance": "chat",
                                                             "app.kubernetes.io/name": "coserve"}}}]}  # fmt: skip
    assert scrapers == {
        "from": [
            {"podSelector": {"matchLabels": {"app": "vm"}}, "namespaceSelector": {"matchLabels": {"team": "obs"}}},
            {
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            },
        ],
        "ports": [{"protocol": "TCP", "port": 8000}],
    }
    # the router's pods carry the labels the first rule admits
    router_labels = deployment(render(document), "router")["spec"]["template"]["metadata"]["labels"]
    assert own["from"][0]["podSelector"]["matchLabels"].items() <= router_labels.items()


def test_by_default_only_the_pools_own_pods_reach_the_engines() -> None:
    """No scraper is admitted unless the spec names one (tests/operator/test_network_policy.py evaluates it)."""
    (policy,) = [c for c in render(make_pool()) if c["kind"] == "NetworkPolicy"]
    assert parse_pool(make_pool()).spec.engine.metrics_scrapers == []
    own_pods = {
        "podSelector": {"matchLabels": {"app.kubernetes.io/instance": "chat", "app.kubernetes.io/name": "coserve"}}
    }
    assert policy["spec"]["ingress"] == [{"from": [own_pods]}]


@pytest.mark.parametrize(
    ("peer", "path", "reason"),
    [
        ({"podLabels": {"app.kubernetes.io/name": "prometheus"}, "namespaceLabels": {}},
         "spec.engine.metricsScrapers[0].namespaceLabels", "an empty selector selects every namespace"),
        ({"podLabels": {}, "namespaceLabels": {"kubernetes.io/metadata.name": "monitoring"}},
         "spec.engine.metricsScrapers[0].podLabels", "an empty selector selects every pod"),
        ({"podLabels": {"app.kubernetes.io/name": "prometheus"}},
         "spec.engine.metricsScrapers[0].namespaceLabels", "required field is missing"),
        ({"namespaceLabels": {"kubernetes.io/metadata.name": "monitoring"}},
         "spec.engine.metricsScrapers[0].podLabels", "required field is missing"),
        ({"podLabels": {"app": "prometheus"}, "namespaceLabels": {"Monitoring/team": "obs"}},
         'spec.engine.metricsScrapers[0].namespaceLabels["Monitoring/team"]', "prefix must be a lowercase DNS"),
    ],
)  # fmt: skip
def test_a_scraper_must_name_its_namespaces_and_its_pods(peer: dict[str, Any], path: str, reason: str) -> None:
    with pytest.raises(InvalidInput) as raised:
        parse_pool(make_pool(engine={"metricsScrapers": [peer]}))
    assert [(p.path, reason in p.reason) for p in raised.value.problems] == [(path, True)]


@pytest.mark.parametrize("path", sorted(EXAMPLES_DIR.glob("pool*.yaml")), ids=lambda p: p.name)
def test_every_rendered_child_is_valid_for_the_kubernetes_api_schema(path: Path) -> None:
    """NetworkPolicy, Secret, Deployments, Services and the ConfigMap, against Kubernetes 1.35's schemas (strict)."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    pool, plan = load_example(path)
    for child in build_children(pool, plan):
        kubernetes_validate.validate(child, "1.35.0", strict=True)  # the recorded API server's version


def test_the_router_may_hold_batch_leases_and_nothing_else() -> None:
    """The router's ServiceAccount is bound to a Role on Leases only, in the pool's namespace."""
    children = {(c["kind"], c["metadata"]["name"]): c for c in render(make_pool())}
    role = children[("Role", "chat-router")]
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "patch"]}
    ]
    binding = children[("RoleBinding", "chat-router")]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "chat-router"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "chat-router", "namespace": "serving"}]
    assert ("ServiceAccount", "chat-router") in children


# --- pod template options -------------------------------------------------------------------------


def pod_template(children: list[dict[str, Any]], component: str) -> dict[str, Any]:
    return deployment(children, component)["spec"]["template"]  # type: ignore[no-any-return]


def env_of(container_manifest: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container_manifest["env"]}


CA_VOLUME = {"name": "ca", "configMap": {"name": "corp-ca"}}
CA_MOUNT = {"name": "ca", "mountPath": "/etc/ssl/corp", "readOnly": True}

ENGINE_OPTIONS: dict[str, Any] = {
    "env": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}, {"name": "NCCL_DEBUG", "value": "WARN"}],
    "envFrom": [{"secretRef": {"name": "engine-secrets"}}],
    "volumes": [CA_VOLUME, {"name": "scratch", "emptyDir": {"sizeLimit": "10Gi"}}],
    "volumeMounts": [CA_MOUNT, {"name": "scratch", "mountPath": "/scratch"}],
    "imagePullSecrets": [{"name": "registry"}],
    "serviceAccountName": "engines",
    "priorityClassName": "serving-high",
    "podLabels": {"team": "inference", "tier": "gpu"},
    "podAnnotations": {"example.com/owner": "inference", "prometheus.io/scrape": "false"},
}


def test_engine_wide_pod_options_land_in_both_engine_pods() -> None:
    children = render(make_pool(engine=ENGINE_OPTIONS))

    for role in ("prefiller", "decoder"):
        template = pod_template(children, role)
        pod, engine = template["spec"], template["spec"]["containers"][0]
        assert engine["env"][:7] == [
            {"name": "COSERVE_ROLE", "value": role},
            {"name": "COSERVE_CONFIG", "value": "/etc/coserve/engine.json"},
            {"name": "VLLM_PLUGINS", "value": "coserve"},
            {"name": "VLLM_USE_V2_MODEL_RUNNER", "value": "0"},
            {"name": "COSERVE_ROUTER_TOKEN_FILE", "value": "/etc/coserve-token/token"},
            *NIXL_ENV,
        ]  # the operator's own first, the user's after: $(NAME) may refer to them
        assert engine["env"][7:] == ENGINE_OPTIONS["env"]
        assert engine["envFrom"] == [{"secretRef": {"name": "engine-secrets"}}]
        assert pod["volumes"][3:] == ENGINE_OPTIONS["volumes"]
        assert engine["volumeMounts"][3:] == ENGINE_OPTIONS["volumeMounts"]
        assert pod["imagePullSecrets"] == [{"name": "registry"}]
        assert pod["serviceAccountName"] == "engines"
        assert pod["priorityClassName"] == "serving-high"
        assert template["metadata"]["labels"] == {
            "team": "inference",
            "tier": "gpu",
            "app.kubernetes.io/name": "coserve",
            "app.kubernetes.io/instance": "chat",
            "app.kubernetes.io/component": role,
            "app.kubernetes.io/managed-by": "coserve-operator",
            "coserve.dev/role": role,
        }
        annotations = template["metadata"]["annotations"]
        assert annotations["example.com/owner"] == "inference"
        assert annotations["prometheus.io/scrape"] == "true"  # the operator's own annotations win


def test_a_roles_options_extend_and_replace_the_engine_wide_ones() -> None:
    decoder = {
        "env": [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "DECODER_ONLY", "value": "1"}],
        "envFrom": [{"configMapRef": {"name": "decoder-tuning"}, "prefix": "TUNE_"}],
        "volumes": [{"name": "scratch", "hostPath": {"path": "/mnt/nvme"}}, {"name": "extra", "emptyDir": {}}],
        "volumeMounts": [{"name": "extra", "mountPath": "/scratch"}, {"name": "ca", "mountPath": "/etc/ssl/more"}],
        "imagePullSecrets": [{"name": "registry"}, {"name": "decoder-registry"}],
        "serviceAccountName": "decoders",
        "priorityClassName": "serving-critical",
        "podLabels": {"tier": "l40s", "pool-part": "decode"},
        "podAnnotations": {"example.com/owner": "decode-team"},
    }
    children = render(make_pool(engine={**ENGINE_OPTIONS, "decoder": decoder}))
    template = pod_template(children, "decoder")
    pod, engine = template["spec"], template["spec"]["containers"][0]

    # lists: engine-wide then the role's, a same-named role entry replacing the engine-wide one in place
    assert engine["env"][7:] == [  # after the operator's own (the side channel's two included)
        {"name": "HTTPS_PROXY", "value": "http://proxy:3128"},
        {"name": "NCCL_DEBUG", "value": "INFO"},
        {"name": "DECODER_ONLY", "value": "1"},
    ]
    assert engine["envFrom"] == [
        {"secretRef": {"name": "engine-secrets"}},
        {"prefix": "TUNE_", "configMapRef": {"name": "decoder-tuning"}},
    ]
    assert pod["volumes"][3:] == [
        CA_VOLUME,
        {"name": "scratch", "hostPath": {"path": "/mnt/nvme"}},
        {"name": "extra", "emptyDir": {}},
    ]
    assert engine["volumeMounts"][3:] == [  # keyed by mountPath: /scratch now mounts the role's volume
        CA_MOUNT,
        {"name": "extra", "mountPath": "/scratch"},
        {"name": "ca", "mountPath": "/etc/ssl/more"},
    ]
    assert pod["imagePullSecrets"] == [{"name": "registry"}, {"name": "decoder-registry"}]
    # scalars: the role's; maps: merged, the role's values winning
    assert (pod["serviceAccountName"], pod["priorityClassName"]) == ("decoders", "serving-critical")
    labels = template["metadata"]["labels"]
    assert (labels["team"], labels["tier"], labels["pool-part"]) == ("inference", "l40s", "decode")
    assert template["metadata"]["annotations"]["example.com/owner"] == "decode-team"
    # the prefiller keeps the engine-wide options alone
    prefiller = pod_template(children, "prefiller")
    assert prefiller["spec"]["serviceAccountName"] == "engines"
    assert prefiller["spec"]["containers"][0]["env"][7:] == ENGINE_OPTIONS["env"]


def test_engine_pods_without_options_keep_the_namespace_defaults() -> None:
    pod = pod_template(render(make_pool()), "decoder")["spec"]

    for absent in ("serviceAccountName", "priorityClassName", "imagePullSecrets", "initContainers"):
        assert absent not in pod
    assert "envFrom" not in pod["containers"][0]


def test_the_router_takes_its_own_pod_options_and_keeps_its_service_account() -> None:
    router = {
        "env": [{"name": "LOG_LEVEL", "value": "debug"}],
        "envFrom": [{"configMapRef": {"name": "router-env"}}],
        "volumes": [CA_VOLUME],
        "volumeMounts": [CA_MOUNT],
        "imagePullSecrets": [{"name": "registry"}],
        "priorityClassName": "serving-high",
        "podLabels": {"team": "edge"},
        "podAnnotations": {"example.com/owner": "edge"},
    }
    children = render(make_pool(engine=ENGINE_OPTIONS, router=router))
    template = pod_template(children, "router")
    pod, router_container = template["spec"], template["spec"]["containers"][0]

    assert router_container["env"] == [
        {"name": "COSERVE_ROUTER_TOKEN_FILE", "value": "/etc/coserve-token/token"},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "LOG_LEVEL", "value": "debug"},
    ]
    assert router_container["envFrom"] == [{"configMapRef": {"name": "router-env"}}]
    assert pod["volumes"][-1] == CA_VOLUME and router_container["volumeMounts"][-1] == CA_MOUNT
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    assert pod["priorityClassName"] == "serving-high"
    assert pod["serviceAccountName"] == "chat-router"  # its Role on Leases; never the engines' account
    assert template["metadata"]["labels"]["team"] == "edge"
    assert template["metadata"]["annotations"]["example.com/owner"] == "edge"
    assert "HTTPS_PROXY" not in env_of(router_container)  # the engines' options stay with the engines


def test_a_users_variable_may_retune_what_the_operator_sets_for_lmcache() -> None:
    document = make_pool(
        engine={**GPU_ENGINE, "env": [{"name": "LMCACHE_CHUNK_SIZE", "value": "512"}]},
        kvOffload={"enabled": True, "backend": "lmcache"},
    )
    env = container(render(document), "decoder")["env"]

    names = [item["name"] for item in env]
    assert names.count("LMCACHE_CHUNK_SIZE") == 1
    assert {"name": "LMCACHE_CHUNK_SIZE", "value": "512"} in env


def test_the_operators_own_names_are_the_ones_the_api_refuses() -> None:
    """Every env name, volume, mount path and label the operator sets is reserved in the API, or overridable."""
    document = make_pool(
        model={"name": "Qwen/Qwen3-8B", "hfTokenSecretRef": {"name": "hf"}, "cache": {"size": "1Ti"}},
        engine=GPU_ENGINE,
        kvOffload={"enabled": True, "backend": "lmcache"},
        gateway={"enabled": True, "pickerCertSecret": "picker-cert"},  # the picker, its certificate mounted
    )
    children = render(document)
    for component in ("prefiller", "decoder", "router", "picker"):
        template = pod_template(children, component)
        containers = template["spec"]["containers"] + template["spec"].get("initContainers", [])
        for item in (env for c in containers for env in c.get("env", [])):
            name = item["name"]
            reserved = name.startswith(OPERATOR_ENV_PREFIX) or name in OPERATOR_ENV_NAMES or name == "HF_TOKEN"
            # LMCACHE_* may be retuned (see above), and NIXL's side channel moved (tests/operator/test_engine_args.py)
            assert reserved or name.startswith(("LMCACHE_", "VLLM_NIXL_SIDE_CHANNEL_")), name
        assert {v["name"] for v in template["spec"]["volumes"]} <= set(OPERATOR_VOLUMES)
        mount_paths = {m["mountPath"] for c in containers for m in c["volumeMounts"]}
        assert mount_paths <= {*OPERATOR_MOUNT_PATHS, *ROUTER_MOUNT_PATHS, "/models"}
        assert set(template["metadata"]["labels"]) == set(OPERATOR_LABELS)


# --- the model's source -----------------------------------------------------------------------------


def test_a_hugging_face_token_reaches_every_engine_container_and_the_download() -> None:
    token = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-credentials", "key": "token"}}}
    for model in ({}, {"cache": {"size": "100Gi"}}):
        source = {"name": "meta-llama/Llama-3.1-8B", "hfTokenSecretRef": {"name": "hf-credentials"}, **model}
        children = render(make_pool(model=source))
        for role in ("prefiller", "decoder"):
            pod = pod_template(children, role)["spec"]
            for engine_container in pod["containers"] + pod.get("initContainers", []):
                assert token in engine_container["env"], engine_container["name"]
        assert "HF_TOKEN" not in env_of(container(children, "router"))


def test_a_cache_of_a_size_gets_its_claim_and_a_download_init_container() -> None:
    document = make_pool(
        model={
            "name": "Qwen/Qwen3-8B",
            "cache": {"size": "200Gi", "storageClassName": "fast-rwx", "mountPath": "/weights"},
        },
        engine={"image": "registry.example/vllm:1", "imagePullPolicy": "Always", **ENGINE_OPTIONS},
    )
    children = render(document)

    claim = by_key(children)[("PersistentVolumeClaim", "chat-model-cache")]
    assert children[1] is claim  # before the Deployments whose pods mount it
    assert claim["metadata"]["labels"]["app.kubernetes.io/component"] == "model-cache"
    assert claim["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "200Gi"}},
        "storageClassName": "fast-rwx",
    }
    for role in ("prefiller", "decoder"):
        pod = pod_template(children, role)["spec"]
        assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "chat-model-cache"}} in pod["volumes"]
        engine = pod["containers"][0]
        assert {"name": "model-cache", "mountPath": "/weights", "readOnly": True} in engine["volumeMounts"]
        assert env_of(engine)["HF_HUB_CACHE"] == "/weights/hub"
        assert env_of(engine)["HF_HUB_OFFLINE"] == "1"
        (download,) = pod["initContainers"]
        assert download["name"] == "model-download"
        assert (download["image"], download["imagePullPolicy"]) == ("registry.example/vllm:1", "Always")
        assert download["command"] == [
            "python3", "-m", "coserve.model_cache", "--model", "Qwen/Qwen3-8B", "--cache-dir", "/weights/hub"
        ]  # fmt: skip
        cache_mount = {"name": "model-cache", "mountPath": "/weights"}  # read-write: it fills the cache
        assert download["volumeMounts"] == [cache_mount, *ENGINE_OPTIONS["volumeMounts"]]
        assert download["env"] == ENGINE_OPTIONS["env"]  # a proxy or HF_ENDPOINT reaches the download too
        assert download["envFrom"] == ENGINE_OPTIONS["envFrom"]
        assert "nvidia.com/gpu" not in json.dumps(download["resources"])  # the download needs no GPU
        assert download["securityContext"] == engine["securityContext"]


def test_a_cache_on_an_existing_claim_creates_no_claim() -> None:
    children = render(make_pool(model={"name": "Qwen/Qwen3-8B", "cache": {"claimName": "shared-weights"}}))

    assert not [c for c in children if c["kind"] == "PersistentVolumeClaim"]
    pod = pod_template(children, "decoder")["spec"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "shared-weights"}} in pod["volumes"]
    assert {"name": "model-cache", "mountPath": "/models", "readOnly": True} in pod["containers"][0]["volumeMounts"]
    assert pod["initContainers"][0]["command"][-2:] == ["--cache-dir", "/models/hub"]


def test_local_weights_load_offline_without_a_download() -> None:
    document = make_pool(
        model={"name": "/weights/qwen3-8b", "local": True},
        engine={"volumes": [{"name": "weights", "persistentVolumeClaim": {"claimName": "w", "readOnly": True}}],
                "volumeMounts": [{"name": "weights", "mountPath": "/weights", "readOnly": True}]},
    )  # fmt: skip
    children = render(document)

    pod = pod_template(children, "prefiller")["spec"]
    engine = pod["containers"][0]
    assert "initContainers" not in pod
    assert env_of(engine)["HF_HUB_OFFLINE"] == "1" and "HF_HUB_CACHE" not in env_of(engine)
    assert arg_value(engine["args"], "--model") == "/weights/qwen3-8b"
    assert not [c for c in children if c["kind"] == "PersistentVolumeClaim"]


def test_without_a_cache_engines_download_online_at_start() -> None:
    engine = container(render(make_pool()), "decoder")

    assert not {"HF_HUB_CACHE", "HF_HUB_OFFLINE", "HF_TOKEN"} & set(env_of(engine))
    assert "model-cache" not in json.dumps(pod_template(render(make_pool()), "decoder"))


# --- topology spread --------------------------------------------------------------------------------


def default_spread(component: str) -> list[dict[str, Any]]:
    return [
        {
            "maxSkew": 1,
            "topologyKey": key,
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "chat", "coserve.dev/role": component}},
            "matchLabelKeys": ["pod-template-hash"],
        }
        for key in ("kubernetes.io/hostname", "topology.kubernetes.io/zone")
    ]


@pytest.mark.parametrize("component", ["prefiller", "decoder", "router"])
def test_every_role_spreads_over_nodes_and_zones_by_default(component: str) -> None:
    children = render(make_pool())
    template = pod_template(children, component)

    assert template["spec"]["topologySpreadConstraints"] == default_spread(component)
    selector = template["spec"]["topologySpreadConstraints"][0]["labelSelector"]["matchLabels"]
    assert selector.items() <= template["metadata"]["labels"].items()  # it counts the role's own pods


def test_spread_constraints_replace_the_default_and_an_empty_list_turns_it_off() -> None:
    rack = {"topologyKey": "example.com/rack", "maxSkew": 2, "whenUnsatisfiable": "DoNotSchedule", "minDomains": 3}
    selected = {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"app": "x"}}}
    document = make_pool(
        engine={"topologySpreadConstraints": [rack], "decoder": {"topologySpreadConstraints": []}},
        router={"topologySpreadConstraints": [selected]},
    )
    children = render(document)

    assert pod_template(children, "prefiller")["spec"]["topologySpreadConstraints"] == [
        {
            "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "chat", "coserve.dev/role": "prefiller"}},
            **rack,
        }
    ]  # no labelSelector: the role's own pods
    assert "topologySpreadConstraints" not in pod_template(children, "decoder")["spec"]
    assert pod_template(children, "router")["spec"]["topologySpreadConstraints"] == [
        {"labelSelector": {"matchLabels": {"app": "x"}}, "topologyKey": "kubernetes.io/hostname", "maxSkew": 1,
         "whenUnsatisfiable": "ScheduleAnyway"}
    ]  # fmt: skip


# --- PodDisruptionBudgets ---------------------------------------------------------------------------


def budgets(children: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """role -> the PodDisruptionBudget's spec without its selector."""
    out = {}
    for child in children:
        if child["kind"] == "PodDisruptionBudget":
            spec = dict(child["spec"])
            assert spec.pop("unhealthyPodEvictionPolicy") == "AlwaysAllow"
            spec.pop("selector")
            out[child["metadata"]["labels"]["coserve.dev/role"]] = spec
    return out


def plan_with(pool: CoServePool, **update: Any) -> Plan:
    return plan_for(pool.spec).model_copy(update=update)


def busy(throughput: float, memory: float) -> PlanUtilization:
    return PlanUtilization(prefiller=0.5, decoder_throughput=throughput, decoder_memory=memory)


@pytest.mark.parametrize(
    ("update", "prefillers_min", "decoders_min"),
    [
        # the target rate keeps 7 decoders 64.3 % busy: 4.5 decoders' work -> 5 of 7
        ({"prefillers": 3, "decoders": 7, "utilization": busy(4.5 / 7, 0.2)}, 2, 5),
        # KV memory is the tighter need: 2 decoders' worth of 4 -> 2
        ({"prefillers": 1, "decoders": 4, "utilization": busy(0.1, 0.5)}, 1, 2),
        # no spare decoder: the budget holds them all
        ({"prefillers": 2, "decoders": 6, "utilization": busy(1.0, 0.3)}, 1, 6),
        # float noise is not a decoder
        ({"prefillers": 4, "decoders": 9, "utilization": busy(6.0000000000000004 / 9, 0.1)}, 3, 6),
        # a quiet pool keeps one
        ({"prefillers": 1, "decoders": 2, "utilization": busy(0.0, 0.0)}, 1, 1),
    ],
)  # fmt: skip
def test_engine_budgets_follow_the_plan(update: dict[str, Any], prefillers_min: int, decoders_min: int) -> None:
    pool = parse_pool(make_pool())

    found = budgets(build_children(pool, plan_with(pool, **update)))

    assert found["prefiller"] == {"minAvailable": prefillers_min}
    assert found["decoder"] == {"minAvailable": decoders_min}


def test_an_aggregated_pool_keeps_no_budget_and_no_handoff_for_its_empty_prefiller_role() -> None:
    """Aggregated engines: the prefiller Deployment at 0 replicas has no PodDisruptionBudget (minAvailable 1 of 0
    would block nothing and mislead), and every engine is rendered kv_both without NIXL: it hands nothing over."""
    pool = parse_pool(make_pool(shape="Aggregated"))
    plan = plan_for(pool.spec)
    assert plan.aggregated and plan.prefillers == 0
    children = build_children(pool, plan)
    found = budgets(children)
    assert "prefiller" not in found and "decoder" in found
    split = parse_pool(make_pool(shape="Disaggregated"))
    split_children = build_children(split, plan_for(split.spec))
    assert "prefiller" in budgets(split_children)
    assert "NixlConnector" in json.dumps([c for c in split_children if c["kind"] == "Deployment"])  # GPU engines
    for child in children:
        if child["kind"] == "Deployment" and child["metadata"]["name"].endswith(("-prefiller", "-decoder")):
            args = child["spec"]["template"]["spec"]["containers"][0]["args"]
            transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
            assert transfer["kv_role"] == "kv_both"
            assert "NixlConnector" not in json.dumps(transfer)


@settings(max_examples=60, deadline=None)
@given(
    rate=st.floats(min_value=0.01, max_value=50),
    output_tokens=st.integers(min_value=10, max_value=20_000),
    lifetime_s=st.floats(min_value=1, max_value=3600),
    headroom=st.floats(min_value=1, max_value=4),
)
def test_the_decoder_budget_is_the_plan_before_headroom(
    rate: float, output_tokens: int, lifetime_s: float, headroom: float
) -> None:
    workload = {"arrivalRatePerS": rate, "inputTokens": 2000, "outputTokens": output_tokens, "lifetimeS": lifetime_s}
    pool = parse_pool(make_pool(workload=workload, headroom=headroom))
    try:
        plan = plan_for(pool.spec)
    except InvalidInput:
        assume(False)  # beyond what one pool supports (more than 10,000 decoders): no plan, no budget
        raise

    floor = decoders_before_headroom(plan)

    assert 1 <= floor <= plan.decoders
    # the floor carries the target rate's decode work and KV, and not one decoder more
    need = max(plan.utilization.decoder_throughput, plan.utilization.decoder_memory) * plan.decoders
    assert floor >= need * (1 - 1e-9) or floor == plan.decoders
    assert floor == 1 or floor - 1 < need * (1 + 1e-9)


@pytest.mark.parametrize(("replicas", "expected"), [(1, None), (2, {"minAvailable": 1}), (5, {"minAvailable": 1})])
def test_the_router_budget_needs_two_replicas(replicas: int, expected: dict[str, int] | None) -> None:
    assert budgets(render(make_pool(router={"replicas": replicas}))).get("router") == expected


def test_with_autoscaling_the_engine_budgets_are_the_declared_minimums() -> None:
    document = make_pool(
        autoscaling={
            "enabled": True,
            "prometheusUrl": "http://prometheus:9090",
            "prefillers": {"minReplicas": 2, "maxReplicas": 8},
            "decoders": {"minReplicas": 3, "maxReplicas": 32},
        }
    )
    found = budgets(render(document))

    assert found["prefiller"] == {"minAvailable": 2}
    assert found["decoder"] == {"minAvailable": 3}


def test_budgets_may_be_set_per_role_or_turned_off() -> None:
    disruption = {
        "router": {"maxUnavailable": 1},
        "prefiller": {"maxUnavailable": "50%"},
        "decoder": {"minAvailable": "80%"},
    }
    found = budgets(render(make_pool(router={"replicas": 1}, disruption=disruption)))

    assert found == {
        "router": {"maxUnavailable": 1},  # a budget of one's own applies even to a single replica
        "prefiller": {"maxUnavailable": "50%"},
        "decoder": {"minAvailable": "80%"},
    }
    assert budgets(render(make_pool(disruption={**disruption, "enabled": False}))) == {}


@pytest.mark.parametrize("component", ["prefiller", "decoder", "router"])
def test_a_budget_selects_exactly_its_roles_pods(component: str) -> None:
    children = render(make_pool())
    selector = by_key(children)[("PodDisruptionBudget", f"chat-{component}")]["spec"]["selector"]["matchLabels"]
    template_labels = {c: pod_template(children, c)["metadata"]["labels"] for c in ("prefiller", "decoder", "router")}

    assert [c for c, labels in template_labels.items() if selector.items() <= labels.items()] == [component]


# --- graceful drain ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("engine", "timeout_s"), [({}, 300), ({"drainTimeoutS": 1800}, 1800), ({"drainTimeoutS": 0}, 0)]
)
@pytest.mark.parametrize("role", ["prefiller", "decoder"])
def test_engines_drain_before_they_stop(role: str, engine: dict[str, Any], timeout_s: int) -> None:
    pool = parse_pool(make_pool(engine=engine))
    children = build_children(pool, plan_for(pool.spec))
    pod = pod_template(children, role)["spec"]

    expected = ["python3", "-m", "coserve.drain", "--port", "8000", "--quiet-s", "15", "--timeout-s", str(timeout_s)]
    assert drain_command(pool.spec) == expected
    assert pod["containers"][0]["lifecycle"] == {"preStop": {"exec": {"command": expected}}}
    assert pod["terminationGracePeriodSeconds"] == timeout_s + 30  # the hook's bound, then time for SIGTERM
    assert "lifecycle" not in pod_template(children, "router")["spec"]["containers"][0]


# --- everything at once, against the Kubernetes schemas ------------------------------------------------


KITCHEN_SINK: dict[str, Any] = {
    "model": {
        "name": "meta-llama/Llama-3.1-8B-Instruct",
        "hfTokenSecretRef": {"name": "hf", "key": "hf-token"},
        "cache": {"size": "500Gi", "storageClassName": "nfs", "accessModes": ["ReadWriteMany", "ReadOnlyMany"]},
    },
    "engine": {
        **ENGINE_OPTIONS,
        "drainTimeoutS": 900,
        "env": [
            *ENGINE_OPTIONS["env"],
            {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "GPU_MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}},
            {"name": "FLAG", "valueFrom": {"configMapKeyRef": {"name": "flags", "key": "flag", "optional": True}}},
        ],
        "topologySpreadConstraints": [
            {"topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule", "minDomains": 2,
             "labelSelector": {"matchExpressions": [{"key": "coserve.dev/role", "operator": "In",
                                                     "values": ["prefiller", "decoder"]}]},
             "matchLabelKeys": ["pod-template-hash"]},
        ],
        "decoder": {
            "volumes": [{"name": "kv", "ephemeral": {"volumeClaimTemplate": {"spec": {
                "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Ti"}}}}}}],
            "volumeMounts": [{"name": "kv", "mountPath": "/kv"}, {"name": "ca", "mountPath": "/ca", "subPath": "x"}],
            "serviceAccountName": "decoders",
        },
    },
    "router": {
        "env": [{"name": "LOG_LEVEL", "value": "debug"}],
        "volumes": [{"name": "ca", "secret": {"secretName": "ca", "defaultMode": 288}}],
        "volumeMounts": [{"name": "ca", "mountPath": "/etc/ssl/corp", "readOnly": True}],
        "priorityClassName": "serving-high",
        "topologySpreadConstraints": [],
    },
    "disruption": {"decoder": {"maxUnavailable": "25%"}},
}  # fmt: skip


@pytest.mark.parametrize(
    "spec",
    [
        KITCHEN_SINK,
        {**KITCHEN_SINK, "model": {"name": "/weights", "local": True}},
        {**KITCHEN_SINK, "model": {"name": "Qwen/Qwen3-8B", "cache": {"claimName": "weights"}}},
    ],
    ids=["cache-of-a-size", "local", "cache-on-a-claim"],
)
def test_every_option_renders_objects_the_kubernetes_api_accepts(spec: dict[str, Any]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    children = render(make_pool(**spec))

    for child in children:
        kubernetes_validate.validate(child, "1.35.0", strict=True)
    assert [p for child in children for p, value in walk(child) if value is None] == []
    assert {"PodDisruptionBudget", "Deployment"} <= {c["kind"] for c in children}


def test_security_context_options_are_merged_over_the_restricted_defaults() -> None:
    engine = {
        "securityContext": {"runAsUser": 1000, "capabilities": {"add": ["IPC_LOCK"]}},
        "podSecurityContext": {"runAsGroup": 1000},
        "decoder": {
            "securityContext": {"runAsUser": 2000},
            "podSecurityContext": {"seccompProfile": {"type": "Localhost", "localhostProfile": "vllm.json"}},
        },
    }
    router = {"securityContext": {"readOnlyRootFilesystem": False}, "podSecurityContext": {"runAsUser": 1001}}
    children = render(make_pool(engine=engine, router=router))
    decoder, prefiller = pod_template(children, "decoder")["spec"], pod_template(children, "prefiller")["spec"]
    # maps merge (the role's over the engine-wide, both over the default); a set field replaces the default's
    assert decoder["containers"][0]["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]},
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
        "runAsUser": 2000,
    }
    assert prefiller["containers"][0]["securityContext"]["runAsUser"] == 1000
    assert decoder["securityContext"] == {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "Localhost", "localhostProfile": "vllm.json"},
        "runAsGroup": 1000,
    }
    assert prefiller["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    router_pod = pod_template(children, "router")["spec"]
    assert router_pod["securityContext"]["runAsUser"] == 1001
    assert router_pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is False
    assert router_pod["containers"][0]["securityContext"]["runAsNonRoot"] is True


def test_engines_with_a_model_cache_share_its_group_and_the_download_is_restricted_too() -> None:
    pool = make_pool(model={**BASE_POOL["spec"]["model"], "cache": {"size": "100Gi"}})
    pod = pod_template(render(pool), "decoder")["spec"]
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
        "fsGroup": 65532,
        "fsGroupChangePolicy": "OnRootMismatch",
    }
    assert pod["initContainers"][0]["securityContext"] == pod["containers"][0]["securityContext"]


def test_an_aggregated_pool_runs_no_prefillers_and_its_router_looks_for_none() -> None:
    """The shape decides two things only: the prefillers' replicas (0) and the router's prefiller Service (none,
    so the decoders prefill every turn); the prefiller Deployment and Service stay, for a change back."""
    by_shape = {}
    for shape in ("Aggregated", "Disaggregated"):
        pool = parse_pool(make_pool(shape=shape))
        plan = plan_for(pool.spec)
        children = {(c["kind"], c["metadata"]["name"]): c for c in build_children(pool, plan)}
        by_shape[shape] = (plan, children, json.loads(children[("ConfigMap", "chat-config")]["data"]["router.json"]))
    plan, children, router = by_shape["Aggregated"]
    assert plan.prefillers == 0 and plan.aggregated
    assert children[("Deployment", "chat-prefiller")]["spec"]["replicas"] == 0
    assert ("Service", "chat-prefiller") in children
    assert "prefillerService" not in router and router["decoderService"]
    plan, children, router = by_shape["Disaggregated"]
    assert children[("Deployment", "chat-prefiller")]["spec"]["replicas"] == plan.prefillers >= 1
    assert router["prefillerService"]
