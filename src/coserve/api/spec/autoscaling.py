"""Autoscaling from Prometheus saturation signals: replica bounds per role, thresholds and PromQL overrides.

``AutoscalingSpec`` is ``spec.autoscaling``; ``coserve.autoscaling.policy`` reads it.
"""

from __future__ import annotations

from pydantic import Field

from coserve.api._base import ApiModel


class ReplicaBounds(ApiModel):
    """Replica bounds of one role while autoscaling owns its replica count."""

    min_replicas: int = Field(default=1, ge=1, le=10_000, description="minReplicas is the fewest replicas.")
    max_replicas: int = Field(default=8, ge=1, le=10_000, description="maxReplicas is the most replicas.")
    target_requests_per_replica: float | None = Field(
        default=None,
        gt=0,
        le=100_000,
        description="targetRequestsPerReplica is the queue-length rule's target: running + waiting requests per "
        "replica, as an HPA on vLLM's metrics would use. The rule's count is one of the autoscaler's candidates. "
        "Default: 2 for prefillers, and for decoders the conversations one decoder's KV cache holds (the plan's "
        "kvSlotsPerDecoder).",
    )


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
    prefiller_requests: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description="prefillerRequests is the PromQL for requests running and waiting on prefillers, summed.",
    )
    decoder_requests: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description="decoderRequests is the PromQL for requests running and waiting on decoders, summed.",
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
    replica_startup_s: float = Field(
        default=60,
        ge=0,
        le=86_400,
        description="replicaStartupS is how long a new replica takes from being asked for to serving (scheduling, "
        "image pull, model load). A replica is added for a backlog only when the backlog would outlast it.",
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
