"""The host KV pool's bookkeeping (coserve.kv.pool): bounds, eviction order, commits; and block hashing."""

from __future__ import annotations

import pytest

from coserve.kv.pool import HostPool, block_hashes, copy_budget

SALT = b"model"


def h(name: str) -> bytes:
    return name.encode().ljust(16, b".")


def filled(pool: HostPool, blocks: list[tuple[str, str, int, int]], step: int = 1) -> None:
    """Reserve (name, class, rank, last use) blocks in ``step`` and commit them."""
    for index, (name, cls, rank, now) in enumerate(blocks):
        pool.reserve(h(name), cls, rank, index, now, step)
    pool.commit(step)


def test_block_hashes_chain_every_token_before_the_block() -> None:
    a = block_hashes(list(range(300)), 128, SALT)
    assert len(a) == 2  # only full blocks
    b = block_hashes([*range(128), 7, *range(129, 300)], 128, SALT)
    assert a[0] == b[0] and a[1] != b[1]
    assert block_hashes(list(range(300)), 128, b"other model")[0] != a[0]
    assert block_hashes(list(range(400)), 128, SALT, known=a) == block_hashes(list(range(400)), 128, SALT)


def test_the_pool_never_holds_more_than_its_capacity_and_never_shares_a_slot() -> None:
    pool = HostPool(3)
    for step in range(1, 20):
        pool.reserve(h(f"b{step}"), ["batch", "standard"][step % 2], 1, 0, step, step)  # classes of one rank
        pool.commit(step)
        assert len(pool) <= 3
        slots = [pool.slot(h(f"b{s}")) for s in range(1, step + 1) if h(f"b{s}") in pool]
        assert len(slots) == len(set(slots)) and set(slots) <= {0, 1, 2}
    assert pool.stats.evicted == 16


@pytest.mark.parametrize(
    ("held", "new", "victim"),
    [
        # lowest class (highest rank) first, whatever its age
        ([("a", "interactive", 0, 1), ("b", "offline", 2, 9)], ("n", "standard", 1), "b"),
        # same class: the longest idle first
        ([("a", "standard", 1, 5), ("b", "standard", 1, 2)], ("n", "standard", 1), "b"),
        # never a more important class's block for a less important one: the new block is dropped
        ([("a", "interactive", 0, 1), ("b", "interactive", 0, 2)], ("n", "offline", 2), None),
    ],
)
def test_eviction_order(held: list[tuple[str, str, int, int]], new: tuple[str, str, int], victim: str | None) -> None:
    pool = HostPool(2)
    filled(pool, held)
    slot = pool.reserve(h(new[0]), new[1], new[2], 0, 10, 2)
    if victim is None:
        assert slot is None and pool.stats.dropped == 1 and h(new[0]) not in pool._entries
    else:
        assert slot is not None and h(victim) not in pool._entries


def test_a_conversation_loses_its_tail_before_its_head() -> None:
    pool = HostPool(3)
    filled(pool, [("head", "standard", 1, 1), ("middle", "standard", 1, 1), ("tail", "standard", 1, 1)])
    pool.reserve(h("new"), "standard", 1, 0, 2, 2)
    assert h("tail") not in pool._entries and h("head") in pool


def test_a_class_at_its_share_evicts_its_own_blocks() -> None:
    pool = HostPool(4, class_shares={"offline": 0.5})
    filled(pool, [("s", "standard", 1, 1), ("o1", "offline", 2, 1), ("o2", "offline", 2, 2)])
    pool.reserve(h("o3"), "offline", 2, 0, 3, 2)  # a free slot remains, but offline holds its half
    assert h("o1") not in pool._entries and h("s") in pool and len(pool) == 3


def test_a_block_is_usable_only_after_its_step_completed_and_pinned_blocks_stay() -> None:
    pool = HostPool(1)
    pool.reserve(h("a"), "standard", 1, 0, 1, step=1)
    assert pool.lookup([h("a")], 1) == 0  # the copy is still running
    pool.abort_before(2)  # step 1 never completed: released
    assert len(pool) == 0 and pool.stats.aborted == 1
    pool.reserve(h("b"), "standard", 1, 0, 2, step=2)
    pool.commit(2)
    assert pool.lookup([h("b"), h("c")], 3) == 1 and pool.stats.misses == 2
    pool.pin([h("b")])
    assert pool.reserve(h("c"), "standard", 1, 0, 4, step=3) is None  # b is being loaded: not evicted
    pool.unpin([h("b")])
    assert pool.reserve(h("c"), "standard", 1, 0, 4, step=3) is not None


def test_copy_budget_is_a_fraction_of_the_step_at_the_copy_bandwidth() -> None:
    assert copy_budget(0.1, 0.1, 1e9, 1_000_000) == 10  # 10 ms of copying at 1 GB/s, 1 MB blocks
    assert copy_budget(0.0, 0.1, 1e9, 1_000_000) == 1  # always at least one block
    assert copy_budget(0.1, 0.1, 1e9, 0) == 0


def test_a_zero_byte_pool_holds_nothing() -> None:
    pool = HostPool(0)
    assert pool.reserve(h("a"), "standard", 1, 0, 1, 1) is None and pool.stats.dropped == 1
    with pytest.raises(ValueError, match="capacity"):
        HostPool(-1)
