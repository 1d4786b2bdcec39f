"""A device that runs asynchronously from its host, for tests of code that relies on the host's timing.

A CPU engine executes each kernel before the host moves on, so a CPU test cannot see what a GPU does: the
host queues kernels and returns at once while the device works through them, often hundreds of
milliseconds behind. ``EmulatedDevice`` behaves like one CUDA stream: ``launch`` queues a kernel of a
given duration and returns; a device thread runs the queue in order; ``EmulatedEvents`` are completion
markers in the same queue (``record`` returns at once, ``wait`` blocks the host until the device has run
everything queued before the marker), with the interface ``coserve.engine.layer_safepoints`` expects of
CUDA events. A test double by necessity: no GPU runs in CI.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class _Kernel:
    label: str
    duration_s: float


@dataclass
class _Marker:
    done: threading.Event = field(default_factory=threading.Event)


class EmulatedDevice:
    """One in-order stream; ``after_kernel(n, label)`` runs on the device thread after its n-th kernel (from 1)."""

    def __init__(self, after_kernel: Callable[[int, str], None] | None = None) -> None:
        self._queue: queue.Queue[_Kernel | _Marker | None] = queue.Queue()
        self.after_kernel = after_kernel
        self.completed: list[str] = []  # labels, in the order the device finished them
        self.launched = 0
        self._thread = threading.Thread(target=self._run, name="emulated-device", daemon=True)
        self._thread.start()

    def launch(self, label: str, duration_s: float) -> None:
        """Queue a kernel; returns at once, as a CUDA launch does."""
        self.launched += 1
        self._queue.put(_Kernel(label, duration_s))

    def events(self, count: int) -> EmulatedEvents:
        return EmulatedEvents(self, count)

    def synchronize(self) -> None:
        """Block until the device has run everything queued so far."""
        marker = _Marker()
        self._queue.put(marker)
        marker.done.wait()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if isinstance(item, _Marker):
                item.done.set()
                continue
            time.sleep(item.duration_s)
            self.completed.append(item.label)
            if self.after_kernel is not None:
                self.after_kernel(len(self.completed), item.label)


class EmulatedEvents:
    """A ring of completion markers on an ``EmulatedDevice`` (``coserve.engine.layer_safepoints.DeviceEvents``)."""

    def __init__(self, device: EmulatedDevice, count: int) -> None:
        self._device = device
        self._slots: list[_Marker | None] = [None] * count

    def record(self, slot: int) -> None:
        marker = _Marker()
        self._slots[slot] = marker
        self._device._queue.put(marker)

    def wait(self, slot: int) -> None:
        marker = self._slots[slot]
        assert marker is not None, f"slot {slot} waited for before it was recorded"
        marker.done.wait()

    def capturing(self) -> bool:
        return False
