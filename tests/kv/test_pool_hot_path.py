"""The host pool's per-step work does not grow with the pool (coserve.kv.pool runs inside vLLM's engine-core loop).

The same steps (what the planner does once per step: release the abandoned,
look up and pin a returning conversation, reserve a new one's blocks with the
pool full, commit, unpin) run on a pool of 500 blocks and one of 20,000. Each
block's bookkeeping is an ``_Entry``; a counting one tells how many entry reads
a step makes, and a dict that refuses iteration tells whether anything walks
the pool's table. A scan of the pool (the old ``commit``, ``abort_before`` and
victim search) fails both.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from coserve.kv import pool as pool_module
from coserve.kv.pool import HostPool

CONVERSATION = 16  # blocks a step reserves, and a returning conversation reloads


class CountingEntry(pool_module._Entry):
    reads: ClassVar[int] = 0

    def __getattribute__(self, name: str) -> Any:
        CountingEntry.reads += 1
        return object.__getattribute__(self, name)


class NoScan(dict[bytes, Any]):
    """The pool's table, refusing to be walked: lookups by key only."""

    def __iter__(self) -> Any:
        raise AssertionError("the pool's table was scanned on the hot path")

    keys = values = items = copy = __reversed__ = __iter__


def blocks_of(conversation: int) -> list[bytes]:
    return [(conversation * CONVERSATION + i).to_bytes(16, "big") for i in range(CONVERSATION)]


def filled(size: int) -> tuple[HostPool, int]:
    """A full pool of ``size`` blocks: one conversation reserved and committed per step; the next step."""
    pool = HostPool(size)
    step = 0
    for step in range(1, size // CONVERSATION + 1):
        for position, block in enumerate(blocks_of(step)):
            pool.reserve(block, "standard", 1, position, step, step)
        pool.commit(step)
    return pool, step + 1


def one_step(pool: HostPool, step: int) -> None:
    """A planner's step: a recent conversation returns, a new one is copied out (the pool is full, so each of its
    blocks evicts one); every 7th step is abandoned (never committed)."""
    pool.abort_before(step)
    returning = blocks_of(step - 2 if (step - 2) % 7 else step - 3)
    found = pool.lookup(returning, step)
    assert found == CONVERSATION
    slots = [pool.slot(block) for block in returning[:found]]
    assert len(set(slots)) == found
    pool.pin(returning[:found])
    for position, block in enumerate(blocks_of(step)):
        assert pool.reserve(block, "standard", 1, position, step, step) is not None
    if step % 7:
        pool.commit(step)
    pool.unpin(returning[:found])


def reads_per_step(size: int, steps: int, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    monkeypatch.setattr(pool_module, "_Entry", CountingEntry)
    pool, first = filled(size)
    assert len(pool) == size - size % CONVERSATION
    reads = []
    for step in range(first, first + steps):
        CountingEntry.reads = 0
        one_step(pool, step)
        reads.append(CountingEntry.reads)
    return reads


def test_a_step_reads_as_many_entries_in_a_pool_of_20000_blocks_as_in_one_of_500(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    small = reads_per_step(500, 60, monkeypatch)
    large = reads_per_step(20_000, 60, monkeypatch)
    # the blocks a step touches (16 looked up and pinned, 16 evicted, 16 reserved and committed) cost a few reads each
    assert max(large) < 40 * 3 * CONVERSATION, max(large)
    assert sum(large) <= 1.1 * sum(small), (sum(large), sum(small))


def test_no_step_walks_the_pools_table() -> None:
    pool = HostPool(2_000)
    pool._entries = NoScan()
    step = 0
    for step in range(1, 2_000 // CONVERSATION + 1):
        for position, block in enumerate(blocks_of(step)):
            pool.reserve(block, "standard", 1, position, step, step)
        pool.commit(step)
    for later in range(step + 1, step + 40):
        one_step(pool, later)
    assert pool.stats.evicted > 0 and pool.stats.aborted > 0
