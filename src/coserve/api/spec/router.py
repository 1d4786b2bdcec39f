"""The OpenAI-compatible router in front of the pool: replicas, image, resources, batch storage and pod options.

``RouterSpec`` is ``spec.router``; ``coserve.operator.resources`` renders the router Deployment from it.
"""

from __future__ import annotations

from typing import Self

from pydantic import ConfigDict, Field, model_validator

from coserve.api.spec._rules import _cel, _cel_list, _fail
from coserve.api.spec.core import ResourceRequirements
from coserve.api.spec.pod_options import PodOptions
from coserve.api.spec.reserved import ROUTER_MOUNT_PATHS
from coserve.api.spec.volumes import _mount_rule, _unnamed_volumes

_ROUTER_MOUNT_RULE = (
    f"!has(self.volumeMounts) || self.volumeMounts.all(m, !(m.mountPath in {_cel_list(ROUTER_MOUNT_PATHS)}))",
    f"{' and '.join(ROUTER_MOUNT_PATHS)} are mounts of the router's own",
    ".volumeMounts",
)


class RouterSpec(PodOptions):
    """The OpenAI-compatible router in front of the pool."""

    model_config = ConfigDict(
        json_schema_extra=_cel(_mount_rule("self.volumeMounts", ["self.volumes"], ".volumeMounts"), _ROUTER_MOUNT_RULE)
    )

    replicas: int = Field(default=2, ge=1, le=100, description="replicas of the router Deployment.")
    image: str = Field(
        default="ghcr.io/coserve/coserve:0.1.0",
        min_length=1,
        max_length=512,
        description="image is the control-plane image that runs `coserve router`.",
    )
    resources: ResourceRequirements = Field(
        default_factory=lambda: ResourceRequirements(
            requests={"cpu": "500m", "memory": "256Mi"}, limits={"memory": "1Gi"}
        ),
        description="resources of the router container.",
    )
    batch_volume_claim: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="batchVolumeClaim names a PersistentVolumeClaim (ReadWriteMany when replicas > 1) that "
        "holds offline batches (/v1/files, /v1/batches), so accepted batches survive the router's pods. "
        "Unset: an emptyDir per pod, which survives container restarts but not the pod.",
    )
    kv_transfer_s_per_token: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="kvTransferSPerToken is what moving one prompt token's KV from a prefiller to a decoder costs, "
        "in seconds: the KV bytes per token over the link's bytes per second (128 KiB over 25 GB/s: 5.2e-6). "
        "The router adds it to a prefiller's predicted first token when it decides where turn 1 prefills. "
        "0: not counted.",
    )

    @model_validator(mode="after")
    def _mounts(self) -> Self:
        problems = [
            (("volumeMounts", *loc), reason, value)
            for loc, reason, value in _unnamed_volumes(self.volume_mounts, self.volumes)
        ]
        problems += [
            (("volumeMounts", index, "mountPath"), _ROUTER_MOUNT_RULE[1], mount.mount_path)
            for index, mount in enumerate(self.volume_mounts or ())
            if mount.mount_path in ROUTER_MOUNT_PATHS
        ]
        if problems:
            _fail(problems)
        return self
