"""Tenant priority classes with their latency objectives, and offline co-serving, which runs as one of them.

``spec.priorityClasses`` and ``spec.offline``; ``coserve.operator.resources`` hands both to the engines and
the router through their config, and ``coserve.provisioning.validation`` checks that the offline class is one
of the pool's.
"""

from __future__ import annotations

from pydantic import Field

from coserve.api._base import ApiModel
from coserve.api.spec.core import DNS_LABEL_PATTERN


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
