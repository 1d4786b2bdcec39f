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
Who calls it: ``TDGScheduler.__init__`` and ``CoServeConnector.__init__`` (scheduler side).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["ASYNC_OFF_FLAG", "require_one_step_in_flight"]

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
