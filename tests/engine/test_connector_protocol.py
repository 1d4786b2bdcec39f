"""An abandoned step keeps vLLM's KV-connector protocol: transfers it reports are applied, and no other connector
stores or moves KV in a step coserve may abandon.

Driven with vLLM's real classes: coserve's ``TDGScheduler`` (vLLM's ``Scheduler`` underneath) with vLLM's
``MultiConnector`` holding coserve's connector first and a second connector after it, as the operator renders
GPU engines; on the worker side the same MultiConnector, coserve's safepoint worker mixin, and vLLM's V1 runner
connector calls (``KVConnectorModelRunnerMixin.maybe_get_kv_connector_output``, the context manager
``gpu_model_runner.execute_model`` opens around the forward). Stood in for, and why:

- the second connector is ``tests/recording_connector.py``, which plays NIXL's part in the protocol (async
  receives, held sent blocks, destructive ``get_finished``) deterministically; its docstring says why the
  real NixlConnector cannot be made to finish a transfer in a chosen step;
- the forward is each layer's two connector calls (where vLLM's attention makes them) and nothing else; the
  worker's own ``execute_model`` (vLLM's ``Worker`` needs a device) calls the runner directly;
- vLLM's V2 runner is not driven: coserve refuses it at start-up (the last test).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
from vllm.forward_context import set_forward_context
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

from coserve.engine.connector import find_connector, find_metadata, sibling_transfer_work
from coserve.engine.in_flight import require_supported_engine
from coserve.engine.safepoint import SafepointBoard, board_name
from coserve.engine.scheduler import TDGScheduler
from coserve.engine.worker import _SafepointMixin
from recording_connector import RecordingConnector, RecordingMetadata

BLOCK = 16
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
ABORT_LAYER = 2


class V1Runner(KVConnectorModelRunnerMixin):
    """vLLM's V1 model runner's connector calls, in its order, around a forward of per-layer connector calls."""

    def __init__(
        self, vllm_config: VllmConfig, board: SafepointBoard, abort: bool, requests: dict[str, Request]
    ) -> None:
        self.vllm_config = vllm_config
        self.board = board
        self.abort = abort  # an urgent arrival during every step (honoured where the step checks safepoints)
        self.requests = requests  # the scheduler's, to sample a token where a step completes the prompt

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if not scheduler_output.total_num_scheduled_tokens:
            return self.kv_connector_no_forward(scheduler_output, self.vllm_config)
        metadata = find_metadata(scheduler_output.kv_connector_metadata)
        assert metadata is not None
        with (
            set_forward_context(None, self.vllm_config),
            self.maybe_get_kv_connector_output(scheduler_output) as kv_output,
        ):
            connector = kv_transfer_state.get_kv_transfer_group()
            for index, name in enumerate(LAYERS):
                if self.abort and index == ABORT_LAYER:
                    self.board.request_abort(metadata.step_id)
                connector.wait_for_layer_load(name)
                connector.save_kv_layer(name, torch.empty(0), None)
        req_ids = list(scheduler_output.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[7] if self._complete(r) else [] for r in req_ids],
            kv_connector_output=kv_output,
        )

    def _complete(self, req_id: str) -> bool:
        """Whether the step computes the request's last token (the scheduler has already counted the step)."""
        request = self.requests.get(req_id)
        return request is not None and request.num_computed_tokens >= request.num_tokens


class _Base:
    def __init__(self, vllm_config: VllmConfig, runner: V1Runner) -> None:
        self.vllm_config = vllm_config
        self.model_runner = runner
        self.rank = 0

    def execute_model(self, scheduler_output: SchedulerOutput) -> Any:
        return self.model_runner.execute_model(scheduler_output)


class SafepointTestWorker(_SafepointMixin, _Base):
    """coserve's safepoint worker over a runner that needs no device."""


@dataclass
class Engine:
    scheduler: TDGScheduler
    worker: SafepointTestWorker
    recording: RecordingConnector  # the worker side's second connector
    board: SafepointBoard
    abandoned: list[int]

    def step(self) -> SchedulerOutput:
        output = self.scheduler.schedule()
        before = self.board.num_preemptions
        result = self.worker.execute_model(output)
        if self.board.num_preemptions > before:
            metadata = find_metadata(output.kv_connector_metadata)
            assert metadata is not None
            self.abandoned.append(metadata.step_id)
        self.scheduler.update_from_output(output, result)
        return output


init_none_hash(sha256)
HASHER = get_request_block_hasher(BLOCK, sha256)  # as the engine core hashes each request's blocks


def _request(request_id: str, num_tokens: int, max_tokens: int, **transfer: Any) -> Request:
    params = SamplingParams(max_tokens=max_tokens, extra_args={"kv_transfer_params": transfer} if transfer else None)
    first = 1 + 1000 * (sum(map(ord, request_id)) % 7)
    tokens = list(range(first, first + num_tokens))
    return Request(request_id, tokens, params, None, arrival_time=time.time(), block_hasher=HASHER)


@pytest.fixture
def make_engine(tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    made: list[Engine] = []

    def make(role: str, *, store: bool = False, abort: bool = True) -> Engine:
        connectors = [
            {"kv_connector": "CoServeConnector", "kv_connector_module_path": "coserve.engine.connector",
             "kv_role": role},
            {"kv_connector": "RecordingConnector", "kv_connector_module_path": "recording_connector",
             "kv_role": role, "kv_connector_extra_config": {"store": store}},
        ]  # fmt: skip
        transfer = KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role=role,
            engine_id=f"proto{tmp_path.name[-10:]}{len(made)}",
            kv_connector_extra_config={"connectors": connectors},
        )
        vllm_config = VllmConfig(
            model_config=ModelConfig(model=str(tiny_model), dtype="float32", skip_tokenizer_init=True),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True, num_gpu_blocks_override=128),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=64, max_num_seqs=8, max_model_len=2048, is_encoder_decoder=False
            ),
            kv_transfer_config=transfer,
        )
        vllm_config.cache_config.num_gpu_blocks = 128  # what the engine core sets once it has profiled memory
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
        kv_cache_config = KVCacheConfig(
            num_blocks=128, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)]
        )
        scheduler = TDGScheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=BLOCK,
        )
        worker_side = MultiConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", worker_side)
        assert scheduler.board is not None
        worker = SafepointTestWorker(vllm_config, V1Runner(vllm_config, scheduler.board, abort, scheduler.requests))
        (recording,) = [c for c in worker_side._connectors if isinstance(c, RecordingConnector)]
        engine = Engine(scheduler, worker, recording, scheduler.board, [])
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.scheduler.shutdown()


def test_a_receive_finished_in_an_abandoned_step_promotes_the_decoders_request(make_engine: Any) -> None:
    """NIXL pops a finished receive in the step's ``finally``; the step is abandoned; the request must still
    leave ``WAITING_FOR_REMOTE_KVS`` and run."""
    engine = make_engine("kv_consumer")
    engine.scheduler.add_request(_request("turn", 96, 4, do_remote_prefill=True))
    engine.scheduler.add_request(_request("offline", 600, 4))  # keeps the decoder's steps busy (and abandonable)
    first = engine.step()
    turn = engine.scheduler.requests["turn"]
    assert turn.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert "turn" not in first.num_scheduled_tokens
    # the receive finishes on the worker while the next step runs: that step's finally pops it
    engine.recording.pending_recving.add("turn")
    before = len(engine.abandoned)
    engine.step()
    assert len(engine.abandoned) == before + 1, "the step the receive finished in was not abandoned"
    engine.worker.model_runner.abort = False
    deadline = time.monotonic() + 2  # past the scheduler's short hold for the urgent arrival (ARRIVAL_WAIT_S)
    while "turn" not in engine.step().num_scheduled_tokens:
        if time.monotonic() > deadline:
            pytest.fail(f"the received request never ran: {turn.status}")
    assert turn.num_computed_tokens >= 80  # its received prefix counts as computed


def test_blocks_sent_in_an_abandoned_step_are_freed(make_engine: Any) -> None:
    """A prefiller holds a finished ``do_remote_decode`` request's blocks until NIXL reports them read; the
    report comes in a step that is abandoned, and the blocks must still be freed."""
    engine = make_engine("kv_producer", abort=False)
    engine.scheduler.add_request(_request("turn", 40, 1, do_remote_decode=True))
    for _ in range(5):
        engine.step()
    assert "turn" in engine.scheduler.requests, "the prefiller freed the sent request's blocks before the read"
    engine.worker.model_runner.abort = True
    engine.scheduler.add_request(_request("offline", 600, 4))
    engine.recording.pending_sending.add("turn")  # the decoder reads the blocks during the offline step
    before = len(engine.abandoned)
    engine.step()
    assert len(engine.abandoned) == before + 1, "the step the read was reported in was not abandoned"
    assert "turn" not in engine.scheduler.requests, "the sent blocks are still held after the decoder read them"


def test_no_sibling_connector_stores_blocks_of_an_abandoned_step(make_engine: Any) -> None:
    """A sibling that stores each step's blocks (vLLM's OffloadingConnector, LMCache) does so in
    ``wait_for_save``, which vLLM's V1 runner calls even for an abandoned step: such steps must run to their end."""
    engine = make_engine("kv_both", store=True)
    engine.scheduler.add_request(_request("offline", 400, 2))
    for _ in range(8):
        engine.step()
    stored = [stores for stores in engine.recording.stored_steps if stores]
    assert stored, "the sibling stored nothing: the test has no step to judge"
    assert engine.abandoned == [], f"steps {engine.abandoned} were abandoned while a sibling stored their blocks"
    assert engine.scheduler.num_steps_transferring >= len(stored)


def test_steps_without_sibling_work_are_still_abandoned(make_engine: Any) -> None:
    """The same engine without stores: the urgent arrival abandons the steps (so the test above fails only for
    the sibling's work)."""
    engine = make_engine("kv_both", store=False)
    engine.scheduler.add_request(_request("offline", 400, 2))
    for _ in range(4):
        engine.step()
    assert engine.abandoned, "no step was abandoned"


def test_what_counts_as_another_connectors_transfer_work() -> None:
    """NIXL's receives, sends and saves count; its bookkeeping (which requests a batch holds, heartbeats),
    which its worker takes in ``start_load_kv`` (vLLM calls it in the V1 runner's ``finally``), does not."""
    bookkeeping = NixlConnectorMetadata()
    bookkeeping.reqs_in_batch = {"a"}
    bookkeeping.reqs_not_processed = {"b"}
    assert sibling_transfer_work(bookkeeping) == []
    for field in ("reqs_to_recv", "reqs_to_save", "reqs_to_send"):
        metadata = NixlConnectorMetadata()
        setattr(metadata, field, {"a": 1.0})
        assert sibling_transfer_work(metadata) == ["NixlConnectorMetadata"], field
    assert sibling_transfer_work(RecordingMetadata(reqs_to_store=["a"])) == ["RecordingMetadata"]
    assert sibling_transfer_work(RecordingMetadata()) == []


def test_the_v2_runner_speculative_decoding_and_data_parallelism_are_refused(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's V2 runner calls connectors outside any ``finally``; coserve refuses it, naming the variable."""
    config = VllmConfig(model_config=ModelConfig(model=str(tiny_model), dtype="float32", skip_tokenizer_init=True))
    require_supported_engine(config, "test")  # V1 here (this machine's Triton has no CPU backend)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        require_supported_engine(config, "test")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    monkeypatch.setattr(config, "speculative_config", object())
    with pytest.raises(ValueError, match="--speculative-config"):
        require_supported_engine(config, "test")
    monkeypatch.setattr(config, "speculative_config", None)
    monkeypatch.setattr(config.parallel_config, "data_parallel_size", 2)
    with pytest.raises(ValueError, match="--data-parallel-size"):
        require_supported_engine(config, "test")


def test_the_workers_coserve_connector_is_found_in_the_multiconnector(make_engine: Any) -> None:
    engine = make_engine("kv_both")
    assert find_connector(kv_transfer_state.get_kv_transfer_group()) is not None
    assert engine.scheduler.board is not None


def test_data_parallel_ranks_of_one_engine_get_boards_of_their_own() -> None:
    """vLLM appends ``_dp{rank}`` to each DP rank's engine id; a name cut to 20 letters dropped it."""
    engine_id = "9f1c2e4a-6b7d-4c1e-9a2b-3c4d5e6f7a8b"
    names = {board_name(f"{engine_id}_dp{rank}") for rank in range(4)} | {board_name(engine_id)}
    assert len(names) == 5
    assert all(len(name) <= 30 for name in names)
    assert board_name("coserve123") == "coserve-sp-coserve123"
    for name in names:  # a board's own suffix names it again (how the GPU check finds an engine's board)
        assert board_name(name.removeprefix("coserve-sp-")) == name
