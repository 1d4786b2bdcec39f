"""Resolve vLLM engine arguments as vLLM 0.32 would on an H100, on this machine with no GPU.

Run as a process (``python tests/cuda_config_probe.py OUT < launches.json``): it swaps vLLM's current
platform for CUDA, which must not leak into the test session's other tests. stdin is a JSON list of
``{"args": [...], "env": {...}}``, each a rendered engine container's arguments (the model already
substituted) and environment; the file OUT gets a JSON list (vLLM logs to stdout) of what
``EngineArgs`` → ``VllmConfig`` resolved for each, read by tests/engine/test_cuda_config.py.

What is substituted, because it cannot exist on a machine without a GPU, and nothing else:

- **the platform**: ``vllm.platforms.cuda.NonNvmlCudaPlatform`` itself, answering the five questions
  NVML or the driver would (an H100: compute capability 9.0, 80 GiB, 8 devices, all connected);
- **Triton's presence**: the CUDA image has Triton with its CUDA backend, so vLLM's ``HAS_TRITON`` is true
  there; this machine's Triton has no CPU backend and vLLM reports it absent, which would silently resolve
  the V1 model runner where CUDA resolves V2. The probe sets ``vllm.config.vllm.HAS_TRITON`` true;
- **``vllm._C_stable_libtorch``**, a compiled module the CUDA platform imports and never calls while
  resolving a configuration: an empty module;
- **module imports**: ``VllmConfig`` imports the model's class (to inspect it) and each KV connector's
  class (to ask ``requires_piecewise_for_cudagraph``). On CUDA those imports load compiled attention
  kernels that this machine lacks, so they are imported first under the CPU platform. What
  ``VllmConfig`` reads from them is platform-independent: the model's capabilities (a Llama's are the
  same everywhere) and each connector's class method, which reads only its settings.

Everything else (the parser, ``EngineArgs``, ``VllmConfig.__post_init__``, the platform's own
``check_and_update_config``, the executor's choice) is vLLM's own code, run as vLLM runs it.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path
from typing import Any


def _cpu_imports(launches: list[dict[str, Any]]) -> None:
    """Import every model and connector class the launches name, under the CPU platform (see above)."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.engine.arg_utils import EngineArgs

    for launch in launches:
        args = launch["args"]
        EngineArgs(model=args[args.index("--model") + 1], load_format="dummy").create_model_config()
        if "--kv-transfer-config" not in args:
            continue
        transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
        for connector in [transfer, *transfer.get("kv_connector_extra_config", {}).get("connectors", [])]:
            KVConnectorFactory.get_connector_class(KVTransferConfig(**connector))


def _use_cuda() -> None:
    """Make vLLM's current platform an H100's (NonNvmlCudaPlatform: the driver's answers, not NVML's)."""
    sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    import vllm.platforms as platforms
    from vllm.platforms.cuda import NonNvmlCudaPlatform
    from vllm.platforms.interface import DeviceCapability

    class H100(NonNvmlCudaPlatform):
        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(9, 0)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA H100 80GB HBM3"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return 80 * 2**30

        @classmethod
        def device_count(cls) -> int:
            return 8

        @classmethod
        def is_fully_connected(cls, physical_device_ids: list[int]) -> bool:
            return True

    platforms._current_platform = H100()  # type: ignore[attr-defined]
    import vllm.config.vllm as vllm_config_module

    vllm_config_module.HAS_TRITON = True  # as on the CUDA image (the module docstring says why)


def resolve(launch: dict[str, Any]) -> dict[str, Any]:
    """One launch's ``VllmConfig``, as vLLM's API server would build it from these arguments on CUDA."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    saved = dict(os.environ)
    os.environ.update(launch.get("env", {}))
    try:
        namespace = make_arg_parser(FlexibleArgumentParser()).parse_args([*launch["args"], "--load-format", "dummy"])
        config = AsyncEngineArgs.from_cli_args(namespace).create_engine_config()
        import vllm.envs as envs

        transfer = config.kv_transfer_config
        return {
            "platform": type(current_platform).__mro__[1].__name__,
            "async_scheduling": config.scheduler_config.async_scheduling,
            "max_concurrent_batches": config.max_concurrent_batches,
            "cudagraph_mode": config.compilation_config.cudagraph_mode.name,
            "scheduler_cls": str(config.scheduler_config.scheduler_cls),
            "worker_cls": str(config.parallel_config.worker_cls),
            "kv_transfer_config": None if transfer is None else {
                "kv_connector": transfer.kv_connector,
                "kv_role": transfer.kv_role,
                "kv_connector_extra_config": transfer.kv_connector_extra_config,
            },
            "use_v2_model_runner": config.use_v2_model_runner,
            "speculative_config": None if config.speculative_config is None else str(config.speculative_config),
            "compilation_mode": config.compilation_config.mode.name,
            "data_parallel_size": config.parallel_config.data_parallel_size,
            "nixl_side_channel_host": envs.VLLM_NIXL_SIDE_CHANNEL_HOST,
            "nixl_side_channel_port": envs.VLLM_NIXL_SIDE_CHANNEL_PORT,
        }  # fmt: skip
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main() -> None:
    launches = json.load(sys.stdin)
    _cpu_imports(launches)
    _use_cuda()
    Path(sys.argv[1]).write_text(json.dumps([resolve(launch) for launch in launches]))


if __name__ == "__main__":
    main()
