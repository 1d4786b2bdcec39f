"""Shared pydantic configuration for every CoServePool API type.

Field names are snake_case in Python and camelCase on the wire (the Kubernetes
convention), unknown fields are rejected (a typo must not vanish silently), types are
strict as the Kubernetes API server's are (no "12" for 12), and NaN/infinity
never validate as numbers.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

__all__ = ["ApiModel"]


class ApiModel(BaseModel):
    """Base class of the CoServePool spec and status types."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        allow_inf_nan=False,
        validate_default=True,
        # Strict like the API server: "12" is not an integer, true is not a number.
        # Input arrives as JSON (see coserve.api.parse), where enums are plain strings.
        strict=True,
    )

    def to_wire(self) -> dict[str, object]:
        """Serialise with camelCase keys, dropping unset optional fields (``None``)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")
