"""Layer-safepoint preemption in the real engine: abandoned steps change no output and lose no request."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from coserve.engine.safepoint import SafepointBoard, board_name
from coserve.engine.safepoint import safepoint_counters as read_safepoint_counters
from engine_handle import Chaos, Engine

pytestmark = pytest.mark.slow

SHARED = list(range(20, 20 + 520))  # longer than two 256-token steps: sharers hit blocks of running steps


def complete(base: str, prompt: list[int], cls: str, max_tokens: int = 24, **xargs: Any) -> httpx.Response:
    return httpx.post(
        f"{base}/v1/completions",
        timeout=180,
        json={
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "vllm_xargs": {"coserve_class": cls, **xargs},
        },
    )


def text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def test_preempted_requests_give_the_same_greedy_tokens_as_alone(engine: Engine) -> None:
    board = SafepointBoard.attach(board_name(engine.engine_id))
    assert board is not None, "the scheduler did not create the safepoint board"
    prompts = [SHARED[: 300 + 40 * i] + [600 + i] * (8 + 9 * i) for i in range(6)]
    classes = ["offline", "interactive", "offline", "standard", "offline", "interactive"]
    alone = [text(complete(engine.base, p, c)) for p, c in zip(prompts, classes, strict=True)]
    httpx.post(f"{engine.base}/reset_prefix_cache", timeout=30)

    before = board.num_preemptions
    with Chaos(board), ThreadPoolExecutor(max_workers=6) as pool:
        together = list(pool.map(lambda pc: text(complete(engine.base, *pc)), zip(prompts, classes, strict=True)))
    abandoned = board.num_preemptions - before
    assert abandoned >= 10, f"only {abandoned} steps were abandoned: the test did not exercise preemption"
    assert together == alone


def test_an_urgent_arrival_preempts_an_offline_step(engine: Engine) -> None:
    """An interactive request with a 300 ms TTFT SLO arrives behind offline steps the cost model says take
    0.5 s (conftest's pessimistic model): the API server raises the abort, a worker abandons the step."""
    board = SafepointBoard.attach(board_name(engine.engine_id))
    assert board is not None
    aborts, abandoned = board.num_abort_requests, board.num_preemptions
    responses = []
    with ThreadPoolExecutor(max_workers=4) as pool:
        background = []
        for attempt in range(30):
            # A fresh 1500-token offline prompt (no prefix-cache hit): several 256-token steps to land in.
            background.append(pool.submit(complete, engine.base, [900 + attempt] * 1500, "offline", 2))
            deadline = time.monotonic() + 5
            while board.posted_step() is None and time.monotonic() < deadline:
                time.sleep(0.0005)
            responses.append(complete(engine.base, [5, 6, 7, 8 + attempt], "interactive", 2, ttft_slo_ms=300))
            if board.num_preemptions > abandoned:
                break
        responses += [f.result() for f in background]
    assert all(r.status_code == 200 for r in responses)
    assert board.num_abort_requests > aborts, "the API server never raised the abort flag"
    assert board.num_preemptions > abandoned, "no worker abandoned a step"


def safepoint_counters(base: str) -> tuple[float, float]:
    """The engine's ``coserve:safepoint_seconds_total`` and ``coserve:safepoint_steps_total``."""
    return read_safepoint_counters(httpx.get(f"{base}/metrics", timeout=10).text)


def wait_for_steps(base: str, above: float, timeout_s: float = 30) -> tuple[float, float]:
    """The counters once the steps counter has passed ``above`` (metrics trail the steps a little)."""
    deadline = time.monotonic() + timeout_s
    seconds, steps = safepoint_counters(base)
    while steps <= above and time.monotonic() < deadline:
        time.sleep(0.2)
        seconds, steps = safepoint_counters(base)
    return seconds, steps


def test_the_engine_reports_the_time_its_steps_spend_at_safepoints(engine: Engine) -> None:
    """Every step with safepoints counts on /metrics, with the time its checks took (well under a step's)."""
    seconds_before, steps_before = safepoint_counters(engine.base)
    text(complete(engine.base, [20 + (7 * i) % 900 for i in range(600)], "offline", 8))
    seconds, steps = wait_for_steps(engine.base, steps_before + 3)
    assert steps >= steps_before + 3, "the safepoint steps counter did not move"
    per_step = (seconds - seconds_before) / (steps - steps_before)
    assert 0 < per_step < 0.005, f"{per_step * 1e6:.0f} us at safepoints per step"


def test_paused_safepoints_abandon_nothing_until_resumed(engine: Engine) -> None:
    """While paused (the benchmarks' in-engine A/B switch) the workers skip every check: aborts raised on
    every other step abandon none and no step counts at safepoints; resumed, the same load is preempted."""
    board = SafepointBoard.attach(board_name(engine.engine_id))
    assert board is not None
    prompts = [[300 + 7 * i + j for j in range(520)] for i in range(3)]
    board.pause()
    try:
        text(complete(engine.base, [1, 2, 3], "offline", 2))  # a step that carries the pause to the workers
        _, steps_before = wait_for_steps(engine.base, -1)
        aborts, abandoned = board.num_abort_requests, board.num_preemptions
        with Chaos(board), ThreadPoolExecutor(max_workers=3) as pool:
            list(pool.map(lambda p: text(complete(engine.base, p, "offline", 8)), prompts))
        assert board.num_abort_requests > aborts, "Chaos raised no abort: the window tested nothing"
        assert board.num_preemptions == abandoned, "a paused engine abandoned a step"
        assert safepoint_counters(engine.base)[1] == steps_before, "paused steps still ran their safepoints"
    finally:
        board.pause(False)
    httpx.post(f"{engine.base}/reset_prefix_cache", timeout=30)
    with Chaos(board), ThreadPoolExecutor(max_workers=3) as pool:
        list(pool.map(lambda p: text(complete(engine.base, p, "offline", 8)), prompts))
    assert board.num_preemptions > abandoned, "resumed safepoints abandoned nothing"
