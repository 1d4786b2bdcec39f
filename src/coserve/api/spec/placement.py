"""Where pods run: topology spread constraints and the label selectors they count pods by.

Used by ``coserve.api.spec.pod_options``; ``coserve.operator.resources`` puts a role's constraints, or its
default spread over nodes and zones, into the pods.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Self

from pydantic import ConfigDict, Field, model_validator

from coserve.api._base import ApiModel
from coserve.api.spec._rules import _cel, _fail
from coserve.api.spec.core import LABEL_VALUE_PATTERN, MAX_LABEL_KEY_LENGTH


class SelectorOperator(StrEnum):
    IN = "In"
    NOT_IN = "NotIn"
    EXISTS = "Exists"
    DOES_NOT_EXIST = "DoesNotExist"


class LabelSelectorRequirement(ApiModel):
    """One requirement on a label, as in metav1.LabelSelector."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            (
                "(self.operator in ['In', 'NotIn']) == (has(self.values) && size(self.values) > 0)",
                "values are required with In and NotIn, and not allowed with Exists and DoesNotExist",
            )
        )
    )

    key: str = Field(min_length=1, max_length=MAX_LABEL_KEY_LENGTH, description="key is the label key.")
    operator: SelectorOperator = Field(description="operator is In, NotIn, Exists or DoesNotExist.")
    values: list[Annotated[str, Field(max_length=63)]] | None = Field(
        default=None, max_length=64, description="values of the label, for In and NotIn."
    )

    @model_validator(mode="after")
    def _values_match_operator(self) -> Self:
        if (self.operator in (SelectorOperator.IN, SelectorOperator.NOT_IN)) != bool(self.values):
            raise ValueError("values are required with In and NotIn, and not allowed with Exists and DoesNotExist")
        return self


class LabelSelector(ApiModel):
    """Pods selected by their labels, as in metav1.LabelSelector."""

    match_labels: dict[str, Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]] | None = Field(
        default=None, max_length=64, description="matchLabels selects pods carrying every one of these labels."
    )
    match_expressions: list[LabelSelectorRequirement] | None = Field(
        default=None, max_length=16, description="matchExpressions are further requirements, all of which must hold."
    )


class WhenUnsatisfiable(StrEnum):
    DO_NOT_SCHEDULE = "DoNotSchedule"
    SCHEDULE_ANYWAY = "ScheduleAnyway"


class TopologySpreadConstraint(ApiModel):
    """How evenly a role's pods spread over a topology (nodes, zones), as in a Pod spec."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            ("!has(self.minDomains) || self.whenUnsatisfiable == 'DoNotSchedule'",
             "minDomains needs whenUnsatisfiable DoNotSchedule", ".minDomains")
        )
    )  # fmt: skip

    topology_key: str = Field(
        min_length=1,
        max_length=MAX_LABEL_KEY_LENGTH,
        description="topologyKey is the node label whose values are the domains, for example "
        "kubernetes.io/hostname or topology.kubernetes.io/zone.",
    )
    max_skew: int = Field(
        default=1,
        ge=1,
        le=10_000,
        description="maxSkew is the most the pod counts of two domains may differ by.",
    )
    when_unsatisfiable: WhenUnsatisfiable = Field(
        default=WhenUnsatisfiable.SCHEDULE_ANYWAY,
        description="whenUnsatisfiable is ScheduleAnyway (prefer spreading) or DoNotSchedule (leave the pod pending).",
    )
    label_selector: LabelSelector | None = Field(
        default=None, description="labelSelector picks the pods counted per domain; default the role's own pods."
    )
    match_label_keys: list[Annotated[str, Field(min_length=1, max_length=MAX_LABEL_KEY_LENGTH)]] | None = Field(
        default=None,
        max_length=16,
        description="matchLabelKeys also count only pods sharing these labels' values with the new pod; "
        "pod-template-hash counts only the current rollout's pods.",
    )
    min_domains: int | None = Field(
        default=None,
        ge=1,
        le=10_000,
        description="minDomains is the fewest eligible domains; only with whenUnsatisfiable DoNotSchedule.",
    )

    @model_validator(mode="after")
    def _min_domains_needs_do_not_schedule(self) -> Self:
        if self.min_domains is not None and self.when_unsatisfiable != WhenUnsatisfiable.DO_NOT_SCHEDULE:
            _fail([(("minDomains",), "minDomains needs whenUnsatisfiable DoNotSchedule", self.min_domains)])
        return self
