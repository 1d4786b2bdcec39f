"""Pod template options of the engines (engine-wide and per role) and of the router.

Environment, volumes, image pull secrets, priority class, labels and annotations, security contexts and
topology spread: ``PodOptions`` is the router's and the base of ``EnginePodOptions``, which
``EngineSpec`` and ``RoleOverrides`` extend. ``coserve.operator.resources`` merges them into the pods
it renders.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import Field, ValidationInfo, field_validator

from coserve.api._base import ApiModel
from coserve.api.spec._rules import _cel, _cel_list, _check_unique, _fail, _list_map, _preserve_unknown_fields
from coserve.api.spec.core import DNS_SUBDOMAIN_PATTERN, MAX_LABEL_KEY_LENGTH, LabelValue, _label_key_problem
from coserve.api.spec.env import EnvFromSource, EnvVar
from coserve.api.spec.placement import TopologySpreadConstraint
from coserve.api.spec.reserved import OPERATOR_ENV_NAMES, OPERATOR_ENV_PREFIX, OPERATOR_LABELS, OPERATOR_VOLUMES
from coserve.api.spec.volumes import Volume, VolumeMount

# list field -> (the keys no two items may share, what an error calls them): the pydantic twins of the CRD's
# x-kubernetes-list-map-keys on PodOptions' lists
_UNIQUE_BY: dict[str, tuple[tuple[str, ...], str]] = {
    "env": (("name",), "env names"),
    "volumes": (("name",), "volume names"),
    "volume_mounts": (("mount_path",), "mount paths"),
    "image_pull_secrets": (("name",), "image pull secrets"),
    "topology_spread_constraints": (("topology_key", "when_unsatisfiable"), "topologyKey and whenUnsatisfiable pairs"),
}


class LocalObjectReference(ApiModel):
    """An object in the pool's namespace, by name."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="name of the Secret.")


_LABEL_KEYS_RULE = (
    f"self.all(k, size(k) <= {MAX_LABEL_KEY_LENGTH} && !(k in {_cel_list(OPERATOR_LABELS)}))",
    f"the operator's labels ({', '.join(OPERATOR_LABELS)}) are refused; keys are at most "
    f"{MAX_LABEL_KEY_LENGTH} characters",
)
_ANNOTATION_KEYS_RULE = (
    f"self.all(k, size(k) <= {MAX_LABEL_KEY_LENGTH})",
    f"annotation keys are at most {MAX_LABEL_KEY_LENGTH} characters",
)
_MAX_SPREAD_CONSTRAINTS = 8


class PodOptions(ApiModel):
    """Pod template options of the router, and (with serviceAccountName) of the engines, engine-wide or per role.

    A role's options combine with the engine-wide ones: lists are the engine-wide entries then the role's,
    a role's entry replacing an engine-wide one with the same name (mountPath for volumeMounts); maps are
    merged, the role's value winning; a role's scalar or topologySpreadConstraints replaces the engine-wide one.
    """

    env: list[EnvVar] | None = Field(
        default=None,
        max_length=128,
        json_schema_extra=_list_map("name"),
        description="env are environment variables of the main container (vLLM in engine pods and their "
        "model-download init container; the router), after the operator's own. Names starting with "
        f"{OPERATOR_ENV_PREFIX}, {', '.join(OPERATOR_ENV_NAMES)} and, with model.hfTokenSecretRef, "
        "HF_TOKEN are the operator's.",
    )
    env_from: list[EnvFromSource] | None = Field(
        default=None,
        max_length=32,
        description="envFrom turns every entry of a ConfigMap or Secret into environment variables of the main "
        "container (and the model-download init container).",
    )
    volumes: list[Volume] | None = Field(
        default=None,
        max_length=64,
        json_schema_extra=_list_map("name"),
        description="volumes are extra pod volumes for volumeMounts; "
        f"{', '.join(OPERATOR_VOLUMES)} are the operator's.",
    )
    volume_mounts: list[VolumeMount] | None = Field(
        default=None,
        max_length=64,
        json_schema_extra=_list_map("mountPath"),
        description="volumeMounts mount volumes into the main container (and the model-download init container).",
    )
    image_pull_secrets: list[LocalObjectReference] | None = Field(
        default=None,
        max_length=16,
        json_schema_extra=_list_map("name"),
        description="imagePullSecrets name Secrets in the pool's namespace that pull the pods' images from a "
        "private registry.",
    )
    priority_class_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="priorityClassName is the Kubernetes PriorityClass of the pods, so serving pods may preempt "
        "less important ones on a full cluster (tenant classes are priorityClasses, a different thing).",
    )
    pod_labels: dict[str, LabelValue] | None = Field(
        default=None,
        max_length=64,
        json_schema_extra=_cel(_LABEL_KEYS_RULE),
        description=f"podLabels are added to the pods' labels; the operator's ({', '.join(OPERATOR_LABELS)}) are "
        "refused.",
    )
    pod_annotations: dict[str, Annotated[str, Field(max_length=65_536)]] | None = Field(
        default=None,
        max_length=64,
        json_schema_extra=_cel(_ANNOTATION_KEYS_RULE),
        description="podAnnotations are added to the pods' annotations; the operator's own "
        "(coserve.dev/config-hash, prometheus.io/scrape, prometheus.io/port, prometheus.io/path) win.",
    )
    security_context: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra=_preserve_unknown_fields,
        description="securityContext is merged over the main container's (and the model-download init "
        "container's) default, which passes the Pod Security Standards restricted profile: "
        "allowPrivilegeEscalation false, capabilities drop ALL, runAsNonRoot true, seccompProfile RuntimeDefault "
        "(the router also runAsUser 65532 and a read-only root filesystem). Fields as in a container's "
        "securityContext; maps merge, a set field replaces the default. Whatever it loosens (a root user, "
        "added capabilities, privilege escalation, another seccomp profile) is given up on every pod of the role, "
        "and a namespace enforcing the restricted profile then refuses them.",
    )
    pod_security_context: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra=_preserve_unknown_fields,
        description="podSecurityContext is merged over the pod's default securityContext: runAsNonRoot true and "
        "seccompProfile RuntimeDefault (the router also runAsUser 65532; engines with a model cache fsGroup "
        "65532). Fields as in a Pod's securityContext; maps merge, a set field replaces the default. "
        "runAsNonRoot false lets an image run as root, and an Unconfined seccomp profile gives the pods every "
        "system call: both fail the restricted profile.",
    )
    topology_spread_constraints: list[TopologySpreadConstraint] | None = Field(
        default=None,
        max_length=_MAX_SPREAD_CONSTRAINTS,
        json_schema_extra=_list_map("topologyKey", "whenUnsatisfiable"),
        description="topologySpreadConstraints replace the default spread of each role's pods: unset, they "
        "spread over nodes (kubernetes.io/hostname) and zones (topology.kubernetes.io/zone) with maxSkew 1, "
        "ScheduleAnyway, counting the role's pods of the current rollout (matchLabelKeys pod-template-hash); "
        "[] turns spreading off.",
    )

    @field_validator("env", "volumes", "volume_mounts", "image_pull_secrets", "topology_spread_constraints")
    @classmethod
    def _items_unique(cls, items: Sequence[ApiModel] | None, info: ValidationInfo) -> Sequence[ApiModel] | None:
        keys, what = _UNIQUE_BY[str(info.field_name)]
        _check_unique(items, keys, what)
        return items

    @field_validator("pod_labels")
    @classmethod
    def _labels_not_the_operators(cls, labels: dict[str, str] | None) -> dict[str, str] | None:
        problems: list[tuple[tuple[str | int, ...], str, object]] = []
        for key in labels or {}:
            reason = _label_key_problem(key)
            if key in OPERATOR_LABELS:
                reason = "is a label of the operator's, which selects the pods by it"
            if reason is not None:
                problems.append(((key,), f"key: {reason}", key))
        if problems:
            _fail(problems)
        return labels

    @field_validator("pod_annotations")
    @classmethod
    def _annotation_keys(cls, annotations: dict[str, str] | None) -> dict[str, str] | None:
        problems = [((key,), f"key: {reason}", key) for key in annotations or {} if (reason := _label_key_problem(key))]
        if problems:
            _fail(problems)
        return annotations


class EnginePodOptions(PodOptions):
    """Pod template options of the engine pods; ``serviceAccountName`` is theirs only (the router has its own)."""

    service_account_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="serviceAccountName runs the engine pods as this ServiceAccount of the pool's namespace (for "
        "example one allowed to read weights from cloud storage); default the namespace's default one.",
    )
