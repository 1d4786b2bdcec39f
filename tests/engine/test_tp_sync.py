"""Every tensor-parallel rank leaves a step at the same safepoint (coserve.engine.tp_sync).

The model of ranks whose collectives do not block their hosts (GPUs), running consecutive steps, is at
the end of this file.

The shared-memory agreement is checked here against a model of how TP ranks move through a step (each
rank evaluates its safepoints in order; no rank passes an all-reduce before every rank reaches it, and
there is one between each after-attention safepoint and the next layer's before-attention one), on a real
board; the real thing runs in test_tp2_safepoints.py. The broadcast fallback (ranks on several nodes)
runs in two real gloo processes, one of them without a board as on a node other than the engine's.
"""

from __future__ import annotations

import itertools
import random
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch.multiprocessing as mp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coserve.engine.safepoint import EXIT_SLOTS, SafepointBoard, board_name
from coserve.engine.tp_sync import SafepointAgreement, abort_target
from tp_sync_ranks import ABORT_AT, rank_main, safepoints_rank_main

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
        board.agree_exit(step - EXIT_SLOTS, 0)  # a stale agreement from an older step, in the same slot
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
    assert board.agreed_exit(3) == (3, 2)
    assert leader.should_leave(board, 3, 2)
    assert board.agreed_exit(3) == (3, 2)  # not moved on by later safepoints of the same step
    assert not leader.should_leave(board, 4, 0)  # another step: the old agreement does not apply
    assert not leader.should_leave(board, 3 + EXIT_SLOTS, 2)  # nor does it to a later step in its slot


def test_each_step_keeps_its_own_exit_until_the_step_exit_slots_later_reuses_its_slot(board: SafepointBoard) -> None:
    board.agree_exit(3, 2)
    board.agree_exit(4, 5)
    assert (board.agreed_exit(3), board.agreed_exit(4)) == ((3, 2), (4, 5))
    assert board.agreed_exit(5) == (-1, -1)
    board.agree_exit(3 + EXIT_SLOTS, 1)
    assert board.agreed_exit(3) == (3 + EXIT_SLOTS, 1)  # the slot now holds the later step's exit
    with pytest.raises(ValueError, match="safepoint index"):
        board.agree_exit(6, 4096)


def test_creating_the_board_again_clears_every_steps_exit() -> None:
    name = board_name(f"tpagain{_free_port()}")
    with closing(SafepointBoard.create(name)) as first:
        for step in range(EXIT_SLOTS):
            first.agree_exit(step, 3)
        with closing(SafepointBoard.create(name)) as again:  # an engine restarted with the same id
            assert [again.agreed_exit(step) for step in range(EXIT_SLOTS)] == [(-1, -1)] * EXIT_SLOTS


def test_a_follower_a_step_behind_leaves_where_the_leader_left_that_step(board: SafepointBoard) -> None:
    """vLLM dispatches step 8 once rank 0 has left step 7; the leader's host agrees step 8's exit while the
    follower's host, up to K + 1 safepoints behind, is still short of step 7's."""
    k = 1
    leader = SafepointAgreement("shared", leader=True, runahead=k)
    follower = SafepointAgreement("shared", leader=False, runahead=k)
    board.request_abort(7)
    assert leave_index(leader, board, 7, 0) == abort_target(0, k)
    board.request_abort(8)  # another urgent request, for the step now running
    assert not leader.should_leave(board, 8, 0)
    assert leave_index(follower, board, 7, abort_target(0, k) - k - 1) == abort_target(0, k)
    assert leave_index(follower, board, 8, 0) == abort_target(0, k)


def test_a_follower_never_reads_the_abort_flag_itself(board: SafepointBoard) -> None:
    follower = SafepointAgreement("shared", leader=False)
    board.request_abort(5)
    assert not any(follower.should_leave(board, 5, i) for i in range(SAFEPOINTS))


def test_one_rank_reads_the_flag_directly(board: SafepointBoard) -> None:
    single = SafepointAgreement("single")
    assert not single.should_leave(board, 9, 0)
    board.request_abort(9)
    assert single.should_leave(board, 9, 1)


RANKS_TIMEOUT_S = 90.0  # spawning two ranks takes a few seconds; a rank that hangs fails the test after this


def _spawn_two_ranks(main: Callable[..., None], *args: Any) -> None:
    """Run ``main(rank, *args)`` in two spawned processes; a hang fails the test instead of blocking the run."""
    context = mp.spawn(main, args=args, nprocs=2, join=False)
    deadline_s = time.monotonic() + RANKS_TIMEOUT_S
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline_s:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the ranks did not finish within {RANKS_TIMEOUT_S:.0f} s: one waits in a collective")


@pytest.mark.slow
def test_the_broadcast_fallback_makes_all_ranks_follow_rank_zero() -> None:
    flags = [False, False, True, False, True]
    with mp.Manager() as manager:
        results = manager.dict()
        _spawn_two_ranks(rank_main, _free_port(), flags, results)
        assert results[0] == flags
        assert results[1] == flags


@pytest.mark.slow
def test_in_broadcast_mode_a_rank_without_the_board_still_leaves_with_rank_zero() -> None:
    """Rank 1 cannot attach the board (another node); it still resolves the agreement and joins every
    safepoint's broadcast, so both ranks run the first step out and leave the second where rank 0 saw the
    abort, and neither waits in a collective the other skipped."""
    port = _free_port()
    with mp.Manager() as manager:
        results = manager.dict()
        _spawn_two_ranks(safepoints_rank_main, port, board_name(f"tpbcast{port}"), results)
        expected = ([None, ABORT_AT], [0, 0])  # (where each step was left, where each rank resolved)
        assert results[0] == expected
        assert results[1] == expected


def test_the_agreement_asks_vllm_about_the_group_leader_by_its_rank_in_the_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With pipeline parallelism a TP group's ranks are not 0..n-1 (here 4 and 5): vLLM's
    ``in_the_same_node_as`` takes the source's rank in the group, ``dist.broadcast`` its global rank.

    A stand-in for vLLM's TP group: a group spanning two nodes cannot be made on this machine.
    """
    from vllm.distributed import parallel_state

    asked: list[int] = []

    def in_the_same_node_as(pg: object, source_rank: int = 0) -> list[bool]:
        asked.append(source_rank)
        return [True, False]  # rank 5 is on another node

    group = SimpleNamespace(world_size=2, rank_in_group=1, ranks=[4, 5], cpu_group=object())
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: group)
    monkeypatch.setattr(parallel_state, "in_the_same_node_as", in_the_same_node_as)
    agreement = SafepointAgreement.resolve(runahead=1)
    assert asked == [0]  # the leader's rank in the group
    assert agreement.mode == "broadcast" and not agreement.leader
    assert agreement.group is group.cpu_group
    assert agreement.src == 4  # the leader's global rank, as dist.broadcast takes it


# --- ranks whose collectives do not block the host (NCCL, vLLM's custom all-reduce) ---------------------
#
# A model of consecutive steps on N ranks, each a host and a device. Safepoint j of a step comes before its
# half-layer j (even j: before attention; odd j: after it); an odd half-layer (output projection, MLP)
# holds an all-reduce, which a device finishes only once every rank's device has reached the same one. A
# host checks safepoint j (the real ``SafepointAgreement.should_leave`` on a real board), then queues
# half-layer j and returns at once, as a CUDA launch does; with the run-ahead bound K it may check safepoint
# j >= K only once its device has run everything queued before safepoint j - K of the step (the event the
# real bound waits for). A host that left a step, or queued all of it, goes on to the next: the leader at
# once (vLLM dispatches the next step as soon as rank 0 answers), a follower once the leader has started it.
# Which host or device moves next, and when an abort comes (at most once a step, for the step the leader is
# in: the scheduler posted it), is drawn at random: that is the devices' random lag. A schedule is correct
# when in every step every rank leaves at the same safepoint (or none does), and every host runs every step
# and every device drains its queue: a rank that left while a peer queued one more all-reduce leaves that
# peer's device waiting forever.

MODEL_LAYERS = 4
HALF_LAYERS = 2 * MODEL_LAYERS


@dataclass
class ModelRank:
    agreement: SafepointAgreement
    step: int = 0  # the step this host is in, from 0 (the number of steps once it has run them all)
    checked: int = 0  # the next safepoint this host checks in its step
    step_start: int = 0  # how much was queued on the device before the host began its step
    queue: list[tuple[int, int]] = field(default_factory=list)  # (step, half-layer) queued on the device
    device: int = 0  # how many of them the device has run
    left: list[int | None] = field(default_factory=list)  # step -> where the host left it (None: ran it out)

    def check(self, board: SafepointBoard, step_id: int) -> None:
        """The host checks its next safepoint: it leaves the step there, or queues the half-layer after it."""
        if self.agreement.should_leave(board, step_id, self.checked):
            self.go_on(self.checked)
            return
        self.queue.append((self.step, self.checked))
        self.checked += 1
        if self.checked == HALF_LAYERS:
            self.go_on(None)

    def go_on(self, left: int | None) -> None:
        self.left.append(left)
        self.step += 1
        self.checked = 0
        self.step_start = len(self.queue)


@dataclass
class ModelRun:
    left: list[list[int | None]]  # rank -> step -> where the rank left it
    drained: bool  # every host ran every step and every device ran all it queued
    max_lead_steps: int  # how many steps the leader's host was ever ahead of a follower's

    def together(self) -> bool:
        return all(len(set(exits)) == 1 for exits in zip(*self.left, strict=False))  # unfinished: not drained


_model_steps = itertools.count(0, 10)  # each run's first step id: fresh ids, as the scheduler's, on a shared board


def run_model(
    board: SafepointBoard, steps: int, ranks: int, bound: int | None, target_k: int, choose: Callable[[int], int]
) -> ModelRun:
    """``steps`` consecutive steps under the schedule ``choose`` draws (at most 10 steps)."""
    first_step = next(_model_steps)
    model = [ModelRank(SafepointAgreement("shared", leader=r == 0, runahead=target_k)) for r in range(ranks)]
    leader = model[0]
    max_lead_steps = 0

    def host_may_move(rank: ModelRank) -> bool:
        if rank.step == steps or rank.step > leader.step:  # done, or the step is not dispatched yet
            return False
        return bound is None or rank.checked < bound or rank.device >= rank.step_start + rank.checked - bound

    def device_may_move(rank: ModelRank) -> bool:
        if rank.device == len(rank.queue):
            return False
        half_layer = rank.queue[rank.device]
        if half_layer[1] % 2 == 1:  # an all-reduce: every device must have reached it
            return all(half_layer in peer.queue and peer.device >= peer.queue.index(half_layer) for peer in model)
        return True

    moves_per_step = 2 * ranks * HALF_LAYERS  # every rank's host and device through a step
    abort_step, abort_move, moves = -1, -1, 0
    while True:
        if leader.step != abort_step and leader.step < steps:  # a step was dispatched: when does an abort come?
            abort_step, abort_move = leader.step, moves + choose(moves_per_step)
        if moves == abort_move:  # (never, if the step is over by then)
            board.request_abort(first_step + leader.step)  # for the step the scheduler posted
        actions = [("host", r) for r in model if host_may_move(r)] + [
            ("device", r) for r in model if device_may_move(r)
        ]
        if not actions:
            break
        kind, rank = actions[choose(len(actions))]
        moves += 1
        if kind == "device":
            rank.device += 1
        else:
            rank.check(board, first_step + rank.step)
        max_lead_steps = max(max_lead_steps, leader.step - min(rank.step for rank in model))
    drained = all(rank.step == steps and rank.device == len(rank.queue) for rank in model)
    return ModelRun([rank.left for rank in model], drained, max_lead_steps)


class OneWordBoard(SafepointBoard):
    """The board before the ring: one agreed-exit word shared by every step."""

    exit_slots = 1


@pytest.fixture(scope="module")
def model_board() -> Iterator[SafepointBoard]:
    created = SafepointBoard.create(board_name(f"tpmodel{_free_port()}"))
    yield created
    created.close()


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), ranks=st.integers(2, 4), k=st.integers(0, 3), steps=st.integers(1, 3))
def test_with_the_bound_every_rank_leaves_each_step_together_and_no_device_waits_forever(
    model_board: SafepointBoard, data: st.DataObject, ranks: int, k: int, steps: int
) -> None:
    def choose(n: int) -> int:
        return data.draw(st.integers(0, n - 1))

    run = run_model(model_board, steps, ranks, k, k, choose)
    assert run.together(), f"ranks left a step at different safepoints: {run.left}"
    assert run.drained, "a device waits in an all-reduce a peer never queued"
    assert run.max_lead_steps <= 1 < EXIT_SLOTS, "the leader's host got two steps ahead of a follower's"


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
        run = run_model(model_board, 1, 2, bound, target_k, random.Random(seed).randrange)
        broken += not (run.together() and run.drained)
    assert broken > 0


@pytest.mark.parametrize("k", [0, 1, 2])
def test_with_one_exit_word_for_every_step_the_model_finds_a_hang_across_two_steps(k: int) -> None:
    """The model can fail across steps: with the board's old single word, the leader agreeing step s + 1's
    exit overwrites step s's before a lagging follower gets there; one step alone never breaks."""
    broken_steps = {1: 0, 2: 0}
    with closing(OneWordBoard.create(board_name(f"tpword{_free_port()}"))) as board:
        for seed, steps in itertools.product(range(1000), broken_steps):
            run = run_model(board, steps, 2, k, k, random.Random(seed).randrange)
            broken_steps[steps] += not (run.together() and run.drained)
    assert broken_steps[1] == 0
    assert broken_steps[2] > 0
