"""A step abandoned at a safepoint saves nothing, and its reloads complete, in vLLM's own call order.

vLLM's model runner wraps every forward in ``KVConnectorModelRunnerMixin._get_kv_connector_output``:
``bind_connector_metadata`` before, and in a ``finally`` ``start_load_kv``, ``wait_for_save``, the
transfer results, the load errors and the stats. So when a safepoint raises ``StepPreempted`` mid-forward,
``wait_for_save`` still runs, with the step's blocks partly computed. These tests run that real context
manager around a forward of coserve's real worker-side connector, on real CPU KV tensors, with a real
safepoint board; the forward itself is the one thing written here (each layer: vLLM's two per-layer
connector calls around writing the step's KV), since the path under test is the connector's.

Stood in for, because they cannot exist here: vLLM's tensor-parallel state (a single-process worker is
rank 0; ``get_tensor_model_parallel_rank`` is patched to say so), and, for the CUDA path, the CUDA
streams (``InlineStreams`` runs the copier's CUDA schedule on CPU tensors, as tests/engine/test_kv_copies.py
does).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import set_forward_context
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

from coserve.engine.connector import CoServeConnector, CoServeConnectorMetadata, StepPreempted
from coserve.engine.kv_copies import InlineStreams
from coserve.engine.offload import BlockCopy, StepPlan, handoff_file
from coserve.engine.safepoint import SafepointBoard

BLOCK = 16
BLOCKS = 12
LAYERS = 6
HEAD = 8
SAVED_BLOCK, SAVED_SLOT, HANDOFF = 5, 0, "ab" * 16
LOADED_BLOCK, LOADED_SLOT = 7, 1
ABORT_LAYER = 2  # the urgent request arrives while the forward is at this layer


@pytest.fixture
def connector(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[CoServeConnector, VllmConfig, SafepointBoard]]:
    """A prefiller's worker-side connector with a host pool and the shm handoff; the board its scheduler made."""
    import vllm.distributed.parallel_state as parallel_state

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=HEAD, dtype=torch.float32)
    layer_bytes = spec.page_size_bytes
    transfer = KVTransferConfig(
        kv_connector="CoServeConnector",
        kv_connector_module_path="coserve.engine.connector",
        kv_role="kv_producer",
        engine_id=f"abandon{tmp_path.name[-12:]}",
        kv_connector_extra_config={
            "host_memory_bytes": 4 * LAYERS * layer_bytes,
            "handoff_backend": "shm",
            "handoff_path": str(tmp_path / "handoff"),
        },
    )
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(tiny_model), dtype="float32", skip_tokenizer_init=True),
        cache_config=CacheConfig(block_size=BLOCK),
        kv_transfer_config=transfer,
    )
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    kv_cache_config = KVCacheConfig(
        num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)]
    )
    worker = CoServeConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    generator = torch.Generator().manual_seed(3)
    caches = {name: torch.randn(BLOCKS, 2, BLOCK, 1, HEAD, generator=generator) for name in layers}
    assert worker.kv_worker is not None
    if request.param == "cuda":
        worker.kv_worker.register(caches, BLOCKS, streams=InlineStreams())
    else:
        worker.register_kv_caches(caches)
    board = SafepointBoard.create(worker.board_name)
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", worker)
    try:
        yield worker, vllm_config, board
    finally:
        worker.shutdown()
        board.close()


def run_step(
    worker: CoServeConnector, vllm_config: VllmConfig, board: SafepointBoard, step_id: int, plan: StepPlan,
    abort_at: int | None,
) -> None:  # fmt: skip
    """One forward inside vLLM's own connector context manager: each layer's two connector calls around
    writing the step's KV into the saved block; the abort is raised when the forward reaches ``abort_at``."""
    output = SchedulerOutput.make_empty()
    output.kv_connector_metadata = CoServeConnectorMetadata(step_id, worker.board_name, True, plan)
    caches = worker.kv_worker._caches if worker.kv_worker is not None else []
    with ExitStack() as stack:
        stack.enter_context(set_forward_context(None, vllm_config))
        stack.enter_context(KVConnectorModelRunnerMixin._get_kv_connector_output(output))
        for layer, name in enumerate(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)):
            if layer == abort_at:
                board.request_abort(step_id)
            worker.wait_for_layer_load(name)
            caches[layer][SAVED_BLOCK].fill_(float(step_id))  # attention writes the step's KV
            worker.save_kv_layer(name, caches[layer], None)


def host_slot(worker: CoServeConnector, slot: int) -> torch.Tensor:
    assert worker.kv_worker is not None and worker.kv_worker._host is not None
    return worker.kv_worker._host[:, slot].clone()


def device_block(worker: CoServeConnector, block: int) -> torch.Tensor:
    assert worker.kv_worker is not None
    return torch.stack([cache[block] for cache in worker.kv_worker._caches])


@pytest.mark.parametrize("connector", ["cpu", "cuda"], indirect=True, ids=["cpu copies", "cuda copier (inline)"])
def test_an_abandoned_step_copies_nothing_out_and_writes_no_handoff_file(
    connector: tuple[CoServeConnector, VllmConfig, SafepointBoard],
) -> None:
    worker, vllm_config, board = connector
    pool_before = host_slot(worker, SAVED_SLOT)
    plan = StepPlan(saves=[BlockCopy(SAVED_BLOCK, SAVED_SLOT, HANDOFF)])
    with pytest.raises(StepPreempted):
        run_step(worker, vllm_config, board, 1, plan, abort_at=ABORT_LAYER)
    assert worker.kv_worker is not None
    worker.kv_worker.close()  # every copy and file write the step started has finished
    path = handoff_file(worker.kv_settings.handoff_path, HANDOFF, 0)
    assert not path.exists(), "an abandoned step wrote its partly computed block for a decoder to load"
    assert torch.equal(host_slot(worker, SAVED_SLOT), pool_before), "an abandoned step copied a block out"


@pytest.mark.parametrize("connector", ["cpu", "cuda"], indirect=True, ids=["cpu copies", "cuda copier (inline)"])
def test_a_completed_step_copies_out_and_hands_off(
    connector: tuple[CoServeConnector, VllmConfig, SafepointBoard],
) -> None:
    """The same step run to its end saves its block (so the test above fails for the abandonment alone)."""
    worker, vllm_config, board = connector
    run_step(worker, vllm_config, board, 1, StepPlan(saves=[BlockCopy(SAVED_BLOCK, SAVED_SLOT, HANDOFF)]), None)
    assert worker.kv_worker is not None
    worker.kv_worker.close()
    assert handoff_file(worker.kv_settings.handoff_path, HANDOFF, 0).exists()
    assert torch.equal(host_slot(worker, SAVED_SLOT), device_block(worker, SAVED_BLOCK))


@pytest.mark.parametrize("connector", ["cpu", "cuda"], indirect=True, ids=["cpu copies", "cuda copier (inline)"])
def test_an_abandoned_steps_reload_completes_in_every_layer(
    connector: tuple[CoServeConnector, VllmConfig, SafepointBoard],
) -> None:
    """The scheduler keeps a reloaded prefix counted as computed after a rollback, so every layer must hold it
    before the next step runs; on a CPU reloads go a layer ahead of the forward, and the abort stops that."""
    worker, vllm_config, board = connector
    assert worker.kv_worker is not None and worker.kv_worker._host is not None
    worker.kv_worker._host[:, LOADED_SLOT].normal_()
    expected = host_slot(worker, LOADED_SLOT)
    with pytest.raises(StepPreempted):
        run_step(worker, vllm_config, board, 1, StepPlan(loads=[BlockCopy(LOADED_BLOCK, LOADED_SLOT)]), ABORT_LAYER)
    run_step(worker, vllm_config, board, 2, StepPlan(), None)  # the next step's forward: after everything in flight
    assert torch.equal(device_block(worker, LOADED_BLOCK), expected)


@pytest.mark.parametrize("connector", ["cpu"], indirect=True, ids=["cpu copies"])
def test_a_reload_completes_when_vllm_never_calls_wait_for_save(
    connector: tuple[CoServeConnector, VllmConfig, SafepointBoard],
) -> None:
    """A runner that defers or skips the connector's ``wait_for_save`` (vLLM's V1 runner with spec decode defers
    it past drafting; V2 has no ``finally``): the next step's ``bind_connector_metadata`` finishes the last one,
    so an abandoned step's reload still reaches every layer before the next forward reads it. Driven without
    vLLM's context manager, since its ``finally`` is exactly what this runner lacks."""
    worker, _, board = connector
    assert worker.kv_worker is not None and worker.kv_worker._host is not None
    worker.kv_worker._host[:, LOADED_SLOT].normal_()
    expected = host_slot(worker, LOADED_SLOT)
    plan = StepPlan(loads=[BlockCopy(LOADED_BLOCK, LOADED_SLOT)])
    worker.bind_connector_metadata(CoServeConnectorMetadata(1, worker.board_name, True, plan))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    with pytest.raises(StepPreempted):
        for layer, name in enumerate(names):
            if layer == ABORT_LAYER:
                board.request_abort(1)
            worker.wait_for_layer_load(name)
            worker.save_kv_layer(name, torch.empty(0), None)
    worker.clear_connector_metadata()  # no wait_for_save
    worker.bind_connector_metadata(CoServeConnectorMetadata(2, worker.board_name, True, StepPlan()))
    assert torch.equal(device_block(worker, LOADED_BLOCK), expected)
