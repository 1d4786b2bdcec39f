"""The indexed host pool (coserve.kv.pool.HostPool) against a naive pool of the same rules, op by op.

``NaivePool`` is the pool as it was before its eviction order was indexed: it
scans every entry to find a victim, to commit a step and to release an
abandoned one, which makes it slow but obviously right. Over random sequences
of every operation (non-monotone times and steps included, so that ties and
odd orders happen), both must return the same, evict the same blocks into the
same slots, and keep the same counters.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coserve.kv.pool import BlockHash, HostPool, PoolStats

CLASSES = [("interactive", 0), ("standard", 1), ("batch", 1), ("offline", 2)]  # two classes share rank 1


@dataclass
class _NaiveEntry:
    slot: int
    class_name: str
    rank: int
    position: int
    last_use: int
    step: int
    committed: bool = False
    pins: int = 0


class NaivePool:
    """The reference: the same rules (see coserve.kv.pool), every decision by a scan of all entries."""

    def __init__(self, capacity: int, class_shares: Mapping[str, float] | None = None) -> None:
        self.capacity = capacity
        self._shares = dict(class_shares or {})
        self._free = list(range(capacity - 1, -1, -1))
        self._entries: dict[BlockHash, _NaiveEntry] = {}
        self.stats = PoolStats()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block: object) -> bool:
        entry = self._entries.get(block) if isinstance(block, bytes) else None
        return entry is not None and entry.committed

    def slot(self, block: BlockHash) -> int:
        return self._entries[block].slot

    def lookup(self, blocks: Sequence[BlockHash], now: int) -> int:
        found = 0
        for block in blocks:
            entry = self._entries.get(block)
            if entry is None or not entry.committed:
                self.stats.misses += 1
                break
            entry.last_use = now
            found += 1
        self.stats.hits += found
        return found

    def pin(self, blocks: Sequence[BlockHash]) -> None:
        for block in blocks:
            self._entries[block].pins += 1

    def unpin(self, blocks: Sequence[BlockHash]) -> None:
        for block in blocks:
            entry = self._entries.get(block)
            if entry is not None and entry.pins > 0:
                entry.pins -= 1

    def reserve(self, block: BlockHash, class_name: str, rank: int, position: int, now: int, step: int) -> int | None:
        if block in self._entries or self.capacity == 0:
            if block in self._entries:
                self._entries[block].last_use = now
            else:
                self.stats.dropped += 1
            return None
        at_share = self.stats.by_class.get(class_name, 0) >= self._shares.get(class_name, 1.0) * self.capacity
        if self._free and not at_share:
            slot = self._free.pop()
        else:
            victim = self._victim(class_name if at_share else None, rank)
            if victim is None:
                self.stats.dropped += 1
                return None
            slot = self._remove(victim)
            self._free.remove(slot)
            self.stats.evicted += 1
        self._entries[block] = _NaiveEntry(slot, class_name, rank, position, now, step)
        self.stats.by_class[class_name] = self.stats.by_class.get(class_name, 0) + 1
        self.stats.saved += 1
        return slot

    def commit(self, step: int) -> None:
        for entry in self._entries.values():
            if entry.step == step:
                entry.committed = True

    def abort_before(self, step: int) -> None:
        for block in [b for b, e in self._entries.items() if e.step < step and not e.committed]:
            self._remove(block)
            self.stats.aborted += 1

    def clear(self) -> None:
        for block in list(self._entries):
            self._remove(block)

    def occupancy(self) -> float:
        return len(self._entries) / self.capacity if self.capacity else 0.0

    def _victim(self, own_class: str | None, rank: int) -> BlockHash | None:
        best: tuple[int, int, int] | None = None
        victim: BlockHash | None = None
        for block, entry in self._entries.items():
            if entry.pins or not entry.committed:
                continue
            if own_class is not None and entry.class_name != own_class:
                continue
            if entry.rank < rank:
                continue
            key = (entry.rank, -entry.last_use, entry.position)
            if best is None or key > best:  # strict: of equal keys, the first held wins
                best, victim = key, block
        return victim

    def _remove(self, block: BlockHash) -> int:
        entry = self._entries.pop(block)
        self.stats.by_class[entry.class_name] -= 1
        self._free.append(entry.slot)
        return entry.slot


def h(index: int) -> bytes:
    return index.to_bytes(16, "big")


def state(pool: Any) -> tuple[Any, ...]:
    """Everything observable: the held blocks in order with their bookkeeping, the free slots, the counters."""
    entries = [
        (b, e.slot, e.class_name, e.rank, e.position, e.last_use, e.step, e.committed, e.pins)
        for b, e in pool._entries.items()
    ]
    return entries, list(pool._free), asdict(pool.stats), len(pool), pool.occupancy()


def apply(pool: Any, op: tuple[Any, ...]) -> Any:
    """Run one operation; its result, or the type of the exception it raised."""
    name, *args = op
    try:
        if name == "reserve":
            block, cls, position, now, step = args
            return pool.reserve(h(block), CLASSES[cls][0], CLASSES[cls][1], position, now, step)
        if name == "lookup":
            blocks, now = args
            found = pool.lookup([h(b) for b in blocks], now)
            return found, [pool.slot(h(b)) for b in blocks[:found]]
        if name == "load":  # what the planner does for a request it reloads: look up, then pin what was found
            blocks, now = args
            found = pool.lookup([h(b) for b in blocks], now)
            pool.pin([h(b) for b in blocks[:found]])
            return found
        if name == "pin":
            return pool.pin([h(b) for b in args[0]])
        if name == "unpin":
            return pool.unpin([h(b) for b in args[0]])
        if name == "commit":
            return pool.commit(args[0])
        if name == "abort_before":
            return pool.abort_before(args[0])
        if name == "contains":
            return h(args[0]) in pool
        if name == "clear":
            return pool.clear()
    except KeyError as error:
        return ("KeyError", error.args)
    raise AssertionError(f"unknown op {name}")


def run_both(capacity: int, shares: dict[str, float], ops: Sequence[tuple[Any, ...]]) -> HostPool:
    pool, naive = HostPool(capacity, shares), NaivePool(capacity, shares)
    for index, op in enumerate(ops):
        assert apply(pool, op) == apply(naive, op), f"op {index}: {op}"
        assert state(pool) == state(naive), f"after op {index}: {op}"
    return pool


BLOCK = st.integers(0, 9)
TIME = st.integers(0, 6)
STEP = st.integers(0, 5)
OPS = st.one_of(
    st.tuples(st.just("reserve"), BLOCK, st.integers(0, len(CLASSES) - 1), st.integers(0, 3), TIME, STEP),
    st.tuples(st.just("lookup"), st.lists(BLOCK, max_size=4), TIME),
    st.tuples(st.just("pin"), st.lists(BLOCK, max_size=3)),
    st.tuples(st.just("unpin"), st.lists(BLOCK, max_size=3)),
    st.tuples(st.just("commit"), STEP),
    st.tuples(st.just("abort_before"), STEP),
    st.tuples(st.just("contains"), BLOCK),
    st.tuples(st.just("clear")),
)
SHARES = st.dictionaries(st.sampled_from([c for c, _ in CLASSES]), st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]))


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(0, 6), shares=SHARES, ops=st.lists(OPS, max_size=60))
def test_the_pool_decides_as_the_naive_pool_over_any_sequence(
    capacity: int, shares: dict[str, float], ops: list[tuple[Any, ...]]
) -> None:
    run_both(capacity, shares, ops)


@st.composite
def engine_steps(draw: st.DrawFn) -> list[tuple[Any, ...]]:
    """What the planner does: per step, abort the unfinished, look up and pin, reserve at now = step, commit, unpin;
    sometimes a step is abandoned (never committed)."""
    ops: list[tuple[Any, ...]] = []
    for step in range(1, draw(st.integers(1, 12)) + 1):
        ops.append(("abort_before", step))
        looked = draw(st.lists(st.integers(0, 15), max_size=4))
        ops.append(("load", looked, step))
        for _ in range(draw(st.integers(0, 5))):
            cls = draw(st.integers(0, len(CLASSES) - 1))
            ops.append(("reserve", draw(st.integers(0, 15)), cls, draw(st.integers(0, 3)), step, step))
        if draw(st.booleans()) or step % 5:
            ops += [("commit", step), ("unpin", looked)]
    return ops


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 8), shares=SHARES, ops=engine_steps())
def test_the_pool_decides_as_the_naive_pool_step_by_step(
    capacity: int, shares: dict[str, float], ops: list[tuple[Any, ...]]
) -> None:
    run_both(capacity, shares, ops)


@pytest.mark.parametrize(("times", "seed"), [(3, 1), (50, 2), (2000, 3)])
def test_long_random_runs_agree_through_the_indexes_rebuilds(times: int, seed: int) -> None:
    """Thousands of operations on a pool of 40: few distinct times make big groups that blocks leave and rejoin
    (a group's heap is rebuilt), many make many groups that empty (the heap of times is rebuilt)."""
    rng = random.Random(seed)
    ops: list[tuple[Any, ...]] = []
    for _ in range(6000):
        kind = rng.random()
        if kind < 0.45:
            cls = rng.randrange(len(CLASSES))
            ops.append(("reserve", rng.randrange(120), cls, rng.randrange(8), rng.randrange(times), rng.randrange(6)))
        elif kind < 0.6:
            ops.append(("load", [rng.randrange(120) for _ in range(rng.randrange(6))], rng.randrange(times)))
        elif kind < 0.7:
            ops.append(("lookup", [rng.randrange(120) for _ in range(rng.randrange(6))], rng.randrange(times)))
        elif kind < 0.8:
            ops.append(("pin", [rng.randrange(120) for _ in range(rng.randrange(3))]))
        elif kind < 0.9:
            ops.append(("unpin", [rng.randrange(120) for _ in range(rng.randrange(4))]))
        elif kind < 0.97:
            ops.append(("commit", rng.randrange(6)))
        else:
            ops.append(("abort_before", rng.randrange(6)))
    run_both(40, {"offline": 0.3}, ops)
