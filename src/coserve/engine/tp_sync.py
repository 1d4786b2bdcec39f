"""Make every tensor-parallel rank leave a step at the same safepoint.

Each rank reads the shared board at its own moment; if rank 0 saw the abort
at layer 5 and rank 1 only at layer 6, rank 0 would leave while rank 1 waits
in the next all-reduce forever. Who calls it: the connector's safepoint
(``LayerSafepoints.check``), on every rank, with the safepoint's index in
the step (two per layer: before attention, even; after attention, odd).

Two ways to agree, chosen once per worker (``SafepointAgreement.resolve``):

``shared`` (all ranks on one node, the usual case)
    No collective at all. The leader (the group's first rank) alone reads the
    abort flag; when it is up, it writes *where* every rank leaves
    (``abort_target``), and every rank leaves exactly there. The target must
    lie beyond every safepoint any follower's host may already have checked.
    Tensor parallelism puts an all-reduce after every attention (the
    row-parallel output projection), between an odd safepoint and the next
    even one, and no rank's *device* passes it before every rank's device
    reaches it; so when the leader is at safepoint i, no follower's device is
    past i's next all-reduce. On a CPU (gloo) the all-reduce also blocks the
    host, and the next even safepoint is far enough. On a GPU it does not
    (NCCL and vLLM's custom all-reduce return at once); there each rank's host
    is kept at most K safepoints ahead of its own device (the run-ahead bound,
    ``coserve.engine.layer_safepoints``), so a follower's host is at most K
    safepoints further, and the target moves K safepoints on. A rank leaves
    only at the agreed target, so every rank queues the same collectives and
    none waits in one that another will never join. The cost is one 8-byte
    read per safepoint; a preemption lands up to 1 + K/2 layers later than
    with one rank.

    The target is recorded per step, in the step's slot of a ring of four
    on the board (``SafepointBoard.agree_exit``), not in one word for all
    steps: vLLM dispatches step s + 1 as soon as rank 0 answers, so the
    leader may be in step s + 1, and agree its exit, while a follower's host
    (up to K + 1 safepoints behind) has not yet reached step s's target; one
    word would lose step s's exit and leave that follower running the rest
    of the step alone. The collectives bound the lag: the leader's host
    leaves step s + 1 (at its end, or at a target K + 2 or more) only after
    its device has finished that step's first all-reduce (the bound's wait),
    which no device finishes before every follower's device, and so its
    host, has left step s. A follower is thus at most one step behind; two
    under async scheduling (two steps in flight) when the step between
    checks no safepoint. ``tests/engine/test_tp_sync.py`` checks this against
    a model of ranks running consecutive steps whose devices lag their hosts
    at random.
``broadcast`` (ranks on several nodes, where shared memory cannot reach)
    The leader's view is broadcast over the TP group's CPU (gloo) group at
    every safepoint, as ConServe does with ncclBroadcast: one collective per
    safepoint. Ranks on another node than the engine's cannot attach the
    board; they join every broadcast all the same, and contribute "no".

With one rank (``single``) the flag is read directly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from coserve.engine.safepoint import SafepointBoard

__all__ = ["SafepointAgreement", "abort_target", "broadcast_flag"]

logger = logging.getLogger(__name__)

Mode = Literal["single", "shared", "broadcast"]


def abort_target(index: int, runahead: int = 0) -> int:
    """Where every rank leaves when the leader sees the abort at safepoint ``index``: the next even one,
    plus the ``runahead`` safepoints a host may be ahead of its device (0 where collectives block the host)."""
    return (index // 2 + 1) * 2 + runahead


def broadcast_flag(flag: bool, group: dist.ProcessGroup | None, src: int) -> bool:
    """Rank ``src``'s ``flag`` on every rank of ``group`` (a CPU/gloo group)."""
    tensor = torch.tensor([1 if flag else 0], dtype=torch.int8)
    dist.broadcast(tensor, src=src, group=group)
    return bool(tensor.item())


@dataclass
class SafepointAgreement:
    """One worker's way of agreeing with its TP peers; ``should_leave`` is called at every safepoint."""

    mode: Mode
    leader: bool = True
    group: dist.ProcessGroup | None = None
    src: int = 0
    runahead: int = 0  # how many safepoints a host may be ahead of its device (the run-ahead bound's K)

    @classmethod
    def resolve(cls, runahead: int = 0) -> SafepointAgreement:
        """This worker's mode, from vLLM's TP group; called once, at a safepoint all ranks reach together."""
        try:
            from vllm.distributed.parallel_state import get_tp_group, in_the_same_node_as
        except ImportError:  # pragma: no cover - vLLM always ships them
            return cls("single")
        try:
            group = get_tp_group()
        except AssertionError:  # no model-parallel state (single process, tests)
            return cls("single")
        if group.world_size == 1:
            return cls("single")
        leader = group.rank_in_group == 0
        # NOTE: vLLM's source_rank is the rank in the group (vLLM passes 0); broadcast's src is a global rank.
        if all(in_the_same_node_as(group.cpu_group, source_rank=0)):
            return cls("shared", leader=leader, runahead=runahead)
        logger.info("coserve: TP ranks span nodes; safepoints agree by a broadcast per safepoint")
        return cls("broadcast", leader=leader, group=group.cpu_group, src=group.ranks[0])

    def should_leave(self, board: SafepointBoard | None, step_id: int, index: int) -> bool:
        """Whether this rank leaves ``step_id`` at safepoint ``index`` (the same answer on every rank).

        Called by ``LayerSafepoints.check`` at every checked safepoint, on every rank; ``board`` is None on a
        rank that cannot attach it (another node), which still joins the broadcast but otherwise never leaves.
        """
        if self.mode == "broadcast":
            seen = self.leader and board is not None and board.abort_requested(step_id)
            return broadcast_flag(seen, self.group, self.src)
        if board is None:
            return False
        if self.mode == "single":
            return board.abort_requested(step_id)
        if self.leader and board.agreed_exit(step_id)[0] != step_id and board.abort_requested(step_id):
            board.agree_exit(step_id, abort_target(index, self.runahead))
        return board.agreed_exit(step_id) == (step_id, index)
