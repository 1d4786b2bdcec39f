"""Every tensor-parallel rank leaves a step at the same safepoint (coserve.engine.tp_sync).

The shared-memory agreement is checked here against a model of how TP ranks move through a step (each
rank evaluates its safepoints in order; no rank passes an all-reduce before every rank reaches it, and
there is one between each after-attention safepoint and the next layer's before-attention one), on a real
board; the real thing runs in test_tp2_safepoints.py. The broadcast fallback (ranks on several nodes)
runs in two real gloo processes.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch.multiprocessing as mp

from coserve.engine.safepoint import SafepointBoard, board_name
from coserve.engine.tp_sync import SafepointAgreement, abort_target
from tp_sync_ranks import rank_main

LAYERS = 6
SAFEPOINTS = 2 * LAYERS


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def board() -> Iterator[SafepointBoard]:
    created = SafepointBoard.create(board_name(f"tpsync{_free_port()}"))
    yield created
    created.close()


def test_the_target_is_the_next_layers_first_safepoint() -> None:
    assert [abort_target(i) for i in range(6)] == [2, 2, 4, 4, 6, 6]


def leave_index(agreement: SafepointAgreement, board: SafepointBoard, step: int, start: int) -> int | None:
    """Evaluate safepoints from ``start`` on; the index the rank leaves at, or None if it runs the step out."""
    for index in range(start, SAFEPOINTS):
        if agreement.should_leave(board, step, index):
            return index
    return None


@pytest.mark.parametrize("seen_at", range(SAFEPOINTS))
def test_every_rank_leaves_where_the_leader_said_wherever_the_follower_was(board: SafepointBoard, seen_at: int) -> None:
    """The leader sees the abort at ``seen_at``; the follower may have evaluated any safepoint up to the one
    before the next all-reduce (it cannot pass that all-reduce before the leader gets there)."""
    step = 7
    last_before_collective = 2 * (seen_at // 2) + 1
    for follower_done in range(max(-1, seen_at - 2), last_before_collective + 1):
        board.agree_exit(1, 0)  # a stale agreement from an older step
        leader, follower = SafepointAgreement("shared", leader=True), SafepointAgreement("shared", leader=False)
        for index in range(follower_done + 1):  # the follower ran ahead, before the abort
            assert not follower.should_leave(board, step, index)
        for index in range(seen_at):  # the leader, before the abort
            assert not leader.should_leave(board, step, index)
        board.request_abort(step)
        left = leave_index(leader, board, step, seen_at)
        expected = abort_target(seen_at) if abort_target(seen_at) < SAFEPOINTS else None
        assert left == expected
        assert leave_index(follower, board, step, follower_done + 1) == expected
        board.request_abort(-1)


def test_the_leader_fixes_the_exit_once_per_step(board: SafepointBoard) -> None:
    leader = SafepointAgreement("shared", leader=True)
    board.request_abort(3)
    assert not leader.should_leave(board, 3, 1)
    assert board.agreed_exit() == (3, 2)
    assert leader.should_leave(board, 3, 2)
    assert board.agreed_exit() == (3, 2)  # not moved on by later safepoints of the same step
    assert not leader.should_leave(board, 4, 0)  # another step: the old agreement does not apply


def test_a_follower_never_reads_the_abort_flag_itself(board: SafepointBoard) -> None:
    follower = SafepointAgreement("shared", leader=False)
    board.request_abort(5)
    assert not any(follower.should_leave(board, 5, i) for i in range(SAFEPOINTS))


def test_one_rank_reads_the_flag_directly(board: SafepointBoard) -> None:
    single = SafepointAgreement("single")
    assert not single.should_leave(board, 9, 0)
    board.request_abort(9)
    assert single.should_leave(board, 9, 1)


@pytest.mark.slow
def test_the_broadcast_fallback_makes_all_ranks_follow_rank_zero() -> None:
    flags = [False, False, True, False, True]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank_main, args=(_free_port(), flags, results), nprocs=2, join=True)
        assert results[0] == flags
        assert results[1] == flags
