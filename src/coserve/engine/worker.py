"""Worker classes that survive an abandoned step.

An exception escaping vLLM's forward kills the engine (``EngineDeadError``).
These workers catch ``StepPreempted`` from the layer safepoint and return an
output with no tokens for the step; rank 0 marks the step abandoned on the
safepoint board, and the coserve scheduler rolls its bookkeeping back.

Select with ``--worker-cls coserve.engine.worker.SafepointCPUWorker`` on CPUs
or ``coserve.engine.worker.SafepointGPUWorker`` on CUDA (the operator renders
it).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker

from coserve.engine.connector import StepPreempted, find_connector

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

__all__ = ["SafepointCPUWorker", "SafepointGPUWorker", "abandoned_output"]

logger = logging.getLogger("coserve.engine.worker")


def abandoned_output(scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
    """Every scheduled request, no sampled token: the step produced nothing."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: index for index, req_id in enumerate(req_ids)},
        sampled_token_ids=[[] for _ in req_ids],
    )


class _SafepointMixin:
    """``execute_model`` that turns a preempted step into an empty output."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> Any:
        try:
            return super().execute_model(scheduler_output)  # type: ignore[misc]
        except StepPreempted as stop:
            self._recover(stop)
            return abandoned_output(scheduler_output)

    def _recover(self, stop: StepPreempted) -> None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        runner = getattr(self, "model_runner", None)
        if runner is not None and hasattr(runner, "execute_model_state"):
            runner.execute_model_state = None
        if has_kv_transfer_group():
            connector = get_kv_transfer_group()
            connector.clear_connector_metadata()
            board = getattr(find_connector(connector), "board", None)  # alone, or inside MultiConnector
            rank = getattr(self, "rank", 0)
            if board is not None and rank == 0:
                board.mark_abandoned(stop.step_id)
        logger.debug("abandoned step %d at %s", stop.step_id, stop.layer_name)


class SafepointCPUWorker(_SafepointMixin, CPUWorker):
    """vLLM's CPU worker with layer-safepoint preemption."""


class SafepointGPUWorker(_SafepointMixin, Worker):
    """vLLM's CUDA worker with layer-safepoint preemption."""
