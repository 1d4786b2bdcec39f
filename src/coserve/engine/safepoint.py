"""The safepoint board: a few shared-memory words linking the API server, scheduler and workers.

Layer-safepoint preemption needs three processes of one engine to agree within
microseconds, without a round trip through the engine core's busy loop (which
is blocked while a step runs):

- the scheduler (engine core) posts each step as it dispatches it: its id,
  start time, predicted duration, the most important class in it, layers;
- the API server's middleware reads that when an urgent request arrives and,
  if ``should_preempt`` says so, writes the step id into ``abort_step``;
- each worker checks ``abort_step`` at every layer boundary (the KV
  connector's per-layer hook) and abandons the step; rank 0 writes
  ``abandoned_step`` and the exit time, which the scheduler reads to roll the
  step back (with tensor parallelism, the first rank also writes the
  safepoint where every rank leaves, in that step's slot of a small ring of
  per-step exits: ``coserve.engine.tp_sync``);
- anyone attached may pause the safepoints (``pause``): the scheduler then
  tells the workers to skip every check from the next step on, exactly as an
  engine started with ``safepoints: false`` does, until resumed. Benchmarks use
  it to compare checks on and off in one engine, step batch by step batch.

The board is named after the engine's ``kv_transfer_config.engine_id``, which
every process of the engine shares. Reads and writes are single aligned 8-byte
words, so no lock is needed; a stale read only delays a preemption by a layer.
"""

from __future__ import annotations

import contextlib
import hashlib
import struct
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

__all__ = ["BOARD_SIZE", "EXIT_SLOTS", "PostedStep", "SafepointBoard", "board_name", "safepoint_counters"]

# Offsets of the 8-byte words.
_ABORT_STEP = 0
_ABANDONED_STEP = 8
_RUNNING_STEP = 16
_STARTED_S = 24
_PREDICTED_S = 32
_MIN_RANK = 40
_NUM_LAYERS = 48
_EXIT_S = 56
_ABORT_RAISED_S = 64
_NUM_PREEMPTIONS = 72
_NUM_ABORT_REQUESTS = 80
_PAUSED = 88
_AGREED_EXITS = 96  # EXIT_SLOTS words: slot step_id % EXIT_SLOTS holds (step id, safepoint index), packed
# NOTE: 4 slots: step ids are consecutive, and a follower is at most 2 steps behind the leader (1 where every
# step checks its safepoints; each step's all-reduces bound the lag: coserve.engine.tp_sync), so 1 to spare.
EXIT_SLOTS = 4
BOARD_SIZE = _AGREED_EXITS + 8 * EXIT_SLOTS  # 128 bytes, a whole number of words
_SAFEPOINTS_PER_STEP = 4096  # an agreed exit packs (step id, safepoint index) into one word

_NO_STEP = -1


def board_name(engine_id: str) -> str:
    """The shared-memory name of an engine's board (POSIX names are short: at most 30 characters).

    An id of at most 20 letters and digits is kept as it is (``board_name(suffix)`` of such a name is the name
    again). Any other id (vLLM's default is a UUID) gives its first 9 letters and digits, for a person reading
    ``/dev/shm``, then a digest of the whole id, so that ids that differ only in what that drops (vLLM appends
    ``_dp{rank}`` to each data-parallel rank's) never share a board. The engine refuses data parallelism
    (``coserve.engine.in_flight``); this keeps ranks apart regardless."""
    if engine_id.isalnum() and engine_id.isascii() and len(engine_id) <= 20:
        return f"coserve-sp-{engine_id}"
    safe = "".join(ch for ch in engine_id if ch.isascii() and ch.isalnum())[:9]
    digest = hashlib.blake2s(engine_id.encode(), digest_size=5).hexdigest()
    return f"coserve-sp-{safe}{digest}"


@dataclass(frozen=True)
class PostedStep:
    """What the scheduler says about the step in flight."""

    step_id: int
    started_s: float
    predicted_s: float
    min_rank: int
    num_layers: int


class SafepointBoard:
    """One engine's board; ``create`` in the scheduler, ``attach`` everywhere else."""

    exit_slots = EXIT_SLOTS  # the ring's length (a test sets 1: every step's exit in one word, as before)

    def __init__(self, memory: shared_memory.SharedMemory, owner: bool) -> None:
        self._memory = memory
        buffer = memory.buf
        if buffer is None:  # pragma: no cover - only after close()
            raise ValueError(f"shared memory {memory.name} is closed")
        self._buffer: memoryview = buffer
        self.owner = owner

    @classmethod
    def create(cls, name: str) -> SafepointBoard:
        """Create (or reset) the board; called once by the scheduler when the engine starts."""
        try:
            memory = shared_memory.SharedMemory(name=name, create=True, size=BOARD_SIZE)
        except FileExistsError:  # a previous engine with this id died without cleaning up
            memory = shared_memory.SharedMemory(name=name, create=False)
        board = cls(memory, owner=True)
        board._buffer[:BOARD_SIZE] = bytes(BOARD_SIZE)
        exits = [_AGREED_EXITS + 8 * slot for slot in range(EXIT_SLOTS)]
        for offset in (_ABORT_STEP, _ABANDONED_STEP, _RUNNING_STEP, *exits):
            board._put_int(offset, _NO_STEP)
        return board

    @classmethod
    def attach(cls, name: str) -> SafepointBoard | None:
        """Attach to an existing board, or ``None`` when the engine has not created it (yet)."""
        try:
            memory = shared_memory.SharedMemory(name=name, create=False)
        except FileNotFoundError:
            return None
        # NOTE: only the creator may unlink; stop this process's tracker from doing it at exit.
        with contextlib.suppress(AttributeError, KeyError, ValueError):
            resource_tracker.unregister(getattr(memory, "_name", "/" + memory.name), "shared_memory")
        return cls(memory, owner=False)

    @staticmethod
    def remove(name: str) -> None:
        """Unlink a board left behind by an engine that was killed before its scheduler shut down."""
        with contextlib.suppress(FileNotFoundError):
            memory = shared_memory.SharedMemory(name=name, create=False)
            memory.close()
            memory.unlink()

    def close(self) -> None:
        self._buffer.release()
        self._memory.close()
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                self._memory.unlink()

    # --- scheduler side ----------------------------------------------------------------------------

    def post_step(self, step: PostedStep) -> None:
        """Publish the step being dispatched (running_step last, so readers never see a torn step)."""
        self._put_float(_STARTED_S, step.started_s)
        self._put_float(_PREDICTED_S, step.predicted_s)
        self._put_int(_MIN_RANK, step.min_rank)
        self._put_int(_NUM_LAYERS, step.num_layers)
        self._put_int(_RUNNING_STEP, step.step_id)

    def clear_step(self) -> None:
        self._put_int(_RUNNING_STEP, _NO_STEP)

    def take_abandoned(self, step_id: int) -> bool:
        """True (once) if the workers abandoned ``step_id``."""
        if self._get_int(_ABANDONED_STEP) == step_id:
            self._put_int(_ABANDONED_STEP, _NO_STEP)
            return True
        return False

    def paused(self) -> bool:
        """Whether safepoints are paused; read by the scheduler once per step."""
        return self._get_int(_PAUSED) != 0

    def pause(self, paused: bool = True) -> None:
        """Pause (or resume) the safepoints from the next step on; the running step keeps its setting."""
        self._put_int(_PAUSED, 1 if paused else 0)

    # --- API server side ---------------------------------------------------------------------------

    def posted_step(self) -> PostedStep | None:
        step_id = self._get_int(_RUNNING_STEP)
        if step_id == _NO_STEP:
            return None
        return PostedStep(
            step_id,
            self._get_float(_STARTED_S),
            self._get_float(_PREDICTED_S),
            self._get_int(_MIN_RANK),
            self._get_int(_NUM_LAYERS),
        )

    def request_abort(self, step_id: int) -> None:
        """Ask the workers to abandon ``step_id`` at their next layer boundary."""
        self._put_float(_ABORT_RAISED_S, time.time())
        self._put_int(_NUM_ABORT_REQUESTS, self._get_int(_NUM_ABORT_REQUESTS) + 1)
        self._put_int(_ABORT_STEP, step_id)

    # --- worker side -------------------------------------------------------------------------------

    def abort_requested(self, step_id: int) -> bool:
        """The per-layer check: one 8-byte read and a compare."""
        return self._get_int(_ABORT_STEP) == step_id

    def agree_exit(self, step_id: int, index: int) -> None:
        """The TP leader's word: every rank leaves ``step_id`` at safepoint ``index`` (one 8-byte write, in
        ``step_id``'s slot of the ring, so a follower still in an earlier step keeps that step's exit)."""
        if not 0 <= index < _SAFEPOINTS_PER_STEP:
            raise ValueError(f"safepoint index {index} is outside 0..{_SAFEPOINTS_PER_STEP - 1}")
        self._put_int(self._exit_offset(step_id), step_id * _SAFEPOINTS_PER_STEP + index)

    def agreed_exit(self, step_id: int) -> tuple[int, int]:
        """``(step id, safepoint index)`` in ``step_id``'s slot: that step's agreed exit, or an older step's
        that shares the slot (step id -1: none yet). Read at every safepoint by every TP rank."""
        word = self._get_int(self._exit_offset(step_id))
        if word < 0:
            return _NO_STEP, -1
        slot_step_id, index = divmod(word, _SAFEPOINTS_PER_STEP)
        return slot_step_id, index

    def mark_abandoned(self, step_id: int) -> None:
        self._put_float(_EXIT_S, time.time())
        self._put_int(_NUM_PREEMPTIONS, self._get_int(_NUM_PREEMPTIONS) + 1)
        self._put_int(_ABANDONED_STEP, step_id)

    # --- measurements ------------------------------------------------------------------------------

    def aborted_step(self) -> int:
        """The step id of the last abort request (benchmarks)."""
        return self._get_int(_ABORT_STEP)

    def last_abort_raised_s(self) -> float:
        """Wall time of the last abort request (benchmarks)."""
        return self._get_float(_ABORT_RAISED_S)

    def last_exit_s(self) -> float:
        """Wall time the workers last left a step at a safepoint (benchmarks)."""
        return self._get_float(_EXIT_S)

    @property
    def num_preemptions(self) -> int:
        """Steps the workers abandoned."""
        return self._get_int(_NUM_PREEMPTIONS)

    @property
    def num_abort_requests(self) -> int:
        """Aborts raised (some reach a step that has already finished, and abandon nothing)."""
        return self._get_int(_NUM_ABORT_REQUESTS)

    def _exit_offset(self, step_id: int) -> int:
        return _AGREED_EXITS + 8 * (step_id % self.exit_slots)

    def _get_int(self, offset: int) -> int:
        return int(struct.unpack_from("<q", self._buffer, offset)[0])

    def _put_int(self, offset: int, value: int) -> None:
        struct.pack_into("<q", self._buffer, offset, value)

    def _get_float(self, offset: int) -> float:
        return float(struct.unpack_from("<d", self._buffer, offset)[0])

    def _put_float(self, offset: int, value: float) -> None:
        struct.pack_into("<d", self._buffer, offset, value)


def safepoint_counters(metrics_text: str) -> tuple[float, float]:
    """``coserve:safepoint_seconds_total`` and ``coserve:safepoint_steps_total`` from an engine's /metrics
    text (benchmarks and tests read the time workers spend at safepoints per step with it)."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {"coserve:safepoint_seconds_total": 0.0, "coserve:safepoint_steps_total": 0.0}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name] += sample.value
    return values["coserve:safepoint_seconds_total"], values["coserve:safepoint_steps_total"]
