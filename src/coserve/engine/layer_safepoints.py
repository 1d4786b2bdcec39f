"""A worker's layer safepoints: the check between layers, and the bound that makes it mean something on a GPU.

Who calls what: ``CoServeConnector`` (worker side) owns one ``LayerSafepoints`` per worker; vLLM calls the
connector before and after every attention layer, and the connector calls ``check`` there. The GPU check
(``benchmarks/gpu/torch_check.py``) drives the same object from a plain-PyTorch model, which is why this
module imports nothing from vLLM.

Why the bound. A CUDA stream runs asynchronously: the host queues kernels and moves on. In a large
offline prefill the host passes every safepoint of the step within its first few percent while the GPU
runs hundreds of milliseconds behind (measured on an H200: a 408 ms step was queued in 7 ms), so a
host-side check has nothing left to stop by the time an urgent request arrives. ``RunAheadBound`` records
a device event at each safepoint and, before checking safepoint *i*, waits for the event of safepoint
*i − K*: the host is then never more than K half-layers ahead of the device, and an abort lands within
about K + 1 half-layers of device time. On a CPU the host is the device, there is nothing to bound, and
no events are made.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from coserve.engine.safepoint import SafepointBoard
    from coserve.engine.tp_sync import SafepointAgreement

__all__ = ["CudaEvents", "DeviceEvents", "LayerSafepoints", "RunAheadBound", "StepPreempted"]

DEFAULT_RUNAHEAD = 1  # K: measured on an H200, K = 1 exits within ~1 layer at no measurable cost


class StepPreempted(RuntimeError):
    """Raised at a layer boundary to abandon the running step; caught by the coserve worker."""

    def __init__(self, step_id: int, layer_name: str) -> None:
        super().__init__(f"step {step_id} preempted before {layer_name}")
        self.step_id = step_id
        self.layer_name = layer_name


class DeviceEvents(Protocol):
    """A fixed ring of completion markers in the device's stream."""

    def record(self, slot: int) -> None:
        """Mark the current end of the stream's queued work in ``slot`` (returns at once)."""

    def wait(self, slot: int) -> None:
        """Block the host until the device has run everything queued before ``slot`` was recorded."""

    def capturing(self) -> bool:
        """Whether the stream is being captured into a graph (nothing may block the host then)."""


class CudaEvents:
    """``count`` CUDA events, made once per worker on the current device; recorded on the current stream.

    With piecewise CUDA graphs the safepoint runs between graph pieces, outside any capture, so recording
    an event there and waiting for an earlier one is what any eager kernel launch between two replays
    does: the replays are ordinary work on the same stream, and the event marks where they end. While a
    graph is being captured (vLLM's warm-up) no event is waited on: synchronizing a capturing stream is
    illegal, and there is no step to preempt.
    """

    def __init__(self, count: int, blocking: bool = False) -> None:
        """``blocking``: a wait yields the CPU until the device signals (``cudaEventBlockingSync``) instead of
        spinning a core on the event, for a later wake-up. Off (spinning) by measurement: on the emulated
        device (``python benchmarks/gpu/torch_check.py --smoke --only prefill``, 2026-12-07) blocking waits
        cost 5.7 % [4.2, 7.3] of a piecewise decode step's throughput and 4.9 % [1.5, 8.3] of a large
        prefill's, for 0.2-5 % less process CPU: the late wake-up delays the next half-layer's launches.
        The same comparison on a GPU (``torch_safepoint_overhead_cuda``'s ``events``) decides it there."""
        import torch

        self._torch = torch
        self._events = [torch.cuda.Event(blocking=blocking) for _ in range(count)]  # type: ignore[no-untyped-call]

    def record(self, slot: int) -> None:
        self._events[slot].record()

    def wait(self, slot: int) -> None:
        self._events[slot].synchronize()

    def capturing(self) -> bool:
        return bool(self._torch.cuda.is_current_stream_capturing())


class RunAheadBound:
    """Keeps the host at most ``k`` safepoints ahead of the device (k ≥ 0; 0 waits for the device each time).

    The ring holds k + 1 events: the slot recorded at safepoint *i* is the one of *i − k − 1*, already
    waited for at safepoint *i − 1*. Only events of the running step are waited for (the ring is reused
    from the first safepoint of every step on), so a step never waits for the one before it.
    """

    def __init__(self, k: int, make_events: Callable[[int], DeviceEvents]) -> None:
        if k < 0:
            raise ValueError(f"safepoint_runahead: must be 0 or more, got {k}")
        self.k = k
        self._make_events = make_events
        self._events: DeviceEvents | None = None  # made at the first safepoint, once the device is set

    def reach(self, index: int) -> None:
        """Called at safepoint ``index`` of a step, before its check; blocks until the device is close enough."""
        if self._events is None:
            self._events = self._make_events(self.k + 1)
        events = self._events
        if events.capturing():
            return
        events.record(index % (self.k + 1))
        if index >= self.k:
            events.wait((index - self.k) % (self.k + 1))


class LayerSafepoints:
    """One worker's safepoints: ``begin`` with every step, ``check`` at every safepoint of it."""

    def __init__(
        self,
        bound: RunAheadBound | None = None,
        agreement: Callable[[], SafepointAgreement] | None = None,
    ) -> None:
        self.bound = bound
        self._resolve_agreement = agreement
        self._agreement: SafepointAgreement | None = None  # resolved at the first check, on every rank
        self.board: SafepointBoard | None = None
        self.step_id = -1
        self.checking = False
        self.index = 0  # the next safepoint's index in the step: 2 per layer, before and after attention
        self.check_s = 0.0  # time in checks and the TP agreement (not in the bound's wait) since take_stats
        self.steps = 0

    def begin(self, step_id: int, board: SafepointBoard | None, checking: bool) -> None:
        """Called before each forward with the step's number, the engine's board (None on a rank that cannot
        attach it: another node than the engine's) and whether to check (the same on every rank)."""
        self.step_id = step_id
        self.board = board
        self.checking = checking
        self.index = 0

    def check(self, layer_name: str) -> None:
        """The safepoint: ``StepPreempted`` when this step must be abandoned here, on every rank alike."""
        if not self.checking:
            return
        # NOTE: every rank checks, board or not: resolving the agreement is a collective, and so is the
        # broadcast mode's every check (a rank on another node has no board and contributes "no").
        if self._agreement is None:
            self._agreement = self._agreement_now()
        if self.board is None and self._agreement.mode != "broadcast":
            return
        index = self.index
        self.index += 1
        if index == 0:
            self.steps += 1
        if self.bound is not None:
            self.bound.reach(index)
        started = time.perf_counter()
        leave = self._agreement.should_leave(self.board, self.step_id, index)
        self.check_s += time.perf_counter() - started
        if leave:
            raise StepPreempted(self.step_id, layer_name)

    def take_stats(self) -> tuple[float, int]:
        """(seconds in checks, steps checked) since the last call; read after each step for /metrics."""
        stats = (self.check_s, self.steps)
        self.check_s, self.steps = 0.0, 0
        return stats

    def _agreement_now(self) -> SafepointAgreement:
        if self._resolve_agreement is not None:
            return self._resolve_agreement()
        from coserve.engine.tp_sync import SafepointAgreement

        return SafepointAgreement.resolve(self.bound.k if self.bound is not None else 0)
