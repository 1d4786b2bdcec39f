"""Names the operator gives its own things in engine and router pods.

The env, volume and pod option models refuse user settings that use them (each with a CEL rule and
its pydantic twin); ``coserve.operator.resources`` gives them to what it renders. The engine models
refuse extraArgs that set a vLLM flag of ``OPERATOR_ENGINE_FLAGS`` (a pydantic check only, see
``coserve.api.spec.engine``); ``coserve.operator.resources.engine_args`` renders exactly those flags.
"""

from __future__ import annotations

OPERATOR_VOLUMES = ("config", "dshm", "router-token", "tmp", "batches", "model-cache", "picker-tls")
OPERATOR_ENV_PREFIX = "COSERVE_"
# vLLM 0.32 picks its V2 model runner on CUDA whenever Triton is installed; coserve's preemption needs V1
# (coserve.engine.in_flight says why). coserve.operator.resources renders V2_RUNNER_ENV=V2_RUNNER_OFF for every
# engine and the env models refuse a user's entry of that name; an engine started without it refuses to start.
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
V2_RUNNER_OFF = "0"
OPERATOR_ENV_NAMES = ("VLLM_PLUGINS", V2_RUNNER_ENV, "POD_NAMESPACE", "HF_HUB_CACHE", "HF_HUB_OFFLINE")
HF_TOKEN_ENV = "HF_TOKEN"  # noqa: S105 - a variable's name, not a secret
OPERATOR_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/component",
    "app.kubernetes.io/managed-by",
    "coserve.dev/role",
)
OPERATOR_MOUNT_PATHS = ("/etc/coserve", "/etc/coserve-token", "/etc/coserve-picker-tls", "/dev/shm")  # noqa: S108
ROUTER_MOUNT_PATHS = ("/tmp", "/var/lib/coserve/batches")  # noqa: S108 - paths in the pod

# The vLLM server flags coserve.operator.resources.engine_args renders for every engine, in its order: flag -> what
# a user sets instead. extraArgs come after them, and vLLM keeps a repeated flag's last value, so extraArgs that set
# one would silently replace coserve's: EngineSpec and RoleOverrides refuse them. One list for both, so what is
# rendered and what is refused cannot disagree.
OPERATOR_ENGINE_FLAGS: dict[str, str] = {
    "--model": "set spec.model.name",
    "--served-model-name": "set spec.model.servedModelName",
    "--port": "probes, Services and the router use the port the operator sets",
    "--tensor-parallel-size": "set spec.engine.tensorParallelSize",
    "--scheduler-cls": "every engine runs coserve's scheduler",
    "--no-async-scheduling": "coserve's scheduler and layer safepoints run one step at a time",
    "--worker-cls": "the worker follows the role's nvidia.com/gpu resources",
    "--middleware": "every engine runs coserve's request validator",
    "--kv-transfer-config": "set spec.kvOffload; the KV connectors follow it and the roles' GPUs",
}
# vLLM's other option strings for flags of OPERATOR_ENGINE_FLAGS (option -> the flag): a short option, and the
# other half of a boolean flag. Refused as the flag is.
OPERATOR_ENGINE_FLAG_ALIASES: dict[str, str] = {
    "-tp": "--tensor-parallel-size",
    "--async-scheduling": "--no-async-scheduling",
}
