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

The symbols of the provisioning model map to fields here once:
R = ``workload.arrival_rate_per_s``, L_in = ``workload.input_tokens``,
L_d = ``workload.output_tokens``, W = ``workload.lifetime_s``, n = ``workload.turns``,
a = ``workload.appended_tokens``, g = ``workload.idle_s``,
T_d = ``profile.decode_throughput_tokens_per_s``, B = KV slots derived from
``profile.kv_capacity_tokens`` / ``profile.live_context_tokens``, and T_p from
``profile.prefill_latency`` evaluated at L_in.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from enum import StrEnum
from typing import Annotated, Any, Literal, NoReturn, Self

from pydantic import (
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from coserve.api._base import ApiModel

__all__ = [
    "DEFAULT_PRIORITY_CLASSES",
    "HF_TOKEN_ENV",
    "OPERATOR_ENV_NAMES",
    "OPERATOR_ENV_PREFIX",
    "OPERATOR_LABELS",
    "OPERATOR_MOUNT_PATHS",
    "OPERATOR_VOLUMES",
    "ROUTER_MOUNT_PATHS",
    "AutoscalingSpec",
    "ConfigMapProfileRef",
    "DisruptionBudget",
    "DisruptionSpec",
    "EnginePodOptions",
    "EngineSpec",
    "EnvFromSource",
    "EnvVar",
    "KVOffloadBackend",
    "KVOffloadSpec",
    "LabelSelector",
    "ModelCacheSpec",
    "ModelSpec",
    "OfflineSpec",
    "PodOptions",
    "PrefillLatencyCurve",
    "PriorityClassSpec",
    "ProfileSpec",
    "ReplicaBounds",
    "ResourceRequirements",
    "RoleOverrides",
    "RouterSpec",
    "ScraperPeer",
    "SecretKeyRef",
    "SpecModel",
    "Toleration",
    "TopologySpreadConstraint",
    "Volume",
    "VolumeMount",
    "WorkloadSpec",
]

# Kubernetes resource.Quantity, as apimachinery parses it ("500m", "16Gi", "1e3").
# Negative amounts are legal Quantities but never legal resources, so the sign is "+" or none.
QUANTITY_PATTERN = (
    r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"

_QUANTITY_RE = re.compile(QUANTITY_PATTERN)


def _check_quantity(value: object) -> object:
    """Accept what the API server accepts for an int-or-string quantity, with one clear reason otherwise."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and len(value) <= 64 and _QUANTITY_RE.match(value):
        return value
    raise ValueError("must be a non-negative integer or a Kubernetes quantity string such as '500m', '8' or '16Gi'")


Quantity = Annotated[
    int | str,
    BeforeValidator(_check_quantity),
    WithJsonSchema(
        {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": QUANTITY_PATTERN, "maxLength": 64}]}
    ),
]
ResourceName = Annotated[str, Field(min_length=1, max_length=253)]
# The API server's structural schemas cannot constrain map keys; a CEL rule does it there.
_RESOURCE_NAME_RULE = {
    "x-kubernetes-validations": [
        {"rule": "self.all(k, size(k) >= 1 && size(k) <= 253)", "message": "resource names are 1 to 253 characters"}
    ]
}
# Bounded so that the API server's cost estimate of the rule that walks the keys stays small.
ResourceList = Annotated[dict[ResourceName, Quantity], Field(max_length=32, json_schema_extra=_RESOURCE_NAME_RULE)]


class ResourceRequirements(ApiModel):
    """Compute resources of one container, as in a Pod spec."""

    limits: ResourceList | None = Field(
        default=None,
        description="limits is the most of each resource the container may use, "
        'for example {"nvidia.com/gpu": 1, "memory": "64Gi"}.',
    )
    requests: ResourceList | None = Field(
        default=None,
        description="requests is the amount of each resource the scheduler reserves "
        'for the container, for example {"cpu": "8", "memory": "64Gi"}.',
    )


class TolerationOperator(StrEnum):
    EXISTS = "Exists"
    EQUAL = "Equal"


class TaintEffect(StrEnum):
    NO_SCHEDULE = "NoSchedule"
    PREFER_NO_SCHEDULE = "PreferNoSchedule"
    NO_EXECUTE = "NoExecute"


class Toleration(ApiModel):
    """A Pod toleration, so a role can run on tainted (for example GPU) nodes."""

    key: str | None = Field(default=None, max_length=316, description="key is the taint key the toleration applies to.")
    operator: TolerationOperator = Field(
        default=TolerationOperator.EQUAL,
        description="operator is Exists (any value) or Equal (value must match).",
    )
    value: str | None = Field(
        default=None, max_length=63, description="value is the taint value to match when operator is Equal."
    )
    effect: TaintEffect | None = Field(
        default=None, description="effect is the taint effect to match; empty matches every effect."
    )
    toleration_seconds: int | None = Field(
        default=None,
        ge=0,
        description="tolerationSeconds is how long a NoExecute taint is tolerated before eviction.",
    )


# --- CEL rules and their pydantic twins --------------------------------------------------------
#
# The API server checks what a structural schema cannot (one of two fields, names the operator keeps
# for itself, references between lists) with CEL rules (x-kubernetes-validations). Each rule below has a
# pydantic validator that refuses the same input with the same field path, so `coserve render` and the
# operator report it as the API server would.


def _cel(*rules: tuple[str, str] | tuple[str, str, str]) -> dict[str, Any]:
    """``x-kubernetes-validations`` from (rule, message[, fieldPath]) triples."""
    validations = []
    for rule in rules:
        entry = {"rule": rule[0], "message": rule[1]}
        if len(rule) == 3:
            entry["fieldPath"] = rule[2]
        validations.append(entry)
    return {"x-kubernetes-validations": validations}


def _cel_list(values: Iterable[str]) -> str:
    return "[" + ", ".join(f"'{value}'" for value in values) + "]"


def _has(field: str) -> str:
    """CEL that ``field`` (``self.a.b.c``) is set, each object on the way tested first.

    The API server's CEL tests only the last field of ``has(self.a.b)``: where ``self.a`` is absent, the
    rule fails to evaluate ("no such key: a") rather than answer false, and the object, or a CRD whose
    default reaches the rule, is refused.
    """
    parts = field.split(".")
    tests = [f"has({'.'.join(parts[:n])})" for n in range(2, len(parts) + 1)]
    return tests[0] if len(tests) == 1 else "(" + " && ".join(tests) + ")"


def _fail(problems: Sequence[tuple[tuple[str | int, ...], str, object]]) -> NoReturn:
    """Raise pydantic's error for each (loc, reason, input), ``loc`` relative to the model being validated.

    NOTE: a ValidationError raised inside a validator keeps its locations, so a rule checked on a parent
    object can still name the list item or map key at fault (``spec.engine.env[2].name``).
    """
    raise ValidationError.from_exception_data(
        "CoServePool",
        [
            InitErrorDetails(type=PydanticCustomError("coserve", "{reason}", {"reason": reason}), loc=loc, input=value)
            for loc, reason, value in problems
        ],
    )


def _one_of(model: ApiModel, fields: Sequence[str], what: str) -> None:
    """Pydantic twin of ``[has(a), has(b), ...].exists_one(x, x)``."""
    if sum(getattr(model, name) is not None for name in fields) != 1:
        raise ValueError(what)


# Names the operator gives its own things in engine and router pods, refused in user settings.
OPERATOR_VOLUMES = ("config", "dshm", "router-token", "tmp", "batches", "model-cache")
OPERATOR_ENV_PREFIX = "COSERVE_"
OPERATOR_ENV_NAMES = ("VLLM_PLUGINS", "POD_NAMESPACE", "HF_HUB_CACHE", "HF_HUB_OFFLINE")
HF_TOKEN_ENV = "HF_TOKEN"  # noqa: S105 - a variable's name, not a secret
OPERATOR_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/component",
    "app.kubernetes.io/managed-by",
    "coserve.dev/role",
)
OPERATOR_MOUNT_PATHS = ("/etc/coserve", "/etc/coserve-token", "/dev/shm")  # noqa: S108 - paths in the pod
ROUTER_MOUNT_PATHS = ("/tmp", "/var/lib/coserve/batches")  # noqa: S108 - paths in the pod

ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
CONFIG_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
_LABEL_NAME_RE = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN_RE = re.compile(DNS_SUBDOMAIN_PATTERN)
MAX_LABEL_KEY_LENGTH = 317  # a 253-character DNS prefix, "/", a 63-character name

# Every volume source a Pod's volume may name (core/v1 Volume, Kubernetes 1.35).
VOLUME_SOURCES = frozenset(
    {
        "awsElasticBlockStore", "azureDisk", "azureFile", "cephfs", "cinder", "configMap", "csi", "downwardAPI",
        "emptyDir", "ephemeral", "fc", "flexVolume", "flocker", "gcePersistentDisk", "gitRepo", "glusterfs",
        "hostPath", "image", "iscsi", "nfs", "persistentVolumeClaim", "photonPersistentDisk", "portworxVolume",
        "projected", "quobyte", "rbd", "scaleIO", "secret", "storageos", "vsphereVolume",
    }
)  # fmt: skip


def _env_name_reserved(name: str) -> bool:
    return name.startswith(OPERATOR_ENV_PREFIX) or name in OPERATOR_ENV_NAMES


def _label_key_problem(key: str) -> str | None:
    """Why ``key`` is not a Kubernetes label or annotation key (an optional DNS prefix and "/", then a name)."""
    prefix, _, name = key.rpartition("/")
    if len(key) > MAX_LABEL_KEY_LENGTH:
        return f"keys are at most {MAX_LABEL_KEY_LENGTH} characters"
    if "/" in key and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN_RE.match(prefix)):
        return "a key's prefix must be a lowercase DNS subdomain (example.com/name)"
    if len(name) > 63 or not _LABEL_NAME_RE.match(name):
        return "a key's name is 1 to 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
    return None


def _check_unique(items: Sequence[ApiModel] | None, keys: Sequence[str], what: str) -> None:
    """Pydantic twin of ``x-kubernetes-list-type: map``: no two items share their ``keys``."""
    seen: set[tuple[object, ...]] = set()
    problems: list[tuple[tuple[str | int, ...], str, object]] = []
    for index, item in enumerate(items or ()):
        key = tuple(getattr(item, name) for name in keys)
        if key in seen:
            shown = "/".join(str(part) for part in key)
            alias = type(item).model_fields[keys[0]].alias or keys[0]
            problems.append(((index, alias), f"{what} must be unique: {shown} appears twice", key[0]))
        seen.add(key)
    if problems:
        _fail(problems)


# --- pod template options: environment, volumes, identity, labels, placement -------------------

# list field -> (the keys no two items may share, what an error calls them): the pydantic twins of the CRD's
# x-kubernetes-list-map-keys on PodOptions' lists
_UNIQUE_BY: dict[str, tuple[tuple[str, ...], str]] = {
    "env": (("name",), "env names"),
    "volumes": (("name",), "volume names"),
    "volume_mounts": (("mount_path",), "mount paths"),
    "image_pull_secrets": (("name",), "image pull secrets"),
    "topology_spread_constraints": (("topology_key", "when_unsatisfiable"), "topologyKey and whenUnsatisfiable pairs"),
}


class SecretKeyRef(ApiModel):
    """One key of a Secret in the pool's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="name of the Secret.")
    key: str = Field(
        default="token",
        min_length=1,
        max_length=253,
        pattern=CONFIG_KEY_PATTERN,
        description="key of the Secret's entry.",
    )


class KeySelector(ApiModel):
    """One key of a ConfigMap or Secret in the pool's namespace, as an environment variable's source."""

    name: str = Field(
        min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="name of the ConfigMap or Secret."
    )
    key: str = Field(min_length=1, max_length=253, pattern=CONFIG_KEY_PATTERN, description="key of the entry to read.")
    optional: bool | None = Field(
        default=None, description="optional lets the pod start when the object or the key is missing."
    )


class ObjectFieldSelector(ApiModel):
    """A field of the pod, as an environment variable's source."""

    field_path: str = Field(
        min_length=1,
        max_length=256,
        description="fieldPath is the pod field to read, for example metadata.name, spec.nodeName or status.podIP.",
    )
    api_version: str | None = Field(
        default=None, min_length=1, max_length=64, description="apiVersion fieldPath is written in; default v1."
    )


class ResourceFieldSelector(ApiModel):
    """A resource limit or request of a container, as an environment variable's source."""

    resource: str = Field(
        min_length=1,
        max_length=253,
        description="resource to read: limits.cpu, limits.memory, requests.cpu, requests.memory, ...",
    )
    container_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=63,
        pattern=DNS_LABEL_PATTERN,
        description="containerName is the container whose resource is read; default this one.",
    )
    divisor: Quantity | None = Field(default=None, description="divisor scales the value; default 1.")


_ENV_SOURCES = ("secret_key_ref", "config_map_key_ref", "field_ref", "resource_field_ref")


class EnvVarSource(ApiModel):
    """Where an environment variable's value comes from: exactly one source."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            (
                "[has(self.secretKeyRef), has(self.configMapKeyRef), has(self.fieldRef), "
                "has(self.resourceFieldRef)].exists_one(x, x)",
                "valueFrom sets exactly one of secretKeyRef, configMapKeyRef, fieldRef and resourceFieldRef",
            )
        )
    )

    secret_key_ref: KeySelector | None = Field(default=None, description="secretKeyRef reads a key of a Secret.")
    config_map_key_ref: KeySelector | None = Field(
        default=None, description="configMapKeyRef reads a key of a ConfigMap."
    )
    field_ref: ObjectFieldSelector | None = Field(default=None, description="fieldRef reads a field of the pod.")
    resource_field_ref: ResourceFieldSelector | None = Field(
        default=None, description="resourceFieldRef reads a resource limit or request of a container."
    )

    @model_validator(mode="after")
    def _exactly_one_source(self) -> Self:
        _one_of(self, _ENV_SOURCES, "valueFrom sets exactly one of secretKeyRef, configMapKeyRef, fieldRef and "
                "resourceFieldRef")  # fmt: skip
        return self


_ENV_NAME_RULE = (
    f"!self.startsWith('{OPERATOR_ENV_PREFIX}') && !(self in {_cel_list(OPERATOR_ENV_NAMES)})",
    f"is set by the operator: names starting with {OPERATOR_ENV_PREFIX}, and "
    f"{', '.join(OPERATOR_ENV_NAMES)}, are refused",
)


class EnvVar(ApiModel):
    """An environment variable of a container, as in a Pod spec."""

    model_config = ConfigDict(
        json_schema_extra=_cel(("!(has(self.value) && has(self.valueFrom))", "value and valueFrom are exclusive"))
    )

    name: str = Field(
        min_length=1,
        max_length=256,
        pattern=ENV_NAME_PATTERN,
        json_schema_extra=_cel(_ENV_NAME_RULE),
        description=f"name of the variable; names starting with {OPERATOR_ENV_PREFIX}, and "
        f"{', '.join(OPERATOR_ENV_NAMES)}, are the operator's (HF_HUB_CACHE and HF_HUB_OFFLINE follow "
        "model.cache and model.local).",
    )
    value: str | None = Field(
        default=None, max_length=131_072, description="value of the variable; $(NAME) expands an earlier variable."
    )
    value_from: EnvVarSource | None = Field(
        default=None, description="valueFrom reads the value from a Secret, a ConfigMap or the pod itself."
    )

    @field_validator("name")
    @classmethod
    def _not_the_operators(cls, name: str) -> str:
        if _env_name_reserved(name):
            raise ValueError(_ENV_NAME_RULE[1])
        return name

    @model_validator(mode="after")
    def _value_or_value_from(self) -> Self:
        if self.value is not None and self.value_from is not None:
            raise ValueError("value and valueFrom are exclusive")
        return self


class ObjectRef(ApiModel):
    """A ConfigMap or Secret in the pool's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="name of the object.")
    optional: bool | None = Field(default=None, description="optional lets the pod start when the object is missing.")


class EnvFromSource(ApiModel):
    """Every entry of one ConfigMap or Secret as environment variables."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            ("has(self.configMapRef) != has(self.secretRef)", "envFrom sets exactly one of configMapRef and secretRef")
        )
    )

    prefix: str | None = Field(
        default=None, max_length=253, pattern=ENV_NAME_PATTERN, description="prefix is put before every name."
    )
    config_map_ref: ObjectRef | None = Field(default=None, description="configMapRef names the ConfigMap.")
    secret_ref: ObjectRef | None = Field(default=None, description="secretRef names the Secret.")

    @model_validator(mode="after")
    def _exactly_one_source(self) -> Self:
        _one_of(self, ("config_map_ref", "secret_ref"), "envFrom sets exactly one of configMapRef and secretRef")
        return self


def _preserve_unknown_fields(schema: dict[str, Any]) -> None:
    schema.pop("additionalProperties", None)
    schema["x-kubernetes-preserve-unknown-fields"] = True


_VOLUME_NAME_RULE = (
    f"!(self in {_cel_list(OPERATOR_VOLUMES)})",
    f"is a volume of the operator's: {', '.join(OPERATOR_VOLUMES)} are refused",
)


class Volume(ApiModel):
    """A pod volume, as in a Pod spec: its name and one volume source."""

    # NOTE: Kubernetes has some thirty volume sources; typing them here would copy core/v1 for little gain,
    # so the source is kept as written (the API server checks it with the pod template) and coserve checks
    # only that there is exactly one, of a known kind.
    model_config = ConfigDict(extra="allow", json_schema_extra=_preserve_unknown_fields)

    name: str = Field(
        min_length=1,
        max_length=63,
        pattern=DNS_LABEL_PATTERN,
        json_schema_extra=_cel(_VOLUME_NAME_RULE),
        description="name of the volume, what volumeMounts refer to; besides it the volume holds exactly one "
        "volume source as in a Pod (configMap, secret, persistentVolumeClaim, emptyDir, csi, nfs, ephemeral, ...). "
        f"{', '.join(OPERATOR_VOLUMES)} are the operator's.",
    )

    @field_validator("name")
    @classmethod
    def _not_the_operators(cls, name: str) -> str:
        if name in OPERATOR_VOLUMES:
            raise ValueError(_VOLUME_NAME_RULE[1])
        return name

    @model_validator(mode="after")
    def _exactly_one_source(self) -> Self:
        sources = dict(self.model_extra or {})
        unknown = sorted(key for key in sources if key not in VOLUME_SOURCES)
        if unknown:
            _fail([((key,), "unknown volume source (a Pod volume's source, such as persistentVolumeClaim)", key)
                   for key in unknown])  # fmt: skip
        if len(sources) != 1:
            raise ValueError(f"a volume holds exactly one volume source besides its name (got {len(sources)})")
        ((kind, source),) = sources.items()
        if not isinstance(source, dict):
            _fail([((kind,), "a volume source is an object", source)])
        return self


_MOUNT_PATH_RULE = (
    f"!(self in {_cel_list(OPERATOR_MOUNT_PATHS)})",
    f"is a mount of the operator's: {', '.join(OPERATOR_MOUNT_PATHS)} are refused",
)


class VolumeMount(ApiModel):
    """Where a container mounts a volume, as in a Pod spec."""

    name: str = Field(
        min_length=1,
        max_length=63,
        pattern=DNS_LABEL_PATTERN,
        description="name of the volume to mount: one of the same pod options' volumes (a role's mounts may also "
        "name engine.volumes).",
    )
    mount_path: str = Field(
        min_length=1,
        max_length=4096,
        pattern=r"^/",
        json_schema_extra=_cel(_MOUNT_PATH_RULE),
        description="mountPath is the absolute path in the container; "
        f"{', '.join(OPERATOR_MOUNT_PATHS)} and model.cache.mountPath are the operator's.",
    )
    read_only: bool | None = Field(default=None, description="readOnly mounts the volume read-only.")
    sub_path: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description="subPath mounts this path inside the volume instead of its root.",
    )

    @field_validator("mount_path")
    @classmethod
    def _not_the_operators(cls, mount_path: str) -> str:
        if mount_path in OPERATOR_MOUNT_PATHS:
            raise ValueError(_MOUNT_PATH_RULE[1])
        return mount_path


class LocalObjectReference(ApiModel):
    """An object in the pool's namespace, by name."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="name of the Secret.")


class SelectorOperator(StrEnum):
    IN = "In"
    NOT_IN = "NotIn"
    EXISTS = "Exists"
    DOES_NOT_EXIST = "DoesNotExist"


class LabelSelectorRequirement(ApiModel):
    """One requirement on a label, as in metav1.LabelSelector."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            (
                "(self.operator in ['In', 'NotIn']) == (has(self.values) && size(self.values) > 0)",
                "values are required with In and NotIn, and not allowed with Exists and DoesNotExist",
            )
        )
    )

    key: str = Field(min_length=1, max_length=MAX_LABEL_KEY_LENGTH, description="key is the label key.")
    operator: SelectorOperator = Field(description="operator is In, NotIn, Exists or DoesNotExist.")
    values: list[Annotated[str, Field(max_length=63)]] | None = Field(
        default=None, max_length=64, description="values of the label, for In and NotIn."
    )

    @model_validator(mode="after")
    def _values_match_operator(self) -> Self:
        if (self.operator in (SelectorOperator.IN, SelectorOperator.NOT_IN)) != bool(self.values):
            raise ValueError("values are required with In and NotIn, and not allowed with Exists and DoesNotExist")
        return self


class LabelSelector(ApiModel):
    """Pods selected by their labels, as in metav1.LabelSelector."""

    match_labels: dict[str, Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]] | None = Field(
        default=None, max_length=64, description="matchLabels selects pods carrying every one of these labels."
    )
    match_expressions: list[LabelSelectorRequirement] | None = Field(
        default=None, max_length=16, description="matchExpressions are further requirements, all of which must hold."
    )


class WhenUnsatisfiable(StrEnum):
    DO_NOT_SCHEDULE = "DoNotSchedule"
    SCHEDULE_ANYWAY = "ScheduleAnyway"


class TopologySpreadConstraint(ApiModel):
    """How evenly a role's pods spread over a topology (nodes, zones), as in a Pod spec."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            ("!has(self.minDomains) || self.whenUnsatisfiable == 'DoNotSchedule'",
             "minDomains needs whenUnsatisfiable DoNotSchedule", ".minDomains")
        )
    )  # fmt: skip

    topology_key: str = Field(
        min_length=1,
        max_length=MAX_LABEL_KEY_LENGTH,
        description="topologyKey is the node label whose values are the domains, for example "
        "kubernetes.io/hostname or topology.kubernetes.io/zone.",
    )
    max_skew: int = Field(
        default=1,
        ge=1,
        le=10_000,
        description="maxSkew is the most the pod counts of two domains may differ by.",
    )
    when_unsatisfiable: WhenUnsatisfiable = Field(
        default=WhenUnsatisfiable.SCHEDULE_ANYWAY,
        description="whenUnsatisfiable is ScheduleAnyway (prefer spreading) or DoNotSchedule (leave the pod pending).",
    )
    label_selector: LabelSelector | None = Field(
        default=None, description="labelSelector picks the pods counted per domain; default the role's own pods."
    )
    match_label_keys: list[Annotated[str, Field(min_length=1, max_length=MAX_LABEL_KEY_LENGTH)]] | None = Field(
        default=None,
        max_length=16,
        description="matchLabelKeys also count only pods sharing these labels' values with the new pod; "
        "pod-template-hash counts only the current rollout's pods.",
    )
    min_domains: int | None = Field(
        default=None,
        ge=1,
        le=10_000,
        description="minDomains is the fewest eligible domains; only with whenUnsatisfiable DoNotSchedule.",
    )

    @model_validator(mode="after")
    def _min_domains_needs_do_not_schedule(self) -> Self:
        if self.min_domains is not None and self.when_unsatisfiable != WhenUnsatisfiable.DO_NOT_SCHEDULE:
            _fail([(("minDomains",), "minDomains needs whenUnsatisfiable DoNotSchedule", self.min_domains)])
        return self


def _list_map(*keys: str) -> dict[str, Any]:
    """A list whose items are unique by ``keys``, checked by the API server (and merged by key under apply)."""
    return {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": list(keys)}


LabelValue = Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]
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
        "model-download init container; the router), after the operator's own. Names starting with COSERVE_, "
        "VLLM_PLUGINS, POD_NAMESPACE, HF_HUB_CACHE, HF_HUB_OFFLINE and, with model.hfTokenSecretRef, "
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


def _unnamed_volumes(
    mounts: Sequence[VolumeMount] | None, *volume_lists: Sequence[Volume] | None
) -> list[tuple[tuple[str | int, ...], str, object]]:
    """Problems of ``mounts`` that name no volume of ``volume_lists`` (locations relative to the mounts)."""
    names = {volume.name for volumes in volume_lists for volume in volumes or ()}
    return [
        ((index, "name"), "names no volume of these pod options", mount.name)
        for index, mount in enumerate(mounts or ())
        if mount.name not in names
    ]


def _mount_rule(mounts: str, volumes: Sequence[str], field_path: str) -> tuple[str, str, str]:
    """CEL: every mount of ``mounts`` names a volume of one of the ``volumes`` lists."""
    names = " || ".join(f"({_has(v)} && {v}.exists(v, v.name == m.name))" for v in volumes)
    return (
        f"!{_has(mounts)} || {mounts}.all(m, {names})",
        "volumeMounts name volumes of the same pod options (a role's may also name engine.volumes)",
        field_path,
    )


AccessMode = Literal["ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"]
DEFAULT_MODEL_MOUNT_PATH = "/models"


def _default_access_modes() -> list[AccessMode]:
    return ["ReadWriteMany"]


class ModelCacheSpec(ApiModel):
    """A shared volume that holds the model's weights, downloaded once instead of by every engine at every start."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            ("has(self.claimName) != has(self.size)", "cache sets exactly one of claimName and size"),
            ("!has(self.storageClassName) || has(self.size)", "storageClassName goes with size", ".storageClassName"),
        )
    )

    claim_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="claimName is an existing PersistentVolumeClaim in the pool's namespace to keep the weights "
        "on; exactly one of claimName and size. Engines on several nodes need a ReadWriteMany claim.",
    )
    size: Quantity | None = Field(
        default=None,
        description="size makes the operator create a PersistentVolumeClaim named <pool>-model-cache of this "
        "size (for example 100Gi), deleted with the pool; exactly one of claimName and size.",
    )
    storage_class_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="storageClassName of the claim the operator creates (with size only); default the "
        "cluster's default class. A claim's class cannot change once it exists.",
    )
    access_modes: list[AccessMode] = Field(
        default_factory=_default_access_modes,
        min_length=1,
        max_length=4,
        description="accessModes of the claim the operator creates (with size only): ReadWriteMany lets engines "
        "on every node share it; ReadWriteOnce keeps a pool on one node.",
    )
    mount_path: str = Field(
        default=DEFAULT_MODEL_MOUNT_PATH,
        min_length=2,
        max_length=4096,
        pattern=r"^/",
        json_schema_extra=_cel(_MOUNT_PATH_RULE),
        description="mountPath is where engines mount the cache, read-only; the Hugging Face hub cache is its "
        "hub folder (HF_HUB_CACHE).",
    )

    @field_validator("mount_path")
    @classmethod
    def _not_the_operators(cls, mount_path: str) -> str:
        if mount_path in OPERATOR_MOUNT_PATHS:
            raise ValueError(_MOUNT_PATH_RULE[1])
        return mount_path

    @model_validator(mode="after")
    def _claim_or_size(self) -> Self:
        _one_of(self, ("claim_name", "size"), "cache sets exactly one of claimName and size")
        if self.storage_class_name is not None and self.size is None:
            _fail([(("storageClassName",), "storageClassName goes with size", self.storage_class_name)])
        return self


_CACHED_NAME_MESSAGE = (
    "with cache, name is a Hugging Face model id to download, not a path (weights on a volume are local)"
)


class ModelSpec(ApiModel):
    """The model every engine of the pool serves, and where its weights come from."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            ("!self.local || !has(self.cache)", "local excludes cache", ".cache"),
            ("!has(self.cache) || !self.name.startsWith('/')", _CACHED_NAME_MESSAGE, ".name"),
        )
    )

    name: str = Field(
        min_length=1,
        max_length=512,
        description="name is the Hugging Face model id or the path of the weights inside the engine image "
        "or its volumes, passed to vLLM as --model.",
    )
    served_model_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="servedModelName is the model name clients use in OpenAI requests; defaults to name.",
    )
    hf_token_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description="hfTokenSecretRef names a Secret key in the pool's namespace holding a Hugging Face access "
        "token, for gated or private models; every engine container and the model download get it as HF_TOKEN.",
    )
    cache: ModelCacheSpec | None = Field(
        default=None,
        description="cache keeps the weights on a shared volume: an init container (model-download) of each "
        "engine pod fills it once per model while the other pods wait, then the engines mount it read-only "
        "and load offline (HF_HUB_OFFLINE=1). Unset: every engine downloads the weights at every start.",
    )
    local: bool = Field(
        default=False,
        description="local says the weights are already in the engine image or in engine.volumes (name is "
        "then their path, or a model id in the image's Hugging Face cache): nothing is downloaded and engines "
        "load offline (HF_HUB_OFFLINE=1). Excludes cache.",
    )
    download_timeout_s: int = Field(
        default=3600,
        ge=0,
        le=86_400,
        description="downloadTimeoutS is how long an engine may spend downloading the weights when it starts "
        "without cache or local: its startup probe allows this on top of the 10 minutes for loading them. With "
        "cache the download runs in an init container, outside any probe, and with local there is none, so "
        "the startup probe allows the 10 minutes alone.",
    )

    @model_validator(mode="after")
    def _local_excludes_cache(self) -> Self:
        if self.local and self.cache is not None:
            _fail([(("cache",), "local excludes cache", self.cache.to_wire())])
        if self.cache is not None and self.name.startswith("/"):
            _fail([(("name",), _CACHED_NAME_MESSAGE, self.name)])
        return self


class RoleOverrides(EnginePodOptions):
    """Settings of one role (prefiller or decoder), combined with the engine-wide ones: env, envFrom,
    volumes, volumeMounts, imagePullSecrets and extraArgs come after the engine's (an entry with the name,
    or mountPath, of an engine-wide one replaces it); podLabels and podAnnotations are merged over the
    engine's; resources, serviceAccountName, priorityClassName and topologySpreadConstraints replace the
    engine's when set."""

    resources: ResourceRequirements | None = Field(
        default=None,
        description="resources replaces engine.resources for this role, so decoders can run on a cheaper "
        "GPU tier than prefillers.",
    )
    node_selector: dict[str, str] | None = Field(
        default=None, description="nodeSelector places this role's pods on matching nodes."
    )
    tolerations: list[Toleration] | None = Field(
        default=None, max_length=64, description="tolerations let this role's pods run on tainted nodes."
    )
    extra_args: list[str] | None = Field(
        default=None,
        max_length=256,
        description="extraArgs are appended to engine.extraArgs for this role only.",
    )


_MAX_SCRAPER_LABELS = 16


class ScraperPeer(ApiModel):
    """A metrics scraper the engines admit on their port: one NetworkPolicy peer, by namespace and pod labels."""

    pod_labels: dict[str, LabelValue] = Field(
        min_length=1,
        max_length=_MAX_SCRAPER_LABELS,
        description="podLabels select the scraper's pods: every one of these labels (at least one).",
    )
    namespace_labels: dict[str, LabelValue] = Field(
        min_length=1,
        max_length=_MAX_SCRAPER_LABELS,
        description="namespaceLabels select the namespaces the scraper's pods run in: every one of these labels "
        "(at least one; {} would select every namespace). kubernetes.io/metadata.name: <namespace> names one "
        "namespace; the API server sets that label on every namespace to its name.",
    )

    @model_validator(mode="before")
    @classmethod
    def _names_both(cls, data: object) -> object:
        if isinstance(data, dict):
            missing = [
                ((alias,), f"required field is missing: name the scraper's {what}", data)
                for name, alias, what in (
                    ("pod_labels", "podLabels", "pods by their labels"),
                    ("namespace_labels", "namespaceLabels",
                     "namespaces by their labels (kubernetes.io/metadata.name: <namespace> names one)"),
                )
                if name not in data and alias not in data
            ]  # fmt: skip
            if missing:
                _fail(missing)
        return data

    @field_validator("pod_labels", "namespace_labels", mode="before")
    @classmethod
    def _selects_something(cls, value: object, info: ValidationInfo) -> object:
        if isinstance(value, dict) and not value:
            what = "pod" if info.field_name == "pod_labels" else "namespace"
            raise ValueError(f"must name at least one label: an empty selector selects every {what}")
        return value

    @field_validator("pod_labels", "namespace_labels")
    @classmethod
    def _label_keys(cls, labels: dict[str, str]) -> dict[str, str]:
        problems = [((key,), f"key: {reason}", key) for key in labels if (reason := _label_key_problem(key))]
        if problems:
            _fail(problems)
        return labels


_ENGINE_ROLES = ("prefiller", "decoder")


class EngineSpec(EnginePodOptions):
    """The vLLM engine that prefillers and decoders run."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            _mount_rule("self.volumeMounts", ["self.volumes"], ".volumeMounts"),
            *(
                _mount_rule(f"self.{role}.volumeMounts", [f"self.{role}.volumes", "self.volumes"],
                            f".{role}.volumeMounts")
                for role in _ENGINE_ROLES
            ),
        )
    )  # fmt: skip

    image: str = Field(
        default="ghcr.io/coserve/vllm:0.1.0",
        min_length=1,
        max_length=512,
        description="image is the serving image: vLLM 0.32 with the coserve engine plugin.",
    )
    image_pull_policy: str = Field(
        default="IfNotPresent",
        pattern="^(Always|IfNotPresent|Never)$",
        description="imagePullPolicy is Always, IfNotPresent or Never.",
    )
    extra_args: list[str] = Field(
        default_factory=list,
        max_length=256,
        description="extraArgs are appended to the vLLM server's command line in every engine pod.",
    )
    tensor_parallel_size: int = Field(
        default=1, ge=1, le=64, description="tensorParallelSize is vLLM's --tensor-parallel-size."
    )
    resources: ResourceRequirements = Field(
        default_factory=lambda: ResourceRequirements(limits={"nvidia.com/gpu": 1}),
        description="resources of each engine container; set nvidia.com/gpu to tensorParallelSize.",
    )
    prefiller: RoleOverrides = Field(
        default_factory=RoleOverrides, description="prefiller holds overrides for the prefiller role."
    )
    decoder: RoleOverrides = Field(
        default_factory=RoleOverrides, description="decoder holds overrides for the decoder role."
    )
    metrics_scrapers: list[ScraperPeer] = Field(
        default_factory=list,
        max_length=16,
        description="metricsScrapers may reach the engines' port. By default nobody may but the pool's own pods "
        "(router, prefillers, decoders), which the pool's NetworkPolicy admits on any port. Each scraper names its "
        "namespaces and its pods by labels, for example namespaceLabels {kubernetes.io/metadata.name: monitoring} "
        "and podLabels {app.kubernetes.io/name: prometheus}; autoscaling's engine signals need the Prometheus that "
        "collects them listed here. vLLM serves /metrics on its API port, so a scraper can also send requests, "
        "which the engines serve at the lowest class without the router's token.",
    )
    drain_timeout_s: int = Field(
        default=300,
        ge=0,
        le=86_400,
        description="drainTimeoutS is how long a leaving engine (a scale-down, a rollout, a node drain) may take "
        "to finish its in-flight requests after the router stops sending it new conversations; its live "
        "conversations move to another decoder at their next turn. The pod is deleted when it is idle or this "
        "bound passes.",
    )

    @model_validator(mode="after")
    def _mounts_name_volumes(self) -> Self:
        problems = [
            (("volumeMounts", *loc), reason, value)
            for loc, reason, value in _unnamed_volumes(self.volume_mounts, self.volumes)
        ]
        for role in _ENGINE_ROLES:
            overrides: RoleOverrides = getattr(self, role)
            problems += [
                ((role, "volumeMounts", *loc), reason, value)
                for loc, reason, value in _unnamed_volumes(overrides.volume_mounts, overrides.volumes, self.volumes)
            ]
        if problems:
            _fail(problems)
        return self


class WorkloadSpec(ApiModel):
    """The conversation workload the pool is sized for."""

    arrival_rate_per_s: float = Field(
        ge=0,
        le=100_000,
        description="arrivalRatePerS is the target rate R of new conversations per second.",
    )
    input_tokens: int = Field(
        ge=1,
        le=10_000_000,
        description="inputTokens is the mean prompt length L_in of a conversation's first turn.",
    )
    input_tokens_std_dev: float = Field(
        default=0.0,
        ge=0,
        le=10_000_000,
        description="inputTokensStdDev is the standard deviation σ of turn-1 prompt lengths. Prefill time grows "
        "faster than linearly with length, so prompts of mixed lengths cost a prefiller more than prompts of the "
        "mean length: the plan prices a prefill at the mean of latency(L), constantS + perTokenS·inputTokens + "
        "perTokenSquaredS·(inputTokens² + σ²). Default 0: every prompt of the mean length.",
    )
    output_tokens: int = Field(
        ge=1,
        le=10_000_000,
        description="outputTokens is the mean number of tokens L_d decoded over a whole conversation, all turns.",
    )
    lifetime_s: float = Field(
        gt=0,
        le=2_592_000,
        description="lifetimeS is the mean time W from a conversation's first token to its last, tool-call "
        "gaps included.",
    )
    turns: float = Field(
        default=1.0,
        ge=1,
        le=100_000,
        description="turns is the mean number of requests per conversation. Turn 1 is prefilled on a prefiller; "
        "every later turn runs on the conversation's decoder, which prefills what the turn appends. 1 (the "
        "default): single-turn conversations.",
    )
    appended_tokens: int = Field(
        default=0,
        ge=0,
        le=10_000_000,
        description="appendedTokens is the mean number of prompt tokens each later turn appends (a tool's result, "
        "the user's next message), not counting the previous answer, whose KV the decoder already holds. The "
        "decoder prefills them. Default 0.",
    )
    idle_s: float = Field(
        default=0.0,
        ge=0,
        le=2_592_000,
        description="idleS is the mean time between one turn's answer and the next turn's arrival (a tool call, "
        "the user thinking). Nothing of the conversation runs meanwhile, so the engine keeps its KV only as "
        "evictable prefix cache; the conversation runs on its decoder for lifetimeS - (turns - 1)·idleS. "
        "Default 0: its KV is counted for the whole lifetime.",
    )


class PrefillLatencyCurve(ApiModel):
    """latency(L) = constantS + perTokenS·L + perTokenSquaredS·L², in seconds, for an L-token prefill."""

    constant_s: float = Field(
        default=0.0, ge=0, le=3600, description="constantS is the fixed cost a of one prefill, in seconds."
    )
    per_token_s: float = Field(ge=0, le=10, description="perTokenS is the linear coefficient b, in seconds per token.")
    per_token_squared_s: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="perTokenSquaredS is the quadratic (attention) coefficient c, in seconds per token².",
    )

    def latency_s(self, num_tokens: float) -> float:
        """Predicted prefill latency of a ``num_tokens`` prompt."""
        return self.constant_s + self.per_token_s * num_tokens + self.per_token_squared_s * num_tokens**2


class ConfigMapProfileRef(ApiModel):
    """Where a profile written by `coserve profile` is stored in the cluster."""

    name: str = Field(
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="name of the ConfigMap, in the pool's namespace.",
    )
    key: str = Field(
        default="profile.yaml",
        min_length=1,
        max_length=253,
        description="key of the ConfigMap entry that holds the profile YAML.",
    )


class ProfileSpec(ApiModel):
    """How fast one engine replica is: inline numbers, or a measured profile in a ConfigMap.

    Inline fields win over the referenced profile, so a measured profile can be
    corrected field by field.
    """

    prefill_latency: PrefillLatencyCurve | None = Field(
        default=None,
        description="prefillLatency is the prefill latency curve of one prefiller; its throughput T_p at "
        "inputTokens is inputTokens / latency(inputTokens).",
    )
    decode_throughput_tokens_per_s: float | None = Field(
        default=None,
        ge=0.001,
        le=1e9,
        description="decodeThroughputTokensPerS is T_d, the output tokens per second one decoder sustains.",
    )
    kv_capacity_tokens: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000_000_000,
        description="kvCapacityTokens is how many tokens of KV cache one decoder holds.",
    )
    live_context_tokens: int | None = Field(
        default=None,
        ge=1,
        le=10_000_000,
        description="liveContextTokens is the context a running conversation keeps in KV; defaults to "
        "inputTokens + outputTokens + (turns - 1)·appendedTokens, its whole context at its last token. KV slots "
        "B = floor(kvCapacityTokens / liveContextTokens).",
    )
    config_map_ref: ConfigMapProfileRef | None = Field(
        default=None,
        description="configMapRef points at a profile measured by `coserve profile`; inline fields override it.",
    )


class PriorityClassSpec(ApiModel):
    """One tenant priority class with its latency objectives."""

    name: str = Field(
        min_length=1,
        max_length=63,
        pattern=DNS_LABEL_PATTERN,
        description="name is how requests select the class (vllm_xargs coserve_class, or the router's header).",
    )
    weight: float = Field(gt=0, le=1_000_000, description="weight is the gain of one on-time token of this class.")
    ttft_slo_ms: float = Field(
        gt=0, le=86_400_000, description="ttftSloMs is the time-to-first-token objective, in milliseconds."
    )
    tpot_slo_ms: float = Field(
        gt=0, le=3_600_000, description="tpotSloMs is the time-per-output-token objective, in milliseconds."
    )


DEFAULT_PRIORITY_CLASSES: tuple[PriorityClassSpec, ...] = (
    PriorityClassSpec(name="interactive", weight=10.0, ttft_slo_ms=1_000, tpot_slo_ms=100),
    PriorityClassSpec(name="standard", weight=3.0, ttft_slo_ms=5_000, tpot_slo_ms=200),
    PriorityClassSpec(name="offline", weight=1.0, ttft_slo_ms=3_600_000, tpot_slo_ms=10_000),
)


class OfflineSpec(ApiModel):
    """Co-serving of offline batch work on idle GPU time."""

    enabled: bool = Field(default=False, description="enabled admits offline batch work into the pool.")
    share: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="share is the largest fraction of decoder capacity offline work may hold; online work "
        "preempts it at the next layer boundary.",
    )
    class_name: str = Field(
        default="offline",
        min_length=1,
        max_length=63,
        pattern=DNS_LABEL_PATTERN,
        description="className is the priority class offline work runs as; it must be in priorityClasses.",
    )


class KVOffloadBackend(StrEnum):
    HOST = "host"
    LMCACHE = "lmcache"
    NATIVE = "native"


class KVOffloadSpec(ApiModel):
    """Offload of KV cache to host memory, so preempted and idle conversations keep their KV."""

    enabled: bool = Field(default=False, description="enabled turns KV offload on in every engine.")
    backend: KVOffloadBackend = Field(
        default=KVOffloadBackend.HOST,
        description="backend is host (coserve's connector), lmcache (LMCache, GPU only) or native "
        "(vLLM's offloading connector, GPU only).",
    )
    host_memory_bytes: int = Field(
        default=8 * 2**30,
        ge=0,
        le=2**50,
        description="hostMemoryBytes is the hard bound of each engine's host KV pool, in bytes.",
    )


class ReplicaBounds(ApiModel):
    """Replica bounds of one role while autoscaling owns its replica count."""

    min_replicas: int = Field(default=1, ge=1, le=10_000, description="minReplicas is the fewest replicas.")
    max_replicas: int = Field(default=8, ge=1, le=10_000, description="maxReplicas is the most replicas.")


class AutoscalingQueries(ApiModel):
    """PromQL per signal; unset ones use the defaults (see the README). {selector}, {namespace} and {pool} are
    filled in; each query must return one number."""

    arrival_rate: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description="arrivalRate is the PromQL for R, new conversations per second.",
    )
    input_tokens: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description="inputTokens is the PromQL for L_in, mean turn-1 prompt tokens.",
    )
    output_tokens: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description="outputTokens is the PromQL for L_d, mean output tokens per conversation.",
    )
    lifetime: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description="lifetime is the PromQL for W, mean conversation lifetime in seconds.",
    )
    prefill_tokens_rate: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description="prefillTokensRate is the PromQL for prompt tokens one prefiller processes per second (mean).",
    )
    prefiller_queue: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description="prefillerQueue is the PromQL for mean requests waiting per prefiller.",
    )
    decoder_kv_usage: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description="decoderKvUsage is the PromQL for mean decoder KV cache occupancy, 0-1.",
    )
    decoder_waiting: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description="decoderWaiting is the PromQL for requests waiting on decoders, summed.",
    )


class AutoscalingSpec(ApiModel):
    """Autoscaling from Prometheus saturation signals."""

    enabled: bool = Field(default=False, description="enabled lets the operator own replica counts.")
    prefillers: ReplicaBounds = Field(
        default_factory=ReplicaBounds, description="prefillers bounds the prefiller replica count."
    )
    decoders: ReplicaBounds = Field(
        default_factory=lambda: ReplicaBounds(min_replicas=1, max_replicas=32),
        description="decoders bounds the decoder replica count.",
    )
    prometheus_url: str | None = Field(
        default=None,
        max_length=2048,
        pattern=r"^https?://[^\s]+$",
        description="prometheusUrl is the base URL of the Prometheus HTTP API; required when enabled.",
    )
    evaluation_interval_s: float = Field(
        default=30, ge=1, le=3600, description="evaluationIntervalS is how often signals are read."
    )
    stabilization_window_s: float = Field(
        default=300,
        ge=0,
        le=86_400,
        description="stabilizationWindowS is how long load must stay low before a role scales down.",
    )
    kv_usage_high: float = Field(
        default=0.85,
        gt=0,
        le=1,
        description="kvUsageHigh is the mean decoder KV occupancy (0-1) that, held for two evaluations, adds "
        "decoders whatever the model says.",
    )
    prefiller_queue_high: float = Field(
        default=4,
        ge=0,
        le=100_000,
        description="prefillerQueueHigh is the mean requests waiting per prefiller that, while growing, adds "
        "a prefiller.",
    )
    selector: str | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        description="selector is the PromQL label matcher that picks this pool's series, with {namespace} and "
        '{pool} filled in; default namespace="{namespace}",pool="{pool}".',
    )
    queries: AutoscalingQueries = Field(
        default_factory=lambda: AutoscalingQueries(),
        description="queries overrides the PromQL of individual signals.",
    )


_ROUTER_MOUNT_RULE = (
    f"!has(self.volumeMounts) || self.volumeMounts.all(m, !(m.mountPath in {_cel_list(ROUTER_MOUNT_PATHS)}))",
    f"{' and '.join(ROUTER_MOUNT_PATHS)} are mounts of the router's own",
    ".volumeMounts",
)


class RouterSpec(PodOptions):
    """The OpenAI-compatible router in front of the pool."""

    model_config = ConfigDict(
        json_schema_extra=_cel(_mount_rule("self.volumeMounts", ["self.volumes"], ".volumeMounts"), _ROUTER_MOUNT_RULE)
    )

    replicas: int = Field(default=2, ge=1, le=100, description="replicas of the router Deployment.")
    image: str = Field(
        default="ghcr.io/coserve/coserve:0.1.0",
        min_length=1,
        max_length=512,
        description="image is the control-plane image that runs `coserve router`.",
    )
    resources: ResourceRequirements = Field(
        default_factory=lambda: ResourceRequirements(
            requests={"cpu": "500m", "memory": "256Mi"}, limits={"memory": "1Gi"}
        ),
        description="resources of the router container.",
    )
    batch_volume_claim: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="batchVolumeClaim names a PersistentVolumeClaim (ReadWriteMany when replicas > 1) that "
        "holds offline batches (/v1/files, /v1/batches), so accepted batches survive the router's pods. "
        "Unset: an emptyDir per pod, which survives container restarts but not the pod.",
    )

    @model_validator(mode="after")
    def _mounts(self) -> Self:
        problems = [
            (("volumeMounts", *loc), reason, value)
            for loc, reason, value in _unnamed_volumes(self.volume_mounts, self.volumes)
        ]
        problems += [
            (("volumeMounts", index, "mountPath"), _ROUTER_MOUNT_RULE[1], mount.mount_path)
            for index, mount in enumerate(self.volume_mounts or ())
            if mount.mount_path in ROUTER_MOUNT_PATHS
        ]
        if problems:
            _fail(problems)
        return self


def _check_int_or_percent(value: object) -> object:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and _PERCENT_RE.match(value):
        return value
    raise ValueError("must be a non-negative integer or a percentage from 0% to 100%")


PERCENT_PATTERN = r"^(100|[1-9]?[0-9])%$"
_PERCENT_RE = re.compile(PERCENT_PATTERN)
IntOrPercent = Annotated[
    int | str,
    BeforeValidator(_check_int_or_percent),
    WithJsonSchema({"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": PERCENT_PATTERN}]}),
]


class DisruptionBudget(ApiModel):
    """A PodDisruptionBudget's bound on one role's pods: exactly one of minAvailable and maxUnavailable."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            ("has(self.minAvailable) != has(self.maxUnavailable)", "set exactly one of minAvailable and maxUnavailable")
        )
    )

    min_available: IntOrPercent | None = Field(
        default=None,
        description="minAvailable is how many of the role's pods (a number, or a percentage of its replicas) "
        "must stay up through voluntary evictions.",
    )
    max_unavailable: IntOrPercent | None = Field(
        default=None,
        description="maxUnavailable is how many of the role's pods (a number, or a percentage of its replicas) "
        "voluntary evictions may take down at once.",
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> Self:
        _one_of(self, ("min_available", "max_unavailable"), "set exactly one of minAvailable and maxUnavailable")
        return self


class DisruptionSpec(ApiModel):
    """PodDisruptionBudgets that keep each role above its minimum while nodes are drained or upgraded."""

    enabled: bool = Field(
        default=True,
        description="enabled gives the router, prefillers and decoders a PodDisruptionBudget each "
        "(<pool>-router, <pool>-prefiller, <pool>-decoder), so voluntary evictions (node drains, cluster "
        "upgrades) wait rather than take a role below its minimum. Pods that are not ready may always be evicted.",
    )
    router: DisruptionBudget | None = Field(
        default=None,
        description="router replaces the router's budget; default minAvailable 1 with two or more replicas, "
        "and no budget for a single replica.",
    )
    prefiller: DisruptionBudget | None = Field(
        default=None,
        description="prefiller replaces the prefillers' budget; default minAvailable one less than the "
        "planned prefillers, at least 1: prefillers leave one at a time, never the last (the pool's saturation "
        "rate drops by one prefiller's meanwhile). With autoscaling, autoscaling.prefillers.minReplicas.",
    )
    decoder: DisruptionBudget | None = Field(
        default=None,
        description="decoder replaces the decoders' budget; default minAvailable the decoders the plan needs "
        "before headroom (at least 1), so evictions take only the headroom's decoders. With autoscaling, "
        "autoscaling.decoders.minReplicas.",
    )


_HF_TOKEN_RULE_MESSAGE = "the operator sets HF_TOKEN from model.hfTokenSecretRef"  # noqa: S105 - not a secret
_CACHE_MOUNT_RULE_MESSAGE = "model.cache.mountPath is where the operator mounts the model cache"
_ENGINE_OPTION_PATHS = (("engine",), ("engine", "prefiller"), ("engine", "decoder"))


def _engine_option_lists(engine: EngineSpec) -> list[tuple[tuple[str, ...], EnginePodOptions]]:
    """(path, options) of the engine-wide pod options and each role's."""
    return [(("engine",), engine), (("engine", "prefiller"), engine.prefiller), (("engine", "decoder"), engine.decoder)]


def _spec_rules() -> dict[str, Any]:
    rules: list[tuple[str, str, str]] = []
    for path in _ENGINE_OPTION_PATHS:
        options = "self." + ".".join(path)
        rules.append(
            (
                f"!{_has('self.model.hfTokenSecretRef')} || !{_has(options + '.env')} "
                f"|| !{options}.env.exists(e, e.name == '{HF_TOKEN_ENV}')",
                _HF_TOKEN_RULE_MESSAGE,
                f".{'.'.join(path)}.env",
            )
        )
        rules.append(
            (
                f"!{_has('self.model.cache')} || !{_has(options + '.volumeMounts')} "
                f"|| !{options}.volumeMounts.exists(m, m.mountPath == self.model.cache.mountPath)",
                _CACHE_MOUNT_RULE_MESSAGE,
                f".{'.'.join(path)}.volumeMounts",
            )
        )
    return _cel(*rules)


class SpecModel(ApiModel):
    """spec of a CoServePool: the model, engines, workload and policies of one serving pool."""

    model_config = ConfigDict(json_schema_extra=_spec_rules())

    model: ModelSpec = Field(description="model is the model the pool serves.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="engine configures the vLLM engines.")
    workload: WorkloadSpec = Field(description="workload is the conversation workload to size the pool for.")
    profile: ProfileSpec = Field(description="profile says how fast one engine replica is.")
    headroom: float = Field(
        default=1.5,
        ge=1,
        le=10,
        description="headroom over-provisions decoders beyond the provisioning model's minimum, so the "
        "prefillers, whose load is observable, saturate first.",
    )
    priority_classes: list[PriorityClassSpec] = Field(
        default_factory=lambda: [c.model_copy() for c in DEFAULT_PRIORITY_CLASSES],
        min_length=1,
        max_length=16,
        description="priorityClasses are the tenant classes with their weights and SLOs.",
    )
    offline: OfflineSpec = Field(default_factory=OfflineSpec, description="offline configures offline co-serving.")
    kv_offload: KVOffloadSpec = Field(default_factory=KVOffloadSpec, description="kvOffload configures KV offload.")
    autoscaling: AutoscalingSpec = Field(
        default_factory=AutoscalingSpec, description="autoscaling configures replica autoscaling."
    )
    router: RouterSpec = Field(default_factory=RouterSpec, description="router configures the router.")
    disruption: DisruptionSpec = Field(
        default_factory=DisruptionSpec,
        description="disruption configures the PodDisruptionBudgets that protect each role during voluntary evictions.",
    )

    @model_validator(mode="after")
    def _model_source_settings(self) -> Self:
        problems: list[tuple[tuple[str | int, ...], str, object]] = []
        cache = self.model.cache
        for path, options in _engine_option_lists(self.engine):
            if self.model.hf_token_secret_ref is not None:
                problems += [
                    ((*path, "env", index, "name"), _HF_TOKEN_RULE_MESSAGE, env.name)
                    for index, env in enumerate(options.env or ())
                    if env.name == HF_TOKEN_ENV
                ]
            if cache is not None:
                problems += [
                    ((*path, "volumeMounts", index, "mountPath"), _CACHE_MOUNT_RULE_MESSAGE, mount.mount_path)
                    for index, mount in enumerate(options.volume_mounts or ())
                    if mount.mount_path == cache.mount_path
                ]
        if problems:
            _fail(problems)
        return self
