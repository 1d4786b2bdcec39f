"""Every tensor-parallel rank leaves a step at the same safepoint (coserve.engine.tp_sync).

The model of ranks whose collectives do not block their hosts (GPUs) is at the end of this file.

The shared-memory agreement is checked here against a model of how TP ranks move through a step (each
rank evaluates its safepoints in order; no rank passes an all-reduce before every rank reaches it, and
there is one between each after-attention safepoint and the next layer's before-attention one), on a real
board; the real thing runs in test_tp2_safepoints.py. The broadcast fallback (ranks on several nodes)
runs in two real gloo processes.
"""

from __future__ import annotations

import itertools
import random
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch.multiprocessing as mp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
    # with hosts up to K safepoints ahead of their devices (GPUs), K safepoints further on
    assert [abort_target(i, 1) for i in range(4)] == [3, 3, 5, 5]


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


# --- ranks whose collectives do not block the host (NCCL, vLLM's custom all-reduce) ---------------------
#
# A model of one step on N ranks, each a host and a device. Safepoint j comes before half-layer j (even j:
# before attention; odd j: after it); an odd half-layer (output projection, MLP) holds an all-reduce, which
# a device finishes only once every rank's device has reached it. A host checks safepoint j (the real
# ``SafepointAgreement.should_leave`` on a real board), then queues half-layer j and returns at once, as a
# CUDA launch does; with the run-ahead bound K it may check safepoint j only once its own device has done
# half-layer j - K - 1 (the event of safepoint j - K). Which host or device moves next, and when the
# abort comes, is drawn at random: that is the devices' random lag. A schedule is correct when every rank
# leaves at the same safepoint (or none does) and every device drains its queue: a rank that left while a
# peer queued one more all-reduce leaves that peer's device waiting forever.

MODEL_LAYERS = 4


@dataclass
class ModelRank:
    agreement: SafepointAgreement
    checked: int = 0  # the next safepoint this host checks
    queued: int = 0  # half-layers queued on the device
    device: int = 0  # half-layers the device has finished
    left: int | None = None
    finished: bool = False  # the host queued the whole step

    @property
    def host_moving(self) -> bool:
        return self.left is None and not self.finished


def run_step_model(
    board: SafepointBoard, step: int, ranks: int, bound: int | None, target_k: int, choose: Callable[[int], int]
) -> tuple[list[int | None], bool]:
    """One step under the schedule ``choose`` draws; (where each rank left, whether every device drained)."""
    half_layers = 2 * MODEL_LAYERS
    model = [ModelRank(SafepointAgreement("shared", leader=r == 0, runahead=target_k)) for r in range(ranks)]
    abort_at = choose(2 * ranks * half_layers)  # how many moves happen before the urgent request arrives
    moves = 0

    def host_may_move(rank: ModelRank) -> bool:
        return rank.host_moving and (bound is None or rank.device >= rank.checked - bound)

    def device_may_move(rank: ModelRank) -> bool:
        if rank.device >= rank.queued:
            return False
        if rank.device % 2 == 1:  # an all-reduce: every device must have reached it
            return all(peer.queued > rank.device and peer.device >= rank.device for peer in model)
        return True

    while True:
        if moves == abort_at:
            board.request_abort(step)
        actions = [("host", r) for r in model if host_may_move(r)] + [
            ("device", r) for r in model if device_may_move(r)
        ]
        if not actions:
            break
        kind, rank = actions[choose(len(actions))]
        moves += 1
        if kind == "device":
            rank.device += 1
        elif rank.agreement.should_leave(board, step, rank.checked):
            rank.left = rank.checked
        else:
            rank.queued = rank.checked + 1
            rank.checked += 1
            rank.finished = rank.checked == half_layers
    if moves < abort_at:
        board.request_abort(step)  # it came after the step: nothing to leave
    return [rank.left for rank in model], all(rank.device == rank.queued for rank in model)


_model_steps = itertools.count(1)


def model_is_correct(
    board: SafepointBoard, ranks: int, bound: int | None, target_k: int, choose: Callable[[int], int]
) -> bool:
    left, drained = run_step_model(board, next(_model_steps), ranks, bound, target_k, choose)
    return drained and len(set(left)) == 1


@pytest.fixture(scope="module")
def model_board() -> Iterator[SafepointBoard]:
    created = SafepointBoard.create(board_name(f"tpmodel{_free_port()}"))
    yield created
    created.close()


@settings(max_examples=1200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), ranks=st.integers(2, 4), k=st.integers(0, 3))
def test_with_the_bound_every_rank_leaves_together_and_no_device_waits_forever(
    model_board: SafepointBoard, data: st.DataObject, ranks: int, k: int
) -> None:
    def choose(n: int) -> int:
        return data.draw(st.integers(0, n - 1))

    left, drained = run_step_model(model_board, next(_model_steps), ranks, k, k, choose)
    assert len(set(left)) == 1, f"ranks left at different safepoints: {left}"
    assert drained, "a device waits in an all-reduce a peer never queued"


@pytest.mark.parametrize(
    ("bound", "target_k"),
    [(None, 0), (1, 0)],
    ids=["the shared mode before the bound (no bound, next even safepoint)", "the bound without moving the target"],
)
def test_without_the_bound_in_the_target_the_model_finds_a_broken_schedule(
    model_board: SafepointBoard, bound: int | None, target_k: int
) -> None:
    """The model can fail: today's ``shared`` mode, where collectives do not block the host, strands a rank."""
    broken = 0
    for seed in range(300):
        rng = random.Random(seed)
        if not model_is_correct(model_board, 2, bound, target_k, rng.randrange):
            broken += 1
    assert broken > 0
