"""Names the operator gives its own things in engine and router pods.

The env, volume and pod option models refuse user settings that use them (each with a CEL rule and
its pydantic twin); ``coserve.operator.resources`` gives them to what it renders.
"""

from __future__ import annotations

OPERATOR_VOLUMES = ("config", "dshm", "router-token", "tmp", "batches", "model-cache")
OPERATOR_ENV_PREFIX = "COSERVE_"
OPERATOR_ENV_NAMES = ("VLLM_PLUGINS", "POD_NAMESPACE", "HF_HUB_CACHE", "HF_HUB_OFFLINE")
HF_TOKEN_ENV = "HF_TOKEN"  # noqa: S105 - a variable's name, not a secret
OPERATOR_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/component",
    "app.kubernetes.io/managed-by",
    "coserve.dev/role",
)
OPERATOR_MOUNT_PATHS = ("/etc/coserve", "/etc/coserve-token", "/dev/shm")  # noqa: S108 - paths in the pod
ROUTER_MOUNT_PATHS = ("/tmp", "/var/lib/coserve/batches")  # noqa: S108 - paths in the pod
