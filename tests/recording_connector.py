"""A KV connector that moves no KV but keeps NIXL's protocol, for driving vLLM's real classes around it.

Why a stand-in: vLLM's real NixlConnector runs here between two engines (tests/engine/test_topology_parity.py),
but when its transfers finish is up to UCX, so a test cannot make one finish exactly in the step it abandons.
This connector takes the part NIXL plays in vLLM's protocol, deterministically:

- scheduler side, as NIXL on a decoder: a request whose ``kv_transfer_params`` say ``do_remote_prefill`` has
  its full prompt blocks loaded asynchronously (vLLM parks it in ``WAITING_FOR_REMOTE_KVS``), and the step's
  metadata lists it in ``reqs_to_recv``; as NIXL on a prefiller: a finished ``do_remote_decode`` request's
  blocks are held (``request_finished`` returns True) until a worker reports them sent. With ``store: true``
  in its settings it also lists every scheduled request in ``reqs_to_store``, as vLLM's OffloadingConnector
  and LMCache store each step's blocks;
- worker side: ``get_finished`` pops what the test marked finished (``finish_recving``, ``finish_sending``),
  destructively, as NIXL's does; each ``wait_for_save`` is recorded with the step's stores.

Loaded by vLLM's own factory from ``kv_connector_module_path: recording_connector`` (tests/ is on the path).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


@dataclass
class RecordingMetadata(KVConnectorMetadata):
    reqs_to_recv: dict[str, list[int]] = field(default_factory=dict)
    reqs_to_store: list[str] = field(default_factory=list)


class RecordingConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.store = bool(extra.get("store", False))
        self.block_size = vllm_config.cache_config.block_size
        self._recv: dict[str, list[int]] = {}
        self._received: set[str] = set()
        # worker side
        self.pending_recving: set[str] = set()
        self.pending_sending: set[str] = set()
        self.stored_steps: list[list[str]] = []  # the stores bound at each wait_for_save, in order

    # scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill") or request.request_id in self._received:
            return 0, False
        full = (request.num_prompt_tokens - 1) // self.block_size * self.block_size
        return max(full - num_computed_tokens, 0), True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self._recv[request.request_id] = list(blocks.get_block_ids()[0])
            self._received.add(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        stores = list(scheduler_output.num_scheduled_tokens) if self.store else []
        metadata = RecordingMetadata(reqs_to_recv=self._recv, reqs_to_store=stores)
        self._recv = {}
        return metadata

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params or {}
        return bool(params.get("do_remote_decode")), None

    # worker side
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, RecordingMetadata)
        self.stored_steps.append(list(metadata.reqs_to_store))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, self.pending_sending = self.pending_sending, set()
        recving, self.pending_recving = self.pending_recving, set()
        return sending or None, recving or None
