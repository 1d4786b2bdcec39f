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
"""

from __future__ import annotations

import hashlib
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


@dataclass
class _Entry:
    slot: int
    class_name: str
    rank: int  # 0 = most important class
    position: int  # block index within its conversation
    last_use: int
    step: int  # the step that reserved it
    committed: bool = False
    pins: int = 0


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


class HostPool:
    """Bookkeeping of a pool of ``capacity`` block slots."""

    def __init__(self, capacity: int, class_shares: Mapping[str, float] | None = None) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must not be negative, got {capacity}")
        self.capacity = capacity
        self._shares = dict(class_shares or {})
        self._free = list(range(capacity - 1, -1, -1))
        self._entries: dict[BlockHash, _Entry] = {}
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
        """A slot for a new block, evicting if needed; ``None``: already held, or dropped (see the module rules)."""
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
            self._free.remove(slot)  # the freed slot goes straight to the new block
            self.stats.evicted += 1
        self._entries[block] = _Entry(slot, class_name, rank, position, now, step)
        self.stats.by_class[class_name] = self.stats.by_class.get(class_name, 0) + 1
        self.stats.saved += 1
        return slot

    def commit(self, step: int) -> None:
        """``step`` completed: its copies are in the pool."""
        for entry in self._entries.values():
            if entry.step == step:
                entry.committed = True

    def abort_before(self, step: int) -> None:
        """Steps before ``step`` that never completed were abandoned: their copies may be partial, release them."""
        for block in [b for b, e in self._entries.items() if e.step < step and not e.committed]:
            self._remove(block)
            self.stats.aborted += 1

    def clear(self) -> None:
        """Forget every block (an operator's reset); counters are kept."""
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
            if entry.rank < rank:  # never evict a more important class's block for this one
                continue
            key = (entry.rank, -entry.last_use, entry.position)
            if best is None or key > best:
                best, victim = key, block
        return victim

    def _remove(self, block: BlockHash) -> int:
        entry = self._entries.pop(block)
        self.stats.by_class[entry.class_name] -= 1
        self._free.append(entry.slot)
        return entry.slot
