"""Values spelled as Kubernetes' core/v1 API spells them, which several parts of the spec share.

Quantities and resource requirements, tolerations, and the name and label patterns the API server
enforces (DNS labels and subdomains, environment variable names, label keys and values). The engine,
router, model source and pod option models build on them; ``coserve.operator.resources`` copies
``ResourceRequirements`` into the pods it renders.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated

from pydantic import BeforeValidator, Field, WithJsonSchema

from coserve.api._base import ApiModel

# Kubernetes resource.Quantity, as apimachinery parses it ("500m", "16Gi", "1e3").
# Negative amounts are legal Quantities but never legal resources, so the sign is "+" or none.
QUANTITY_PATTERN = (
    r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"

_QUANTITY_RE = re.compile(QUANTITY_PATTERN)

ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
CONFIG_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
_LABEL_NAME_RE = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN_RE = re.compile(DNS_SUBDOMAIN_PATTERN)
MAX_LABEL_KEY_LENGTH = 317  # a 253-character DNS prefix, "/", a 63-character name

LabelValue = Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]


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
# Bounded so that the API server's cost estimate of the rule that walks the keys stays small.
ResourceList = Annotated[dict[ResourceName, Quantity], Field(max_length=32, json_schema_extra=_RESOURCE_NAME_RULE)]


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


def _label_key_problem(key: str) -> str | None:
    """Why ``key`` is not a Kubernetes label or annotation key (an optional DNS prefix and "/", then a name)."""
    prefix, _, name = key.rpartition("/")
    if len(key) > MAX_LABEL_KEY_LENGTH:
        return f"keys are at most {MAX_LABEL_KEY_LENGTH} characters"
    if "/" in key and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN_RE.match(prefix)):
        return "a key's prefix must be a lowercase DNS subdomain (example.com/name)"
    if len(name) > 63 or not _LABEL_NAME_RE.match(name):
        return "a key's name is 1 to 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
    return None
