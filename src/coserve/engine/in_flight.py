"""One step in flight: what coserve's engine parts require of vLLM's configuration, checked at start-up.

coserve's scheduler and connector follow each step from dispatch to result before the next is
planned: the safepoint board holds the running step, an abandoned step is rolled back from the
computed-token counts it left, and the host pool commits a step's copies when its output returns.
vLLM keeps more than one step in flight in two cases, and each breaks that:

- **async scheduling**, which vLLM 0.32 turns on by default on CUDA (``VllmConfig`` resolves
  ``async_scheduling=None`` to ``True``; the CPU platform forces it off, so CPU tests never see it).
  The engine core then dispatches step N+1 before N's output returns: clearing N on the board
  erases N+1's post, N+1's prefill chunk runs on KV an abandoned N never wrote, and a rollback
  counts N+1's tokens as N's.
- **pipeline parallelism**, which keeps one step per stage in flight.

The operator renders ``--no-async-scheduling`` and no pipeline parallelism; an engine started some
other way fails here with what to change, instead of running with preemption silently wrong.

``require_supported_engine`` adds what else an abandoned step cannot survive:

- **vLLM's V2 model runner**, which vLLM 0.32 picks on CUDA whenever Triton is installed (the CUDA
  image has it; this machine's Triton has no CPU backend, so CPU tests never see V2). V2 calls the KV
  connector with no ``try/finally``: a step abandoned at a safepoint skips ``start_load_kv``,
  ``wait_for_save``, its transfer results and the metadata's clear, which strands NIXL receives and
  leaks a prefiller's sent blocks. coserve supports the V1 runner, whose connector calls run in a
  ``finally``; the operator renders ``VLLM_USE_V2_MODEL_RUNNER=0`` for every engine.
- **speculative decoding**: both runners draft inside ``sample_tokens`` with the connector's metadata
  still bound, so a draft layer reaches a safepoint outside the worker's ``execute_model``, and the
  engine would die. The operator refuses ``--speculative-config`` in extraArgs.
- **data parallelism**: each DP rank is an engine core of its own, but the request validator in the API
  server raises aborts on one safepoint board. Run more replicas instead (the operator refuses
  ``--data-parallel-size`` > 1 in extraArgs).

Who calls them: ``TDGScheduler.__init__`` and ``CoServeConnector.__init__`` (scheduler side), and the
safepoint workers' ``__init__`` (``coserve.engine.worker``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from coserve.api.spec.reserved import V2_RUNNER_ENV, V2_RUNNER_OFF

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["ASYNC_OFF_FLAG", "require_one_step_in_flight", "require_supported_engine"]

ASYNC_OFF_FLAG = "--no-async-scheduling"


def require_one_step_in_flight(vllm_config: VllmConfig, who: str) -> None:
    """Raise ``ValueError`` naming the flag to change when ``vllm_config`` keeps several steps in flight."""
    pipeline = vllm_config.parallel_config.pipeline_parallel_size
    if pipeline > 1:
        raise ValueError(
            f"--pipeline-parallel-size: {who} supports tensor parallelism only (got {pipeline} stages, which keep "
            f"{pipeline} steps in flight); use --tensor-parallel-size"
        )
    if vllm_config.scheduler_config.async_scheduling:
        raise ValueError(
            f"--async-scheduling: {who} needs one step in flight at a time (its safepoints, rollback and KV copies "
            f"follow each step to its end), but async scheduling is on (vLLM's default on CUDA); start vLLM with "
            f"{ASYNC_OFF_FLAG}, as the operator renders it"
        )
    if vllm_config.max_concurrent_batches > 1:  # any other way this vLLM may overlap steps
        raise ValueError(
            f"{who} needs one step in flight at a time, but this engine keeps {vllm_config.max_concurrent_batches}; "
            f"start vLLM with {ASYNC_OFF_FLAG} and no pipeline parallelism"
        )


def require_supported_engine(vllm_config: VllmConfig, who: str) -> None:
    """``require_one_step_in_flight``, and raise ``ValueError`` naming what to change for the V2 model runner,
    speculative decoding or data parallelism (see the module docstring)."""
    require_one_step_in_flight(vllm_config, who)
    if vllm_config.use_v2_model_runner:
        raise ValueError(
            f"{V2_RUNNER_ENV}: {who} supports vLLM's V1 model runner only (an abandoned step must still finish the "
            f"KV connector's calls, which V2 makes outside any try/finally), but this engine resolved the V2 runner "
            f"(vLLM's default on CUDA when Triton is installed); start vLLM with {V2_RUNNER_ENV}={V2_RUNNER_OFF}, as "
            f"the operator renders it"
        )
    if vllm_config.speculative_config is not None:
        raise ValueError(
            f"--speculative-config: {who} does not support speculative decoding (the draft model runs inside the "
            f"sampling step with the KV connector bound, where a layer safepoint would stop the engine); remove it"
        )
    data_parallel = vllm_config.parallel_config.data_parallel_size
    if data_parallel > 1:
        raise ValueError(
            f"--data-parallel-size: {who} runs one engine core per server (the request validator raises aborts on "
            f"one safepoint board), but this engine has {data_parallel} data-parallel ranks; run more replicas instead"
        )
