"""The host KV pool's copies on a CUDA device: pinned memory, one copy stream, device-side ordering only.

Who calls what, and when. ``coserve.engine.offload.OffloadWorker`` owns one ``DeviceKVCopier`` when
vLLM's KV caches are CUDA tensors; vLLM calls the worker through ``CoServeConnector``:

- ``bind_connector_metadata`` (before the forward) -> ``OffloadWorker.begin`` -> ``DeviceKVCopier.begin``
  (the compute stream waits, device-side, for the copy-outs it must not overlap; see ``begin``), then
  ``issue_loads``: every layer's reload is queued on the copy stream at once, and the host moves on;
- ``wait_for_layer_load`` (before layer L's attention) -> ``wait_layer(L)``: the compute stream waits,
  device-side, for layer L's reload; the host never blocks;
- ``wait_for_save`` (after the forward) -> ``OffloadWorker.end`` -> ``issue_saves``: the step's newly
  completed blocks are gathered and copied into the pinned pool on the copy stream, overlapping the
  next step's forward; every step calls it (with or without copy-outs), as it also ends the step;
- the handoff writer (the worker's background thread, producers only) calls ``SaveBatch.synchronize``
  before it reads the copied bytes out of pinned memory.

Why one copy stream. Copy-outs and reloads share it, so its FIFO order alone guarantees that a reload of
a host slot never reads it before an earlier copy-out into that slot has landed, and that a copy-out
into a slot that was evicted and reused runs after the reloads issued before it.

Why pinned memory: measured on an H200, a pinned pool moves 55 GB/s, a pageable one 16-22 GB/s; copying
each step's new KV out on a side stream overlapped with the next step cost +0.74 % on 16k-token prefill
steps and nothing measurable on decode steps.

Stream and event operations go through ``CopyStreams``: ``CudaCopyStreams`` on a GPU, and
``InlineStreams`` for CPU tensors, where every copy has completed when it returns and ordering is
trivially kept, so the data movement itself (runs of slots, the gather and the scatter, either block
dimension) runs, and is tested, on a CPU. This module imports only the standard library and PyTorch
(lazily), never vLLM: the GPU check (``benchmarks/gpu/torch_check.py``) drives it on a machine that has
PyTorch and no vLLM.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

__all__ = [
    "CopyStreams",
    "CudaCopyStreams",
    "DeviceKVCopier",
    "InlineStreams",
    "SaveBatch",
    "slot_runs",
]


class CopyStreams(Protocol):
    """The device's ordering primitives the copier needs: a compute stream (the current one) and one copy stream.

    Events are opaque to the copier; ``label`` names what an event marks (for logs and test doubles).
    """

    def record_compute(self, label: str) -> object:
        """An event at the current end of the compute stream's queued work (returns at once)."""

    def record_copy(self, label: str, *, timing: bool = False) -> object:
        """An event at the current end of the copy stream's queued work; ``timing``: usable by ``elapsed_s``."""

    def copy_waits(self, event: object) -> None:
        """Work queued on the copy stream from now on runs after ``event`` (device-side; the host goes on)."""

    def compute_waits(self, event: object) -> None:
        """Work queued on the compute stream from now on runs after ``event`` (device-side; the host goes on)."""

    def on_copy(self) -> contextlib.AbstractContextManager[Any]:
        """Within it, copies and allocations go to the copy stream."""

    def done(self, event: object) -> bool:
        """Whether the device has run everything queued before ``event`` (never blocks)."""

    def synchronize(self, event: object) -> None:
        """Block the calling thread until ``done(event)``."""

    def elapsed_s(self, start: object, end: object) -> float:
        """Device time between two completed timing events of the copy stream."""

    def capturing(self) -> bool:
        """Whether the compute stream is being captured into a CUDA graph (nothing may be waited on then)."""


class CudaCopyStreams:
    """``CopyStreams`` on one CUDA device: the current stream computes, a stream made here copies."""

    def __init__(self, device: torch.device) -> None:
        import torch

        self._torch = torch
        self.device = device
        self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    def record_compute(self, label: str) -> object:
        event = self._torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._torch.cuda.current_stream(self.device))
        return event

    def record_copy(self, label: str, *, timing: bool = False) -> object:
        event = self._torch.cuda.Event(enable_timing=timing)  # type: ignore[no-untyped-call]
        event.record(self.stream)
        return event

    def copy_waits(self, event: object) -> None:
        self.stream.wait_event(event)  # type: ignore[arg-type]

    def compute_waits(self, event: object) -> None:
        self._torch.cuda.current_stream(self.device).wait_event(event)  # type: ignore[arg-type]

    def on_copy(self) -> contextlib.AbstractContextManager[Any]:
        return self._torch.cuda.stream(self.stream)

    def done(self, event: object) -> bool:
        return bool(event.query())  # type: ignore[attr-defined]

    def synchronize(self, event: object) -> None:
        event.synchronize()  # type: ignore[attr-defined]

    def elapsed_s(self, start: object, end: object) -> float:
        return float(start.elapsed_time(end)) / 1e3  # type: ignore[attr-defined]

    def capturing(self) -> bool:
        return bool(self._torch.cuda.is_current_stream_capturing())


@dataclass(frozen=True)
class InlineEvent:
    """An ``InlineStreams`` event: what it marks and when (host time: inline copies are synchronous)."""

    label: str
    at: float


class InlineStreams:
    """``CopyStreams`` for CPU tensors: one stream in effect, every copy done when it returns, waits are no-ops."""

    def record_compute(self, label: str) -> object:
        return InlineEvent(label, time.perf_counter())

    def record_copy(self, label: str, *, timing: bool = False) -> object:
        return InlineEvent(label, time.perf_counter())

    def copy_waits(self, event: object) -> None:
        return None

    def compute_waits(self, event: object) -> None:
        return None

    def on_copy(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def done(self, event: object) -> bool:
        return True

    def synchronize(self, event: object) -> None:
        return None

    def elapsed_s(self, start: object, end: object) -> float:
        if not (isinstance(start, InlineEvent) and isinstance(end, InlineEvent)):
            raise TypeError("InlineStreams times only its own events")
        return end.at - start.at

    def capturing(self) -> bool:
        return False


def slot_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive slots in ``slots`` (sorted by the caller): (first slot, count, position in ``slots``)."""
    runs: list[tuple[int, int, int]] = []
    for position, slot in enumerate(slots):
        if runs and runs[-1][0] + runs[-1][1] == slot:
            first, count, start = runs[-1]
            runs[-1] = (first, count + 1, start)
        else:
            runs.append((slot, 1, position))
    return runs


def _by_slot(
    pairs: Sequence[tuple[int, int]], unpooled: Sequence[int]
) -> tuple[list[tuple[int, int, int]], list[int], int]:
    """(device block, host slot) pairs ordered by slot: their ``slot_runs``, the device blocks in that order
    followed by ``unpooled`` (blocks with no slot), and how many of those blocks have a slot."""
    order = sorted(pairs, key=lambda pair: pair[1])
    return slot_runs([slot for _, slot in order]), [block for block, _ in order] + list(unpooled), len(order)


@dataclass
class _Pending:
    """A batch of copies issued on the copy stream whose time and bytes are counted once it completes."""

    kind: str  # "bytes_offloaded" or "bytes_reloaded"
    num_bytes: int
    start: object
    end: object
    keep: tuple[object, ...]  # tensors the queued copies use: alive until they have run


@dataclass
class SaveBatch:
    """One step's copy-outs: ``event`` marks their end on the copy stream; ``extra`` holds, in pinned
    memory, the blocks saved with no host slot (for the handoff only), (layers, n, *block shape)."""

    event: object
    extra: torch.Tensor | None
    streams: CopyStreams

    def synchronize(self) -> None:
        """Block the calling thread until the copies have landed (the handoff writer, before it reads them)."""
        self.streams.synchronize(self.event)


class DeviceKVCopier:
    """Copies between vLLM's paged KV caches (one tensor per layer) and a pinned, layer-major host pool.

    ``caches`` are the layers' tensors; ``block_dim`` is the dimension that indexes blocks (0, or 1 in
    vLLM's CUDA flash-attention layout ``(2, num_blocks, block_size, heads, head_dim)``); the pool holds
    ``capacity`` slots of every layer, ``host[layer, slot]`` one block of one layer. ``streams`` defaults
    to ``CudaCopyStreams`` for CUDA caches and ``InlineStreams`` otherwise.

    Counters: ``completed()`` returns each batch of copies the device has finished since the last call,
    as (``"bytes_offloaded"`` or ``"bytes_reloaded"``, bytes, seconds). On CUDA the seconds are device
    time on the copy stream between two timing events recorded around the batch (after its wait for the
    compute stream), read lazily with ``event.query()`` so the host never blocks for them; they include
    any slowdown from sharing memory bandwidth with the forward, which is what the planner's copy budget
    needs. With ``InlineStreams`` they are the host time of the (synchronous) copies.
    """

    def __init__(
        self,
        caches: Sequence[torch.Tensor],
        block_dim: int,
        capacity: int,
        streams: CopyStreams | None = None,
    ) -> None:
        import torch

        if not caches:
            raise ValueError("DeviceKVCopier needs at least one layer's KV cache")
        self.caches = list(caches)
        self.block_dim = block_dim
        first = self.caches[0]
        self.device = first.device
        self.dtype = first.dtype
        self.block_shape = tuple(first.select(block_dim, 0).shape)
        self.layer_block_bytes = math.prod(self.block_shape) * first.element_size()
        self.streams: CopyStreams = streams or (CudaCopyStreams(first.device) if first.is_cuda else InlineStreams())
        self._pin = first.is_cuda
        # (num_blocks, *block shape) views of each layer: block b of layer L is views[L][b]
        self._views = [cache.movedim(block_dim, 0) for cache in self.caches]
        self.host: torch.Tensor | None = None
        if capacity:
            self.host = torch.empty(
                (len(self.caches), capacity, *self.block_shape), dtype=self.dtype, pin_memory=self._pin
            )
            # NOTE: touch every page now. Untouched memory faults on its first write, and a copy-out into
            # it ran at 0.7 GB/s instead of 13 GB/s (measured on a CPU); pinning also maps it now.
            self.host.zero_()
        self._load_events: dict[int, object] = {}  # layer -> its reload's event, until the compute stream waits
        self._latest_saves: object | None = None  # the copy-outs issued at the last step's end
        self._older_saves: object | None = None  # copy-outs issued before that, not yet waited for
        self._last_copy: object | None = None  # the last event recorded on the copy stream
        self._in_step = False
        self._pending: list[_Pending] = []
        self._finished: list[tuple[str, int, float]] = []  # reaped batches, until ``completed`` hands them over

    @property
    def layers(self) -> int:
        return len(self.caches)

    # -- one step --------------------------------------------------------------------------------------

    def begin(self, fence: bool) -> None:
        """Before the step's forward: order it after the copy-outs it must not overlap (device-side).

        The previous step's copy-outs may still be reading device blocks while this forward runs. That is
        safe unless this step writes one of those blocks, which it can only if the block was freed and
        reallocated in between: its request finished or was preempted. The planner sets ``fence`` then
        (``StepPlan.fence_saves``), and the forward waits for those copy-outs. Copy-outs of earlier steps
        are always waited for (they have long finished: this costs nothing, and it bounds any request's
        copy-outs to overlapping one forward, whatever the scheduler reports late). A step that began and
        never ended (abandoned at a safepoint) waits for everything on the copy stream.
        """
        if self.streams.capturing():
            return
        if self._in_step:  # the last step was abandoned: its requests may have been preempted
            target, self._latest_saves = self._last_copy, None
            self._load_events = {}
        elif fence:
            target, self._latest_saves = self._latest_saves, None  # FIFO: covers the older ones too
        else:
            target = self._older_saves
        self._older_saves = None
        if target is not None:
            self.streams.compute_waits(target)
        self._in_step = True

    def issue_loads(
        self,
        loads: Sequence[tuple[int, int]],
        staged_blocks: Sequence[int] = (),
        staged: torch.Tensor | None = None,
    ) -> None:
        """Queue the step's reloads, every layer at once: (device block, host slot) pairs from the pool, and
        ``staged_blocks`` from ``staged``, host memory of (layers, len(staged_blocks), *block shape)."""
        if self.streams.capturing() or not (loads or staged_blocks):
            return
        self._reap()
        import torch

        host = self.host
        if loads and host is None:
            raise ValueError("reloads from a host pool of no capacity")
        runs, blocks, pooled = _by_slot(loads, staged_blocks)
        # The blocks being loaded were just allocated: the previous step's kernels may still read them.
        self.streams.copy_waits(self.streams.record_compute("begin"))
        with self.streams.on_copy():
            start = self.streams.record_copy("loads start", timing=True)
            index = torch.as_tensor(blocks, dtype=torch.long).to(self.device, non_blocking=True)
            staging = torch.empty((len(blocks), *self.block_shape), dtype=self.dtype, device=self.device)
            extra: torch.Tensor | None = None
            if staged_blocks:
                if staged is None or tuple(staged.shape) != (self.layers, len(staged_blocks), *self.block_shape):
                    raise ValueError("staged blocks need a (layers, blocks, *block shape) host tensor")
                extra = torch.empty(tuple(staged.shape), dtype=self.dtype, pin_memory=self._pin)
                extra.copy_(staged)
            for layer, cache in enumerate(self.caches):
                if host is not None:
                    for first, count, position in runs:
                        staging[position : position + count].copy_(
                            host[layer, first : first + count], non_blocking=True
                        )
                if extra is not None:
                    staging[pooled:].copy_(extra[layer], non_blocking=True)
                cache.index_copy_(self.block_dim, index, staging.movedim(0, self.block_dim))
                self._load_events[layer] = self.streams.record_copy(f"load {layer}")
            end = self.streams.record_copy("loads end", timing=True)
        self._last_copy = end
        moved = len(blocks) * self.layer_block_bytes * self.layers
        self._pending.append(_Pending("bytes_reloaded", moved, start, end, (index, staging, extra)))

    def wait_layer(self, layer: int) -> None:
        """Before layer ``layer``'s attention: the compute stream waits for that layer's reload (device-side).

        Legal between piecewise CUDA-graph pieces: in vLLM's piecewise mode the attention op, and the
        connector hooks it calls, run eagerly between two graph replays, and a replay is ordinary work on
        the current stream, so a ``wait_event`` queued here holds back the pieces queued after it, as any
        eager kernel would. While a graph is being captured (vLLM's warm-up, which plans no copies) nothing
        is waited on: a capturing stream must not wait on an event recorded outside the capture.
        """
        if self.streams.capturing():
            return
        event = self._load_events.pop(layer, None)
        if event is not None:
            self.streams.compute_waits(event)

    def issue_saves(self, saves: Sequence[tuple[int, int]], extra_blocks: Sequence[int] = ()) -> SaveBatch | None:
        """End of the step's forward: queue its copy-outs, (device block, host slot) pairs, and ``extra_blocks``
        into a fresh pinned tensor (blocks with no host slot, for the handoff). Called after every step's
        forward, with or without copy-outs: it ends the step. Returns ``None`` when nothing was queued."""
        if self.streams.capturing():
            return None
        if self._load_events:  # a layer the forward never waited for: later steps wait for all of them
            self.streams.compute_waits(self._load_events[max(self._load_events)])
            self._load_events = {}
        self._in_step = False
        self._older_saves, self._latest_saves = self._latest_saves, None
        if not (saves or extra_blocks):
            return None
        self._reap()
        import torch

        host = self.host
        if saves and host is None:
            raise ValueError("copy-outs into a host pool of no capacity")
        runs, blocks, pooled = _by_slot(saves, extra_blocks)
        # The forward just queued wrote these blocks: copy them only after it.
        self.streams.copy_waits(self.streams.record_compute("forward end"))
        with self.streams.on_copy():  # staging is allocated on the copy stream: reused only after these copies
            start = self.streams.record_copy("saves start", timing=True)
            index = torch.as_tensor(blocks, dtype=torch.long).to(self.device, non_blocking=True)
            staging = torch.empty((len(blocks), *self.block_shape), dtype=self.dtype, device=self.device)
            extra: torch.Tensor | None = None
            if extra_blocks:
                extra = torch.empty(
                    (self.layers, len(extra_blocks), *self.block_shape), dtype=self.dtype, pin_memory=self._pin
                )
            for layer, view in enumerate(self._views):
                torch.index_select(view, 0, index, out=staging)  # ordered by slot, contiguous
                if host is not None:
                    for first, count, position in runs:
                        host[layer, first : first + count].copy_(
                            staging[position : position + count], non_blocking=True
                        )
                if extra is not None:
                    extra[layer].copy_(staging[pooled:], non_blocking=True)
            end = self.streams.record_copy("saves", timing=True)
        self._latest_saves = self._last_copy = end
        moved = len(blocks) * self.layer_block_bytes * self.layers
        self._pending.append(_Pending("bytes_offloaded", moved, start, end, (index, staging, extra)))
        return SaveBatch(end, extra, self.streams)

    # -- counters and shutdown -------------------------------------------------------------------------

    def completed(self) -> list[tuple[str, int, float]]:
        """Batches the device has finished since the last call: (counter, bytes, seconds); never blocks."""
        self._reap()
        done, self._finished = self._finished, []
        return done

    def _reap(self) -> None:
        """Time the finished batches and let their staging tensors go (also when nobody reads the counters)."""
        while self._pending and self.streams.done(self._pending[0].end):  # one stream: they finish in order
            batch = self._pending.pop(0)
            self._finished.append((batch.kind, batch.num_bytes, self.streams.elapsed_s(batch.start, batch.end)))

    def synchronize(self) -> None:
        """Block until every queued copy has run (shutdown, and the GPU check's timings)."""
        if self._last_copy is not None:
            self.streams.synchronize(self._last_copy)
