"""``coserve bench`` over real HTTP: the router in front of fast fake engines (the real-engine run is in
tests/engine/test_router_engines.py). The fake engines are test doubles for vLLM's OpenAI server."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from coserve.cli import bench as cli_bench
from coserve.cli.main import main
from coserve.router.app import build_app
from coserve.router.config import parse_router_config
from router_served import FakeEngine, Served, free_port


@pytest.fixture
def pool() -> Iterator[tuple[str, list[FakeEngine]]]:
    engines = [FakeEngine("a"), FakeEngine("b")]
    router = Served(build_app(parse_router_config({"model": "tiny", "decoders": [e.url for e in engines]})))
    try:
        yield router.url, engines
    finally:
        router.stop()
        for engine in engines:
            engine.served.stop()


def run_bench(url: str, out: Path, *extra: str) -> int:
    return main(["bench", "--url", url, "--output", str(out), "--first", "40", "--gap", "0", "--rate", "50", *extra])


def test_an_agentic_run_pins_each_conversation_and_writes_json_and_png(
    pool: tuple[str, list[FakeEngine]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, engines = pool
    assert run_bench(url, tmp_path, "--conversations", "4", "--turns", "3") == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert (report["benchmark"], report["met"], report["requests"], report["errors"]) == ("coserve_bench", True, 12, 0)
    assert report["ttfet_s"]["p50"] is not None and report["ttft_s"]["p99"] is not None
    assert len(report["tbt_s"]) == 4 and report["tbt_s"]["p50"] > 0  # the fake streams 3 chunks 10 ms apart
    assert (tmp_path / "bench.png").stat().st_size > 1000
    prompts: dict[str, list[tuple[int, ...]]] = {e.name: [tuple(r["prompt"]) for r in e.requests] for e in engines}
    assert sum(map(len, prompts.values())) == 12
    for name, seen in prompts.items():  # every later turn went where its conversation's first turn went
        for prompt in seen:
            if len(prompt) > 40:
                assert prompt[:40] in seen, f"a turn on {name} whose first turn ran elsewhere"
    out = capsys.readouterr()
    assert "TTFET (s)" in out.out and "12 requests, 0 errors" in out.out
    assert "12/12 requests" in out.err  # the progress bar


def test_a_p95_ttft_target_is_judged_from_the_measurement(pool: tuple[str, list[FakeEngine]], tmp_path: Path) -> None:
    url, _ = pool
    assert run_bench(url, tmp_path, "--conversations", "2", "--turns", "1", "--ttft-p95-target", "0.000001") == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["met"] is False and "p95 TTFT <= 1e-06 s" in report["target"]


def test_failed_requests_are_reported_not_dropped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    router = Served(build_app(parse_router_config({"model": "tiny", "decoders": [dead]})))
    try:
        assert run_bench(router.url, tmp_path, "--conversations", "2", "--turns", "2") == 1
    finally:
        router.stop()
    report = json.loads((tmp_path / "bench.json").read_text())
    assert (report["requests"], report["errors"], report["met"]) == (4, 4, False)
    assert report["records"][0]["error"].startswith("HTTP 503")
    assert "first error: HTTP 503" in capsys.readouterr().err


def test_an_unreachable_endpoint_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_bench(f"http://127.0.0.1:{free_port()}", tmp_path) == 1
    assert "did not answer within 0 s" in capsys.readouterr().err
    assert not (tmp_path / "bench.json").exists()


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["--url", "localhost:8080"], "coserve bench: --url: must be an http(s) URL"),
        (["--url", "http://x", "--rate", "0"], "coserve bench: --rate: must be a positive number, got 0.0"),
        (["--url", "http://x", "--turns", "0"], "coserve bench: --turns: must be at least 1, got 0"),
        (["--url", "http://x", "--gap", "-1"], "coserve bench: --gap: must not be negative"),
        (["--url", "http://x", "--workload", "azure", "--trace", "/nonexistent.csv"], "--trace: cannot read"),
    ],
)
def test_bad_arguments_exit_2_naming_the_flag(
    args: list[str], problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", *args]) == 2
    assert problem in capsys.readouterr().err


def test_a_file_that_is_not_the_trace_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("a,b\n1,2\n")
    assert main(["bench", "--url", "http://x", "--workload", "azure", "--trace", str(trace)]) == 2
    assert "is not a azure trace" in capsys.readouterr().err


@pytest.mark.parametrize("workload", ["mooncake", "azure"])
def test_without_trace_a_checkout_replays_its_own_copy_of_the_trace(workload: str) -> None:
    parser = argparse.ArgumentParser()
    cli_bench.add_workload_arguments(parser, conversations=3)
    conversations = cli_bench.workload_from(parser.parse_args(["--workload", workload]), lengths_only=True)
    assert len(conversations) == 3
    assert cli_bench.DEFAULT_TRACES[workload].parent.parts[-2:] == ("data", "traces")


def test_a_missing_default_trace_says_to_pass_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Installed from a wheel, coserve has no data/traces beside it."""
    monkeypatch.setitem(cli_bench.DEFAULT_TRACES, "mooncake", tmp_path / "data/traces/mooncake_conversation.jsonl")
    assert main(["bench", "--url", "http://x", "--workload", "mooncake"]) == 2
    err = capsys.readouterr().err
    assert "--trace: no mooncake trace at" in err and "pass --trace FILE" in err


def test_a_mooncake_trace_file_is_replayed_sped_up_and_scaled(
    pool: tuple[str, list[FakeEngine]], tmp_path: Path
) -> None:
    url, engines = pool
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1200, "output_length": 100, "hash_ids": [0, 1, 2, 3]},
        {"timestamp": 100, "input_length": 700, "output_length": 10, "hash_ids": [0, 4]},
        {"timestamp": 300, "input_length": 1700, "output_length": 50, "hash_ids": [0, 1, 2, 3, 5]},
    ]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    argv = ["bench", "--url", url, "--output", str(tmp_path), "--workload", "mooncake", "--trace", str(trace),
            "--speedup", "10", "--scale", "0.1"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert (report["requests"], report["errors"]) == (3, 0)
    sent = sorted(len(r["prompt"]) for e in engines for r in e.requests)
    assert sent == [70, 120, 170]
    assert [r["max_tokens"] for e in engines for r in e.requests if len(r["prompt"]) == 170] == [5]
