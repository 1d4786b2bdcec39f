"""Process entries for tests/engine/test_tp_sync.py (spawned children must import them by a plain name)."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from coserve.engine.layer_safepoints import LayerSafepoints, StepPreempted
from coserve.engine.safepoint import SafepointBoard
from coserve.engine.tp_sync import SafepointAgreement, broadcast_flag

GLOO_TIMEOUT = timedelta(seconds=20)  # a rank left alone in a collective fails instead of waiting forever
SAFEPOINTS = 8  # a step of four layers
ABORT_AT = 5  # rank 0's board asks to abandon the second step just before this safepoint


def rank_main(rank: int, port: int, flags: list[bool], results: dict[int, list[bool]]) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        # Each "layer": the ranks saw different things; all must leave with rank 0's view.
        results[rank] = [broadcast_flag(flag if rank == 0 else not flag, None, src=0) for flag in flags]
    finally:
        dist.destroy_process_group()


def safepoints_rank_main(
    rank: int, port: int, name: str, results: dict[int, tuple[list[int | None], list[int]]]
) -> None:
    """A worker's ``LayerSafepoints`` in broadcast mode, for two steps: rank 0 holds the engine's board,
    rank 1 none (as on another node than the engine's). ``results[rank]``: where the rank left each step
    (None: it ran the step out), and the safepoint index at which each rank resolved the agreement."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=GLOO_TIMEOUT
    )
    board = SafepointBoard.create(name) if rank == 0 else None
    resolved_at: list[int] = []

    def resolve() -> SafepointAgreement:
        # SafepointAgreement.resolve is a collective too (vLLM's in_the_same_node_as): every rank must call it
        indexes: list[int] = [-1, -1]
        dist.all_gather_object(indexes, safepoints.index)
        resolved_at.extend(indexes)
        return SafepointAgreement("broadcast", leader=rank == 0, group=None, src=0)

    safepoints = LayerSafepoints(None, agreement=resolve)
    try:
        left = [run_step(safepoints, board, step_id, abort=step_id == 2) for step_id in (1, 2)]
        results[rank] = (left, resolved_at)
    finally:
        if board is not None:
            board.close()
        dist.destroy_process_group()


def run_step(safepoints: LayerSafepoints, board: SafepointBoard | None, step_id: int, abort: bool) -> int | None:
    """One step's safepoints as the connector calls them; the index the rank leaves at, or None."""
    safepoints.begin(step_id, board, checking=True)
    for index in range(SAFEPOINTS):
        if abort and board is not None and index == ABORT_AT:
            board.request_abort(step_id)
        try:
            safepoints.check(f"layers.{index // 2}")
        except StepPreempted:
            return index
    return None
