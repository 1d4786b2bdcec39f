"""The Kubernetes objects of one CoServePool, built as plain dicts.

Who calls it: ``coserve render`` prints ``build_children(pool, plan)``, and the
operator's reconcile handler applies the same list, so what render shows is what
the operator creates. Pure: imports the stdlib and ``coserve.api`` only (no kopf,
no Kubernetes client, no YAML), and the output is deterministic (equal input,
equal dicts), holds no ``None`` and keeps integers as integers.

A pool named ``chat`` owns, in this order (``CHILDREN``; those marked * only when its spec asks
for them, see ``OPTIONAL_CHILDREN``)::

    ConfigMap             chat-config        engine.json (engines) and router.json (router)
    PersistentVolumeClaim chat-model-cache * the model cache, with spec.model.cache.size
    Deployment            chat-prefiller     vLLM, kv_producer, plan.prefillers replicas (0: aggregated)
    Deployment            chat-decoder       vLLM, kv_consumer, plan.decoders replicas
    Deployment            chat-router        `coserve router`, spec.router.replicas replicas
    Service               chat-router        ClusterIP, port 80 -> 8080, what clients call
    Service               chat-prefiller     headless, port 8000, the router resolves engine pods through it
    Service               chat-decoder       headless, port 8000
    Secret                chat-router-token  the router's token (the operator fills it in)
    NetworkPolicy         chat-engines       who may reach the engines
    ServiceAccount        chat-router        the router's identity, with a Role and RoleBinding on Leases
    Role, RoleBinding     chat-router
    PodDisruptionBudget   chat-router      * with spec.disruption.enabled and 2+ router replicas (or a budget set)
    PodDisruptionBudget   chat-prefiller   * with spec.disruption.enabled
    PodDisruptionBudget   chat-decoder     * with spec.disruption.enabled

Every pod template carries ``coserve.dev/config-hash``, a digest of the
ConfigMap's data, so a change of SLOs or offload settings rolls the pods while a
change of replica counts does not.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from coserve.api._base import ApiModel
from coserve.api.resource import API_VERSION, KIND, CoServePool
from coserve.api.spec import (
    HF_TOKEN_ENV,
    OPERATOR_ENGINE_FLAGS,
    V2_RUNNER_ENV,
    V2_RUNNER_OFF,
    EngineSpec,
    KVOffloadBackend,
    ModelCacheSpec,
    ModelSpec,
    PodOptions,
    PoolShape,
    ResourceRequirements,
    RoleOverrides,
    RouterSpec,
    SpecModel,
    TopologySpreadConstraint,
)
from coserve.api.status import Plan
from coserve.gaie import HEALTH_PORT, LIVENESS_SERVICE, PICKER_PORT, READINESS_SERVICE
from coserve.kv.handoff import KV_LOAD_FAILURE_POLICY, Handoff, router_sends_transfer_params
from coserve.scheduling.config import CONFIG_ENV
from coserve.scheduling.preemption import safepoint_min_step_s

__all__ = [
    "APP_NAME",
    "CHILDREN",
    "COMPONENTS",
    "COMPONENT_LABEL",
    "CONFIG_HASH_ANNOTATION",
    "CONFIG_MOUNT_PATH",
    "DEFAULT_SPREAD_TOPOLOGY_KEYS",
    "DRAIN_GRACE_MARGIN_S",
    "DRAIN_QUIET_S",
    "ENGINE_CONFIG_KEY",
    "ENGINE_CONFIG_PATH",
    "ENGINE_PORT",
    "ENGINE_ROLES",
    "GATEWAY_API_KINDS",
    "GATEWAY_CHILDREN",
    "INSTANCE_LABEL",
    "MANAGED_BY",
    "MANAGED_BY_LABEL",
    "MODEL_DOWNLOAD_CONTAINER",
    "NAME_LABEL",
    "NIXL_SIDE_CHANNEL_PORT",
    "OPTIONAL_CHILDREN",
    "PICKER_CERT_PATH",
    "PICKER_METRICS_PORT",
    "PICKER_PORT",
    "RESTRICTED_CONTAINER_SECURITY",
    "RESTRICTED_POD_SECURITY",
    "ROLE_LABEL",
    "ROUTER_CONFIG_KEY",
    "ROUTER_CONFIG_PATH",
    "ROUTER_ONLY_PATHS",
    "ROUTER_PORT",
    "ROUTER_SERVICE_PORT",
    "Component",
    "EngineRole",
    "Manifest",
    "PodTemplateOptions",
    "build_children",
    "child_keys",
    "child_name",
    "config_data",
    "config_hash",
    "decoders_before_headroom",
    "disruption_budget",
    "drain_command",
    "engine_args",
    "engine_config",
    "engine_service_host",
    "kv_transfer_config",
    "labels_for",
    "merged_over",
    "model_download_command",
    "owner_references",
    "pod_template_options",
    "router_config",
    "router_image",
    "selector_for",
    "startup_budget_s",
    "uses_gpus",
]

Manifest = dict[str, Any]  # one Kubernetes object, JSON-ready

Component = Literal[
    "prefiller",
    "decoder",
    "router",
    "config",
    "router-token",
    "engines",
    "model-cache",
    "picker",
    "inference-pool",
    "route",
    "gateway-proxies",
]
EngineRole = Literal["prefiller", "decoder"]
COMPONENTS: tuple[Component, ...] = get_args(Component)
ENGINE_ROLES: tuple[EngineRole, ...] = get_args(EngineRole)

APP_NAME = "coserve"
MANAGED_BY = "coserve-operator"
NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
ROLE_LABEL = "coserve.dev/role"
CONFIG_HASH_ANNOTATION = "coserve.dev/config-hash"

ENGINE_PORT = 8000
ROUTER_PORT = 8080
ROUTER_SERVICE_PORT = 80
PORT_NAME = "http"
# NixlConnector's side channel (pools whose handoff is NIXL): each engine's scheduler listens on this port of its
# pod's address for the NIXL handshake, and the prefiller advertises both to the decoder (remote_host, remote_port).
# vLLM's defaults are localhost and 5600: in another pod, localhost is the decoder itself. One constant renders
# the variable and the containerPort NIXL_SIDE_PORT_NAME, so they cannot disagree.
# NOTE: the tensor-parallel ranks of an engine share that one listener (a request names its rank); vLLM adds the
# data-parallel rank to the port, and coserve runs one data-parallel rank per pod, so one port is the whole range.
NIXL_SIDE_CHANNEL_PORT = 5600
NIXL_SIDE_PORT_NAME = "nixl-side"
NIXL_SIDE_CHANNEL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
NIXL_SIDE_CHANNEL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"

# Gateway mode's endpoint picker (coserve.epp): ext_proc and gRPC health on PICKER_PORT, the router's metrics on
# PICKER_METRICS_PORT. The router alone serves the batch API (ROUTER_ONLY_PATHS): the example HTTPRoute sends it there.
PICKER_CONTAINER = "picker"
PICKER_PORT_NAME = "grpc"
PICKER_HEALTH_PORT_NAME = "grpc-health"
PICKER_METRICS_PORT = 9090
# spec.gateway.pickerCertSecret's volume and mount: whole (no subPath: it rotates), beside the config's mount
# rather than inside it (a mount point inside a read-only configMap volume cannot be made)
PICKER_CERT_VOLUME = "picker-tls"
PICKER_CERT_PATH = "/etc/coserve-picker-tls"
METRICS_PORT_NAME = "metrics"
ROUTER_ONLY_PATHS = ("/v1/files", "/v1/batches")

CONFIG_VOLUME = "config"
CONFIG_MOUNT_PATH = "/etc/coserve"
ENGINE_CONFIG_KEY = "engine.json"
ROUTER_CONFIG_KEY = "router.json"
ROUTER_BATCH_PATH = "/var/lib/coserve/batches"
ENGINE_CONFIG_PATH = f"{CONFIG_MOUNT_PATH}/{ENGINE_CONFIG_KEY}"
ROUTER_CONFIG_PATH = f"{CONFIG_MOUNT_PATH}/{ROUTER_CONFIG_KEY}"

# The pool's router token: generated once by the operator into a Secret, mounted in router and engines
# (coserve.engine.validation trusts a request's class only with it).
TOKEN_VOLUME = "router-token"  # noqa: S105 - a volume name, not a secret
TOKEN_MOUNT_PATH = "/etc/coserve-token"  # noqa: S105 - a path, not a secret
TOKEN_KEY = "token"  # noqa: S105 - a key name, not a secret
TOKEN_FILE_ENV = "COSERVE_ROUTER_TOKEN_FILE"  # noqa: S105 - a variable's name, not a secret

ENGINE_CONTAINER = "vllm"
ENGINE_COMMAND = ("python3", "-m", "vllm.entrypoints.openai.api_server")
SCHEDULER_CLS = "coserve.engine.scheduler.TDGScheduler"
# Engines that request GPUs run the CUDA worker; the others (images/vllm-cpu, e.g. on kind) the CPU one.
WORKER_CLS = "coserve.engine.worker.SafepointGPUWorker"
CPU_WORKER_CLS = "coserve.engine.worker.SafepointCPUWorker"
GPU_RESOURCE = "nvidia.com/gpu"
REQUEST_VALIDATOR = "coserve.engine.validation.RequestClassValidator"
KV_CONNECTOR = "CoServeConnector"
KV_CONNECTOR_MODULE = "coserve.engine.connector"
_KV_ROLES: dict[EngineRole, str] = {"prefiller": "kv_producer", "decoder": "kv_consumer"}  # role -> vLLM kv_role

ROUTER_CONTAINER = "router"
ROUTER_USER_ID = 65532  # "nonroot" in distroless images
# The user every coserve image runs as (Dockerfile, images/vllm, images/vllm-cpu): 65532:65532, numeric so that
# the kubelet can check runAsNonRoot. Engine pods with a model cache get it as fsGroup, so the cache is writable.
IMAGE_USER_ID = 65532

# Pod Security Standards, restricted profile (kubernetes.io/docs/concepts/security/pod-security-standards): what
# every pod and container gets unless the pool's podSecurityContext / securityContext options loosen it.
RESTRICTED_POD_SECURITY: Manifest = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
RESTRICTED_CONTAINER_SECURITY: Manifest = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}

# The model cache: a shared volume the model-download init container fills and the engines read.
MODEL_CACHE_VOLUME = "model-cache"
MODEL_DOWNLOAD_CONTAINER = "model-download"
HF_HUB_FOLDER = "hub"  # HF_HUB_CACHE is <mountPath>/hub, as HF_HOME/hub would be
# Loading weights and capturing CUDA graphs takes minutes: a startup probe every 10 s allows 10 of them.
STARTUP_PERIOD_S = 10
LOAD_BUDGET_S = 600
# The download runs once per cache, not per start; it needs a CPU and some memory, never a GPU.
MODEL_DOWNLOAD_RESOURCES: Manifest = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "8Gi"}}

# Graceful drain (coserve.drain): the preStop hook waits for the engine to be idle this long in a row, and
# the pod's grace period exceeds the hook's bound by this margin, so vLLM still gets SIGTERM, not SIGKILL.
DRAIN_QUIET_S = 15
DRAIN_GRACE_MARGIN_S = 30

DEFAULT_SPREAD_TOPOLOGY_KEYS = ("kubernetes.io/hostname", "topology.kubernetes.io/zone")

CONFIG_HASH_LENGTH = 16
# Docker's tag grammar: a word character, then up to 127 of [A-Za-z0-9_.-].
_IMAGE_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


def build_children(pool: CoServePool, plan: Plan, *, operator_image_tag: str | None = None) -> list[Manifest]:
    """Every object the operator keeps for ``pool``, sized by ``plan``, in apply order.

    Who calls it: ``coserve render`` and the operator on every reconcile.
    ``operator_image_tag`` is the operator's own version; when given, a router
    left on the default image runs that tag, so router and operator stay in step
    (see ``router_image``).
    """
    if plan.aggregated and pool.spec.shape is not PoolShape.AGGREGATED:
        # what the engines are rendered from knows the shape the plan took (``pool_handoff``, ``kv_transfer_config``)
        pool = pool.model_copy(update={"spec": pool.spec.model_copy(update={"shape": PoolShape.AGGREGATED})})
    data = config_data(pool, aggregated=plan.aggregated)
    digest = config_hash(data)
    image = router_image(pool.spec.router, operator_image_tag)
    children = [
        _config_map(pool, data),
        _model_cache_claim(pool),
        _engine_deployment(pool, "prefiller", plan.prefillers, digest),
        _engine_deployment(pool, "decoder", plan.decoders, digest),
        _router_deployment(pool, digest, image),
        _router_service(pool),
        _engine_service(pool, "prefiller"),
        _engine_service(pool, "decoder"),
        _token_secret(pool),
        _engine_network_policy(pool),
        *_router_identity(pool),
        *(_disruption_budget(pool, plan, component) for component in ("router", "prefiller", "decoder")),
        *(_gateway_children(pool, digest, image) if pool.spec.gateway.enabled else ()),
    ]
    return [_without_none(child) for child in children if child is not None]


# --- names, labels, ownership ------------------------------------------------------------------


# (kind, component) of every child a pool may have, in the order build_children returns them.
CHILDREN: tuple[tuple[str, Component], ...] = (
    ("ConfigMap", "config"),
    ("PersistentVolumeClaim", "model-cache"),
    ("Deployment", "prefiller"),
    ("Deployment", "decoder"),
    ("Deployment", "router"),
    ("Service", "router"),
    ("Service", "prefiller"),
    ("Service", "decoder"),
    ("Secret", "router-token"),
    ("NetworkPolicy", "engines"),
    ("ServiceAccount", "router"),
    ("Role", "router"),
    ("RoleBinding", "router"),
    ("PodDisruptionBudget", "router"),
    ("PodDisruptionBudget", "prefiller"),
    ("PodDisruptionBudget", "decoder"),
    ("Deployment", "picker"),
    ("Service", "picker"),
    ("NetworkPolicy", "gateway-proxies"),
    ("InferencePool", "inference-pool"),
    ("HTTPRoute", "route"),
)
GATEWAY_CHILDREN: frozenset[tuple[str, Component]] = frozenset(
    {
        ("Deployment", "picker"),
        ("Service", "picker"),
        ("NetworkPolicy", "gateway-proxies"),
        ("InferencePool", "inference-pool"),
        ("HTTPRoute", "route"),
    }
)
# The children build_children leaves out when the spec does not ask for them: the model cache's claim
# (only with spec.model.cache.size), the PodDisruptionBudgets (spec.disruption; the router's also needs
# two replicas or a budget of its own) and gateway mode's (spec.gateway.enabled; the HTTPRoute also
# spec.gateway.httpRoute). Every other child is always rendered.
OPTIONAL_CHILDREN: frozenset[tuple[str, Component]] = frozenset(
    {
        ("PersistentVolumeClaim", "model-cache"),
        ("PodDisruptionBudget", "router"),
        ("PodDisruptionBudget", "prefiller"),
        ("PodDisruptionBudget", "decoder"),
        *GATEWAY_CHILDREN,
    }
)
# The kinds of gateway mode that only a cluster with the Gateway API (HTTPRoute) and its Inference Extension
# (InferencePool) serves: kind -> (apiVersion, plural). Where the API server does not serve one, the operator
# renders the rest and says so (the pool's GatewayReady condition).
GATEWAY_API_KINDS: dict[str, tuple[str, str]] = {
    "InferencePool": ("inference.networking.k8s.io/v1", "inferencepools"),
    "HTTPRoute": ("gateway.networking.k8s.io/v1", "httproutes"),
}


def child_keys(pool_name: str) -> list[tuple[str, str]]:
    """(kind, name) of every child ``pool_name`` may have: what the operator reads before it reconciles."""
    return [(kind, child_name(pool_name, component)) for kind, component in CHILDREN]


def child_name(pool_name: str, component: str) -> str:
    """``<pool>-<component>``; raises ``ValueError`` for a component not in ``COMPONENTS``."""
    if component not in COMPONENTS:
        raise ValueError(f"unknown component {component!r}; expected one of {', '.join(COMPONENTS)}")
    return f"{pool_name}-{component}"


def labels_for(pool_name: str, component: Component) -> dict[str, str]:
    """The labels every object and pod of ``component`` carries."""
    return {
        NAME_LABEL: APP_NAME,
        INSTANCE_LABEL: pool_name,
        COMPONENT_LABEL: component,
        MANAGED_BY_LABEL: MANAGED_BY,
        ROLE_LABEL: component,
    }


def selector_for(pool_name: str, component: Component) -> dict[str, str]:
    """The labels a Deployment and a Service select ``component``'s pods by (a subset of ``labels_for``).

    NOTE: a Deployment's selector is immutable, so it holds only labels that never change.
    """
    return {INSTANCE_LABEL: pool_name, ROLE_LABEL: component}


def owner_references(pool: CoServePool) -> list[dict[str, Any]]:
    """The pool as controlling owner, so deleting it deletes its children; empty before it has a uid.

    ``coserve render`` renders pools that were never stored (no uid); an owner
    reference without a uid would be rejected by the API server.
    """
    if pool.metadata.uid is None:
        return []
    return [
        {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": pool.metadata.name,
            "uid": pool.metadata.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def _metadata(pool: CoServePool, component: Component) -> Manifest:
    return {
        "name": child_name(pool.metadata.name, component),
        "namespace": pool.metadata.namespace,
        "labels": labels_for(pool.metadata.name, component),
        "ownerReferences": owner_references(pool) or None,
    }


def engine_service_host(pool: CoServePool, role: EngineRole) -> str:
    """DNS name of a role's headless Service, ``<pool>-<role>.<namespace>.svc``; namespace "default" if unset."""
    namespace = pool.metadata.namespace or "default"
    return f"{child_name(pool.metadata.name, role)}.{namespace}.svc"


# --- pod template options ----------------------------------------------------------------------


@dataclass(frozen=True)
class PodTemplateOptions:
    """The user's pod template options of one role, engine-wide and the role's combined (lists as wire dicts).

    ``topology_spread_constraints`` is ``None`` for the default spread, ``[]`` for none.
    """

    env: list[Manifest]
    env_from: list[Manifest]
    volumes: list[Manifest]
    volume_mounts: list[Manifest]
    image_pull_secrets: list[Manifest]
    service_account_name: str | None
    priority_class_name: str | None
    pod_labels: dict[str, str]
    pod_annotations: dict[str, str]
    topology_spread_constraints: list[TopologySpreadConstraint] | None
    security_context: dict[str, Any]
    pod_security_context: dict[str, Any]


def pod_template_options(spec: SpecModel, component: Literal["prefiller", "decoder", "router"]) -> PodTemplateOptions:
    """``component``'s pod options: the router's own, or ``engine``'s combined with the role's.

    A role extends the engine-wide options: lists are the engine-wide entries then the role's, a role's
    entry replacing an engine-wide one with the same name (volume mounts: the same mountPath) in place;
    maps are merged, the role's values winning (securityContext and podSecurityContext deeply); serviceAccountName,
    priorityClassName and topologySpreadConstraints are the role's when it sets them.
    """
    if component == "router":
        return _combined(spec.router, PodOptions(), service_account_name=None)
    engine = spec.engine
    role = _role_overrides(engine, component)
    return _combined(engine, role, service_account_name=role.service_account_name or engine.service_account_name)


def _combined(base: PodOptions, role: PodOptions, *, service_account_name: str | None) -> PodTemplateOptions:
    spread = role.topology_spread_constraints
    return PodTemplateOptions(
        env=_merged_by("name", _wire(base.env), _wire(role.env)),
        env_from=[*_wire(base.env_from), *_wire(role.env_from)],
        volumes=_merged_by("name", _wire(base.volumes), _wire(role.volumes)),
        volume_mounts=_merged_by("mountPath", _wire(base.volume_mounts), _wire(role.volume_mounts)),
        image_pull_secrets=_merged_by("name", _wire(base.image_pull_secrets), _wire(role.image_pull_secrets)),
        service_account_name=service_account_name,
        priority_class_name=role.priority_class_name or base.priority_class_name,
        pod_labels={**(base.pod_labels or {}), **(role.pod_labels or {})},
        pod_annotations={**(base.pod_annotations or {}), **(role.pod_annotations or {})},
        topology_spread_constraints=spread if spread is not None else base.topology_spread_constraints,
        security_context=merged_over(base.security_context or {}, role.security_context or {}),
        pod_security_context=merged_over(base.pod_security_context or {}, role.pod_security_context or {}),
    )


def merged_over(defaults: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``override`` merged over ``defaults``: maps merge key by key, any other value of ``override`` replaces."""
    out = dict(defaults)
    for key, value in override.items():
        below = out.get(key)
        out[key] = merged_over(below, value) if isinstance(below, Mapping) and isinstance(value, Mapping) else value
    return out


def _wire(items: Iterable[ApiModel] | None) -> list[Manifest]:
    return [item.to_wire() for item in items or ()]


def _merged_by(key: str, *lists: Iterable[Manifest]) -> list[Manifest]:
    """The items of ``lists`` in order, a later item replacing an earlier one with the same ``key`` in place."""
    merged: dict[Any, Manifest] = {}  # key value -> item; re-assigning a key keeps its first position
    for items in lists:
        for item in items:
            merged[item[key]] = item
    return list(merged.values())


def _spread(
    pool_name: str, component: Component, constraints: list[TopologySpreadConstraint] | None
) -> list[Manifest] | None:
    """The pods' topologySpreadConstraints: the default spread over nodes and zones, or the user's.

    A user's constraint without labelSelector counts the role's own pods, as the default does.
    """
    own_pods = {"matchLabels": selector_for(pool_name, component)}
    if constraints is None:
        return [
            {
                "maxSkew": 1,
                "topologyKey": key,
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": own_pods,
                # count only the current ReplicaSet's pods, so a rollout spreads its new pods too
                "matchLabelKeys": ["pod-template-hash"],
            }
            for key in DEFAULT_SPREAD_TOPOLOGY_KEYS
        ]
    return [{"labelSelector": own_pods, **constraint.to_wire()} for constraint in constraints] or None


# --- the ConfigMap -----------------------------------------------------------------------------


def engine_config(spec: SpecModel) -> dict[str, Any]:
    """What the coserve vLLM plugin reads from ``ENGINE_CONFIG_PATH``: classes, offline, offload, prefill curve."""
    config: dict[str, Any] = {
        "priorityClasses": [cls.to_wire() for cls in spec.priority_classes],
        "offline": spec.offline.to_wire(),
        "kvOffload": spec.kv_offload.to_wire(),
    }
    if spec.profile.prefill_latency is not None:
        config["prefillLatency"] = spec.profile.prefill_latency.to_wire()
    return config


def router_config(pool: CoServePool, *, aggregated: bool = False) -> dict[str, Any]:
    """What ``coserve router`` reads from ``ROUTER_CONFIG_PATH``: model name, engine Services, classes, offline.

    ``aggregated`` (the plan's shape): no prefiller Service, so the decoders prefill every turn themselves.
    """
    spec = pool.spec
    return {
        "model": spec.model.served_model_name or spec.model.name,
        **({} if aggregated else {"prefillerService": engine_service_host(pool, "prefiller")}),
        "decoderService": engine_service_host(pool, "decoder"),
        "enginePort": ENGINE_PORT,
        "priorityClasses": [cls.to_wire() for cls in spec.priority_classes],
        "offline": spec.offline.to_wire(),
        "batchDir": ROUTER_BATCH_PATH,
        # router replicas run each offline batch once by holding a Lease per batch (the router's own Role)
        "batchLock": "lease",
        # the router speaks vLLM's P/D protocol exactly when the engines' connectors move KV (pool_handoff);
        # absent, it is false (a pool without a handoff keeps the config, and its pods, it had)
        **({"kvTransferParams": True} if router_sends_transfer_params(pool_handoff(spec)) else {}),
        **({"prefillLatency": spec.profile.prefill_latency.to_wire()} if spec.profile.prefill_latency else {}),
        # absent when 0 (the router's default), so a pool that does not set it keeps the config it had
        **({"kvTransferSPerToken": spec.router.kv_transfer_s_per_token} if spec.router.kv_transfer_s_per_token else {}),
    }


def config_data(pool: CoServePool, *, aggregated: bool = False) -> dict[str, str]:
    """The ConfigMap's ``data``: ``engine.json`` and ``router.json``, as sorted, indented JSON.

    NOTE: replica counts stay out of it, so scaling a role never rolls every pod; the shape is in it (a router
    of aggregated engines looks for no prefillers), so a change of shape rolls them once.
    """
    return {
        ENGINE_CONFIG_KEY: _to_json(engine_config(pool.spec)),
        ROUTER_CONFIG_KEY: _to_json(router_config(pool, aggregated=aggregated)),
    }


def config_hash(data: Mapping[str, str]) -> str:
    """First 16 hex digits of the SHA-256 of ``data`` (key order does not matter)."""
    canonical = json.dumps(dict(data), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:CONFIG_HASH_LENGTH]


def _to_json(value: object) -> str:
    return json.dumps(value, sort_keys=True, indent=2, allow_nan=False) + "\n"


def _config_map(pool: CoServePool, data: dict[str, str]) -> Manifest:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(pool, "config"), "data": data}


# --- engine Deployments ------------------------------------------------------------------------


def _role_overrides(engine: EngineSpec, role: EngineRole) -> RoleOverrides:
    return engine.prefiller if role == "prefiller" else engine.decoder


def kv_transfer_config(spec: SpecModel, role: EngineRole) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for ``role``: the prefiller produces KV, the decoder consumes it.

    Always coserve's connector (layer safepoints; with ``kvOffload`` enabled and
    backend ``host``, its host pool of ``hostMemoryBytes``). On GPUs the
    prefill-to-decode handoff is vLLM's NixlConnector (``pool_handoff``), and the ``lmcache`` /
    ``native`` offload backends are LMCache's and vLLM's own connectors; they
    are combined with vLLM's MultiConnector, coserve's first. Engines without
    GPUs get coserve's connector alone: vLLM has no cross-pod KV transport on
    CPUs, so there the decoder recomputes turn 1 (``handoff_backend: shm``
    moves KV only between engines on one machine, as ``coserve up`` runs them).
    """
    offload = spec.kv_offload
    # aggregated engines neither send nor receive turn 1's KV: vLLM's kv_both, no NIXL (``pool_handoff``)
    kv_role = "kv_both" if spec.shape is PoolShape.AGGREGATED else _KV_ROLES[role]
    extra: dict[str, Any] = {
        "coserve_config": ENGINE_CONFIG_PATH,
        # steps predicted shorter than the exit-latency target run without safepoints (coserve.scheduling.preemption)
        "safepoint_min_step_s": safepoint_min_step_s(_online_ttft_slos_s(spec)),
    }
    if offload.enabled and offload.backend == KVOffloadBackend.HOST:
        extra["host_memory_bytes"] = offload.host_memory_bytes
    coserve = {
        "kv_connector": KV_CONNECTOR,
        "kv_connector_module_path": KV_CONNECTOR_MODULE,
        "kv_role": kv_role,
        "kv_connector_extra_config": extra,
    }
    if not uses_gpus(spec, role):
        return {**coserve, "kv_load_failure_policy": KV_LOAD_FAILURE_POLICY}
    others: list[dict[str, Any]] = []
    if pool_handoff(spec) is Handoff.NIXL:
        others.append({"kv_connector": "NixlConnector", "kv_role": kv_role})
    if offload.enabled and offload.backend == KVOffloadBackend.NATIVE:
        others.append(
            {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": offload.host_memory_bytes},
            }
        )
    if offload.enabled and offload.backend == KVOffloadBackend.LMCACHE:
        others.append({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})
    return {
        "kv_connector": "MultiConnector",
        "kv_role": kv_role,
        "kv_load_failure_policy": KV_LOAD_FAILURE_POLICY,  # vLLM reads it here, not in the children
        "kv_connector_extra_config": {"connectors": [coserve, *others]},
    }


def _online_ttft_slos_s(spec: SpecModel) -> list[float]:
    """Every priority class's TTFT objective in seconds, but the offline class's when offline work is on."""
    offline = spec.offline.class_name if spec.offline.enabled else None
    return [cls.ttft_slo_ms / 1000 for cls in spec.priority_classes if cls.name != offline]


def pool_handoff(spec: SpecModel) -> Handoff:
    """How the pool hands turn 1's KV from prefiller to decoder: NixlConnector when both roles run on GPUs.

    The one decision the engines' connectors (``kv_transfer_config``) and the router's P/D protocol
    (``router_config``'s ``kvTransferParams``) are both rendered from, so they cannot disagree. Without
    GPUs on both sides vLLM has no transport between pods, and the decoder computes turn 1 itself; aggregated
    engines (``spec.shape`` as ``build_children`` pins it to the plan's) hand nothing over.
    """
    if spec.shape is PoolShape.AGGREGATED:
        return Handoff.NONE  # no prefillers: every engine prefills its own turns
    both = uses_gpus(spec, "prefiller") and uses_gpus(spec, "decoder")
    return Handoff.NIXL if both else Handoff.NONE


def _engine_env(spec: SpecModel, role: EngineRole) -> list[Manifest]:
    """The vLLM container's environment as the operator sets it (the user's env follows, see _engine_container)."""
    env = [
        {"name": "COSERVE_ROLE", "value": role},
        {"name": CONFIG_ENV, "value": ENGINE_CONFIG_PATH},
        {"name": "VLLM_PLUGINS", "value": "coserve"},
        # vLLM 0.32 runs its V2 model runner on CUDA whenever Triton is installed; coserve's preemption needs V1
        {"name": V2_RUNNER_ENV, "value": V2_RUNNER_OFF},
        _token_env(),
        *_nixl_side_channel_env(spec),
    ]
    offload = spec.kv_offload
    if offload.enabled and offload.backend == KVOffloadBackend.LMCACHE and uses_gpus(spec, role):
        # LMCache reads its settings from the environment: a local CPU tier bounded like coserve's pool.
        env += [
            {"name": "LMCACHE_LOCAL_CPU", "value": "True"},
            {"name": "LMCACHE_MAX_LOCAL_CPU_SIZE", "value": f"{offload.host_memory_bytes / 2**30:g}"},
            {"name": "LMCACHE_CHUNK_SIZE", "value": "256"},
        ]
    model = spec.model
    env += _hf_token_env(model)
    if model.cache is not None:
        env.append({"name": "HF_HUB_CACHE", "value": _hub_cache_dir(model.cache)})
    if model.cache is not None or model.local:
        # the weights are on the cache or in the image: vLLM must not reach for the Hub (the cache is read-only)
        env.append({"name": "HF_HUB_OFFLINE", "value": "1"})
    return env


def _nixl_side_channel_env(spec: SpecModel) -> list[Manifest]:
    """Where each engine of a NIXL pool (``pool_handoff``) listens for NIXL's handshake: its own pod's address
    (the downward API's ``status.podIP``) and ``NIXL_SIDE_CHANNEL_PORT``; nothing for other pools.

    Both roles get them: the decoder connects to the address the prefiller advertises, and in NIXL's push mode
    the prefiller connects back to the decoder's. A user's env entry of the same name replaces either one, as
    for any variable the operator does not keep for itself (an existing workaround keeps working; another
    address, such as ``status.hostIP``, is the user's call); the containerPort follows a replaced port
    (``_nixl_side_channel_port``).
    """
    if pool_handoff(spec) is not Handoff.NIXL:
        return []
    return [
        {"name": NIXL_SIDE_CHANNEL_HOST_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": NIXL_SIDE_CHANNEL_PORT_ENV, "value": str(NIXL_SIDE_CHANNEL_PORT)},
    ]


def _nixl_side_channel_port(spec: SpecModel, env: Iterable[Manifest]) -> int | None:
    """The port a NIXL pool's engine with environment ``env`` (the operator's merged with the user's) listens on
    for NIXL's handshake; ``None`` outside a NIXL pool, or where the port is only known in the pod (a
    ``valueFrom`` or a value that is no port number, which vLLM would refuse at start).

    Who calls it: ``_engine_container``, for the containerPort ``NIXL_SIDE_PORT_NAME``.
    """
    if pool_handoff(spec) is not Handoff.NIXL:
        return None
    value = next((entry.get("value") for entry in env if entry["name"] == NIXL_SIDE_CHANNEL_PORT_ENV), None)
    if not isinstance(value, str) or not value.strip().isdigit() or not 0 < int(value) < 65_536:
        return None
    return int(value)


def _hf_token_env(model: ModelSpec) -> list[Manifest]:
    ref = model.hf_token_secret_ref
    if ref is None:
        return []
    return [{"name": HF_TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]


def _hub_cache_dir(cache: ModelCacheSpec) -> str:
    return f"{cache.mount_path.rstrip('/')}/{HF_HUB_FOLDER}"


def engine_args(spec: SpecModel, role: EngineRole) -> list[str]:
    """The vLLM server's arguments for ``role``: coserve's own flags, then engine.extraArgs, then the role's.

    Who calls it: ``_engine_container``. coserve's flags are ``OPERATOR_ENGINE_FLAGS``, in that order, and
    nothing else: the spec refuses extraArgs that set any of them (vLLM keeps a repeated flag's last value, so
    one would silently replace coserve's), and this function refuses to render a flag that list does not name,
    so what is rendered and what is refused cannot disagree. ``--no-async-scheduling`` for every role: vLLM
    0.32 keeps two steps in flight by default on CUDA, which coserve's scheduler and layer safepoints do not
    support (on CPUs vLLM turns it off itself).
    """
    engine = spec.engine
    flags = _operator_flags(spec, role)
    if list(flags) != list(OPERATOR_ENGINE_FLAGS):
        raise RuntimeError(
            f"engine_args renders {list(flags)}, not OPERATOR_ENGINE_FLAGS {list(OPERATOR_ENGINE_FLAGS)}"
        )
    args = [part for flag, value in flags.items() for part in ([flag] if value is None else [flag, value])]
    return [*args, *engine.extra_args, *(_role_overrides(engine, role).extra_args or [])]


def _operator_flags(spec: SpecModel, role: EngineRole) -> dict[str, str | None]:
    """flag -> its value (``None``: a switch), in the order ``OPERATOR_ENGINE_FLAGS`` lists them."""
    model = spec.model
    return {
        "--model": model.name,
        "--served-model-name": model.served_model_name or model.name,
        "--port": str(ENGINE_PORT),
        "--tensor-parallel-size": str(spec.engine.tensor_parallel_size),
        "--scheduler-cls": SCHEDULER_CLS,
        "--no-async-scheduling": None,
        "--worker-cls": WORKER_CLS if uses_gpus(spec, role) else CPU_WORKER_CLS,
        "--middleware": REQUEST_VALIDATOR,
        "--kv-transfer-config": json.dumps(kv_transfer_config(spec, role), sort_keys=True, separators=(",", ":")),
    }


def uses_gpus(spec: SpecModel, role: EngineRole) -> bool:
    """True when ``role``'s engine container asks for GPUs (limits or requests); it picks the worker class."""
    resources = _role_overrides(spec.engine, role).resources or spec.engine.resources
    return any(GPU_RESOURCE in (amounts or {}) for amounts in (resources.limits, resources.requests))


def _http_probe(path: str, *, period_s: int, failure_threshold: int, timeout_s: int = 1) -> Manifest:
    return {
        "httpGet": {"path": path, "port": PORT_NAME},
        "periodSeconds": period_s,
        "failureThreshold": failure_threshold,
        "timeoutSeconds": timeout_s,
    }


def _resources(requirements: ResourceRequirements) -> Manifest:
    return requirements.model_dump(by_alias=True, exclude_none=True, mode="json")


def _config_volume(pool: CoServePool) -> Manifest:
    return {"name": CONFIG_VOLUME, "configMap": {"name": child_name(pool.metadata.name, "config")}}


def _config_mount() -> Manifest:
    return {"name": CONFIG_VOLUME, "mountPath": CONFIG_MOUNT_PATH, "readOnly": True}


def _token_volume(pool: CoServePool) -> Manifest:
    return {"name": TOKEN_VOLUME, "secret": {"secretName": child_name(pool.metadata.name, "router-token")}}


def _token_mount() -> Manifest:
    return {"name": TOKEN_VOLUME, "mountPath": TOKEN_MOUNT_PATH, "readOnly": True}


def _token_env() -> Manifest:
    return {"name": TOKEN_FILE_ENV, "value": f"{TOKEN_MOUNT_PATH}/{TOKEN_KEY}"}


def startup_budget_s(model: ModelSpec) -> int:
    """How long an engine's startup probe waits before liveness counts: loading, plus the download if any.

    With ``cache`` the download runs in the model-download init container, before any probe, and with
    ``local`` there is none; otherwise every start downloads the weights in the vLLM container itself,
    so the probe also allows ``downloadTimeoutS``.
    """
    downloads_at_start = model.cache is None and not model.local
    return LOAD_BUDGET_S + (model.download_timeout_s if downloads_at_start else 0)


def drain_command(spec: SpecModel) -> list[str]:
    """The engines' preStop hook: wait until the engine has finished its in-flight requests (``coserve.drain``).

    It waits for ``DRAIN_QUIET_S`` idle seconds in a row, at most ``spec.engine.drainTimeoutS``; the pod's
    terminationGracePeriodSeconds is that bound plus ``DRAIN_GRACE_MARGIN_S``.
    """
    return [
        "python3",
        "-m",
        "coserve.drain",
        "--port",
        str(ENGINE_PORT),
        "--quiet-s",
        str(DRAIN_QUIET_S),
        "--timeout-s",
        str(spec.engine.drain_timeout_s),
    ]


def model_download_command(model: ModelSpec) -> list[str]:
    """The model-download init container's command: fill the cache with ``model.name`` once.

    ``coserve.model_cache`` skips at once when the cache already holds the model; ``model.cache`` must be set.
    """
    if model.cache is None:
        raise ValueError("model_download_command needs spec.model.cache")
    return ["python3", "-m", "coserve.model_cache", "--model", model.name, "--cache-dir", _hub_cache_dir(model.cache)]


def _engine_container(spec: SpecModel, role: EngineRole, options: PodTemplateOptions) -> Manifest:
    engine = spec.engine
    overrides = _role_overrides(engine, role)
    cache = spec.model.cache
    cache_mounts = [] if cache is None else [
        {"name": MODEL_CACHE_VOLUME, "mountPath": cache.mount_path, "readOnly": True}
    ]  # fmt: skip
    # the user's variables follow the operator's; one named like an operator-set LMCACHE_* or NIXL one replaces it
    env = _merged_by("name", _engine_env(spec, role), options.env)
    ports = [{"name": PORT_NAME, "containerPort": ENGINE_PORT, "protocol": "TCP"}]
    side_port = _nixl_side_channel_port(spec, env)
    if side_port is not None:
        ports.append({"name": NIXL_SIDE_PORT_NAME, "containerPort": side_port, "protocol": "TCP"})
    return {
        "name": ENGINE_CONTAINER,
        "image": engine.image,
        "imagePullPolicy": engine.image_pull_policy,
        "command": list(ENGINE_COMMAND),
        "args": engine_args(spec, role),
        "env": env,
        "envFrom": options.env_from or None,
        "ports": ports,
        # Loading weights and capturing CUDA graphs takes minutes (plus the download, without a cache):
        # the startup probe allows that before liveness starts counting.
        "startupProbe": _http_probe(
            "/health",
            period_s=STARTUP_PERIOD_S,
            failure_threshold=math.ceil(startup_budget_s(spec.model) / STARTUP_PERIOD_S),
        ),
        # NOTE: 5 s timeouts because a busy engine answers /health between steps, not at once.
        "livenessProbe": _http_probe("/health", period_s=10, failure_threshold=3, timeout_s=5),
        "readinessProbe": _http_probe("/health", period_s=5, failure_threshold=3, timeout_s=5),
        "lifecycle": {"preStop": {"exec": {"command": drain_command(spec)}}},
        "resources": _resources(overrides.resources or engine.resources),
        "securityContext": merged_over(RESTRICTED_CONTAINER_SECURITY, options.security_context),
        "volumeMounts": [
            _config_mount(),
            {"name": "dshm", "mountPath": "/dev/shm"},  # noqa: S108 (a path in the pod)
            _token_mount(),
            *cache_mounts,
            *options.volume_mounts,
        ],
    }


def _model_download_container(spec: SpecModel, options: PodTemplateOptions) -> Manifest | None:
    """The init container that fills the model cache (read-write), or ``None`` without a cache.

    It gets the user's env, envFrom and volume mounts too (a proxy, HF_ENDPOINT, a CA bundle), and HF_TOKEN.
    """
    model = spec.model
    if model.cache is None:
        return None
    return {
        "name": MODEL_DOWNLOAD_CONTAINER,
        "image": spec.engine.image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": model_download_command(model),
        "env": _merged_by("name", _hf_token_env(model), options.env) or None,
        "envFrom": options.env_from or None,
        "resources": MODEL_DOWNLOAD_RESOURCES,
        "securityContext": merged_over(RESTRICTED_CONTAINER_SECURITY, options.security_context),
        "volumeMounts": [{"name": MODEL_CACHE_VOLUME, "mountPath": model.cache.mount_path}, *options.volume_mounts],
    }


def _model_cache_volume(pool: CoServePool) -> list[Manifest]:
    cache = pool.spec.model.cache
    if cache is None:
        return []
    claim = cache.claim_name or child_name(pool.metadata.name, "model-cache")
    return [{"name": MODEL_CACHE_VOLUME, "persistentVolumeClaim": {"claimName": claim}}]


def _model_cache_claim(pool: CoServePool) -> Manifest | None:
    """The PersistentVolumeClaim ``<pool>-model-cache``, with ``spec.model.cache.size`` only."""
    cache = pool.spec.model.cache
    if cache is None or cache.size is None:
        return None
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _metadata(pool, "model-cache"),
        "spec": {
            "accessModes": list(cache.access_modes),
            "resources": {"requests": {"storage": cache.size}},
            "storageClassName": cache.storage_class_name,
        },
    }


def _engine_pod_security(spec: SpecModel) -> Manifest:
    """The engine pods' default securityContext: restricted; with a model cache, the images' group owns it, so
    the model-download init container (a non-root user) can write it (checked only at the root: no slow chown)."""
    if spec.model.cache is None:
        return dict(RESTRICTED_POD_SECURITY)
    return {**RESTRICTED_POD_SECURITY, "fsGroup": IMAGE_USER_ID, "fsGroupChangePolicy": "OnRootMismatch"}


def _engine_deployment(pool: CoServePool, role: EngineRole, replicas: int, digest: str) -> Manifest:
    spec = pool.spec
    overrides = _role_overrides(spec.engine, role)
    options = pod_template_options(spec, role)
    download = _model_download_container(spec, options)
    pod_spec: Manifest = {
        "serviceAccountName": options.service_account_name,
        "priorityClassName": options.priority_class_name,
        "imagePullSecrets": options.image_pull_secrets or None,
        # the preStop drain may take drainTimeoutS; vLLM then gets SIGTERM with time left to stop
        "terminationGracePeriodSeconds": spec.engine.drain_timeout_s + DRAIN_GRACE_MARGIN_S,
        # NOTE: runAsNonRoot without a runAsUser: coserve's engine images run as the numeric user 65532, which
        # the kubelet checks; an image running as root is refused (podSecurityContext can loosen that).
        "securityContext": merged_over(_engine_pod_security(spec), options.pod_security_context),
        "initContainers": [download] if download is not None else None,
        "containers": [_engine_container(spec, role, options)],
        "volumes": [
            _config_volume(pool),
            # vLLM's workers (tensor parallelism, NCCL) exchange data through /dev/shm,
            # which the container runtime caps at 64 MiB.
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            _token_volume(pool),
            *_model_cache_volume(pool),
            *options.volumes,
        ],
        "nodeSelector": dict(overrides.node_selector) if overrides.node_selector else None,
        "tolerations": [t.to_wire() for t in overrides.tolerations] if overrides.tolerations else None,
        "topologySpreadConstraints": _spread(pool.metadata.name, role, options.topology_spread_constraints),
    }
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(ENGINE_PORT),
        "prometheus.io/path": "/metrics",
        CONFIG_HASH_ANNOTATION: digest,
    }
    return _deployment(pool, role, replicas, annotations, pod_spec, options)


def _deployment(
    pool: CoServePool,
    component: Component,
    replicas: int,
    annotations: dict[str, str],
    pod_spec: Manifest,
    options: PodTemplateOptions,
) -> Manifest:
    # the user's pod labels and annotations first: the operator's own win (its labels are refused outright)
    labels = {**options.pod_labels, **labels_for(pool.metadata.name, component)}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(pool, component),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_for(pool.metadata.name, component)},
            "template": {
                "metadata": {"labels": labels, "annotations": {**options.pod_annotations, **annotations}},
                "spec": pod_spec,
            },
        },
    }


# --- the router --------------------------------------------------------------------------------


def router_image(router: RouterSpec, operator_image_tag: str | None = None) -> str:
    """The router's image: ``spec.router.image``, or the default image at the operator's tag.

    Only a router left on the default image follows ``operator_image_tag``; an
    image the user chose always wins. The comparison is by value because the API
    server fills the CRD's defaults in, so "unset" cannot be told from "default".
    Raises ``ValueError`` for a tag that is not a valid image tag.
    """
    if operator_image_tag is None:
        return router.image
    if not _IMAGE_TAG_RE.match(operator_image_tag):
        raise ValueError(f"operator_image_tag {operator_image_tag!r} is not a valid image tag")
    if router.image != RouterSpec.model_fields["image"].default:
        return router.image
    repository = router.image.split("@", 1)[0]
    if repository.rfind(":") > repository.rfind("/"):
        repository = repository[: repository.rfind(":")]
    return f"{repository}:{operator_image_tag}"


# A read-only root still needs somewhere for Python's temporary files (the router's and the picker's pods).
_TMP_MOUNT: Manifest = {"name": "tmp", "mountPath": "/tmp"}  # noqa: S108 (a path in the pod)


def _control_plane_security(options: PodTemplateOptions) -> Manifest:
    """The router's and the picker's container: restricted, a read-only root, the image's user; the pool's
    ``spec.router.securityContext`` over it."""
    return merged_over(
        {**RESTRICTED_CONTAINER_SECURITY, "readOnlyRootFilesystem": True, "runAsUser": ROUTER_USER_ID},
        options.security_context,
    )


def _router_deployment(pool: CoServePool, digest: str, image: str) -> Manifest:
    router = pool.spec.router
    options = pod_template_options(pool.spec, "router")
    container = {
        "name": ROUTER_CONTAINER,
        "image": image,
        "command": ["coserve", "router", "--config", ROUTER_CONFIG_PATH, "--port", str(ROUTER_PORT)],
        "env": [
            _token_env(),
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            *options.env,
        ],
        "envFrom": options.env_from or None,
        "ports": [{"name": PORT_NAME, "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        # Liveness: the process serves. Readiness: it can place a request (a healthy decoder below full), so
        # while engines load (minutes on GPUs) the router is left alive and simply gets no traffic.
        "startupProbe": _http_probe("/live", period_s=2, failure_threshold=30),
        "livenessProbe": _http_probe("/live", period_s=10, failure_threshold=3),
        "readinessProbe": _http_probe("/ready", period_s=5, failure_threshold=3),
        "resources": _resources(router.resources),
        "securityContext": _control_plane_security(options),
        "volumeMounts": [
            _config_mount(),
            _TMP_MOUNT,
            {"name": "batches", "mountPath": ROUTER_BATCH_PATH},
            _token_mount(),
            *options.volume_mounts,
        ],
    }
    # Offline batches outlive a router pod only on a claim; an emptyDir still survives container restarts.
    batches: Manifest = (
        {"name": "batches", "persistentVolumeClaim": {"claimName": router.batch_volume_claim}}
        if router.batch_volume_claim
        else {"name": "batches", "emptyDir": {}}
    )
    pod_spec = {
        "serviceAccountName": child_name(pool.metadata.name, "router"),
        "priorityClassName": options.priority_class_name,
        "imagePullSecrets": options.image_pull_secrets or None,
        "securityContext": merged_over(
            {**RESTRICTED_POD_SECURITY, "runAsUser": ROUTER_USER_ID}, options.pod_security_context
        ),
        "containers": [container],
        "volumes": [
            _config_volume(pool),
            {"name": "tmp", "emptyDir": {}},
            batches,
            _token_volume(pool),
            *options.volumes,
        ],
        "topologySpreadConstraints": _spread(pool.metadata.name, "router", options.topology_spread_constraints),
    }
    annotations = {
        CONFIG_HASH_ANNOTATION: digest,
        # the autoscaler's workload signals (R, L_in, L_d, W) are the router's metrics
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(ROUTER_PORT),
        "prometheus.io/path": "/metrics",
    }
    return _deployment(pool, "router", router.replicas, annotations, pod_spec, options)


# --- the router's identity: the Leases it runs offline batches under ---------------------------


def _router_identity(pool: CoServePool) -> list[Manifest]:
    """A ServiceAccount for the router pods, and a Role (bound to it) on the Leases that make each offline
    batch run on one replica at a time: create any, read and renew them (names are per batch)."""
    name = child_name(pool.metadata.name, "router")
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(pool, "router")},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _metadata(pool, "router"),
            "rules": [
                {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "patch"]}
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _metadata(pool, "router"),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            # the same "default" as engine_service_host when a rendered pool names no namespace
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": pool.metadata.namespace or "default"}],
        },
    ]


# --- gateway mode: the endpoint picker, the InferencePool, its route, the gateway's proxies -----------


def _gateway_children(pool: CoServePool, digest: str, image: str) -> list[Manifest | None]:
    """What ``spec.gateway.enabled`` adds: the picker (``coserve epp``) and its Service, the NetworkPolicy that
    admits the gateway's proxies to the decoders, the InferencePool and (``spec.gateway.httpRoute``) its route."""
    return [
        _picker_deployment(pool, digest, image),
        _picker_service(pool),
        _gateway_proxies_policy(pool),
        _inference_pool(pool),
        _http_route(pool) if pool.spec.gateway.http_route else None,
    ]


def _grpc_probe(service: str, *, period_s: int, failure_threshold: int) -> Manifest:
    """The kubelet's gRPC probe of the picker: on its cleartext health port (kubelet probes speak no TLS)."""
    return {
        "grpc": {"port": HEALTH_PORT, "service": service},
        "periodSeconds": period_s,
        "failureThreshold": failure_threshold,
        "timeoutSeconds": 1,
    }


def _picker_deployment(pool: CoServePool, digest: str, image: str) -> Manifest:
    """The endpoint picker: the router's image and pod options, ``coserve epp`` on the router's config and token.

    It never calls the API server (pins live on the decoders), so its pods get no service account token.
    """
    options = pod_template_options(pool.spec, "router")
    gateway = pool.spec.gateway
    certificate: list[Manifest] = []  # spec.gateway.pickerCertSecret's volume, and its mount
    certificate_mount: list[Manifest] = []
    if gateway.picker_cert_secret:
        certificate = [{"name": PICKER_CERT_VOLUME, "secret": {"secretName": gateway.picker_cert_secret}}]
        certificate_mount = [{"name": PICKER_CERT_VOLUME, "mountPath": PICKER_CERT_PATH, "readOnly": True}]
    container = {
        "name": PICKER_CONTAINER,
        "image": image,
        "command": [
            *("coserve", "epp", "--config", ROUTER_CONFIG_PATH),
            *("--port", str(PICKER_PORT), "--metrics-port", str(PICKER_METRICS_PORT)),
            *("--health-port", str(HEALTH_PORT)),
            *(("--secure-serving",) if gateway.secure_serving else ()),
            *(("--cert-path", PICKER_CERT_PATH) if certificate else ()),
        ],
        "env": [_token_env(), *options.env],
        "envFrom": options.env_from or None,
        "ports": [
            {"name": PICKER_PORT_NAME, "containerPort": PICKER_PORT, "protocol": "TCP"},
            {"name": PICKER_HEALTH_PORT_NAME, "containerPort": HEALTH_PORT, "protocol": "TCP"},
            {"name": METRICS_PORT_NAME, "containerPort": PICKER_METRICS_PORT, "protocol": "TCP"},
        ],
        # gRPC health (GAIE's protocol): live once it serves, ready once it has read the engines
        "startupProbe": _grpc_probe(LIVENESS_SERVICE, period_s=2, failure_threshold=30),
        "livenessProbe": _grpc_probe(LIVENESS_SERVICE, period_s=10, failure_threshold=3),
        "readinessProbe": _grpc_probe(READINESS_SERVICE, period_s=5, failure_threshold=3),
        "resources": _resources(pool.spec.gateway.picker_resources),
        "securityContext": _control_plane_security(options),
        "volumeMounts": [_config_mount(), _TMP_MOUNT, _token_mount(), *certificate_mount, *options.volume_mounts],
    }
    pod_spec = {
        "automountServiceAccountToken": False,
        "priorityClassName": options.priority_class_name,
        "imagePullSecrets": options.image_pull_secrets or None,
        "securityContext": merged_over(
            {**RESTRICTED_POD_SECURITY, "runAsUser": ROUTER_USER_ID}, options.pod_security_context
        ),
        "containers": [container],
        "volumes": [
            _config_volume(pool),
            {"name": "tmp", "emptyDir": {}},
            _token_volume(pool),
            *certificate,
            *options.volumes,
        ],
        "topologySpreadConstraints": _spread(pool.metadata.name, "picker", options.topology_spread_constraints),
    }
    annotations = {
        CONFIG_HASH_ANNOTATION: digest,
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(PICKER_METRICS_PORT),
        "prometheus.io/path": "/metrics",
    }
    return _deployment(pool, "picker", pool.spec.gateway.picker_replicas, annotations, pod_spec, options)


def _picker_service(pool: CoServePool) -> Manifest:
    """What the InferencePool's endpointPickerRef names: ext_proc over HTTP/2, in TLS (``http2``, as GAIE's own
    picker Service says) or cleartext (``kubernetes.io/h2c``), and the metrics."""
    protocol = "http2" if pool.spec.gateway.secure_serving else "kubernetes.io/h2c"
    ports = [
        {"name": PICKER_PORT_NAME, "port": PICKER_PORT, "targetPort": PICKER_PORT, "protocol": "TCP",
         "appProtocol": protocol},
        {"name": METRICS_PORT_NAME, "port": PICKER_METRICS_PORT, "targetPort": PICKER_METRICS_PORT, "protocol": "TCP"},
    ]  # fmt: skip
    return _service(pool, "picker", {"type": "ClusterIP", "ports": ports})


def _gateway_proxies_policy(pool: CoServePool) -> Manifest:
    """The decoders admit the gateway's proxies (``spec.gateway.proxies``; none named: any pod) on the engine port.

    NetworkPolicies add up: this one widens ``<pool>-engines`` for the decoders' port only, and goes with gateway
    mode. Prefillers are never reached by the gateway: the picker (one of the pool's own pods) prefills turn 1."""
    peers = [
        {
            "podSelector": {"matchLabels": dict(peer.pod_labels)},
            "namespaceSelector": {"matchLabels": dict(peer.namespace_labels)},
        }
        for peer in pool.spec.gateway.proxies
    ]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(pool, "gateway-proxies"),
        "spec": {
            "podSelector": {"matchLabels": selector_for(pool.metadata.name, "decoder")},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": peers or None, "ports": [{"protocol": "TCP", "port": ENGINE_PORT}]}],
        },
    }


def _inference_pool(pool: CoServePool) -> Manifest:
    """The decoders as a GAIE InferencePool, whose endpoint picker is the pool's; the gateway fails closed
    (``FailClose``): with the picker unreachable, a request is refused rather than sent to any decoder, since
    a decoder without the conversation's KV recomputes it and a turn 1 would skip its prefiller."""
    return {
        "apiVersion": GATEWAY_API_KINDS["InferencePool"][0],
        "kind": "InferencePool",
        "metadata": _metadata(pool, "inference-pool"),
        "spec": {
            "selector": {"matchLabels": selector_for(pool.metadata.name, "decoder")},
            "targetPorts": [{"number": ENGINE_PORT}],
            "endpointPickerRef": {
                "name": child_name(pool.metadata.name, "picker"),
                "port": {"number": PICKER_PORT},
                "failureMode": "FailClose",
            },
        },
    }


def _http_route(pool: CoServePool) -> Manifest:
    """An HTTPRoute on ``spec.gateway.gatewayName``: the batch API to the router (which runs offline batches),
    every other path to the InferencePool."""
    gateway = pool.spec.gateway
    name = pool.metadata.name
    timeouts = {"request": gateway.request_timeout}
    parent = {"name": gateway.gateway_name, "namespace": gateway.gateway_namespace}
    router = {"kind": "Service", "name": child_name(name, "router"), "port": ROUTER_SERVICE_PORT}
    inference_pool = {"group": "inference.networking.k8s.io", "kind": "InferencePool",
                      "name": child_name(name, "inference-pool")}  # fmt: skip
    return {
        "apiVersion": GATEWAY_API_KINDS["HTTPRoute"][0],
        "kind": "HTTPRoute",
        "metadata": _metadata(pool, "route"),
        "spec": {
            "parentRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", **parent}],
            "rules": [
                {
                    "matches": [{"path": {"type": "PathPrefix", "value": path}} for path in ROUTER_ONLY_PATHS],
                    "backendRefs": [router],
                    "timeouts": timeouts,
                },
                {
                    "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                    "backendRefs": [inference_pool],
                    "timeouts": timeouts,
                },
            ],
        },
    }


# --- the router token and who may reach the engines ---------------------------------------------


def _token_secret(pool: CoServePool) -> Manifest:
    """The Secret that holds the pool's router token. Its ``data`` is not rendered: the operator
    generates a random token when it creates the Secret and never changes it (drift ignores ``data``)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(pool, "router-token"),
        "type": "Opaque",
    }


def _engine_network_policy(pool: CoServePool) -> Manifest:
    """Engine pods accept traffic from the pool's own pods (router, prefillers, decoders: requests and KV
    handoff) on any port, and from ``spec.engine.metricsScrapers`` on the engine port; nobody else.

    NOTE: any port, not ENGINE_PORT, for the pool's own pods: NixlConnector's handshake runs between the engines on
    NIXL_SIDE_CHANNEL_PORT (one data-parallel rank per engine: the spec refuses extraArgs that ask for several), and its
    transfers on ports UCX picks at run time.

    A peer with only a podSelector selects pods of the policy's own namespace; each scraper is a peer with a
    namespaceSelector and a podSelector, both naming labels (the spec refuses an empty one, which would select
    every namespace or every pod), so only pods in the named namespaces can pass for a scraper by their labels."""
    name = pool.metadata.name
    scrapers: list[Manifest] = [
        {
            "podSelector": {"matchLabels": dict(peer.pod_labels)},
            "namespaceSelector": {"matchLabels": dict(peer.namespace_labels)},
        }
        for peer in pool.spec.engine.metrics_scrapers
    ]
    ingress: list[Manifest] = [
        {"from": [{"podSelector": {"matchLabels": {INSTANCE_LABEL: name, NAME_LABEL: APP_NAME}}}]}
    ]
    if scrapers:
        ingress.append({"from": scrapers, "ports": [{"protocol": "TCP", "port": ENGINE_PORT}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(pool, "engines"),
        "spec": {
            "podSelector": {
                "matchLabels": {INSTANCE_LABEL: name},
                "matchExpressions": [{"key": ROLE_LABEL, "operator": "In", "values": list(ENGINE_ROLES)}],
            },
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


# --- PodDisruptionBudgets ----------------------------------------------------------------------


def decoders_before_headroom(plan: Plan) -> int:
    """The decoders the target rate R needs before headroom: the decoders' floor under evictions.

    The plan sizes decoders for its design rate ``headroom · R``; at R they are busy
    ``max(utilization.decoderThroughput, utilization.decoderMemory)`` of their time, so
    ``ceil(decoders · that)`` of them carry R with no spare, and a budget of that many lets evictions
    take only the headroom's decoders. At least 1 and at most ``plan.decoders``.
    """
    used = max(plan.utilization.decoder_throughput, plan.utilization.decoder_memory)
    need = plan.decoders * used
    return min(plan.decoders, max(1, math.ceil(need - 1e-9 * max(1.0, need))))  # float noise is not a decoder


def disruption_budget(spec: SpecModel, plan: Plan, component: EngineRole | Literal["router"]) -> Manifest | None:
    """``component``'s budget, ``{"minAvailable": n}`` or ``{"maxUnavailable": n}``; ``None``: no budget.

    ``spec.disruption.<role>`` wins when set. Otherwise each role keeps its minimum:

    - router: 1 with two or more replicas; a single replica gets no budget (it restarts in seconds);
    - prefillers: one less than planned, at least 1, so they leave one at a time and never the last.
      The prefiller count sets the pool's saturation rate M·R*, so while one is away the pool saturates
      one prefiller's R* sooner: the usual trade for letting nodes drain at all;
    - decoders: ``decoders_before_headroom(plan)``; decoders hold the live conversations' KV.

    With autoscaling, the engines' minimum is the one the user declared: ``autoscaling.<role>s.minReplicas``
    (the replica count moves with load, the budget does not).
    """
    disruption = spec.disruption
    if not disruption.enabled:
        return None
    override = getattr(disruption, component)
    if override is not None:
        return override.to_wire()  # type: ignore[no-any-return]
    if component == "router":
        return {"minAvailable": 1} if spec.router.replicas >= 2 else None
    autoscaling = spec.autoscaling
    if component == "prefiller" and plan.prefillers == 0:
        return None  # aggregated engines: no prefiller to keep available
    if component == "prefiller":
        floor = autoscaling.prefillers.min_replicas if autoscaling.enabled else max(1, plan.prefillers - 1)
    else:
        floor = autoscaling.decoders.min_replicas if autoscaling.enabled else decoders_before_headroom(plan)
    return {"minAvailable": floor}


def _disruption_budget(pool: CoServePool, plan: Plan, component: EngineRole | Literal["router"]) -> Manifest | None:
    budget = disruption_budget(pool.spec, plan, component)
    if budget is None:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(pool, component),
        "spec": {
            "selector": {"matchLabels": selector_for(pool.metadata.name, component)},
            **budget,
            # a pod that is not ready serves nothing: draining its node must not wait for it
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


# --- Services ----------------------------------------------------------------------------------


def _service(pool: CoServePool, component: Component, spec: Manifest) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(pool, component),
        "spec": {"selector": selector_for(pool.metadata.name, component), **spec},
    }


def _router_service(pool: CoServePool) -> Manifest:
    return _service(
        pool,
        "router",
        {
            "type": "ClusterIP",
            "ports": [{"name": PORT_NAME, "port": ROUTER_SERVICE_PORT, "targetPort": ROUTER_PORT, "protocol": "TCP"}],
        },
    )


def _engine_service(pool: CoServePool, role: EngineRole) -> Manifest:
    # Headless: the router pins conversations to individual engine pods, so it needs
    # their addresses, not one virtual IP; only ready pods are published.
    return _service(
        pool,
        role,
        {
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "ports": [{"name": PORT_NAME, "port": ENGINE_PORT, "targetPort": ENGINE_PORT, "protocol": "TCP"}],
        },
    )


def _without_none(value: Any) -> Any:
    """``value`` with every ``None`` dropped from dicts and lists (empty dicts such as ``emptyDir: {}`` stay)."""
    if isinstance(value, dict):
        return {key: _without_none(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_none(item) for item in value if item is not None]
    return value
