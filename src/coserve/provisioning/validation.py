"""Semantic checks of a CoServePool spec: rules the CRD's schema cannot express.

A spec can pass the schema and still be impossible: min above max, a KV cache
smaller than one conversation, an SLO tighter than the engine can ever meet.
``check_spec`` finds every such problem at once; the CLI prints them and exits
2, the operator reports them as PlanValid=False and touches no child.
"""

from __future__ import annotations

from coserve.api.problems import Problem
from coserve.api.spec import KVOffloadBackend, SpecModel
from coserve.provisioning.model import MAX_REPLICAS_PER_ROLE, make_plan
from coserve.provisioning.profile import ResolvedProfile

__all__ = ["check_plan_limits", "check_spec", "spec_warnings"]

# No real prefill of any length takes less than a microsecond; below that the curve is a unit error.
_MIN_PREFILL_LATENCY_S = 1e-6


def check_spec(spec: SpecModel, profile: ResolvedProfile) -> list[Problem]:
    """Every semantic problem of ``spec`` with ``profile``; empty when the plan can be made.

    Each part of the spec is checked by its own function below, in the order the problems are reported; the
    plan's size is checked only when nothing else is wrong (it needs a plan that can be made)."""
    problems = [
        *_profile_problems(spec, profile),
        *_workload_problems(spec),
        *_class_problems(spec, profile),
        *_offload_problems(spec),
        *_autoscaling_problems(spec),
    ]
    return problems or check_plan_limits(spec, profile)


def _profile_problems(spec: SpecModel, profile: ResolvedProfile) -> list[Problem]:
    """A prefill latency too small to be seconds; a KV cache that cannot hold one conversation."""
    problems = []
    workload = spec.workload
    latency_s = profile.prefill_latency.latency_s(workload.input_tokens)
    if latency_s < _MIN_PREFILL_LATENCY_S:
        problems.append(
            Problem(
                "spec.profile.prefillLatency",
                f"predicts {latency_s:.3g} s for a {workload.input_tokens}-token prefill, i.e. practically "
                "infinite prefill throughput; check the units (seconds, and seconds per token for perTokenS)",
            )
        )
    if profile.kv_capacity_tokens < profile.live_context_tokens:
        problems.append(
            Problem(
                "spec.profile.kvCapacityTokens",
                f"{profile.kv_capacity_tokens} KV tokens cannot hold even one conversation of "
                f"{profile.live_context_tokens} live tokens (spec.profile.liveContextTokens, default "
                "inputTokens + outputTokens)",
            )
        )
    return problems


def _workload_problems(spec: SpecModel) -> list[Problem]:
    """Idle time between turns that does not fit in the conversation's lifetime."""
    workload = spec.workload
    idle_total_s = (workload.turns - 1) * workload.idle_s
    if idle_total_s < workload.lifetime_s:
        return []
    return [
        Problem(
            "spec.workload.idleS",
            f"(turns - 1)·idleS = {workload.turns - 1:g}·{workload.idle_s:g} = {idle_total_s:g} s is not below "
            f"lifetimeS {workload.lifetime_s:g} s: a conversation's idle time between turns is part of its "
            "lifetime, and it must run for some of it",
        )
    ]


def _class_problems(spec: SpecModel, profile: ResolvedProfile) -> list[Problem]:
    """Duplicate class names, TTFT SLOs no prefill can meet, and an offline class that is not a class."""
    problems = []
    names = [c.name for c in spec.priority_classes]
    for index, name in enumerate(names):
        if name in names[:index]:
            problems.append(Problem(f"spec.priorityClasses[{index}].name", f"duplicate class name {name!r}"))
    never_meetable_ms = profile.prefill_latency.constant_s * 1000
    for index, cls in enumerate(spec.priority_classes):
        if cls.ttft_slo_ms < never_meetable_ms:
            problems.append(
                Problem(
                    f"spec.priorityClasses[{index}].ttftSloMs",
                    f"{cls.ttft_slo_ms:g} ms is below the fixed prefill cost of {never_meetable_ms:g} ms "
                    "(spec.profile.prefillLatency.constantS): no request of this class could ever meet it",
                )
            )
    if spec.offline.enabled and spec.offline.class_name not in names:
        problems.append(
            Problem(
                "spec.offline.className",
                f"{spec.offline.class_name!r} is not one of spec.priorityClasses ({', '.join(names)})",
            )
        )
    return problems


def _offload_problems(spec: SpecModel) -> list[Problem]:
    """A host KV pool switched on with no bytes."""
    offload = spec.kv_offload
    if offload.enabled and offload.backend is KVOffloadBackend.HOST and offload.host_memory_bytes == 0:
        return [
            Problem(
                "spec.kvOffload.hostMemoryBytes",
                "is 0 while the host backend is enabled: give the host KV pool some bytes or disable kvOffload",
            )
        ]
    return []


def _autoscaling_problems(spec: SpecModel) -> list[Problem]:
    """Replica bounds the wrong way round; autoscaling with nowhere to read its signals."""
    problems = []
    scaling = spec.autoscaling
    for role in ("prefillers", "decoders"):
        bounds = getattr(scaling, role)
        if bounds.min_replicas > bounds.max_replicas:
            problems.append(
                Problem(
                    f"spec.autoscaling.{role}.minReplicas",
                    f"{bounds.min_replicas} is above maxReplicas {bounds.max_replicas}",
                )
            )
    if scaling.enabled and scaling.prometheus_url is None:
        problems.append(Problem("spec.autoscaling.prometheusUrl", "is required when autoscaling is enabled"))
    return problems


def check_plan_limits(spec: SpecModel, profile: ResolvedProfile) -> list[Problem]:
    """A plan beyond MAX_REPLICAS_PER_ROLE per role is a typo in the workload or the profile."""
    plan = make_plan(spec, profile)
    problems = []
    for role, count in (("prefillers", plan.prefillers), ("decoders", plan.decoders)):
        if count > MAX_REPLICAS_PER_ROLE:
            shown = f"{count}" if count < 10**9 else f"about {float(count):.1e}"
            problems.append(
                Problem(
                    "spec.workload.arrivalRatePerS",
                    f"needs {shown} {role}, more than the {MAX_REPLICAS_PER_ROLE} one pool supports; "
                    "check the workload and profile numbers for a unit error, or split the pool",
                )
            )
    return problems


def spec_warnings(spec: SpecModel) -> list[str]:
    """Legal but suspicious settings, reported next to the plan."""
    warnings = []
    gpus = None
    limits = spec.engine.resources.limits or {}
    if "nvidia.com/gpu" in limits and isinstance(limits["nvidia.com/gpu"], int):
        gpus = limits["nvidia.com/gpu"]
    if gpus is not None and gpus != spec.engine.tensor_parallel_size:
        warnings.append(
            f"spec.engine.resources.limits[nvidia.com/gpu] is {gpus} but tensorParallelSize is "
            f"{spec.engine.tensor_parallel_size}: each engine uses tensorParallelSize GPUs"
        )
    if spec.kv_offload.enabled and spec.kv_offload.backend is not KVOffloadBackend.HOST:
        warnings.append(
            f"spec.kvOffload.backend {spec.kv_offload.backend.value} needs CUDA engines; use host on CPU nodes"
        )
    return warnings
