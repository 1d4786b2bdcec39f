"""The host KV pool's GPU copy path (coserve.engine.kv_copies.DeviceKVCopier), on CPU tensors.

The data movement (runs of host slots, the gather and scatter along block dimension 0 or 1) runs here for
real with ``InlineStreams``. The stream ordering is checked with ``RecordingStreams``, a test double of the
CUDA stream and event operations (no GPU runs in CI): it logs every record and wait, with what the
tensors held at that moment, so a test can see that a copy waited for the compute stream before it
wrote, and that the compute stream waited for layer L's reload (and no later one) before layer L.
``benchmarks/gpu/torch_check.py --only offload`` runs the same code on CUDA streams.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from coserve.engine.kv_copies import DeviceKVCopier, InlineStreams, slot_runs
from coserve.engine.offload import BlockCopy, OffloadWorker, StepPlan, handoff_file
from coserve.kv.config import KVSettings

LAYERS = 3
BLOCKS = 10
BLOCK_SHAPE_DIM1 = (2, 10, 4, 2, 3)  # vLLM's CUDA flash-attention layout: (K/V, blocks, tokens, heads, head dim)
BLOCK_SHAPE_DIM0 = (10, 2, 4, 2, 3)  # FlashInfer's: (blocks, K/V, tokens, heads, head dim)


def caches(layout: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(layout, generator=generator) for _ in range(LAYERS)]


def block(cache: torch.Tensor, dim: int, index: int) -> torch.Tensor:
    return cache.select(dim, index)


# -- data movement ----------------------------------------------------------------------------------------


def test_slot_runs_group_consecutive_slots() -> None:
    assert slot_runs([3, 4, 5, 10, 11, 20]) == [(3, 3, 0), (10, 2, 3), (20, 1, 5)]
    assert slot_runs([]) == []
    assert slot_runs([7, 7]) == [(7, 1, 0), (7, 1, 1)]  # a repeated slot is its own copy


@pytest.mark.parametrize(("layout", "dim"), [(BLOCK_SHAPE_DIM1, 1), (BLOCK_SHAPE_DIM0, 0)])
def test_saves_then_loads_round_trip_through_runs_of_slots(layout: tuple[int, ...], dim: int) -> None:
    device = caches(layout)
    copier = DeviceKVCopier(device, dim, capacity=12)
    assert copier.host is not None and copier.host.shape == (LAYERS, 12, *block(device[0], dim, 0).shape)
    # device blocks in no order, host slots in two runs (3-5 and 10-11) given out of order
    saves = [(7, 5), (2, 3), (9, 10), (0, 4), (4, 11)]
    copier.begin(fence=False)
    batch = copier.issue_saves(saves)
    assert batch is not None
    batch.synchronize()
    for layer in range(LAYERS):
        for device_block, slot in saves:
            assert torch.equal(copier.host[layer, slot], block(device[layer], dim, device_block)), (layer, slot)
    assert copier.host[:, [0, 1, 2, 6, 7, 8, 9]].abs().sum() == 0  # nothing else was written

    saved = {slot: [block(c, dim, b).clone() for c in device] for b, slot in saves}
    for cache in device:
        cache.zero_()
    loads = [(1, 11), (8, 3), (3, 4), (5, 10)]  # into other device blocks, again two runs
    copier.begin(fence=False)
    copier.issue_loads(loads)
    for layer in range(LAYERS):
        copier.wait_layer(layer)
        for device_block, slot in loads:
            assert torch.equal(block(device[layer], dim, device_block), saved[slot][layer]), (layer, slot)
        untouched = [b for b in range(BLOCKS) if b not in {b for b, _ in loads}]
        assert all(block(device[layer], dim, b).abs().sum() == 0 for b in untouched)
    copier.issue_saves([])

    counted = copier.completed()
    layer_bytes = block(device[0], dim, 0).numel() * 4
    assert [(kind, num_bytes) for kind, num_bytes, _ in counted] == [
        ("bytes_offloaded", len(saves) * LAYERS * layer_bytes),
        ("bytes_reloaded", len(loads) * LAYERS * layer_bytes),
    ]
    assert all(seconds >= 0 for *_, seconds in counted)
    assert copier.completed() == []  # each batch counts once


def test_blocks_without_a_slot_and_staged_blocks_travel_too() -> None:
    device = caches(BLOCK_SHAPE_DIM1, seed=1)
    copier = DeviceKVCopier(device, 1, capacity=4)
    copier.begin(fence=False)
    batch = copier.issue_saves([(6, 2)], extra_blocks=[3, 9])  # two blocks for the handoff only
    assert batch is not None and batch.extra is not None
    assert batch.extra.shape == (LAYERS, 2, 2, 4, 2, 3)
    for layer in range(LAYERS):
        assert torch.equal(batch.extra[layer, 0], device[layer][:, 3])
        assert torch.equal(batch.extra[layer, 1], device[layer][:, 9])

    staged = batch.extra.clone()
    expected = [device[layer][:, 6].clone() for layer in range(LAYERS)]
    for cache in device:
        cache.zero_()
    copier.begin(fence=False)
    copier.issue_loads([(0, 2)], staged_blocks=[5, 1], staged=staged)
    for layer in range(LAYERS):
        assert torch.equal(device[layer][:, 0], expected[layer])
        assert torch.equal(device[layer][:, 5], staged[layer, 0])
        assert torch.equal(device[layer][:, 1], staged[layer, 1])


def test_finished_batches_let_their_staging_go_even_when_nobody_reads_the_counters() -> None:
    copier = DeviceKVCopier(caches(BLOCK_SHAPE_DIM1), 1, capacity=4)
    for _ in range(5):
        copier.begin(fence=False)
        copier.issue_loads([(1, 0)])
        copier.issue_saves([(2, 1)])
    assert len(copier._pending) <= 1  # the GPU check issues hundreds of steps without reading them
    assert len(copier.completed()) == 10


# -- ordering, with a recording double of the CUDA stream and event operations ------------------------------


@dataclass(frozen=True)
class Event:
    stream: str
    label: str
    number: int


@dataclass
class RecordingStreams:
    """A test double of ``CudaCopyStreams`` (no GPU in CI): copies run inline; every record and wait is logged
    as (operation, stream, event, ``probe()`` at that moment). The test adds ("forward", layer) entries."""

    probe: Callable[[], Any] = lambda: None
    log: list[tuple[str, str, Any, Any]] = field(default_factory=list)
    capture: bool = False
    _count: int = 0

    def _record(self, stream: str, label: str) -> Event:
        self._count += 1
        event = Event(stream, label, self._count)
        self.log.append(("record", stream, event, self.probe()))
        return event

    def record_compute(self, label: str) -> object:
        return self._record("compute", label)

    def record_copy(self, label: str, *, timing: bool = False) -> object:
        return self._record("copy", label)

    def copy_waits(self, event: object) -> None:
        self.log.append(("wait", "copy", event, self.probe()))

    def compute_waits(self, event: object) -> None:
        self.log.append(("wait", "compute", event, self.probe()))

    def on_copy(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def done(self, event: object) -> bool:
        return True

    def synchronize(self, event: object) -> None:
        self.log.append(("synchronize", "host", event, self.probe()))

    def elapsed_s(self, start: object, end: object) -> float:
        return 0.001

    def capturing(self) -> bool:
        return self.capture

    def entries(self, operation: str, stream: str) -> list[tuple[int, Event, Any]]:
        return [(i, e[2], e[3]) for i, e in enumerate(self.log) if e[0] == operation and e[1] == stream]

    def recorded(self, label: str) -> tuple[int, Event, Any]:
        (found,) = [entry for entry in self.entries("record", "copy") + self.entries("record", "compute")
                    if entry[1].label == label]  # fmt: skip
        return found


def test_loads_wait_for_the_compute_stream_and_each_layer_waits_for_its_own_load() -> None:
    device = caches(BLOCK_SHAPE_DIM1, seed=2)
    streams = RecordingStreams()
    copier = DeviceKVCopier(device, 1, capacity=4, streams=streams)
    assert copier.host is not None
    copier.host.normal_()
    # the probe: which layers' target block already holds the reloaded bytes
    streams.probe = lambda: tuple(torch.equal(device[layer][:, 7], copier.host[layer, 2]) for layer in range(LAYERS))

    copier.begin(fence=False)
    copier.issue_loads([(7, 2)])
    for layer in range(LAYERS):
        copier.wait_layer(layer)
        streams.log.append(("forward", "compute", layer, None))
    copier.issue_saves([])

    (begin_index, begin, nothing_loaded), *_ = streams.entries("record", "compute")
    assert begin.label == "begin" and nothing_loaded == (False,) * LAYERS
    (wait_index, waited, state), *_ = streams.entries("wait", "copy")
    assert waited == begin and state == (False,) * LAYERS  # the copy stream waits before any load writes
    first_write = min(i for i, entry in enumerate(streams.log) if entry[3] not in (None, (False,) * LAYERS))
    assert begin_index < wait_index < first_write

    compute_waits = streams.entries("wait", "compute")
    for layer in range(LAYERS):
        forward_index = streams.log.index(("forward", "compute", layer, None))
        _, load_event, loaded = streams.recorded(f"load {layer}")
        assert loaded[layer], "a layer's load event is recorded after its bytes are written"
        waited_before = [event for index, event, _ in compute_waits if index < forward_index]
        assert waited_before[-1] == load_event  # layer L waits for layer L's load ...
        later = {streams.recorded(f"load {other}")[1] for other in range(layer + 1, LAYERS)}
        assert not later & set(waited_before)  # ... and for no later layer's


def test_saves_wait_for_the_end_of_the_forward() -> None:
    device = caches(BLOCK_SHAPE_DIM0, seed=3)
    streams = RecordingStreams()
    copier = DeviceKVCopier(device, 0, capacity=4, streams=streams)
    assert copier.host is not None
    streams.probe = lambda: torch.equal(copier.host[0, 1], device[0][4])

    copier.begin(fence=False)
    device[0][4].fill_(3.0)  # the forward writes the block's KV
    streams.log.append(("forward", "compute", 0, None))
    batch = copier.issue_saves([(4, 1)])
    assert batch is not None

    forward_index = streams.log.index(("forward", "compute", 0, None))
    end_index, end, copied = streams.recorded("forward end")
    assert end_index > forward_index and not copied
    waits = streams.entries("wait", "copy")
    assert [event for _, event, _ in waits] == [end]
    wait_index, _, copied_at_wait = waits[0]
    assert wait_index > end_index and not copied_at_wait  # the copy stream waits before the copy reads
    saves_index, saves_event, copied = streams.recorded("saves")
    assert saves_index > wait_index and copied and batch.event == saves_event


def three_steps(fence: bool) -> tuple[RecordingStreams, list[object]]:
    """Steps 1 and 2 copy out; step 3 begins with ``fence``. Returns the log and the two steps' save events."""
    device = caches(BLOCK_SHAPE_DIM1, seed=4)
    streams = RecordingStreams()
    copier = DeviceKVCopier(device, 1, capacity=4, streams=streams)
    events = []
    for step in range(2):
        copier.begin(fence=False)
        batch = copier.issue_saves([(step, step)])
        assert batch is not None
        events.append(batch.event)
    streams.log.append(("step 3", "host", None, None))
    copier.begin(fence=fence)
    return streams, events


@pytest.mark.parametrize("fence", [True, False])
def test_the_forward_waits_for_the_last_copy_outs_exactly_when_fenced(fence: bool) -> None:
    streams, (first, second) = three_steps(fence)
    start = streams.log.index(("step 3", "host", None, None))
    waited = [event for index, event, _ in streams.entries("wait", "compute") if index > start]
    assert (second in waited) is fence
    # step 2 never waited for step 1's copy-outs: they overlapped its forward
    step2 = [event for index, event, _ in streams.entries("wait", "compute") if index < start]
    assert first not in step2 and second not in step2
    # copy-outs older than the last step's are always waited for (with a fence, the last covers them)
    assert waited == ([second] if fence else [first])


def test_a_step_abandoned_at_a_safepoint_fences_the_next_one() -> None:
    device = caches(BLOCK_SHAPE_DIM1, seed=5)
    streams = RecordingStreams()
    copier = DeviceKVCopier(device, 1, capacity=4, streams=streams)
    copier.begin(fence=False)
    batch = copier.issue_saves([(1, 0)])
    assert batch is not None
    copier.begin(fence=False)
    copier.issue_loads([(2, 0)])
    last_load = streams.recorded("loads end")[1]
    # StepPreempted: vLLM still calls wait_for_save (in a finally), where the connector abandons the step:
    # no issue_saves (tests/engine/test_abandoned_steps.py runs that call order)
    copier.begin(fence=False)
    assert streams.log[-1][:3] == ("wait", "compute", last_load)


def test_nothing_is_recorded_or_waited_while_a_graph_is_captured() -> None:
    streams = RecordingStreams(capture=True)
    copier = DeviceKVCopier(caches(BLOCK_SHAPE_DIM1), 1, capacity=4, streams=streams)
    copier.begin(fence=True)
    copier.issue_loads([(1, 0)])
    copier.wait_layer(0)
    assert copier.issue_saves([(1, 0)]) is None
    assert streams.log == []


# -- the worker's CUDA path, driven on CPU tensors -------------------------------------------------------------


@pytest.fixture
def handoff_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "handoff"
    path.mkdir()
    yield path


def test_the_worker_copies_out_reloads_and_hands_off_through_the_copier(handoff_dir: Path) -> None:
    device = caches(BLOCK_SHAPE_DIM1, seed=6)
    layer_bytes = device[0][:, 0].numel() * 4
    settings = KVSettings(
        host_memory_bytes=4 * LAYERS * layer_bytes, handoff_backend="shm", handoff_path=str(handoff_dir)
    )
    producer = OffloadWorker(settings, capacity=4, rank=0, produce=True)
    producer.register({f"layers.{i}": c for i, c in enumerate(device)}, BLOCKS, streams=InlineStreams())
    expected = {b: torch.stack([c[:, b] for c in device]).clone() for b in (2, 5)}
    producer.begin(StepPlan())
    producer.end()
    producer.begin(StepPlan(saves=[BlockCopy(2, 1, "aa"), BlockCopy(5, -1, "bb")]))
    producer.end()
    producer.close()  # the handoff files are written on the background thread
    assert handoff_file(str(handoff_dir), "aa", 0).read_bytes() == expected[2].numpy().tobytes()
    assert handoff_file(str(handoff_dir), "bb", 0).read_bytes() == expected[5].numpy().tobytes()
    stats = producer.take_stats()
    assert stats is not None and stats["bytes_offloaded"] == 2 * LAYERS * layer_bytes
    assert len(stats["step_copy_s"]) == 1

    consumer_device = [torch.zeros_like(c) for c in device]
    consumer = OffloadWorker(settings, capacity=4, rank=0, produce=False)
    consumer.register({f"layers.{i}": c for i, c in enumerate(consumer_device)}, BLOCKS, streams=InlineStreams())
    assert consumer._host is not None
    consumer._host[:, 3] = expected[2]
    consumer.begin(StepPlan(loads=[BlockCopy(7, 3), BlockCopy(8, -1, "bb"), BlockCopy(9, -1, "gone")]))
    for layer in range(LAYERS):
        consumer.wait_layer(f"layers.{layer}")
    consumer.end()
    assert torch.equal(torch.stack([c[:, 7] for c in consumer_device]), expected[2])
    assert torch.equal(torch.stack([c[:, 8] for c in consumer_device]), expected[5])
    assert consumer.load_errors == {9}  # a missing file: vLLM recomputes that block
    stats = consumer.take_stats()
    assert stats is not None and stats["bytes_reloaded"] == 2 * LAYERS * layer_bytes
    consumer.close()


def test_a_block_handed_off_again_is_the_newest_and_counted_once(handoff_dir: Path) -> None:
    """A prefiller writes a shared prefix's blocks again for every turn; the directory's bound must still hold the
    newest blocks (a decoder is about to read them), however often a block is rewritten."""
    device = caches(BLOCK_SHAPE_DIM1, seed=7)
    block_bytes = LAYERS * device[0][:, 0].numel() * 4
    settings = KVSettings(handoff_backend="shm", handoff_path=str(handoff_dir), handoff_max_bytes=3 * block_bytes)
    producer = OffloadWorker(settings, capacity=0, rank=0, produce=True)
    producer.register({f"layers.{i}": c for i, c in enumerate(device)}, BLOCKS, streams=InlineStreams())
    for turn in range(6):  # the prefix block "aa" in every turn, then the turn's own block
        producer.begin(StepPlan(saves=[BlockCopy(1, -1, "aa"), BlockCopy(2 + turn % 3, -1, f"t{turn}")]))
        producer.end()
    producer.close()  # the handoff files are written on the background thread
    held = sorted(path.name.split(".")[0] for path in handoff_dir.iterdir())
    assert held == ["aa", "t4", "t5"]  # the bound's three newest: the prefix just written, the last two turns
