"""The rendered-engine harness finds its own engine's safepoint board and stops every process it started.

Real processes, real POSIX shared memory: a child that creates a board as an engine's scheduler does (and
starts a grandchild, as vLLM's server starts its engine core), beside a board of another "engine" made by
this process. No vLLM engine is started: what is under test is the harness's bookkeeping.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from coserve.engine.safepoint import SafepointBoard, board_name
from rendered_cpu_engine import own_boards, stop_process_tree

CHILD = """
import subprocess, sys, time
from coserve.engine.safepoint import SafepointBoard
board = SafepointBoard.create(sys.argv[1])
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(grandchild.pid, flush=True)
time.sleep(600)
"""


def test_the_harness_finds_its_engines_board_among_others_and_stops_the_whole_tree() -> None:
    other = SafepointBoard.create(board_name(f"other{os.getpid()}"))  # another engine's, on the same machine
    mine = board_name(f"mine{os.getpid()}")
    child = subprocess.Popen([sys.executable, "-c", CHILD, mine], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        deadline = time.monotonic() + 30
        while not own_boards(child.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert own_boards(child.pid) == [mine]
        stop_process_tree(child, timeout_s=2)
        assert child.poll() is not None
        psutil.wait_procs([psutil.Process(grandchild)], timeout=10) if psutil.pid_exists(grandchild) else None
        assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
    finally:
        if child.poll() is None:
            child.kill()
        other.close()
        SafepointBoard.remove(mine)
