"""The handle of the shared vLLM test server (tests/engine/conftest.py) and the engine tests' helpers."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coserve.engine.safepoint import SafepointBoard


class Engine:
    """What the tests need to know about the shared server."""

    def __init__(self, base: str, engine_id: str) -> None:
        self.base = base
        self.engine_id = engine_id


class Chaos:
    """Abandons every other posted step at its next layer boundary, from another process's view
    (``with Chaos(board): ...``): the engine tests' way to make preemption happen on demand."""

    def __init__(self, board: SafepointBoard) -> None:
        self.board = board
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = -1
        aborting = True
        while not self.stop.is_set():
            step = self.board.posted_step()
            if step is not None and step.step_id != last:
                last = step.step_id
                if aborting:
                    self.board.request_abort(step.step_id)
                aborting = not aborting
            time.sleep(0.0005)

    def __enter__(self) -> Chaos:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
