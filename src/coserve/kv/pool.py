"""The host KV pool's bookkeeping: which token blocks it holds, in which slot, and what to drop when it is full.

Who calls it: the scheduler half of ``coserve.engine.connector.CoServeConnector``,
once per step (``build_connector_meta``) and when vLLM asks how much of a
request's prefix it can load (``get_num_new_matched_tokens``). The worker half
owns the bytes (one preallocated host tensor of ``capacity`` slots) and does
what the bookkeeping says; nothing here touches memory or tensors.

A block is named by a chain hash of every token up to its end (``block_hashes``),
so the same prefix has the same names in every process of a pool: a prefiller's
blocks are a decoder's blocks, and a conversation's turn 2 finds turn 1's.

Rules:

- The pool never holds more than ``capacity`` blocks (the hard byte bound over
  the bytes of one block). When it is full, the victim is the unpinned block of
  the least important class (highest rank), then the longest idle, then the
  furthest into its conversation (a prefix missing its head is useless). A block
  is only ever evicted for a block of the same or a more important class;
  otherwise the new block is dropped (counted) and its request will recompute.
- ``class_shares`` caps the fraction of the pool a class may hold: a class at
  its cap evicts its own coldest block or drops the new one.
- A block reserved in a step is usable only once that step completed
  (``commit``); an abandoned step's reservations are released (``abort_before``).
- Blocks being loaded in a step are pinned for that step and never evicted.

Cost: no call scans the pool. This runs in vLLM's engine-core loop, every step,
so a step costs O(log n) per block it looks up, reserves, evicts, pins or
commits, whether the pool holds 1,000 blocks or 100,000 (benchmarks/kv_pool.py).
The evictable blocks are indexed in eviction order (``_ColdestFirst``, one per
class and rank), and the reservations not committed yet by step (``_pending``);
the indexes' lazy heaps are rebuilt when their stale items outnumber the live
ones, which costs O(1) amortized per removal.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["BlockHash", "HostPool", "PoolStats", "block_hashes", "copy_budget"]

BlockHash = bytes


def block_hashes(
    token_ids: Sequence[int], block_size: int, salt: bytes, known: Sequence[BlockHash] = ()
) -> list[BlockHash]:
    """Chain hashes of every full block of ``token_ids``; ``known`` (earlier hashes of the same tokens) is reused."""
    hashes = list(known)
    previous = hashes[-1] if hashes else salt
    for index in range(len(hashes), len(token_ids) // block_size):
        chunk = array("q", token_ids[index * block_size : (index + 1) * block_size]).tobytes()
        previous = hashlib.blake2b(previous + chunk, digest_size=16).digest()
        hashes.append(previous)
    return hashes


def copy_budget(predicted_step_s: float, fraction: float, bandwidth_bytes_per_s: float, block_bytes: int) -> int:
    """How many blocks a step may copy out: ``fraction`` of its predicted time at the copy bandwidth (at least 1)."""
    if block_bytes <= 0:
        return 0
    return max(1, int(fraction * max(predicted_step_s, 0.0) * bandwidth_bytes_per_s // block_bytes))


@dataclass(slots=True, eq=False)
class _Entry:
    slot: int
    class_name: str
    rank: int  # 0 = most important class
    position: int  # block index within its conversation
    last_use: int
    step: int  # the step that reserved it
    seq: int  # when it entered the pool: of two equally cold blocks, the earlier one goes first
    committed: bool = False
    pins: int = 0
    evictable: bool = False  # in its class's eviction index (committed and unpinned)


@dataclass
class PoolStats:
    """Counters since start (monotonic), and the occupancy now."""

    hits: int = 0  # blocks found for a request
    misses: int = 0  # lookups that stopped at a block the pool does not hold
    saved: int = 0  # blocks reserved for a copy-out
    dropped: int = 0  # blocks not kept: pool (or the class's share) full of more important blocks
    evicted: int = 0  # blocks removed to make room
    aborted: int = 0  # reservations of abandoned steps
    by_class: dict[str, int] = field(default_factory=dict)


class _Group:
    """The evictable blocks of one class last used at one time, furthest into its conversation first, then earliest.

    ``heap`` is lazy: a block that left the group keeps its item until the item surfaces (or the heap is rebuilt,
    once stale items outnumber members, which is amortized O(1) per removal).
    """

    __slots__ = ("heap", "members")

    def __init__(self) -> None:
        self.members: dict[BlockHash, _Entry] = {}
        self.heap: list[tuple[int, int, BlockHash]] = []  # (-position, seq, block)

    def add(self, block: BlockHash, entry: _Entry) -> None:
        self.members[block] = entry
        heapq.heappush(self.heap, (-entry.position, entry.seq, block))
        if len(self.heap) > 2 * len(self.members) + 16:
            self.heap = [(-e.position, e.seq, b) for b, e in self.members.items()]
            heapq.heapify(self.heap)

    def first(self) -> BlockHash:
        """The group's first victim (the group is not empty)."""
        heap, members = self.heap, self.members
        while True:
            _, seq, block = heap[0]
            entry = members.get(block)
            if entry is not None and entry.seq == seq:
                return block
            heapq.heappop(heap)


class _ColdestFirst:
    """The evictable blocks of one (class, rank) in eviction order: the longest idle, then the furthest into its
    conversation, then the earliest to enter the pool. Adding, removing and finding the first cost O(log n).

    Blocks are grouped by last use; ``_times`` is a min-heap of the last uses that have a group, lazy like a
    group's heap (an emptied group's time stays until it surfaces or the heap is rebuilt). A step's touches all
    share its time, the newest: pushing it is O(1).
    """

    __slots__ = ("_groups", "_times")

    def __init__(self) -> None:
        self._groups: dict[int, _Group] = {}
        self._times: list[int] = []

    def add(self, block: BlockHash, entry: _Entry) -> None:
        group = self._groups.get(entry.last_use)
        if group is None:
            group = self._groups[entry.last_use] = _Group()
            heapq.heappush(self._times, entry.last_use)
            if len(self._times) > 2 * len(self._groups) + 16:
                self._times = list(self._groups)
                heapq.heapify(self._times)
        group.add(block, entry)

    def discard(self, block: BlockHash, entry: _Entry) -> None:
        group = self._groups[entry.last_use]
        del group.members[block]
        if not group.members:
            del self._groups[entry.last_use]

    def first(self) -> BlockHash | None:
        times, groups = self._times, self._groups
        while times:
            group = groups.get(times[0])
            if group is not None:
                return group.first()
            heapq.heappop(times)
        return None


class HostPool:
    """Bookkeeping of a pool of ``capacity`` block slots."""

    def __init__(self, capacity: int, class_shares: Mapping[str, float] | None = None) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must not be negative, got {capacity}")
        self.capacity = capacity
        self._shares = dict(class_shares or {})
        self._free = list(range(capacity - 1, -1, -1))
        self._entries: dict[BlockHash, _Entry] = {}
        self._seq = 0
        # step -> its reservations not committed yet, in the order they were made
        self._pending: dict[int, dict[BlockHash, _Entry]] = {}
        self._evictable: dict[tuple[str, int], _ColdestFirst] = {}
        self.stats = PoolStats()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block: object) -> bool:
        entry = self._entries.get(block) if isinstance(block, bytes) else None
        return entry is not None and entry.committed

    def slot(self, block: BlockHash) -> int:
        return self._entries[block].slot

    def lookup(self, blocks: Sequence[BlockHash], now: int) -> int:
        """How many of ``blocks``, from the first, the pool holds (committed); they count as used ``now``."""
        found = 0
        for block in blocks:
            entry = self._entries.get(block)
            if entry is None or not entry.committed:
                self.stats.misses += 1
                break
            self._touch(block, entry, now)
            found += 1
        self.stats.hits += found
        return found

    def pin(self, blocks: Sequence[BlockHash]) -> None:
        for block in blocks:
            entry = self._entries[block]
            if entry.evictable:
                self._hold(block, entry)
            entry.pins += 1

    def unpin(self, blocks: Sequence[BlockHash]) -> None:
        for block in blocks:
            entry = self._entries.get(block)
            if entry is not None and entry.pins > 0:
                entry.pins -= 1
                if not entry.pins and entry.committed:
                    self._release(block, entry)

    def reserve(self, block: BlockHash, class_name: str, rank: int, position: int, now: int, step: int) -> int | None:
        """A slot for a new block, evicting if needed; ``None``: already held, or dropped (see the module rules)."""
        held = self._entries.get(block)
        if held is not None or self.capacity == 0:
            if held is not None:
                self._touch(block, held, now)
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
            self._remove(victim)
            slot = self._free.pop()  # the freed slot goes straight to the new block
            self.stats.evicted += 1
        self._seq += 1
        entry = self._entries[block] = _Entry(slot, class_name, rank, position, now, step, self._seq)
        self._pending.setdefault(step, {})[block] = entry
        self.stats.by_class[class_name] = self.stats.by_class.get(class_name, 0) + 1
        self.stats.saved += 1
        return slot

    def commit(self, step: int) -> None:
        """``step`` completed: its copies are in the pool."""
        for block, entry in self._pending.pop(step, {}).items():
            entry.committed = True
            if not entry.pins:
                self._release(block, entry)

    def abort_before(self, step: int) -> None:
        """Steps before ``step`` that never completed were abandoned: their copies may be partial, release them."""
        stale = [s for s in self._pending if s < step]  # the steps still copying: one or two, not the pool
        if not stale:
            return
        abandoned = [(entry.seq, block) for s in stale for block, entry in self._pending.pop(s).items()]
        abandoned.sort()  # in the order they entered the pool, as the slots were always freed
        for _, block in abandoned:
            self._remove(block)
            self.stats.aborted += 1

    def clear(self) -> None:
        """Forget every block (an operator's reset); counters are kept."""
        for entry in self._entries.values():
            self.stats.by_class[entry.class_name] -= 1
            self._free.append(entry.slot)
        self._entries.clear()
        self._pending.clear()
        self._evictable.clear()

    def occupancy(self) -> float:
        return len(self._entries) / self.capacity if self.capacity else 0.0

    def _touch(self, block: BlockHash, entry: _Entry, now: int) -> None:
        if entry.last_use == now:
            return
        if entry.evictable:
            index = self._evictable[entry.class_name, entry.rank]
            index.discard(block, entry)
            entry.last_use = now
            index.add(block, entry)
        else:
            entry.last_use = now

    def _release(self, block: BlockHash, entry: _Entry) -> None:
        """``entry`` (committed, unpinned) may be evicted from now on."""
        index = self._evictable.get((entry.class_name, entry.rank))
        if index is None:
            index = self._evictable[entry.class_name, entry.rank] = _ColdestFirst()
        index.add(block, entry)
        entry.evictable = True

    def _hold(self, block: BlockHash, entry: _Entry) -> None:
        """``entry`` may not be evicted until released."""
        self._evictable[entry.class_name, entry.rank].discard(block, entry)
        entry.evictable = False

    def _victim(self, own_class: str | None, rank: int) -> BlockHash | None:
        """The evictable block of the highest rank (at least ``rank``; of ``own_class`` if given), then the longest
        idle, then the furthest into its conversation, then the earliest to enter the pool."""
        best: tuple[int, int, int, int] | None = None
        victim: BlockHash | None = None
        for (class_name, class_rank), index in self._evictable.items():  # one per class, not per block
            if class_rank < rank:  # never evict a more important class's block for this one
                continue
            if own_class is not None and class_name != own_class:
                continue
            block = index.first()
            if block is None:
                continue
            entry = self._entries[block]
            key = (entry.rank, -entry.last_use, entry.position, -entry.seq)
            if best is None or key > best:
                best, victim = key, block
        return victim

    def _remove(self, block: BlockHash) -> int:
        entry = self._entries.pop(block)
        if entry.evictable:
            self._hold(block, entry)
        elif not entry.committed:
            pending = self._pending.get(entry.step)
            if pending is not None:
                pending.pop(block, None)
                if not pending:
                    del self._pending[entry.step]
        self.stats.by_class[entry.class_name] -= 1
        self._free.append(entry.slot)
        return entry.slot
