"""Environment variables of the engine and router containers, as in a Pod spec: ``env`` and ``envFrom``.

Used by ``coserve.api.spec.pod_options``; ``SecretKeyRef`` also names the model's Hugging Face token
(``coserve.api.spec.model_source``). Names the operator sets itself are refused.
"""

from __future__ import annotations

from typing import Self

from pydantic import ConfigDict, Field, field_validator, model_validator

from coserve.api._base import ApiModel
from coserve.api.spec._rules import _cel, _cel_list, _one_of
from coserve.api.spec.core import (
    CONFIG_KEY_PATTERN,
    DNS_LABEL_PATTERN,
    DNS_SUBDOMAIN_PATTERN,
    ENV_NAME_PATTERN,
    Quantity,
)
from coserve.api.spec.reserved import OPERATOR_ENV_NAMES, OPERATOR_ENV_PREFIX


def _env_name_reserved(name: str) -> bool:
    return name.startswith(OPERATOR_ENV_PREFIX) or name in OPERATOR_ENV_NAMES


class SecretKeyRef(ApiModel):
    """One key of a Secret in the pool's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="name of the Secret.")
    key: str = Field(
        default="token",
        min_length=1,
        max_length=253,
        pattern=CONFIG_KEY_PATTERN,
        description="key of the Secret's entry.",
    )


class KeySelector(ApiModel):
    """One key of a ConfigMap or Secret in the pool's namespace, as an environment variable's source."""

    name: str = Field(
        min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="name of the ConfigMap or Secret."
    )
    key: str = Field(min_length=1, max_length=253, pattern=CONFIG_KEY_PATTERN, description="key of the entry to read.")
    optional: bool | None = Field(
        default=None, description="optional lets the pod start when the object or the key is missing."
    )


class ObjectFieldSelector(ApiModel):
    """A field of the pod, as an environment variable's source."""

    field_path: str = Field(
        min_length=1,
        max_length=256,
        description="fieldPath is the pod field to read, for example metadata.name, spec.nodeName or status.podIP.",
    )
    api_version: str | None = Field(
        default=None, min_length=1, max_length=64, description="apiVersion fieldPath is written in; default v1."
    )


class ResourceFieldSelector(ApiModel):
    """A resource limit or request of a container, as an environment variable's source."""

    resource: str = Field(
        min_length=1,
        max_length=253,
        description="resource to read: limits.cpu, limits.memory, requests.cpu, requests.memory, ...",
    )
    container_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=63,
        pattern=DNS_LABEL_PATTERN,
        description="containerName is the container whose resource is read; default this one.",
    )
    divisor: Quantity | None = Field(default=None, description="divisor scales the value; default 1.")


_ENV_SOURCES = ("secret_key_ref", "config_map_key_ref", "field_ref", "resource_field_ref")


class EnvVarSource(ApiModel):
    """Where an environment variable's value comes from: exactly one source."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            (
                "[has(self.secretKeyRef), has(self.configMapKeyRef), has(self.fieldRef), "
                "has(self.resourceFieldRef)].exists_one(x, x)",
                "valueFrom sets exactly one of secretKeyRef, configMapKeyRef, fieldRef and resourceFieldRef",
            )
        )
    )

    secret_key_ref: KeySelector | None = Field(default=None, description="secretKeyRef reads a key of a Secret.")
    config_map_key_ref: KeySelector | None = Field(
        default=None, description="configMapKeyRef reads a key of a ConfigMap."
    )
    field_ref: ObjectFieldSelector | None = Field(default=None, description="fieldRef reads a field of the pod.")
    resource_field_ref: ResourceFieldSelector | None = Field(
        default=None, description="resourceFieldRef reads a resource limit or request of a container."
    )

    @model_validator(mode="after")
    def _exactly_one_source(self) -> Self:
        _one_of(self, _ENV_SOURCES, "valueFrom sets exactly one of secretKeyRef, configMapKeyRef, fieldRef and "
                "resourceFieldRef")  # fmt: skip
        return self


_ENV_NAME_RULE = (
    f"!self.startsWith('{OPERATOR_ENV_PREFIX}') && !(self in {_cel_list(OPERATOR_ENV_NAMES)})",
    f"is set by the operator: names starting with {OPERATOR_ENV_PREFIX}, and "
    f"{', '.join(OPERATOR_ENV_NAMES)}, are refused",
)


class EnvVar(ApiModel):
    """An environment variable of a container, as in a Pod spec."""

    model_config = ConfigDict(
        json_schema_extra=_cel(("!(has(self.value) && has(self.valueFrom))", "value and valueFrom are exclusive"))
    )

    name: str = Field(
        min_length=1,
        max_length=256,
        pattern=ENV_NAME_PATTERN,
        json_schema_extra=_cel(_ENV_NAME_RULE),
        description=f"name of the variable; names starting with {OPERATOR_ENV_PREFIX}, and "
        f"{', '.join(OPERATOR_ENV_NAMES)}, are the operator's (HF_HUB_CACHE and HF_HUB_OFFLINE follow "
        "model.cache and model.local).",
    )
    value: str | None = Field(
        default=None, max_length=131_072, description="value of the variable; $(NAME) expands an earlier variable."
    )
    value_from: EnvVarSource | None = Field(
        default=None, description="valueFrom reads the value from a Secret, a ConfigMap or the pod itself."
    )

    @field_validator("name")
    @classmethod
    def _not_the_operators(cls, name: str) -> str:
        if _env_name_reserved(name):
            raise ValueError(_ENV_NAME_RULE[1])
        return name

    @model_validator(mode="after")
    def _value_or_value_from(self) -> Self:
        if self.value is not None and self.value_from is not None:
            raise ValueError("value and valueFrom are exclusive")
        return self


class ObjectRef(ApiModel):
    """A ConfigMap or Secret in the pool's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="name of the object.")
    optional: bool | None = Field(default=None, description="optional lets the pod start when the object is missing.")


class EnvFromSource(ApiModel):
    """Every entry of one ConfigMap or Secret as environment variables."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            ("has(self.configMapRef) != has(self.secretRef)", "envFrom sets exactly one of configMapRef and secretRef")
        )
    )

    prefix: str | None = Field(
        default=None, max_length=253, pattern=ENV_NAME_PATTERN, description="prefix is put before every name."
    )
    config_map_ref: ObjectRef | None = Field(default=None, description="configMapRef names the ConfigMap.")
    secret_ref: ObjectRef | None = Field(default=None, description="secretRef names the Secret.")

    @model_validator(mode="after")
    def _exactly_one_source(self) -> Self:
        _one_of(self, ("config_map_ref", "secret_ref"), "envFrom sets exactly one of configMapRef and secretRef")
        return self
