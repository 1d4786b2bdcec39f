"""The Kubernetes objects of one CoServePool, built as plain dicts.

Who calls it: ``coserve render`` prints ``build_children(pool, plan)``, and the
operator's reconcile handler applies the same list, so what render shows is what
the operator creates. Pure: imports the stdlib and ``coserve.api`` only (no kopf,
no Kubernetes client, no YAML), and the output is deterministic (equal input,
equal dicts), holds no ``None`` and keeps integers as integers.

A pool named ``chat`` owns, in this order::

    ConfigMap  chat-config      engine.json (engines) and router.json (router)
    Deployment chat-prefiller   vLLM, kv_producer, plan.prefillers replicas
    Deployment chat-decoder     vLLM, kv_consumer, plan.decoders replicas
    Deployment chat-router      `coserve router`, spec.router.replicas replicas
    Service    chat-router      ClusterIP, port 80 -> 8080, what clients call
    Service    chat-prefiller   headless, port 8000, the router resolves engine pods through it
    Service    chat-decoder     headless, port 8000

Every pod template carries ``coserve.dev/config-hash``, a digest of the
ConfigMap's data, so a change of SLOs or offload settings rolls the pods while a
change of replica counts does not.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any, Literal, get_args

from coserve.api.resource import API_VERSION, KIND, CoServePool
from coserve.api.spec import (
    EngineSpec,
    KVOffloadBackend,
    ResourceRequirements,
    RoleOverrides,
    RouterSpec,
    SpecModel,
)
from coserve.api.status import Plan

__all__ = [
    "APP_NAME",
    "CHILDREN",
    "COMPONENTS",
    "COMPONENT_LABEL",
    "CONFIG_HASH_ANNOTATION",
    "CONFIG_MOUNT_PATH",
    "ENGINE_CONFIG_KEY",
    "ENGINE_CONFIG_PATH",
    "ENGINE_PORT",
    "ENGINE_ROLES",
    "INSTANCE_LABEL",
    "MANAGED_BY",
    "MANAGED_BY_LABEL",
    "NAME_LABEL",
    "ROLE_LABEL",
    "ROUTER_CONFIG_KEY",
    "ROUTER_CONFIG_PATH",
    "ROUTER_PORT",
    "ROUTER_SERVICE_PORT",
    "Component",
    "EngineRole",
    "Manifest",
    "build_children",
    "child_keys",
    "child_name",
    "config_data",
    "config_hash",
    "engine_args",
    "engine_config",
    "engine_service_host",
    "kv_transfer_config",
    "labels_for",
    "owner_references",
    "router_config",
    "router_image",
    "selector_for",
    "uses_gpus",
]

Manifest = dict[str, Any]  # one Kubernetes object, JSON-ready

Component = Literal["prefiller", "decoder", "router", "config", "router-token", "engines"]
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
    data = config_data(pool)
    digest = config_hash(data)
    children = [
        _config_map(pool, data),
        _engine_deployment(pool, "prefiller", plan.prefillers, digest),
        _engine_deployment(pool, "decoder", plan.decoders, digest),
        _router_deployment(pool, digest, router_image(pool.spec.router, operator_image_tag)),
        _router_service(pool),
        _engine_service(pool, "prefiller"),
        _engine_service(pool, "decoder"),
        _token_secret(pool),
        _engine_network_policy(pool),
        *_router_identity(pool),
    ]
    return [_without_none(child) for child in children]


# --- names, labels, ownership ------------------------------------------------------------------


# (kind, component) of every child, in the order build_children returns them.
CHILDREN: tuple[tuple[str, Component], ...] = (
    ("ConfigMap", "config"),
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
)


def child_keys(pool_name: str) -> list[tuple[str, str]]:
    """(kind, name) of every child of ``pool_name``: what the operator reads before it reconciles."""
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


def router_config(pool: CoServePool) -> dict[str, Any]:
    """What ``coserve router`` reads from ``ROUTER_CONFIG_PATH``: model name, engine Services, classes, offline."""
    spec = pool.spec
    return {
        "model": spec.model.served_model_name or spec.model.name,
        "prefillerService": engine_service_host(pool, "prefiller"),
        "decoderService": engine_service_host(pool, "decoder"),
        "enginePort": ENGINE_PORT,
        "priorityClasses": [cls.to_wire() for cls in spec.priority_classes],
        "offline": spec.offline.to_wire(),
        "batchDir": ROUTER_BATCH_PATH,
        # router replicas run each offline batch once by holding a Lease per batch (the router's own Role)
        "batchLock": "lease",
        **({"prefillLatency": spec.profile.prefill_latency.to_wire()} if spec.profile.prefill_latency else {}),
    }


def config_data(pool: CoServePool) -> dict[str, str]:
    """The ConfigMap's ``data``: ``engine.json`` and ``router.json``, as sorted, indented JSON.

    NOTE: replica counts stay out of it, so scaling a role never rolls every pod.
    """
    return {
        ENGINE_CONFIG_KEY: _to_json(engine_config(pool.spec)),
        ROUTER_CONFIG_KEY: _to_json(router_config(pool)),
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
    prefill-to-decode handoff is vLLM's NixlConnector, and the ``lmcache`` /
    ``native`` offload backends are LMCache's and vLLM's own connectors; they
    are combined with vLLM's MultiConnector, coserve's first. Engines without
    GPUs get coserve's connector alone: vLLM has no cross-pod KV transport on
    CPUs, so there the decoder recomputes turn 1 (``handoff_backend: shm``
    moves KV only between engines on one machine, as ``coserve up`` runs them).
    """
    offload = spec.kv_offload
    kv_role = _KV_ROLES[role]
    extra: dict[str, Any] = {"coserve_config": ENGINE_CONFIG_PATH}
    if offload.enabled and offload.backend == KVOffloadBackend.HOST:
        extra["host_memory_bytes"] = offload.host_memory_bytes
    coserve = {
        "kv_connector": KV_CONNECTOR,
        "kv_connector_module_path": KV_CONNECTOR_MODULE,
        "kv_role": kv_role,
        "kv_connector_extra_config": extra,
    }
    if not uses_gpus(spec, role):
        return coserve
    others: list[dict[str, Any]] = [{"kv_connector": "NixlConnector", "kv_role": kv_role}]
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
        "kv_connector_extra_config": {"connectors": [coserve, *others]},
    }


def _engine_env(spec: SpecModel, role: EngineRole) -> list[Manifest]:
    env = [
        {"name": "COSERVE_ROLE", "value": role},
        {"name": "COSERVE_CONFIG", "value": ENGINE_CONFIG_PATH},
        {"name": "VLLM_PLUGINS", "value": "coserve"},
        _token_env(),
    ]
    offload = spec.kv_offload
    if offload.enabled and offload.backend == KVOffloadBackend.LMCACHE and uses_gpus(spec, role):
        # LMCache reads its settings from the environment: a local CPU tier bounded like coserve's pool.
        env += [
            {"name": "LMCACHE_LOCAL_CPU", "value": "True"},
            {"name": "LMCACHE_MAX_LOCAL_CPU_SIZE", "value": f"{offload.host_memory_bytes / 2**30:g}"},
            {"name": "LMCACHE_CHUNK_SIZE", "value": "256"},
        ]
    return env


def engine_args(spec: SpecModel, role: EngineRole) -> list[str]:
    """The vLLM server's arguments for ``role``: coserve's own, then engine.extraArgs, then the role's.

    NOTE: user arguments come last because vLLM's parser keeps the last value of
    a repeated flag, so extraArgs can override any argument set here.
    """
    model = spec.model
    engine = spec.engine
    kv_json = json.dumps(kv_transfer_config(spec, role), sort_keys=True, separators=(",", ":"))
    return [
        "--model",
        model.name,
        "--served-model-name",
        model.served_model_name or model.name,
        "--port",
        str(ENGINE_PORT),
        "--tensor-parallel-size",
        str(engine.tensor_parallel_size),
        "--scheduler-cls",
        SCHEDULER_CLS,
        "--worker-cls",
        WORKER_CLS if uses_gpus(spec, role) else CPU_WORKER_CLS,
        "--middleware",
        REQUEST_VALIDATOR,
        "--kv-transfer-config",
        kv_json,
        *engine.extra_args,
        *(_role_overrides(engine, role).extra_args or []),
    ]


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


def _engine_container(spec: SpecModel, role: EngineRole) -> Manifest:
    engine = spec.engine
    overrides = _role_overrides(engine, role)
    return {
        "name": ENGINE_CONTAINER,
        "image": engine.image,
        "imagePullPolicy": engine.image_pull_policy,
        "command": list(ENGINE_COMMAND),
        "args": engine_args(spec, role),
        "env": _engine_env(spec, role),
        "ports": [{"name": PORT_NAME, "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        # Loading weights and capturing CUDA graphs takes minutes: the startup probe
        # allows 10 minutes before liveness starts counting.
        "startupProbe": _http_probe("/health", period_s=10, failure_threshold=60),
        # NOTE: 5 s timeouts because a busy engine answers /health between steps, not at once.
        "livenessProbe": _http_probe("/health", period_s=10, failure_threshold=3, timeout_s=5),
        "readinessProbe": _http_probe("/health", period_s=5, failure_threshold=3, timeout_s=5),
        "resources": _resources(overrides.resources or engine.resources),
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [_config_mount(), {"name": "dshm", "mountPath": "/dev/shm"}, _token_mount()],  # noqa: S108
    }


def _engine_deployment(pool: CoServePool, role: EngineRole, replicas: int, digest: str) -> Manifest:
    overrides = _role_overrides(pool.spec.engine, role)
    pod_spec: Manifest = {
        # NOTE: runAsNonRoot is not forced: the upstream vLLM image runs as root, and the kubelet
        # refuses to start a root image under runAsNonRoot. The container still drops every capability.
        "containers": [_engine_container(pool.spec, role)],
        "volumes": [
            _config_volume(pool),
            # vLLM's workers (tensor parallelism, NCCL) exchange data through /dev/shm,
            # which the container runtime caps at 64 MiB.
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            _token_volume(pool),
        ],
        "nodeSelector": dict(overrides.node_selector) if overrides.node_selector else None,
        "tolerations": [t.to_wire() for t in overrides.tolerations] if overrides.tolerations else None,
    }
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(ENGINE_PORT),
        "prometheus.io/path": "/metrics",
        CONFIG_HASH_ANNOTATION: digest,
    }
    return _deployment(pool, role, replicas, annotations, pod_spec)


def _deployment(
    pool: CoServePool, component: Component, replicas: int, annotations: dict[str, str], pod_spec: Manifest
) -> Manifest:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(pool, component),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_for(pool.metadata.name, component)},
            "template": {
                "metadata": {"labels": labels_for(pool.metadata.name, component), "annotations": annotations},
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


def _router_deployment(pool: CoServePool, digest: str, image: str) -> Manifest:
    router = pool.spec.router
    container = {
        "name": ROUTER_CONTAINER,
        "image": image,
        "command": ["coserve", "router", "--config", ROUTER_CONFIG_PATH, "--port", str(ROUTER_PORT)],
        "env": [
            _token_env(),
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        ],
        "ports": [{"name": PORT_NAME, "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        # Liveness: the process serves. Readiness: it can place a request (a healthy decoder below full), so
        # while engines load (minutes on GPUs) the router is left alive and simply gets no traffic.
        "startupProbe": _http_probe("/live", period_s=2, failure_threshold=30),
        "livenessProbe": _http_probe("/live", period_s=10, failure_threshold=3),
        "readinessProbe": _http_probe("/ready", period_s=5, failure_threshold=3),
        "resources": _resources(router.resources),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "runAsUser": ROUTER_USER_ID,
            "capabilities": {"drop": ["ALL"]},
        },
        # A read-only root still needs somewhere for Python's temporary files.
        "volumeMounts": [
            _config_mount(),
            {"name": "tmp", "mountPath": "/tmp"},  # noqa: S108 (a path in the pod)
            {"name": "batches", "mountPath": ROUTER_BATCH_PATH},
            _token_mount(),
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
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": ROUTER_USER_ID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [_config_volume(pool), {"name": "tmp", "emptyDir": {}}, batches, _token_volume(pool)],
    }
    annotations = {
        CONFIG_HASH_ANNOTATION: digest,
        # the autoscaler's workload signals (R, L_in, L_d, W) are the router's metrics
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(ROUTER_PORT),
        "prometheus.io/path": "/metrics",
    }
    return _deployment(pool, "router", router.replicas, annotations, pod_spec)


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
    handoff) on any port, and from ``spec.engine.metricsScrapers`` on the engine port; nobody else."""
    name = pool.metadata.name
    scrapers = []
    for peer in pool.spec.engine.metrics_scrapers:
        entry: Manifest = {"podSelector": {"matchLabels": dict(peer.pod_labels)}}
        if peer.namespace_labels is not None:
            entry["namespaceSelector"] = {"matchLabels": dict(peer.namespace_labels)}
        scrapers.append(entry)
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
