"""The model a pool serves and where its weights come from: a download, a shared cache volume, or the image.

``ModelSpec`` is ``spec.model``; ``coserve.operator.resources`` renders its cache claim, the
model-download init container and the engines' offline settings from it.
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import ConfigDict, Field, field_validator, model_validator

from coserve.api._base import ApiModel
from coserve.api.spec._rules import _cel, _fail, _one_of
from coserve.api.spec.core import DNS_SUBDOMAIN_PATTERN, Quantity
from coserve.api.spec.env import SecretKeyRef
from coserve.api.spec.reserved import OPERATOR_MOUNT_PATHS
from coserve.api.spec.volumes import _MOUNT_PATH_RULE

AccessMode = Literal["ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"]
DEFAULT_MODEL_MOUNT_PATH = "/models"


def _default_access_modes() -> list[AccessMode]:
    return ["ReadWriteMany"]


class ModelCacheSpec(ApiModel):
    """A shared volume that holds the model's weights, downloaded once instead of by every engine at every start."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            ("has(self.claimName) != has(self.size)", "cache sets exactly one of claimName and size"),
            ("!has(self.storageClassName) || has(self.size)", "storageClassName goes with size", ".storageClassName"),
        )
    )

    claim_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="claimName is an existing PersistentVolumeClaim in the pool's namespace to keep the weights "
        "on; exactly one of claimName and size. Engines on several nodes need a ReadWriteMany claim.",
    )
    size: Quantity | None = Field(
        default=None,
        description="size makes the operator create a PersistentVolumeClaim named <pool>-model-cache of this "
        "size (for example 100Gi), deleted with the pool; exactly one of claimName and size.",
    )
    storage_class_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="storageClassName of the claim the operator creates (with size only); default the "
        "cluster's default class. A claim's class cannot change once it exists.",
    )
    access_modes: list[AccessMode] = Field(
        default_factory=_default_access_modes,
        min_length=1,
        max_length=4,
        description="accessModes of the claim the operator creates (with size only): ReadWriteMany lets engines "
        "on every node share it; ReadWriteOnce keeps a pool on one node.",
    )
    mount_path: str = Field(
        default=DEFAULT_MODEL_MOUNT_PATH,
        min_length=2,
        max_length=4096,
        pattern=r"^/",
        json_schema_extra=_cel(_MOUNT_PATH_RULE),
        description="mountPath is where engines mount the cache, read-only; the Hugging Face hub cache is its "
        "hub folder (HF_HUB_CACHE).",
    )

    @field_validator("mount_path")
    @classmethod
    def _not_the_operators(cls, mount_path: str) -> str:
        if mount_path in OPERATOR_MOUNT_PATHS:
            raise ValueError(_MOUNT_PATH_RULE[1])
        return mount_path

    @model_validator(mode="after")
    def _claim_or_size(self) -> Self:
        _one_of(self, ("claim_name", "size"), "cache sets exactly one of claimName and size")
        if self.storage_class_name is not None and self.size is None:
            _fail([(("storageClassName",), "storageClassName goes with size", self.storage_class_name)])
        return self


_CACHED_NAME_MESSAGE = (
    "with cache, name is a Hugging Face model id to download, not a path (weights on a volume are local)"
)


class ModelSpec(ApiModel):
    """The model every engine of the pool serves, and where its weights come from."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            ("!self.local || !has(self.cache)", "local excludes cache", ".cache"),
            ("!has(self.cache) || !self.name.startsWith('/')", _CACHED_NAME_MESSAGE, ".name"),
        )
    )

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
    hf_token_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description="hfTokenSecretRef names a Secret key in the pool's namespace holding a Hugging Face access "
        "token, for gated or private models; every engine container and the model download get it as HF_TOKEN.",
    )
    cache: ModelCacheSpec | None = Field(
        default=None,
        description="cache keeps the weights on a shared volume: an init container (model-download) of each "
        "engine pod fills it once per model while the other pods wait, then the engines mount it read-only "
        "and load offline (HF_HUB_OFFLINE=1). Unset: every engine downloads the weights at every start.",
    )
    local: bool = Field(
        default=False,
        description="local says the weights are already in the engine image or in engine.volumes (name is "
        "then their path, or a model id in the image's Hugging Face cache): nothing is downloaded and engines "
        "load offline (HF_HUB_OFFLINE=1). Excludes cache.",
    )
    download_timeout_s: int = Field(
        default=3600,
        ge=0,
        le=86_400,
        description="downloadTimeoutS is how long an engine may spend downloading the weights when it starts "
        "without cache or local: its startup probe allows this on top of the 10 minutes for loading them. With "
        "cache the download runs in an init container, outside any probe, and with local there is none, so "
        "the startup probe allows the 10 minutes alone.",
    )

    @model_validator(mode="after")
    def _local_excludes_cache(self) -> Self:
        if self.local and self.cache is not None:
            _fail([(("cache",), "local excludes cache", self.cache.to_wire())])
        if self.cache is not None and self.name.startswith("/"):
            _fail([(("name",), _CACHED_NAME_MESSAGE, self.name)])
        return self
