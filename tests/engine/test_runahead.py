"""Layer safepoints stop a step on a device that runs behind its host, as a GPU does.

The worker's real safepoint code (``LayerSafepoints`` with the real shared-memory ``SafepointBoard``) runs
on the host thread of a model of a forward pass; the kernels go to ``EmulatedDevice``, which runs them on
its own thread as a CUDA stream does. An urgent arrival raises the abort when the device finishes a
chosen kernel (on the device thread, so which kernel is exact whatever the machine's speed), and the
exit is counted in half-layers the device still ran after it.

Without the run-ahead bound the host queues the whole step and passes every safepoint long before the
device reaches the abort: nothing is preempted, which is what an H200 showed of the unbounded check. With
the bound (K) the host is never more than K safepoints ahead, and every abort lands within K + 1
half-layers.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from coserve.engine.layer_safepoints import LayerSafepoints, RunAheadBound, StepPreempted
from coserve.engine.safepoint import SafepointBoard
from coserve.engine.tp_sync import SafepointAgreement
from device_emulator import EmulatedDevice

LAYERS = 16
HALF_LAYER_S = 0.003  # one attention or MLP kernel: a 16-layer step takes ~0.1 s of device time
STEP_ID = 7


@pytest.fixture
def board() -> Iterator[SafepointBoard]:
    created = SafepointBoard.create(f"coserve-sp-ra{os.getpid()}")
    try:
        yield created
    finally:
        created.close()


def forward(device: EmulatedDevice, safepoints: LayerSafepoints) -> None:
    """A transformer step as vLLM's host thread runs it: a safepoint before and after each attention."""
    for layer in range(LAYERS):
        safepoints.check(f"layers.{layer}")  # wait_for_layer_load
        device.launch(f"attention {layer}", HALF_LAYER_S)
        safepoints.check(f"layers.{layer}")  # save_kv_layer
        device.launch(f"mlp {layer}", HALF_LAYER_S)


def preempt(board: SafepointBoard, runahead: int | None, abort_after: int) -> tuple[bool, int]:
    """Run one step with the abort raised once the device has finished ``abort_after`` kernels.

    Returns whether the host left the step at a safepoint, and how many kernels the device ran after the
    abort (the exit latency in half-layers: what was already queued when the host stopped).
    """
    finished_at_abort: list[int] = []

    def after_kernel(count: int, label: str) -> None:
        if count == abort_after:
            board.request_abort(STEP_ID)
            finished_at_abort.append(count)

    device = EmulatedDevice(after_kernel)
    bound = RunAheadBound(runahead, device.events) if runahead is not None else None
    safepoints = LayerSafepoints(bound, agreement=lambda: SafepointAgreement("single"))
    safepoints.begin(STEP_ID, board, checking=True)
    try:
        forward(device, safepoints)
        preempted = False
    except StepPreempted as stop:
        assert stop.step_id == STEP_ID
        preempted = True
    device.synchronize()  # the exit: the device is idle again
    device.close()
    assert finished_at_abort == [abort_after], "the device never reached the abort"
    return preempted, len(device.completed) - abort_after


ABORTS = [2, 9, 17, 24]  # kernels finished when the urgent request arrives (of 32 in the step)


@pytest.mark.parametrize("abort_after", ABORTS)
def test_without_the_bound_the_host_passes_every_safepoint_before_the_device_gets_there(
    board: SafepointBoard, abort_after: int
) -> None:
    """The emulator reproduces the GPU defect: a host-side check alone preempts nothing."""
    preempted, ran_after = preempt(board, None, abort_after)
    assert not preempted
    assert ran_after == 2 * LAYERS - abort_after  # the whole rest of the step ran


@pytest.mark.parametrize("runahead", [0, 1, 2])
@pytest.mark.parametrize("abort_after", ABORTS)
def test_with_the_bound_every_abort_lands_within_k_plus_one_half_layers(
    board: SafepointBoard, runahead: int, abort_after: int
) -> None:
    preempted, ran_after = preempt(board, runahead, abort_after)
    assert preempted
    assert ran_after <= runahead + 1


class RecordedEvents:
    """Events that only record what was asked of them."""

    def __init__(self, count: int, capturing: bool = False) -> None:
        self.count = count
        self.calls: list[tuple[str, int]] = []
        self._capturing = capturing

    def record(self, slot: int) -> None:
        self.calls.append(("record", slot))

    def wait(self, slot: int) -> None:
        self.calls.append(("wait", slot))

    def capturing(self) -> bool:
        return self._capturing


def test_the_ring_waits_for_the_event_k_safepoints_back_and_makes_events_once() -> None:
    made: list[RecordedEvents] = []

    def make(count: int) -> RecordedEvents:
        made.append(RecordedEvents(count))
        return made[-1]

    bound = RunAheadBound(2, make)
    for index in range(5):
        bound.reach(index)
    for index in range(2):  # the next step starts the ring again
        bound.reach(index)
    assert len(made) == 1 and made[0].count == 3
    assert made[0].calls == [
        ("record", 0), ("record", 1),
        ("record", 2), ("wait", 0),
        ("record", 0), ("wait", 1),
        ("record", 1), ("wait", 2),
        ("record", 0), ("record", 1),
    ]  # fmt: skip


def test_nothing_is_waited_for_while_a_graph_is_captured() -> None:
    events = RecordedEvents(2, capturing=True)
    bound = RunAheadBound(1, lambda count: events)
    for index in range(4):
        bound.reach(index)
    assert events.calls == []


def test_a_negative_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="safepoint_runahead"):
        RunAheadBound(-1, RecordedEvents)
