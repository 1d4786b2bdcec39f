"""The CoServePool spec: what a user asks for.

These models are the single source of truth for the CRD's openAPIV3Schema
(``coserve.api.crd`` generates ``crds/coserve.dev_coservepools.yaml`` from them),
so every ``Field`` carries the description that ``kubectl explain`` shows, and
its default and bounds. Cross-field rules (min above max, a profile that is
missing, a KV cache smaller than one conversation) are not schema matters: they
live in ``coserve.provisioning.validation`` and surface as PlanValid=False.

The symbols of the provisioning model map to fields here once:
R = ``workload.arrival_rate_per_s``, L_in = ``workload.input_tokens``,
L_d = ``workload.output_tokens``, W = ``workload.lifetime_s``,
T_d = ``profile.decode_throughput_tokens_per_s``, B = KV slots derived from
``profile.kv_capacity_tokens`` / ``profile.live_context_tokens``, and T_p from
``profile.prefill_latency`` evaluated at L_in.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated

from pydantic import BeforeValidator, Field, WithJsonSchema

from coserve.api._base import ApiModel

__all__ = [
    "DEFAULT_PRIORITY_CLASSES",
    "AutoscalingSpec",
    "ConfigMapProfileRef",
    "EngineSpec",
    "KVOffloadBackend",
    "KVOffloadSpec",
    "ModelSpec",
    "OfflineSpec",
    "PrefillLatencyCurve",
    "PriorityClassSpec",
    "ProfileSpec",
    "ReplicaBounds",
    "ResourceRequirements",
    "RoleOverrides",
    "RouterSpec",
    "SpecModel",
    "Toleration",
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
ResourceList = Annotated[dict[ResourceName, Quantity], Field(json_schema_extra=_RESOURCE_NAME_RULE)]


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


class ModelSpec(ApiModel):
    """The model every engine of the pool serves."""

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


class RoleOverrides(ApiModel):
    """Settings of one role (prefiller or decoder) that replace the engine-wide ones."""

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


class ScraperPeer(ApiModel):
    """Pods that may reach the engines' port to scrape their metrics (a NetworkPolicy peer, by labels)."""

    pod_labels: dict[str, str] = Field(
        default_factory=dict, description="podLabels select the scraper's pods; empty selects every pod."
    )
    namespace_labels: dict[str, str] | None = Field(
        default=None,
        description="namespaceLabels select the namespaces the scraper's pods run in; {} selects every "
        "namespace, unset only the pool's own.",
    )


def _default_scrapers() -> list[ScraperPeer]:
    # Prometheus as the Prometheus Operator and its Helm chart label it, in any namespace.
    return [ScraperPeer(pod_labels={"app.kubernetes.io/name": "prometheus"}, namespace_labels={})]


class EngineSpec(ApiModel):
    """The vLLM engine that prefillers and decoders run."""

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
        default_factory=_default_scrapers,
        max_length=16,
        description="metricsScrapers may reach the engines' port besides the pool's own pods (the pool's "
        "NetworkPolicy admits nobody else); the default admits Prometheus pods labelled "
        "app.kubernetes.io/name=prometheus in any namespace. vLLM serves /metrics on its API port, so a "
        "scraper can also send requests, which the engines serve at the lowest class without the router's token.",
    )


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
    output_tokens: int = Field(
        ge=1,
        le=10_000_000,
        description="outputTokens is the mean number of tokens L_d decoded over a whole conversation, all turns.",
    )
    lifetime_s: float = Field(
        gt=0,
        le=2_592_000,
        description="lifetimeS is the mean time W a conversation keeps its KV on a decoder, from its first "
        "token to its last, tool-call gaps included.",
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
        description="liveContextTokens is the mean context a live conversation keeps in KV; "
        "defaults to inputTokens + outputTokens. KV slots B = floor(kvCapacityTokens / liveContextTokens).",
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


class RouterSpec(ApiModel):
    """The OpenAI-compatible router in front of the pool."""

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


class SpecModel(ApiModel):
    """spec of a CoServePool: the model, engines, workload and policies of one serving pool."""

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
