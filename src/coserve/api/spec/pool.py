"""``SpecModel``, the spec of a CoServePool, and the rules that tie its parts together.

The rules here need more than one part of the spec (the model's token and cache against the engines'
env and mounts). ``coserve.api.resource`` wraps ``SpecModel`` in the CoServePool object,
``coserve.api.parse`` validates user input into it and ``coserve.api.crd`` generates the CRD from it.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Self

from pydantic import ConfigDict, Field, model_validator

from coserve.api._base import ApiModel
from coserve.api.spec._rules import _cel, _fail, _has
from coserve.api.spec.autoscaling import AutoscalingSpec
from coserve.api.spec.disruption import DisruptionSpec
from coserve.api.spec.engine import EngineSpec, KVOffloadSpec
from coserve.api.spec.gateway import GatewaySpec
from coserve.api.spec.model_source import ModelSpec
from coserve.api.spec.pod_options import EnginePodOptions
from coserve.api.spec.priority_classes import DEFAULT_PRIORITY_CLASSES, OfflineSpec, PriorityClassSpec
from coserve.api.spec.reserved import HF_TOKEN_ENV
from coserve.api.spec.router import RouterSpec
from coserve.api.spec.workload import ProfileSpec, WorkloadSpec

_HF_TOKEN_RULE_MESSAGE = "the operator sets HF_TOKEN from model.hfTokenSecretRef"  # noqa: S105 - not a secret
_CACHE_MOUNT_RULE_MESSAGE = "model.cache.mountPath is where the operator mounts the model cache"
_ENGINE_OPTION_PATHS = (("engine",), ("engine", "prefiller"), ("engine", "decoder"))


class PoolShape(StrEnum):
    """How a pool's engines split the work: what ``spec.shape`` asks for, and what the plan chose."""

    AUTO = "Auto"  # the plan picks whichever of the two sustains the higher rate on the same engines
    DISAGGREGATED = "Disaggregated"  # prefillers for turn 1, decoders for everything after (P/D)
    AGGREGATED = "Aggregated"  # engines that prefill and decode their own conversations, no prefillers


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
        description="headroom sets the design rate, headroom · workload.arrivalRatePerS, at which the plan sizes "
        "both shapes to meet the priority classes' objectives. The autoscaler, which measures the rate, plans "
        "with its own margin over the measurement instead.",
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
    shape: PoolShape = Field(
        default=PoolShape.AUTO,
        description="shape is Disaggregated (prefillers and decoders), Aggregated (engines that prefill and decode "
        "their own conversations, no prefillers) or Auto: whichever the plan finds sustains the higher rate on the "
        "same engines within the objectives (status.plan.shapes says both rates and why).",
    )
    router: RouterSpec = Field(default_factory=RouterSpec, description="router configures the router.")
    gateway: GatewaySpec = Field(
        default_factory=GatewaySpec,
        description="gateway puts the pool behind a Gateway API Inference Extension gateway: an InferencePool and "
        "coserve's endpoint picker, beside the router.",
    )
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
