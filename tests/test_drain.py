"""The drain decision of an engine pod's preStop hook (``coserve.drain``), on recorded readings.

The real hook against real engines is tests/engine/test_drain_engines.py.
"""

from __future__ import annotations

import http.server
import socket
import threading
import time

import pytest

from coserve.drain import BUSY_UNKNOWN, DrainWatch, busy_requests, drain

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


def test_an_engine_alive_without_a_count_is_busy_not_gone() -> None:
    # slow answers, errors, resets: alive, so the drain waits on, to the bound if need be
    assert run([1, *[BUSY_UNKNOWN] * 30, 0, 0, 0], quiet_s=2, timeout_s=60) == ("idle", 33.0, 34)
    assert run([BUSY_UNKNOWN] * 20, quiet_s=2, timeout_s=10) == ("timeout", 10.0, 11)


def test_each_reading_may_wait_as_long_as_the_drain_may_last() -> None:
    now = [0.0]
    timeouts: list[float] = []

    def read(_url: str, timeout_s: float) -> int | None:
        timeouts.append(timeout_s)
        now[0] += 7.0  # a slow answer
        return 1

    verdict = drain("http://127.0.0.1:8000/metrics", quiet_s=2, timeout_s=20, read=read, clock=lambda: now[0],
                    sleep=lambda s: None, log=lambda _: None)  # fmt: skip
    assert (verdict.reason, verdict.waited_s) == ("timeout", 21.0)
    assert timeouts == [20.0, 13.0, 6.0]


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


# -- against a real HTTP engine on loopback (a test double for vLLM's /metrics) ----------------------------


class SlowEngine:
    """Answers ``/metrics`` from a script of (delay before answering in s, busy requests or an HTTP status);
    after the script, idle at once. ``answered`` counts the answers written in full."""

    def __init__(self, script: list[tuple[float, int | str]]) -> None:
        self.script = list(script)
        self.answered = 0
        engine = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                delay, busy = engine.script.pop(0) if engine.script else (0.0, 0)
                time.sleep(delay)  # the engine is slow to answer (a long step, a loaded API server)
                if isinstance(busy, str):
                    self.send_error(int(busy))
                else:
                    text = f'vllm:num_requests_running{{engine="0"}} {busy}\n'
                    self.send_response(200)
                    self.send_header("content-type", "text/plain")
                    self.end_headers()
                    self.wfile.write(text.encode())
                engine.answered += 1

            def log_message(self, *_: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_slow_answers_are_waited_for_however_slow() -> None:
    """Two readings take longer than any per-read timeout the hook used (1 s at least): the engine is
    alive and busy, so the drain waits for both and ends only once the engine is idle."""
    engine = SlowEngine([(0.0, 1), (1.6, 1), (1.6, 1)])
    try:
        lines: list[str] = []
        verdict = drain(engine.url, quiet_s=0.3, timeout_s=60, period_s=0.05, log=lines.append)
        assert verdict.reason == "idle", lines
        assert engine.answered >= 4  # both slow answers were read in full, then the idle ones
    finally:
        engine.stop()


def test_an_engine_that_answers_with_errors_is_alive_and_waited_for_until_the_bound() -> None:
    engine = SlowEngine([(0.0, 1), *[(0.0, "500")] * 1000])
    try:
        verdict = drain(engine.url, quiet_s=0.2, timeout_s=1.0, period_s=0.05, log=lambda _: None)
        assert verdict.reason == "timeout"
    finally:
        engine.stop()


def test_a_refused_connection_is_an_engine_gone() -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    verdict = drain(f"http://127.0.0.1:{port}/metrics", quiet_s=0.2, timeout_s=60, period_s=0.05, log=lambda _: None)
    assert verdict.reason == "unreachable" and verdict.waited_s < 30
