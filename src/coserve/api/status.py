"""The CoServePool status: what the operator observed and decided.

The operator writes it; users read it through ``kubectl get csp`` (printer
columns) and ``kubectl describe``. Conditions follow the Kubernetes API
conventions: one entry per ``type``, ``lastTransitionTime`` moves only when
``status`` changes (see ``coserve.api.conditions``).
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from coserve.api._base import ApiModel
from coserve.api.spec.pool import PoolShape

__all__ = [
    "DEPRECATED_AUTOSCALING_FIELDS",
    "AutoscalingRecord",
    "AutoscalingSignals",
    "AutoscalingStatus",
    "Bottleneck",
    "Condition",
    "ConditionStatus",
    "ConditionType",
    "IdleKV",
    "Plan",
    "PlanUtilization",
    "ReplicaStatus",
    "RoleCounts",
    "RoleReplicas",
    "ShapeOption",
    "StatusModel",
]


class ConditionType(StrEnum):
    READY = "Ready"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    PLAN_VALID = "PlanValid"
    AUTOSCALING_ACTIVE = "AutoscalingActive"
    GATEWAY_READY = "GatewayReady"


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(ApiModel):
    """One aspect of the pool's state, as in metav1.Condition."""

    type: ConditionType = Field(
        description="type of the condition: Ready, Progressing, Degraded, PlanValid, AutoscalingActive or GatewayReady."
    )
    status: ConditionStatus = Field(description="status is True, False or Unknown.")
    reason: str = Field(
        min_length=1,
        max_length=1024,
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
        description="reason is a CamelCase word for the last transition, for machines.",
    )
    message: str = Field(default="", max_length=32768, description="message explains the condition to a human.")
    last_transition_time: str = Field(
        description="lastTransitionTime is when status last changed (RFC 3339).",
        json_schema_extra={"format": "date-time"},
    )
    observed_generation: int | None = Field(
        default=None, ge=0, description="observedGeneration is the spec generation the condition was set for."
    )


class Bottleneck(StrEnum):
    """Which resource of the pool saturates first as load rises."""

    PREFILLER = "Prefiller"
    DECODER_THROUGHPUT = "DecoderThroughput"
    DECODER_MEMORY = "DecoderMemory"


class IdleKV(StrEnum):
    """What the plan assumes becomes of a conversation's KV while it is idle between turns."""

    KEPT = "Kept"  # held in the decoder's prefix cache until the next turn: KV for the whole lifetime W
    EVICTED = "Evicted"  # evicted by newer work: KV only while running, and every later turn recomputes its prompt


class PlanUtilization(ApiModel):
    """Expected utilization of each resource at the target arrival rate (1.0 = saturated)."""

    prefiller: float = Field(ge=0, description="prefiller is R / (prefillers · R*).")
    decoder_throughput: float = Field(
        ge=0, description="decoderThroughput is R·(L_d + w·A) / (decoders · T_d): decode and decoder prefill work."
    )
    decoder_memory: float = Field(
        ge=0, description="decoderMemory is R·W_kv / (decoders · B), W_kv the time a conversation's KV is held."
    )


class ShapeOption(ApiModel):
    """One shape sized for the pool's objectives at the design rate, and what it is predicted to give."""

    prefillers: int = Field(ge=0, description="prefillers is M (0 for aggregated engines).")
    decoders: int = Field(ge=1, description="decoders is N: the engines that decode (every engine when aggregated).")
    engines: int = Field(ge=1, description="engines is prefillers + decoders.")
    limit: str = Field(
        description="limit is what sets the decoders' count (one engine fewer would break it): DecoderThroughput "
        "or DecoderMemory (saturation), TTFT or TPOT (an objective), or Minimum (one engine)."
    )
    prefillers_limit: str = Field(
        default="", description="prefillersLimit is what sets the prefillers' count (P/D): Prefiller, TTFT or Minimum."
    )
    ttft_p95_s: float = Field(ge=0, description="ttftP95S is the predicted p95 time to turn 1's first token.")
    ttfet_p95_s: float = Field(
        ge=0,
        description="ttfetP95S is the predicted p95 time from a conversation's arrival to its last turn's first token.",
    )
    tpot_s: float = Field(ge=0, description="tpotS is the predicted mean time per output token.")
    saturation_rate_per_s: float = Field(
        ge=0, description="saturationRatePerS is the arrival rate at which this option's first resource saturates."
    )
    unmet: list[str] = Field(
        default_factory=list,
        description="unmet lists the objectives (TTFT, TPOT) this shape cannot meet at any size; it is sized "
        "without them.",
    )


class ShapeComparison(ApiModel):
    """P/D against aggregated engines, each sized for the objectives at the design rate, and the pool's choice."""

    shape: PoolShape = Field(description="shape is the one the pool takes: Disaggregated or Aggregated.")
    design_rate_per_s: float = Field(
        ge=0, description="designRatePerS is headroom · arrivalRatePerS, the rate both shapes are sized for."
    )
    ttft_objective_s: float = Field(ge=0, description="ttftObjectiveS is the tightest online class's TTFT objective.")
    tpot_objective_s: float = Field(ge=0, description="tpotObjectiveS is the tightest online class's TPOT objective.")
    disaggregated: ShapeOption = Field(description="disaggregated is P/D: prefillers and decoders.")
    aggregated: ShapeOption = Field(description="aggregated is engines that prefill their own turns and decode.")
    reason: str = Field(description="reason is why the pool takes its shape, with both options' figures.")

    def option(self, shape: PoolShape | None = None) -> ShapeOption:
        """The sized option for ``shape`` (default: the chosen one)."""
        return self.aggregated if (shape or self.shape) is PoolShape.AGGREGATED else self.disaggregated


class Plan(ApiModel):
    """The provisioning model's answer for a spec: replica counts and why."""

    prefillers: int = Field(
        ge=0, description="prefillers is the number of prefiller replicas M (0 when the shape is Aggregated)."
    )
    decoders: int = Field(ge=1, description="decoders is the number of decoder replicas N.")
    prefill_throughput_tokens_per_s: float = Field(
        ge=0, description="prefillThroughputTokensPerS is T_p, one prefiller's throughput at inputTokens."
    )
    saturation_rate_per_s: float = Field(
        ge=0, description="saturationRatePerS is R* = T_p / L_in, the conversations/s one prefiller saturates at."
    )
    pool_saturation_rate_per_s: float = Field(
        ge=0, description="poolSaturationRatePerS is prefillers · R*, the rate the prefiller pool saturates at."
    )
    design_rate_per_s: float = Field(
        ge=0, description="designRatePerS is the arrival rate the decoders were sized for."
    )
    kv_slots_per_decoder: int = Field(
        ge=1, description="kvSlotsPerDecoder is B, the conversations one decoder's KV cache holds at once."
    )
    decoders_per_prefiller: float = Field(
        ge=0, description="decodersPerPrefiller is the decoders one saturated prefiller needs, before headroom."
    )
    decoder_prefill_tokens: float = Field(
        default=0.0,
        ge=0,
        description="decoderPrefillTokens is A, the prompt tokens a decoder prefills per conversation: what the "
        "later turns append ((turns - 1)·appendedTokens), or, when idleKv is Evicted, their whole prompts.",
    )
    prefill_weight: float = Field(
        default=0.0,
        ge=0,
        description="prefillWeight is w, the decoder time one of those prefill tokens costs, in decode tokens: "
        "decoders need N·T_d >= R·(L_d + w·A).",
    )
    kv_held_s: float | None = Field(
        default=None,
        ge=0,
        description="kvHeldS is W_kv, the seconds a conversation's KV is held on its decoder: lifetimeS when "
        "idleKv is Kept, lifetimeS - (turns - 1)·idleS (the time it runs) when Evicted.",
    )
    idle_kv: IdleKV = Field(
        default=IdleKV.KEPT,
        description="idleKv is Kept when the decoders are sized to keep idle conversations' KV cached between "
        "turns, Evicted when they are sized for running conversations only and later turns recompute their "
        "prompts (whichever needs fewer decoders).",
    )
    binding_constraint: Bottleneck = Field(
        description="bindingConstraint is the decoder constraint that set decoders: DecoderThroughput or DecoderMemory."
    )
    bottleneck: Bottleneck = Field(description="bottleneck is the resource that saturates first as load rises.")
    utilization: PlanUtilization = Field(description="utilization at the target arrival rate.")
    shapes: ShapeComparison | None = Field(
        default=None, description="shapes compares P/D with aggregated engines and says which the pool takes."
    )
    explanation: list[str] = Field(default_factory=list, description="explanation of each number, for humans.")
    warnings: list[str] = Field(default_factory=list, description="warnings about the spec that do not block the plan.")

    @property
    def aggregated(self) -> bool:
        """The pool runs aggregated engines only (its decoders prefill every turn; no prefillers)."""
        return self.shapes is not None and self.shapes.shape is PoolShape.AGGREGATED


class RoleReplicas(ApiModel):
    """Desired and ready replicas of one role."""

    desired: int = Field(default=0, ge=0, description="desired replicas.")
    ready: int = Field(default=0, ge=0, description="ready replicas, from the Deployment's status.")


class ReplicaStatus(ApiModel):
    """Replicas per role."""

    prefillers: RoleReplicas = Field(default_factory=RoleReplicas, description="prefillers replicas.")
    decoders: RoleReplicas = Field(default_factory=RoleReplicas, description="decoders replicas.")
    routers: RoleReplicas = Field(default_factory=RoleReplicas, description="routers replicas.")


class AutoscalingSignals(ApiModel):
    """The signals one evaluation read from Prometheus (absent: no data)."""

    arrival_rate_per_s: float | None = Field(default=None, ge=0, description="arrivalRatePerS is R measured.")
    input_tokens: float | None = Field(default=None, ge=0, description="inputTokens is L_in measured.")
    output_tokens: float | None = Field(default=None, ge=0, description="outputTokens is L_d measured.")
    lifetime_s: float | None = Field(default=None, ge=0, description="lifetimeS is W measured.")
    prefill_tokens_per_s: float | None = Field(
        default=None,
        ge=0,
        description="prefillTokensPerS is the prompt tokens one prefiller processes per second (mean).",
    )
    prefiller_queue: float | None = Field(
        default=None, ge=0, description="prefillerQueue is the mean requests waiting per prefiller."
    )
    decoder_kv_usage: float | None = Field(
        default=None, ge=0, description="decoderKvUsage is the mean decoder KV occupancy (0-1)."
    )
    decoder_waiting: float | None = Field(
        default=None, ge=0, description="decoderWaiting is the requests waiting on decoders."
    )
    prefiller_requests: float | None = Field(
        default=None, ge=0, description="prefillerRequests is the requests running and waiting on prefillers."
    )
    decoder_requests: float | None = Field(
        default=None, ge=0, description="decoderRequests is the requests running and waiting on decoders."
    )


class AutoscalingRecord(ApiModel):
    """One evaluation's recommendation, kept while the stabilization window needs it."""

    at: float = Field(ge=0, description="at is when, in seconds since the Unix epoch.")
    prefillers: int = Field(ge=0, description="prefillers recommended.")
    decoders: int = Field(ge=0, description="decoders recommended.")


class RoleCounts(ApiModel):
    """A replica count per autoscaled role."""

    prefillers: int = Field(ge=0, description="prefillers replicas.")
    decoders: int = Field(ge=0, description="decoders replicas.")


# The decision memory an earlier operator version kept in status.autoscaling. Still accepted, so a stored
# status that has them parses; no longer written, and removed by the autoscaler's next status write.
DEPRECATED_AUTOSCALING_FIELDS = ("history", "kvHighEvaluations", "prefillerQueue")


class AutoscalingStatus(ApiModel):
    """The autoscaler's last evaluation that changed anything: what it saw, what it chose, and why."""

    last_evaluation_time: str | None = Field(
        default=None,
        description="lastEvaluationTime is when an evaluation last changed this status (its signals, "
        "recommendation, replicas or reason, or the AutoscalingActive condition) (RFC 3339). Not a heartbeat: "
        "an evaluation that changes nothing is not written, so a steady pool keeps an old time.",
        json_schema_extra={"format": "date-time"},
    )
    signals: AutoscalingSignals = Field(
        default_factory=AutoscalingSignals, description="signals seen by the evaluation at lastEvaluationTime."
    )
    recommended: RoleCounts | None = Field(
        default=None, description="recommended replicas before the stabilization rules."
    )
    desired: RoleCounts | None = Field(default=None, description="desired replicas the autoscaler set.")
    reason: str = Field(default="", max_length=4096, description="reason for the decision, for humans.")
    history: list[AutoscalingRecord] | None = Field(
        default=None,
        max_length=512,
        description="Deprecated: no longer written, and removed by the next status write. The stabilization "
        "window's past recommendations are kept in the acting operator replica's memory.",
    )
    kv_high_evaluations: int | None = Field(
        default=None,
        ge=0,
        description="Deprecated: no longer written, and removed by the next status write (kept in the acting "
        "operator replica's memory).",
    )
    prefiller_queue: float | None = Field(
        default=None,
        ge=0,
        description="Deprecated: no longer written, and removed by the next status write (kept in the acting "
        "operator replica's memory); signals.prefillerQueue is the measured queue.",
    )


class StatusModel(ApiModel):
    """status of a CoServePool, written by the operator."""

    observed_generation: int | None = Field(
        default=None, ge=0, description="observedGeneration is the spec generation this status describes."
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="conditions: Ready, Progressing, Degraded, PlanValid, AutoscalingActive and GatewayReady.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    plan: Plan | None = Field(default=None, description="plan is the provisioning model's current answer.")
    replicas: ReplicaStatus = Field(default_factory=ReplicaStatus, description="replicas per role.")
    prefillers: str | None = Field(
        default=None,
        description='prefillers is "ready/desired" prefiller replicas, for kubectl get; absent for aggregated engines.',
    )
    decoders: str | None = Field(
        default=None,
        description='decoders is "ready/desired" decoder replicas (every engine when aggregated), for kubectl get.',
    )
    autoscaling: AutoscalingStatus | None = Field(
        default=None, description="autoscaling is the autoscaler's last evaluation (when enabled)."
    )
