"""The host KV pool's per-step bookkeeping cost, from 1k to 100k pooled blocks, against the pool it replaced.

``coserve.kv.pool.HostPool`` runs in vLLM's engine-core loop: once per step the
planner (``coserve.engine.offload.OffloadPlanner``) releases abandoned copies
(``abort_before``), looks up and pins the prefixes of requests it reloads
(``lookup``, ``slot``, ``pin``), reserves slots for the step's new blocks
(``reserve``, evicting when full), and when the step completed commits them
and unpins (``commit``, ``unpin``). This times exactly that sequence, on a full
pool of 1,000, 10,000 and 100,000 blocks:

- a step reloads two recent interactive conversations (2 x 16 blocks: looked
  up, their slots read, pinned, unpinned) and copies out two new ones (2 x 16
  blocks, one interactive, one standard or offline in turn); the pool is full,
  so each of the 32 reservations evicts (class shares 0.5/0.3/0.2: every class
  sits at its share and evicts its own coldest block), 64 blocks touched;
- the pool starts full (filled one conversation pair per step, committed), and
  is warmed up by steps before the clock runs;
- the baseline, ``OldPool``, is the previous ``HostPool`` copied into this file
  (it scanned every entry to commit, to release and to find each victim), run
  in the same process on the same steps; both are checked to decide the same
  (same slots, same counters) before anything is timed.

Sizes and pools are interleaved in rounds, in a new random order each round,
so a load change on this shared machine hits all of them. The garbage
collector is off while the clock runs, as ``timeit`` does (``--gc`` leaves it
on): neither pool makes reference cycles, and a collection's cost depends on
what else the process allocated, not on this step (at 100k blocks, new blocks
live long enough to be promoted, so collections land in that pool's steps and
its p99 grows with gc on; the medians stay flat). Per step: median and
p99 (µs), a 95 % bootstrap confidence interval of the median, and each pool's
100k/1k ratio of medians (with its bootstrap interval). Target: the new pool's
ratio at most 1.5.

    .venv/bin/python benchmarks/kv_pool.py      # ~1.5 minutes

Writes benchmarks/results/kv_pool.json.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
from harness.results import Table, write_result
from harness.stats import percentile, say

from coserve.kv.pool import BlockHash, HostPool, PoolStats

SIZES = (1_000, 10_000, 100_000)
CONVERSATION = 16  # blocks
CLASSES = (("interactive", 0), ("standard", 1), ("offline", 2))
SHARES = {"interactive": 0.5, "standard": 0.3, "offline": 0.2}
TARGET_RATIO = 1.5


class Pool(Protocol):
    stats: PoolStats

    def __len__(self) -> int: ...
    def slot(self, block: BlockHash) -> int: ...
    def lookup(self, blocks: Sequence[BlockHash], now: int) -> int: ...
    def pin(self, blocks: Sequence[BlockHash]) -> None: ...
    def unpin(self, blocks: Sequence[BlockHash]) -> None: ...
    def reserve(
        self, block: BlockHash, class_name: str, rank: int, position: int, now: int, step: int
    ) -> int | None: ...
    def commit(self, step: int) -> None: ...
    def abort_before(self, step: int) -> None: ...


@dataclass
class _OldEntry:
    slot: int
    class_name: str
    rank: int  # 0 = most important class
    position: int  # block index within its conversation
    last_use: int
    step: int  # the step that reserved it
    committed: bool = False
    pins: int = 0


class OldPool:
    """coserve.kv.pool.HostPool before this change (commit 971ded7), verbatim but for its name and entry type."""

    def __init__(self, capacity: int, class_shares: Mapping[str, float] | None = None) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must not be negative, got {capacity}")
        self.capacity = capacity
        self._shares = dict(class_shares or {})
        self._free = list(range(capacity - 1, -1, -1))
        self._entries: dict[BlockHash, _OldEntry] = {}
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
        self._entries[block] = _OldEntry(slot, class_name, rank, position, now, step)
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


def blocks_of(conversation: int) -> list[BlockHash]:
    return [(conversation * CONVERSATION + i).to_bytes(16, "big") for i in range(CONVERSATION)]


@dataclass
class StepWork:
    """One step's calls, built before the clock runs: (blocks, class, rank) to reload and to copy out."""

    step: int
    reloads: list[list[BlockHash]]
    saves: list[tuple[list[BlockHash], str, int]]


def work_for(step: int) -> StepWork:
    """Step ``step`` starts conversations 2·step (interactive) and 2·step+1 (standard, offline in turn); two
    interactive conversations of 2 and 5 steps ago come back."""
    other = CLASSES[1 + step % 2]
    return StepWork(
        step,
        [blocks_of(2 * (step - 2)), blocks_of(2 * (step - 5))],
        [(blocks_of(2 * step), *CLASSES[0]), (blocks_of(2 * step + 1), *other)],
    )


def run_step(pool: Pool, work: StepWork) -> int:
    """What OffloadPlanner does with the pool in one step (plan_step, matched_tokens, allocated, step_done)."""
    step = work.step
    pool.abort_before(step)
    pinned: list[BlockHash] = []
    slots: list[int] = []
    for blocks in work.reloads:
        found = pool.lookup(blocks, step)
        slots += [pool.slot(block) for block in blocks[:found]]
        pool.pin(blocks[:found])
        pinned += blocks[:found]
    for blocks, class_name, rank in work.saves:
        for position, block in enumerate(blocks):
            pool.reserve(block, class_name, rank, position, step, step)
    pool.commit(step)
    pool.unpin(pinned)
    return len(slots)


def filled(pool: Pool, size: int) -> int:
    """Fill ``pool`` to ``size`` blocks, one step's saves per step (committed); the first step after."""
    step = 5  # the first reloads look 5 steps back
    while len(pool) < size:
        step += 1
        work = work_for(step)
        run_step(pool, StepWork(step, [], work.saves))
        if step > size:
            raise RuntimeError(f"the pool never filled ({len(pool)} of {size})")
    return step + 1


def same_decisions(size: int, steps: int) -> None:
    """The new pool and the old one, on the same steps, end with the same blocks in the same slots."""
    new, old = HostPool(size, SHARES), OldPool(size, SHARES)
    first = filled(new, size)
    assert filled(old, size) == first
    for step in range(first, first + steps):
        work = work_for(step)
        assert run_step(new, work) == run_step(old, work)
    assert new.stats == old.stats, (new.stats, old.stats)
    assert {b: e.slot for b, e in new._entries.items()} == {b: e.slot for b, e in old._entries.items()}
    assert new.stats.evicted >= 32 * steps


def old_copy(pool: HostPool) -> OldPool:
    """An OldPool in the state of ``pool`` (filling one by its own steps takes minutes at 100k blocks)."""
    old = OldPool(pool.capacity, SHARES)
    old._entries = {
        block: _OldEntry(e.slot, e.class_name, e.rank, e.position, e.last_use, e.step, e.committed, e.pins)
        for block, e in pool._entries.items()
    }
    old._free = list(pool._free)
    old.stats = replace(pool.stats, by_class=dict(pool.stats.by_class))
    return old


def timed(pool: Pool, step: int, samples: list[float], *, steps: int = 0, seconds: float = 0.0) -> int:
    """Run and time ``steps`` steps (or steps for ``seconds``, at least one) from ``step``; the next step."""
    started_run = time.perf_counter()
    count = 0
    while True:
        if count and (count >= steps if steps else time.perf_counter() - started_run >= seconds):
            return step
        work = work_for(step)
        started = time.perf_counter_ns()
        run_step(pool, work)
        samples.append((time.perf_counter_ns() - started) / 1000)
        step += 1
        count += 1


def median_ci(samples: np.ndarray, rng: np.random.Generator, resamples: int) -> tuple[float, float]:
    medians = np.median(rng.choice(samples, (resamples, len(samples))), axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return float(low), float(high)


def ratio_ci(large: np.ndarray, small: np.ndarray, rng: np.random.Generator, resamples: int) -> tuple[float, float]:
    ratios = np.median(rng.choice(large, (resamples, len(large))), axis=1) / np.median(
        rng.choice(small, (resamples, len(small))), axis=1
    )
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(low), float(high)


def summary(samples_us: list[float], rng: np.random.Generator, resamples: int) -> dict[str, Any]:
    array = np.asarray(samples_us)
    return {
        "steps": len(samples_us),
        "median_us": float(np.median(array)),
        "median_ci95_us": list(median_ci(array, rng, resamples)),
        "p99_us": percentile(samples_us, 99),
        "mean_us": float(array.mean()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40, help="interleaved rounds (default 40)")
    parser.add_argument(
        "--new-steps", type=int, default=100, help="timed steps per size and round, new pool (default 100)"
    )
    parser.add_argument(
        "--old-seconds", type=float, default=0.3, help="seconds per size and round, old pool (default 0.3)"
    )
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples (default 2000)")
    parser.add_argument("--gc", action="store_true", help="leave the garbage collector on while timing")
    args = parser.parse_args()

    say("checking that both pools decide the same (1k blocks, 300 steps)")
    same_decisions(1_000, 300)

    say(f"filling pools of {', '.join(f'{n:,}' for n in SIZES)} blocks")
    pools: dict[tuple[str, int], tuple[Pool, int]] = {}
    for size in SIZES:
        new = HostPool(size, SHARES)
        next_step = filled(new, size)
        for step in range(next_step, next_step + 50):  # warm-up into the steady state, untimed
            run_step(new, work_for(step))
        pools["new", size] = (new, next_step + 50)
        pools["old", size] = (old_copy(new), next_step + 50)
    before = {size: replace(pools["new", size][0].stats) for size in SIZES}
    gc.collect()
    if not args.gc:
        gc.disable()

    samples: dict[tuple[str, int], list[float]] = {key: [] for key in pools}
    order = random.Random(0)
    for round_index in range(args.rounds):
        for name, size in order.sample(list(pools), len(pools)):  # a new order each round
            pool, step = pools[name, size]
            if name == "new":
                step = timed(pool, step, samples[name, size], steps=args.new_steps)
            else:
                step = timed(pool, step, samples[name, size], seconds=args.old_seconds)
            pools[name, size] = (pool, step)
        say(f"round {round_index + 1}/{args.rounds} done")
    gc.enable()
    for (name, size), (pool, _) in pools.items():
        assert len(pool) == size, (name, size, len(pool))
    per_step = {}  # the same work at every size: what the new pool's steps did, on average
    for size in SIZES:
        after, steps = pools["new", size][0].stats, len(samples["new", size])
        per_step[str(size)] = {
            key: (getattr(after, key) - getattr(before[size], key)) / steps
            for key in ("hits", "misses", "saved", "evicted", "dropped", "aborted")
        }

    rng = np.random.default_rng(0)
    results = {name: {str(size): summary(samples[name, size], rng, args.resamples) for size in SIZES}
               for name in ("new", "old")}  # fmt: skip
    ratios = {}
    for name in ("new", "old"):
        large, small = np.asarray(samples[name, SIZES[-1]]), np.asarray(samples[name, SIZES[0]])
        ratios[name] = (float(np.median(large) / np.median(small)), ratio_ci(large, small, rng, args.resamples))
    met = ratios["new"][0] <= TARGET_RATIO

    columns = [("blocks", 9), ("steps", 7), ("median µs", 11), ("95% CI of median", 24), ("p99 µs", 11)]
    table = Table("pool", columns, label_width=6, fmt="{:.1f}")
    for name in ("new", "old"):
        for size in SIZES:
            row = results[name][str(size)]
            low, high = row["median_ci95_us"]
            table.row(name, f"{size:,}", str(row["steps"]), row["median_us"], f"[{low:.1f}, {high:.1f}]", row["p99_us"])
    for name in ("new", "old"):
        ratio, (low, high) = ratios[name]
        print(f"{name} 100k/1k median ratio: {ratio:.2f} (95% CI {low:.2f}-{high:.2f})")
    print(f"target: new pool's 100k/1k ratio <= {TARGET_RATIO} {'met' if met else 'NOT met'}")
    write_result(
        "kv_pool",
        {
            "benchmark": "kv_pool",
            "target": "per-step host-pool overhead flat (≤ 1.5× from 1k to 100k pooled blocks)",
            "met": bool(met),
            "ratio_100k_to_1k": ratios["new"][0],
            "ratio_100k_to_1k_ci95": list(ratios["new"][1]),
            "pool": results["new"],
            "baseline": {
                "name": "the previous HostPool (971ded7): scans every entry to commit, to release and per eviction",
                "ratio_100k_to_1k": ratios["old"][0],
                "ratio_100k_to_1k_ci95": list(ratios["old"][1]),
                **results["old"],
            },
            "setup": {
                "step": "abort_before; 2 reloads x 16 blocks (lookup, slot, pin); 32 reserves, each evicting; "
                "commit; unpin",
                "class_shares": SHARES,
                "pool_counters_per_step": per_step,
                "rounds": args.rounds,
                "new_steps_per_round": args.new_steps,
                "old_seconds_per_round": args.old_seconds,
                "bootstrap_resamples": args.resamples,
                "gc_while_timing": bool(args.gc),
                "machine": f"{os.cpu_count()} cores, shared with other work; one process",
            },
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
