"""Engines that share one machine (``coserve up``, the benchmarks' local pools) each get their share of its cores.

vLLM binds every CPU engine's OpenMP threads to every core it may use; three such engines on two cores ran a
request 7x slower than one alone. ``shared_machine_threads`` gives each engine its own cores, or one unbound
thread when there are more engines than cores, in the form vLLM's own parser reads.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from coserve.engine.launch import EngineServer, EngineSettings, shared_machine_threads

BIND = "VLLM_CPU_OMP_THREADS_BIND"


def bound_cores(engines: int, cores: list[int]) -> list[list[int]]:
    from vllm.utils import cpu_resource_utils

    return [cpu_resource_utils.parse_id_list(shared_machine_threads(i, engines, cores)[BIND]) for i in range(engines)]


def test_one_engine_keeps_vllms_own_binding() -> None:
    assert shared_machine_threads(0, 1, [0, 1]) == {}


@pytest.mark.parametrize(
    ("engines", "cores"), [(2, [0, 1]), (2, [4, 0, 2, 1, 3]), (3, list(range(8))), (4, [6, 7, 8, 9])]
)
def test_each_engine_gets_cores_of_its_own_and_together_all(engines: int, cores: list[int]) -> None:
    pytest.importorskip("vllm")
    shares = bound_cores(engines, cores)
    assert all(shares)  # every engine has at least one core
    assert sorted(core for share in shares for core in share) == sorted(cores)  # each core once, none left idle


def test_more_engines_than_cores_run_one_unbound_thread_each() -> None:
    for index in range(3):
        assert shared_machine_threads(index, 3, [0, 1]) == {BIND: "nobind", "OMP_NUM_THREADS": "1"}


def test_the_share_reaches_the_engines_environment(tmp_path: Path) -> None:
    env = shared_machine_threads(1, 2, [0, 1])
    server = EngineServer(EngineSettings(model=tmp_path / "model", workdir=tmp_path, env=env))
    assert server.environment(tmp_path / "engine.json")[BIND] == "1"
