"""The workload a pool is sized for and how fast one engine replica is: the provisioning model's inputs.

``WorkloadSpec`` is ``spec.workload`` and ``ProfileSpec`` is ``spec.profile``; ``coserve.provisioning``
turns them into replica counts, ``coserve.autoscaling`` replaces the workload with measured signals,
and ``coserve.scheduling.profile_fit`` fits ``PrefillLatencyCurve`` to measurements.

The symbols of the provisioning model map to fields here once:
R = ``workload.arrival_rate_per_s``, L_in = ``workload.input_tokens``,
L_d = ``workload.output_tokens``, W = ``workload.lifetime_s``, n = ``workload.turns``,
a = ``workload.appended_tokens``, g = ``workload.idle_s``,
T_d = ``profile.decode_throughput_tokens_per_s``, B = KV slots derived from
``profile.kv_capacity_tokens`` / ``profile.live_context_tokens``, and T_p from
``profile.prefill_latency`` evaluated at L_in.
"""

from __future__ import annotations

from pydantic import Field

from coserve.api._base import ApiModel
from coserve.api.spec.core import DNS_SUBDOMAIN_PATTERN


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
