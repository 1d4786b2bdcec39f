"""The vLLM engines: image, arguments, resources, per-role overrides, metrics scrapers and KV offload.

``EngineSpec`` is ``spec.engine`` and ``KVOffloadSpec`` is ``spec.kvOffload``;
``coserve.operator.resources`` renders the prefiller and decoder Deployments and the engines' config
from them, and ``coserve.provisioning.validation`` checks the KV offload settings.

extraArgs that set a flag the operator renders (``OPERATOR_ENGINE_FLAGS``) are refused here, by pydantic only:
the API server accepts them, and ``coserve render``/``plan`` and the operator (PlanValid=False) name the item.
So are extraArgs that turn on what coserve's layer-safepoint preemption does not support
(``UNSUPPORTED_ENGINE_FLAGS``: speculative decoding; ``UNSUPPORTED_ENGINE_COUNTS`` over 1: data parallelism);
the engine refuses to start with them too (``coserve.engine.in_flight``).
NOTE: no CEL twin: reading an argument as vLLM does (underscores, ``=``, abbreviations) takes regexes over up to
256 strings of unbounded length, whose estimated cost can make the API server refuse the whole CRD, and no API
server runs here to check it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Self

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from coserve.api._base import ApiModel
from coserve.api.spec._rules import _cel, _fail
from coserve.api.spec.core import LabelValue, ResourceRequirements, Toleration, _label_key_problem
from coserve.api.spec.pod_options import EnginePodOptions
from coserve.api.spec.reserved import OPERATOR_ENGINE_FLAG_ALIASES, OPERATOR_ENGINE_FLAGS
from coserve.api.spec.volumes import _mount_rule, _unnamed_volumes

# every option string vLLM reads as a flag the operator renders -> that flag
_OPERATOR_OPTIONS: dict[str, str] = {**{flag: flag for flag in OPERATOR_ENGINE_FLAGS}, **OPERATOR_ENGINE_FLAG_ALIASES}

_SPECULATIVE = (
    "speculative decoding drafts tokens inside the sampling step with the KV connector bound, where a layer "
    "safepoint would kill the engine; coserve refuses it"
)
_DATA_PARALLEL = (
    "each data-parallel rank is an engine core of its own, and the request validator reaches only one safepoint "
    "board; run more decoder replicas instead"
)
# vLLM 0.32 flags that turn on what coserve's layer-safepoint preemption does not support (flag -> why), refused in
# extraArgs whatever their value: each turns speculative decoding on.
UNSUPPORTED_ENGINE_FLAGS: dict[str, str] = {
    "--speculative-config": _SPECULATIVE,
    "--spec-method": _SPECULATIVE,
    "--spec-model": _SPECULATIVE,
    "--spec-tokens": _SPECULATIVE,
}
# vLLM 0.32 flags that count data-parallel ranks (flag -> why): refused in extraArgs with a value over 1 (vLLM's
# default is 1; vLLM refuses less itself), without a value in the same list, or with one coserve cannot read as a
# number (Kubernetes expands $(VAR) in args).
UNSUPPORTED_ENGINE_COUNTS: dict[str, str] = {
    "--data-parallel-size": _DATA_PARALLEL,
    "--data-parallel-size-local": _DATA_PARALLEL,
}
# vLLM's short options for those flags (option -> the flag), refused as the flag is
UNSUPPORTED_ENGINE_FLAG_ALIASES: dict[str, str] = {
    "-sc": "--speculative-config",
    "-dp": "--data-parallel-size",
    "-dpl": "--data-parallel-size-local",
}
_UNSUPPORTED_OPTIONS: dict[str, str] = {
    **{flag: flag for flag in (*UNSUPPORTED_ENGINE_FLAGS, *UNSUPPORTED_ENGINE_COUNTS)},
    **UNSUPPORTED_ENGINE_FLAG_ALIASES,
}

_REFUSED_ARGS = (
    f"The flags the operator sets ({', '.join(_OPERATOR_OPTIONS)}) are refused, in any spelling vLLM reads "
    "(--flag=value, _ for -, an abbreviation, --flag.key for a JSON flag): vLLM keeps a repeated flag's last value. "
    "So is what coserve's layer-safepoint preemption does not support: speculative decoding "
    f"({', '.join(option for option, flag in _UNSUPPORTED_OPTIONS.items() if flag in UNSUPPORTED_ENGINE_FLAGS)}) "
    "and data parallelism over 1 "
    f"({', '.join(option for option, flag in _UNSUPPORTED_OPTIONS.items() if flag in UNSUPPORTED_ENGINE_COUNTS)}; "
    "run more decoder replicas instead)."
)


def _option_name(arg: str) -> str | None:
    """The option string that the vLLM argument ``arg`` names, as vLLM's ``FlexibleArgumentParser`` reads it, or
    ``None`` for an argument that names none (a value).

    ``--flag=value`` and ``--flag.key`` (a key of a JSON flag; ``-sc.key`` too) name ``--flag``, and ``_`` in a
    long flag's name is ``-``.
    """
    head = arg.split("=", 1)[0].split(".", 1)[0]
    name = "--" + head[2:].replace("_", "-") if head.startswith("--") else head
    if not name.startswith("-") or name in ("-", "--"):
        return None
    return name


def _flag_of(name: str, options: Mapping[str, str]) -> str | None:
    """The flag of ``options`` (option string -> flag) that the option string ``name`` sets, or ``None``.

    ``name`` itself, or, as argparse takes an abbreviation (a prefix of one option) for that option, the option it
    is a prefix of. A prefix of several (which vLLM refuses itself) names the first.
    """
    if name in options:
        return options[name]
    return next((flag for option, flag in options.items() if option.startswith(name)), None)


def _count_problem(args: Sequence[str], index: int, flag: str) -> str | None:
    """Why the data-parallel count ``args[index]`` sets (``--flag=value``, or ``--flag`` then the value) is refused,
    or ``None`` for 1 (or less, which vLLM refuses itself). vLLM reads the value with ``int``, as here."""
    arg = args[index]
    value = arg.split("=", 1)[1] if "=" in arg else (args[index + 1] if index + 1 < len(args) else None)
    why = UNSUPPORTED_ENGINE_COUNTS[flag]
    if value is None:
        return f"'{flag}' is supported by coserve only at 1, and its value must follow it in the same list ({why})"
    try:
        count = int(value)
    except ValueError:
        return f"'{flag}' is supported by coserve only at 1, not {value!r} ({why})"
    return None if count <= 1 else f"'{flag}' is supported by coserve only at 1, not {count} ({why})"


def _arg_problem(args: Sequence[str], index: int) -> str | None:
    """Why the item ``args[index]`` of an ``extraArgs`` list is refused, or ``None``."""
    name = _option_name(args[index])
    if name is None:
        return None
    if (flag := _flag_of(name, _OPERATOR_OPTIONS)) is not None:
        return f"'{flag}' is set by coserve ({OPERATOR_ENGINE_FLAGS[flag]})"
    flag = _flag_of(name, _UNSUPPORTED_OPTIONS)
    if flag in UNSUPPORTED_ENGINE_FLAGS:
        return f"'{flag}' is not supported by coserve ({UNSUPPORTED_ENGINE_FLAGS[flag]})"
    if flag in UNSUPPORTED_ENGINE_COUNTS:
        return _count_problem(args, index, flag)
    return None


def _refuse_operator_flags(args: list[str] | None) -> None:
    """Refuse each item of an ``extraArgs`` list that sets a flag the operator renders, or turns on what coserve's
    preemption does not support, naming its index."""
    args = args or []
    problems = [((index,), reason, arg) for index, arg in enumerate(args) if (reason := _arg_problem(args, index))]
    if problems:
        _fail(problems)


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
        description=f"extraArgs are appended to engine.extraArgs for this role only. {_REFUSED_ARGS}",
    )

    @field_validator("extra_args")
    @classmethod
    def _no_operator_flags(cls, args: list[str] | None) -> list[str] | None:
        _refuse_operator_flags(args)
        return args


_MAX_SCRAPER_LABELS = 16


class ScraperPeer(ApiModel):
    """Pods the engines admit on their port (a metrics scraper, a gateway's proxy): one NetworkPolicy peer, by namespace
    and pod labels."""

    pod_labels: dict[str, LabelValue] = Field(
        min_length=1,
        max_length=_MAX_SCRAPER_LABELS,
        description="podLabels select the peer's pods: every one of these labels (at least one).",
    )
    namespace_labels: dict[str, LabelValue] = Field(
        min_length=1,
        max_length=_MAX_SCRAPER_LABELS,
        description="namespaceLabels select the namespaces the peer's pods run in: every one of these labels "
        "(at least one; {} would select every namespace). kubernetes.io/metadata.name: <namespace> names one "
        "namespace; the API server sets that label on every namespace to its name.",
    )

    @model_validator(mode="before")
    @classmethod
    def _names_both(cls, data: object) -> object:
        if isinstance(data, dict):
            missing = [
                ((alias,), f"required field is missing: name the peer's {what}", data)
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
        description="extraArgs are appended to the vLLM server's command line in every engine pod, after the "
        f"operator's own flags. {_REFUSED_ARGS}",
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

    @field_validator("extra_args")
    @classmethod
    def _no_operator_flags(cls, args: list[str]) -> list[str]:
        _refuse_operator_flags(args)
        return args

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
