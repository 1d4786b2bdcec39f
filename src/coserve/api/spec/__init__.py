"""The CoServePool spec: what a user asks for.

These models are the single source of truth for the CRD's openAPIV3Schema
(``coserve.api.crd`` generates ``crds/coserve.dev_coservepools.yaml`` from them),
so every ``Field`` carries the description that ``kubectl explain`` shows, and
its default and bounds. Rules about the spec's shape that a structural schema
cannot state (exactly one of two fields, names the operator keeps for itself,
volume mounts that name a volume) are CEL rules the API server runs, each with a
pydantic validator that refuses the same input at the same field path. Rules that
need the provisioning model (min above max, a profile that is missing, a KV cache
smaller than one conversation) live in ``coserve.provisioning.validation`` and
surface as PlanValid=False.

One module per part of the spec; import from here, which re-exports them all:

- ``pool``: ``SpecModel``, the whole spec, and the rules across its parts
- ``model_source``: ``spec.model``, the model and where its weights come from
- ``engine``: ``spec.engine``, the vLLM engines and their per-role overrides; ``spec.kvOffload``
- ``workload``: ``spec.workload`` and ``spec.profile``, the provisioning model's inputs
  (its docstring maps the model's symbols to fields)
- ``priority_classes``: ``spec.priorityClasses`` and ``spec.offline``
- ``autoscaling``: ``spec.autoscaling``
- ``router``: ``spec.router``
- ``gateway``: ``spec.gateway``, the InferencePool and endpoint picker of gateway mode
- ``disruption``: ``spec.disruption``, the PodDisruptionBudgets
- ``pod_options``: pod template options shared by the engines and the router, built from
  ``env``, ``volumes`` and ``placement``
- ``core``: quantities, resource requirements, tolerations and name patterns, as core/v1 has them
- ``reserved``: names the operator keeps for itself in the pods, and the vLLM flags it renders
- ``_rules``: helpers for the CEL rules and their pydantic twins

The parts import one another one way only: ``pool`` on top, ``core``, ``reserved`` and ``_rules``
at the bottom.
"""

from __future__ import annotations

from coserve.api.spec.autoscaling import (
    AutoscalingQueries,
    AutoscalingSpec,
    ReplicaBounds,
)
from coserve.api.spec.core import (
    CONFIG_KEY_PATTERN,
    DNS_LABEL_PATTERN,
    DNS_SUBDOMAIN_PATTERN,
    ENV_NAME_PATTERN,
    LABEL_VALUE_PATTERN,
    MAX_LABEL_KEY_LENGTH,
    QUANTITY_PATTERN,
    LabelValue,
    Quantity,
    ResourceList,
    ResourceName,
    ResourceRequirements,
    TaintEffect,
    Toleration,
    TolerationOperator,
)
from coserve.api.spec.disruption import (
    PERCENT_PATTERN,
    DisruptionBudget,
    DisruptionSpec,
    IntOrPercent,
)
from coserve.api.spec.engine import (
    UNSUPPORTED_ENGINE_COUNTS,
    UNSUPPORTED_ENGINE_FLAG_ALIASES,
    UNSUPPORTED_ENGINE_FLAGS,
    EngineSpec,
    KVOffloadBackend,
    KVOffloadSpec,
    RoleOverrides,
    ScraperPeer,
)
from coserve.api.spec.env import (
    EnvFromSource,
    EnvVar,
    EnvVarSource,
    KeySelector,
    ObjectFieldSelector,
    ObjectRef,
    ResourceFieldSelector,
    SecretKeyRef,
)
from coserve.api.spec.gateway import (
    GATEWAY_DURATION_PATTERN,
    GatewaySpec,
)
from coserve.api.spec.model_source import (
    DEFAULT_MODEL_MOUNT_PATH,
    AccessMode,
    ModelCacheSpec,
    ModelSpec,
)
from coserve.api.spec.placement import (
    LabelSelector,
    LabelSelectorRequirement,
    SelectorOperator,
    TopologySpreadConstraint,
    WhenUnsatisfiable,
)
from coserve.api.spec.pod_options import (
    EnginePodOptions,
    LocalObjectReference,
    PodOptions,
)
from coserve.api.spec.pool import (
    PoolShape,
    SpecModel,
)
from coserve.api.spec.priority_classes import (
    DEFAULT_PRIORITY_CLASSES,
    OfflineSpec,
    PriorityClassSpec,
)
from coserve.api.spec.reserved import (
    HF_TOKEN_ENV,
    OPERATOR_ENGINE_FLAG_ALIASES,
    OPERATOR_ENGINE_FLAGS,
    OPERATOR_ENV_NAMES,
    OPERATOR_ENV_PREFIX,
    OPERATOR_LABELS,
    OPERATOR_MOUNT_PATHS,
    OPERATOR_VOLUMES,
    ROUTER_MOUNT_PATHS,
    V2_RUNNER_ENV,
    V2_RUNNER_OFF,
)
from coserve.api.spec.router import (
    RouterSpec,
)
from coserve.api.spec.volumes import (
    VOLUME_SOURCES,
    Volume,
    VolumeMount,
)
from coserve.api.spec.workload import (
    ConfigMapProfileRef,
    PrefillLatencyCurve,
    ProfileSpec,
    WorkloadSpec,
)

__all__ = [
    "CONFIG_KEY_PATTERN",
    "DEFAULT_MODEL_MOUNT_PATH",
    "DEFAULT_PRIORITY_CLASSES",
    "DNS_LABEL_PATTERN",
    "DNS_SUBDOMAIN_PATTERN",
    "ENV_NAME_PATTERN",
    "GATEWAY_DURATION_PATTERN",
    "HF_TOKEN_ENV",
    "LABEL_VALUE_PATTERN",
    "MAX_LABEL_KEY_LENGTH",
    "OPERATOR_ENGINE_FLAGS",
    "OPERATOR_ENGINE_FLAG_ALIASES",
    "OPERATOR_ENV_NAMES",
    "OPERATOR_ENV_PREFIX",
    "OPERATOR_LABELS",
    "OPERATOR_MOUNT_PATHS",
    "OPERATOR_VOLUMES",
    "PERCENT_PATTERN",
    "QUANTITY_PATTERN",
    "ROUTER_MOUNT_PATHS",
    "UNSUPPORTED_ENGINE_COUNTS",
    "UNSUPPORTED_ENGINE_FLAGS",
    "UNSUPPORTED_ENGINE_FLAG_ALIASES",
    "V2_RUNNER_ENV",
    "V2_RUNNER_OFF",
    "VOLUME_SOURCES",
    "AccessMode",
    "AutoscalingQueries",
    "AutoscalingSpec",
    "ConfigMapProfileRef",
    "DisruptionBudget",
    "DisruptionSpec",
    "EnginePodOptions",
    "EngineSpec",
    "EnvFromSource",
    "EnvVar",
    "EnvVarSource",
    "GatewaySpec",
    "IntOrPercent",
    "KVOffloadBackend",
    "KVOffloadSpec",
    "KeySelector",
    "LabelSelector",
    "LabelSelectorRequirement",
    "LabelValue",
    "LocalObjectReference",
    "ModelCacheSpec",
    "ModelSpec",
    "ObjectFieldSelector",
    "ObjectRef",
    "OfflineSpec",
    "PodOptions",
    "PoolShape",
    "PrefillLatencyCurve",
    "PriorityClassSpec",
    "ProfileSpec",
    "Quantity",
    "ReplicaBounds",
    "ResourceFieldSelector",
    "ResourceList",
    "ResourceName",
    "ResourceRequirements",
    "RoleOverrides",
    "RouterSpec",
    "ScraperPeer",
    "SecretKeyRef",
    "SelectorOperator",
    "SpecModel",
    "TaintEffect",
    "Toleration",
    "TolerationOperator",
    "TopologySpreadConstraint",
    "Volume",
    "VolumeMount",
    "WhenUnsatisfiable",
    "WorkloadSpec",
]
