"""CoServePool API types (pydantic v2). Pure: imports pydantic and the stdlib only.

The CRD in ``crds/`` is generated from these models by ``coserve.api.crd``;
``tests/api/test_crd.py`` fails if the two drift apart.
"""

from coserve.api.parse import parse_pool, parse_spec
from coserve.api.problems import InvalidInput, Problem
from coserve.api.resource import API_VERSION, GROUP, KIND, PLURAL, SHORT_NAME, VERSION, CoServePool, ObjectMeta
from coserve.api.spec import (
    DEFAULT_PRIORITY_CLASSES,
    AutoscalingSpec,
    ConfigMapProfileRef,
    EngineSpec,
    KVOffloadBackend,
    KVOffloadSpec,
    ModelSpec,
    OfflineSpec,
    PrefillLatencyCurve,
    PriorityClassSpec,
    ProfileSpec,
    ReplicaBounds,
    ResourceRequirements,
    RoleOverrides,
    RouterSpec,
    SpecModel,
    Toleration,
    WorkloadSpec,
)
from coserve.api.status import (
    Bottleneck,
    Condition,
    ConditionStatus,
    ConditionType,
    IdleKV,
    Plan,
    PlanUtilization,
    ReplicaStatus,
    RoleReplicas,
    StatusModel,
)

__all__ = [
    "API_VERSION",
    "DEFAULT_PRIORITY_CLASSES",
    "GROUP",
    "KIND",
    "PLURAL",
    "SHORT_NAME",
    "VERSION",
    "AutoscalingSpec",
    "Bottleneck",
    "CoServePool",
    "Condition",
    "ConditionStatus",
    "ConditionType",
    "ConfigMapProfileRef",
    "EngineSpec",
    "IdleKV",
    "InvalidInput",
    "KVOffloadBackend",
    "KVOffloadSpec",
    "ModelSpec",
    "ObjectMeta",
    "OfflineSpec",
    "Plan",
    "PlanUtilization",
    "PrefillLatencyCurve",
    "PriorityClassSpec",
    "Problem",
    "ProfileSpec",
    "ReplicaBounds",
    "ReplicaStatus",
    "ResourceRequirements",
    "RoleOverrides",
    "RoleReplicas",
    "RouterSpec",
    "SpecModel",
    "StatusModel",
    "Toleration",
    "WorkloadSpec",
    "parse_pool",
    "parse_spec",
]
