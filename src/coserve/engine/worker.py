"""Worker classes that survive an abandoned step.

An exception escaping vLLM's forward kills the engine (``EngineDeadError``).
These workers catch ``StepPreempted`` from the layer safepoint and return an
output with no tokens for the step; rank 0 marks the step abandoned on the
safepoint board, and the coserve scheduler rolls its bookkeeping back.

The KV connectors' protocol goes on through an abandoned step. vLLM's V1 model
runner calls the connector in a ``finally`` (``KVConnectorModelRunnerMixin``):
the step's loads are started, ``wait_for_save`` runs, and the transfer results
are taken, which pops what NIXL finished since the last step (a decoder's
completed receive, a prefiller's blocks the decoder has read). Those results
travel in the abandoned step's output, as in any other step's, so the scheduler
still promotes the received request and frees the sent blocks. The worker keeps
them by wrapping the model runner's ``maybe_get_kv_connector_output`` once. A
step that carries another connector's transfer work is never abandoned (the
scheduler turns its safepoints off: ``coserve.engine.connector.sibling_transfer_work``).

Who calls what: vLLM builds the worker from ``--worker-cls``
(``coserve.engine.worker.SafepointCPUWorker`` on CPUs,
``coserve.engine.worker.SafepointGPUWorker`` on CUDA; the operator renders it).
At start-up it refuses what it cannot survive (``coserve.engine.in_flight``):
vLLM's V2 model runner, speculative decoding, data parallelism.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker

from coserve.engine.connector import StepPreempted, find_connector
from coserve.engine.in_flight import require_supported_engine

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

__all__ = ["SafepointCPUWorker", "SafepointGPUWorker", "abandoned_output", "keep_connector_output"]

logger = logging.getLogger("coserve.engine.worker")

_KEPT = "_coserve_keeps_connector_output"


def abandoned_output(
    scheduler_output: SchedulerOutput, kv_connector_output: KVConnectorOutput | None = None
) -> ModelRunnerOutput:
    """Every scheduled request, no sampled token: the step produced nothing; the connectors' results it took
    (``kv_connector_output``, from vLLM's ``finally``) go with it."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: index for index, req_id in enumerate(req_ids)},
        sampled_token_ids=[[] for _ in req_ids],
        kv_connector_output=kv_connector_output,
    )


def keep_connector_output(runner: Any, keep: Callable[[KVConnectorOutput | None], None]) -> None:
    """Wrap ``runner.maybe_get_kv_connector_output`` (vLLM's V1 runner opens it around every forward) so that
    ``keep`` receives the step's ``KVConnectorOutput``; vLLM fills it in its ``finally``, so it is complete
    once the forward has ended, by an exception or not. Idempotent: a runner is wrapped once."""
    if getattr(runner, _KEPT, False):
        return
    opened: Callable[..., AbstractContextManager[KVConnectorOutput | None]] = runner.maybe_get_kv_connector_output

    @contextmanager
    def keeping(scheduler_output: SchedulerOutput, *args: Any, **kwargs: Any) -> Iterator[KVConnectorOutput | None]:
        with opened(scheduler_output, *args, **kwargs) as output:
            keep(output)
            yield output

    runner.maybe_get_kv_connector_output = keeping
    setattr(runner, _KEPT, True)


class _SafepointMixin:
    """``execute_model`` that turns a preempted step into an empty output that keeps the connectors' results."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        require_supported_engine(self.vllm_config, "coserve's safepoint worker")  # type: ignore[attr-defined]
        self._step_connector_output: KVConnectorOutput | None = None

    def execute_model(self, scheduler_output: SchedulerOutput) -> Any:
        runner = getattr(self, "model_runner", None)
        if runner is not None:
            keep_connector_output(runner, self._keep)
        self._step_connector_output = None
        try:
            return super().execute_model(scheduler_output)  # type: ignore[misc]
        except StepPreempted as stop:
            self._recover(stop)
            kept, self._step_connector_output = self._step_connector_output, None
            return abandoned_output(scheduler_output, kept)

    def _keep(self, output: KVConnectorOutput | None) -> None:
        self._step_connector_output = output

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
