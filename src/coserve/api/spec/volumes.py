"""Pod volumes and the mounts that name them, as in a Pod spec, and the rule that every mount names a volume.

Used by ``coserve.api.spec.pod_options`` (the lists), ``engine`` and ``router`` (the mount rule, whose
volumes differ per pod) and ``model_source`` (the model cache's mount path).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Self

from pydantic import ConfigDict, Field, field_validator, model_validator

from coserve.api._base import ApiModel
from coserve.api.spec._rules import _cel, _cel_list, _fail, _has, _preserve_unknown_fields
from coserve.api.spec.core import DNS_LABEL_PATTERN
from coserve.api.spec.reserved import OPERATOR_MOUNT_PATHS, OPERATOR_VOLUMES

# Every volume source a Pod's volume may name (core/v1 Volume, Kubernetes 1.35).
VOLUME_SOURCES = frozenset(
    {
        "awsElasticBlockStore", "azureDisk", "azureFile", "cephfs", "cinder", "configMap", "csi", "downwardAPI",
        "emptyDir", "ephemeral", "fc", "flexVolume", "flocker", "gcePersistentDisk", "gitRepo", "glusterfs",
        "hostPath", "image", "iscsi", "nfs", "persistentVolumeClaim", "photonPersistentDisk", "portworxVolume",
        "projected", "quobyte", "rbd", "scaleIO", "secret", "storageos", "vsphereVolume",
    }
)  # fmt: skip


_VOLUME_NAME_RULE = (
    f"!(self in {_cel_list(OPERATOR_VOLUMES)})",
    f"is a volume of the operator's: {', '.join(OPERATOR_VOLUMES)} are refused",
)


class Volume(ApiModel):
    """A pod volume, as in a Pod spec: its name and one volume source."""

    # NOTE: Kubernetes has some thirty volume sources; typing them here would copy core/v1 for little gain,
    # so the source is kept as written (the API server checks it with the pod template) and coserve checks
    # only that there is exactly one, of a known kind.
    model_config = ConfigDict(extra="allow", json_schema_extra=_preserve_unknown_fields)

    name: str = Field(
        min_length=1,
        max_length=63,
        pattern=DNS_LABEL_PATTERN,
        json_schema_extra=_cel(_VOLUME_NAME_RULE),
        description="name of the volume, what volumeMounts refer to; besides it the volume holds exactly one "
        "volume source as in a Pod (configMap, secret, persistentVolumeClaim, emptyDir, csi, nfs, ephemeral, ...). "
        f"{', '.join(OPERATOR_VOLUMES)} are the operator's.",
    )

    @field_validator("name")
    @classmethod
    def _not_the_operators(cls, name: str) -> str:
        if name in OPERATOR_VOLUMES:
            raise ValueError(_VOLUME_NAME_RULE[1])
        return name

    @model_validator(mode="after")
    def _exactly_one_source(self) -> Self:
        sources = dict(self.model_extra or {})
        unknown = sorted(key for key in sources if key not in VOLUME_SOURCES)
        if unknown:
            _fail([((key,), "unknown volume source (a Pod volume's source, such as persistentVolumeClaim)", key)
                   for key in unknown])  # fmt: skip
        if len(sources) != 1:
            raise ValueError(f"a volume holds exactly one volume source besides its name (got {len(sources)})")
        ((kind, source),) = sources.items()
        if not isinstance(source, dict):
            _fail([((kind,), "a volume source is an object", source)])
        return self


_MOUNT_PATH_RULE = (
    f"!(self in {_cel_list(OPERATOR_MOUNT_PATHS)})",
    f"is a mount of the operator's: {', '.join(OPERATOR_MOUNT_PATHS)} are refused",
)


class VolumeMount(ApiModel):
    """Where a container mounts a volume, as in a Pod spec."""

    name: str = Field(
        min_length=1,
        max_length=63,
        pattern=DNS_LABEL_PATTERN,
        description="name of the volume to mount: one of the same pod options' volumes (a role's mounts may also "
        "name engine.volumes).",
    )
    mount_path: str = Field(
        min_length=1,
        max_length=4096,
        pattern=r"^/",
        json_schema_extra=_cel(_MOUNT_PATH_RULE),
        description="mountPath is the absolute path in the container; "
        f"{', '.join(OPERATOR_MOUNT_PATHS)} and model.cache.mountPath are the operator's.",
    )
    read_only: bool | None = Field(default=None, description="readOnly mounts the volume read-only.")
    sub_path: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description="subPath mounts this path inside the volume instead of its root.",
    )

    @field_validator("mount_path")
    @classmethod
    def _not_the_operators(cls, mount_path: str) -> str:
        if mount_path in OPERATOR_MOUNT_PATHS:
            raise ValueError(_MOUNT_PATH_RULE[1])
        return mount_path


def _unnamed_volumes(
    mounts: Sequence[VolumeMount] | None, *volume_lists: Sequence[Volume] | None
) -> list[tuple[tuple[str | int, ...], str, object]]:
    """Problems of ``mounts`` that name no volume of ``volume_lists`` (locations relative to the mounts)."""
    names = {volume.name for volumes in volume_lists for volume in volumes or ()}
    return [
        ((index, "name"), "names no volume of these pod options", mount.name)
        for index, mount in enumerate(mounts or ())
        if mount.name not in names
    ]


def _mount_rule(mounts: str, volumes: Sequence[str], field_path: str) -> tuple[str, str, str]:
    """CEL: every mount of ``mounts`` names a volume of one of the ``volumes`` lists."""
    names = " || ".join(f"({_has(v)} && {v}.exists(v, v.name == m.name))" for v in volumes)
    return (
        f"!{_has(mounts)} || {mounts}.all(m, {names})",
        "volumeMounts name volumes of the same pod options (a role's may also name engine.volumes)",
        field_path,
    )
