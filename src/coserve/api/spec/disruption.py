"""PodDisruptionBudgets that keep each role above its minimum through voluntary evictions.

``DisruptionSpec`` is ``spec.disruption``; ``coserve.operator.resources`` renders one budget per role from it.
"""

from __future__ import annotations

import re
from typing import Annotated, Self

from pydantic import BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator

from coserve.api._base import ApiModel
from coserve.api.spec._rules import _cel, _one_of


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
