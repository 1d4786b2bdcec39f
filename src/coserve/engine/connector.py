"""CoServeConnector: coserve's vLLM KV connector; for now it carries the layer safepoints.

vLLM calls a KV connector's worker-side ``wait_for_layer_load`` before every
attention layer, in eager and in torch.compile mode (plain forward hooks do not
fire under compilation). coserve uses that call as the safepoint: one
shared-memory read per layer, and ``StepPreempted`` when the step must be
abandoned. The scheduler-side half numbers the steps so that a stale abort
flag can never stop a later step.

Enable it with
``--kv-transfer-config '{"kv_connector": "CoServeConnector",
"kv_connector_module_path": "coserve.engine.connector", "kv_role": "kv_both"}'``
(the operator renders it). On GPUs it asks vLLM for piecewise CUDA graphs so
that the per-layer callback runs (see ``requires_piecewise_for_cudagraph``).
Order 4 adds host KV offload and the prefill-to-decode handoff here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from coserve.engine.safepoint import SafepointBoard, board_name
from coserve.engine.tp_sync import agree_across_tp

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["CoServeConnector", "CoServeConnectorMetadata", "StepPreempted"]

logger = logging.getLogger("coserve.engine.connector")


class StepPreempted(RuntimeError):
    """Raised at a layer boundary to abandon the running step; caught by the coserve worker."""

    def __init__(self, step_id: int, layer_name: str) -> None:
        super().__init__(f"step {step_id} preempted before {layer_name}")
        self.step_id = step_id
        self.layer_name = layer_name


@dataclass
class CoServeConnectorMetadata(KVConnectorMetadata):
    """Sent to the workers with every step: the step's number and the board to check."""

    step_id: int
    board: str
    safepoints: bool


class CoServeConnector(KVConnectorBase_V1):
    """Scheduler side numbers steps; worker side checks the safepoint before every layer."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        extra: dict[str, Any] = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        safepoints = extra.get("safepoints", True)
        if not isinstance(safepoints, bool):
            raise ValueError(f"kv_connector_extra_config.safepoints: must be true or false, got {safepoints!r}")
        self.safepoints = safepoints
        self.board_name = board_name(str(self._kv_transfer_config.engine_id))
        self._next_step_id = 0
        self._board: SafepointBoard | None = None
        self._step_id = -1

    # ==============================
    # Scheduler-side methods
    # ==============================

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Called by vLLM's scheduler once per step; gives the step its number."""
        self._next_step_id += 1
        return CoServeConnectorMetadata(self._next_step_id, self.board_name, self.safepoints)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Full CUDA graphs replay kernels without Python, so no safepoint would run: ask for piecewise."""
        return bool(extra_config.get("safepoints", True))

    # ==============================
    # Worker-side methods
    # ==============================

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Called by the model runner before each forward: remember which step is running."""
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, CoServeConnectorMetadata):
            self._step_id = connector_metadata.step_id
            if self._board is None and connector_metadata.safepoints:
                self._board = SafepointBoard.attach(connector_metadata.board)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        """The safepoint, called by vLLM before every attention layer of every step."""
        self._safepoint(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Called after each attention layer: a second safepoint, so the wait is at most half a layer
        (attention or MLP) instead of a whole one. The layer's KV is complete by then."""
        self._safepoint(layer_name)

    def _safepoint(self, layer_name: str) -> None:
        board = self._board
        if board is None:
            return
        if agree_across_tp(board.abort_requested(self._step_id)):
            raise StepPreempted(self._step_id, layer_name)

    def wait_for_save(self) -> None:
        return None

    @property
    def board(self) -> SafepointBoard | None:
        return self._board
