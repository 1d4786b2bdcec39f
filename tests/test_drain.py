"""The drain decision of an engine pod's preStop hook (``coserve.drain``), on recorded readings.

The real hook against real engines is tests/engine/test_drain_engines.py.
"""

from __future__ import annotations

import pytest

from coserve.drain import DrainWatch, busy_requests, drain

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="tiny"} 7.0
"""


def test_busy_counts_running_and_waiting_of_every_engine_and_nothing_else() -> None:
    assert busy_requests(METRICS) == 6
    assert busy_requests("") == 0


def run(readings: list[int | None], quiet_s: float, timeout_s: float) -> tuple[str, float, int]:
    """Feed one reading per second; the verdict, when it came, and how many readings it took."""
    watch = DrainWatch(quiet_s, timeout_s, started=0.0)
    for second, busy in enumerate(readings):
        verdict = watch.observe(float(second), busy)
        if verdict is not None:
            return verdict.reason, verdict.waited_s, second + 1
    raise AssertionError("no verdict")


def test_waits_for_in_flight_requests_then_for_the_quiet_period() -> None:
    # busy for 3 s, then idle: done once idle for 2 s in a row (at t=5), not at the first idle reading
    assert run([2, 2, 1, 0, 0, 0, 0], quiet_s=2, timeout_s=60) == ("idle", 5.0, 6)


def test_a_request_arriving_in_the_quiet_period_restarts_it() -> None:
    # a router that has not yet seen the Service change sends one more request at t=2
    assert run([0, 0, 1, 0, 0, 0, 0], quiet_s=2, timeout_s=60) == ("idle", 5.0, 6)


def test_the_bound_ends_a_drain_that_never_goes_idle() -> None:
    assert run([1] * 20, quiet_s=2, timeout_s=10) == ("timeout", 10.0, 11)


def test_an_engine_that_no_longer_answers_is_not_waited_for_beyond_the_quiet_period() -> None:
    assert run([1, None, None, None, None], quiet_s=2, timeout_s=60) == ("unreachable", 3.0, 4)


def test_zero_quiet_stops_at_the_first_idle_reading() -> None:
    assert run([3, 0], quiet_s=0, timeout_s=60) == ("idle", 1.0, 2)


def test_negative_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        DrainWatch(-1, 10, 0.0)


def test_drain_polls_until_the_verdict_and_logs_each_change() -> None:
    readings = iter([2, 2, 0, 0, 0])
    now = [0.0]
    lines: list[str] = []

    def sleep(seconds: float) -> None:
        now[0] += seconds

    verdict = drain(
        "http://127.0.0.1:8000/metrics", quiet_s=2, timeout_s=60,
        read=lambda _url, _timeout: next(readings), clock=lambda: now[0], sleep=sleep, log=lines.append,
    )  # fmt: skip
    assert (verdict.reason, verdict.waited_s) == ("idle", 4.0)
    assert [line for line in lines if "running or waiting" in line] == [
        "coserve drain: 2 requests running or waiting",
        "coserve drain: 0 requests running or waiting",
    ]
    assert lines[-1] == "coserve drain: done after 4.0 s (idle)"
