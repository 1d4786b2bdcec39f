"""The CoServePool resource as a whole: apiVersion, kind, metadata, spec, status."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from coserve.api._base import ApiModel
from coserve.api.spec import SpecModel
from coserve.api.status import StatusModel

__all__ = ["API_VERSION", "GROUP", "KIND", "PLURAL", "SHORT_NAME", "VERSION", "CoServePool", "ObjectMeta"]

GROUP = "coserve.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "CoServePool"
PLURAL = "coservepools"
SINGULAR = "coservepool"
SHORT_NAME = "csp"

# Child names are "<pool>-prefiller" and friends: Service names are DNS-1035
# labels of at most 63 characters, so the pool's name leaves room for the suffix.
MAX_POOL_NAME_LENGTH = 50
POOL_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


class ObjectMeta(ApiModel):
    """The part of metav1.ObjectMeta coserve reads; the API server's other fields pass through."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=MAX_POOL_NAME_LENGTH, pattern=POOL_NAME_PATTERN)
    namespace: str | None = Field(default=None, min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None


class CoServePool(ApiModel):
    """A pool of prefillers, decoders and a router serving one model (kind CoServePool)."""

    api_version: Literal["coserve.dev/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["CoServePool"]
    metadata: ObjectMeta
    spec: SpecModel
    status: StatusModel | None = None
