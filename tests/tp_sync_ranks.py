"""Process entry for tests/engine/test_tp_sync.py (spawned children must import it by a plain name)."""

from __future__ import annotations

import torch.distributed as dist

from coserve.engine.tp_sync import broadcast_flag


def rank_main(rank: int, port: int, flags: list[bool], results: dict[int, list[bool]]) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        # Each "layer": the ranks saw different things; all must leave with rank 0's view.
        results[rank] = [broadcast_flag(flag if rank == 0 else not flag, None, src=0) for flag in flags]
    finally:
        dist.destroy_process_group()
