"""Make every tensor-parallel rank take the same safepoint decision.

Each rank reads the shared board at its own moment; if rank 0 saw the abort
at layer 5 and rank 1 only at layer 6, rank 0 would leave while rank 1 waits
in the next all-reduce forever. So rank 0's view is broadcast over the TP
group's CPU (gloo) group at every safepoint, as ConServe does with
ncclBroadcast. With one rank it is a plain return.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["agree_across_tp", "broadcast_flag"]


def broadcast_flag(flag: bool, group: dist.ProcessGroup | None, src: int) -> bool:
    """Rank ``src``'s ``flag`` on every rank of ``group`` (a CPU/gloo group)."""
    tensor = torch.tensor([1 if flag else 0], dtype=torch.int8)
    dist.broadcast(tensor, src=src, group=group)
    return bool(tensor.item())


def agree_across_tp(flag: bool) -> bool:
    """The TP group's common answer; called once per layer by the connector's safepoint."""
    try:
        from vllm.distributed.parallel_state import get_tp_group
    except ImportError:  # pragma: no cover - vLLM always ships it
        return flag
    try:
        group = get_tp_group()
    except AssertionError:  # no model-parallel state (single process, tests)
        return flag
    if group.world_size == 1:
        return flag
    return broadcast_flag(flag, group.cpu_group, src=group.ranks[0])
