"""The benchmark harness's guarantees: any trace, percentiles only from enough samples, paired intervals."""

from __future__ import annotations

import random
from pathlib import Path
from types import ModuleType

import pytest


def test_an_azure_csv_and_a_mooncake_jsonl_read_alike(harness: ModuleType, tmp_path: Path) -> None:
    azure = tmp_path / "a.csv"
    azure.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:48.5000000,10,2\n"
        "2023-11-16 18:15:46.0000000,374,44\n"  # out of order: sorted by arrival
    )
    mooncake = tmp_path / "m.jsonl"
    mooncake.write_text(
        '{"timestamp": 1000, "input_length": 6758, "output_length": 500, "hash_ids": [0]}\n'
        '{"timestamp": 3500, "input_length": 7, "output_length": 5, "hash_ids": [1]}\n'
    )
    rows = harness.load_trace(azure)
    assert [(r.offset_s, r.context_tokens, r.generated_tokens) for r in rows] == [(0.0, 374, 44), (2.5, 10, 2)]
    rows = harness.load_trace(mooncake)
    assert [(r.offset_s, r.context_tokens, r.generated_tokens) for r in rows] == [(0.0, 6758, 500), (2.5, 7, 5)]
    assert harness.trace_label(mooncake) == str(mooncake)  # not a shared trace: named by its path


def test_a_file_that_is_no_trace_is_a_clear_error(harness: ModuleType, tmp_path: Path) -> None:
    other = tmp_path / "x.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(SystemExit, match="not a trace"):
        harness.load_trace(other)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    with pytest.raises(SystemExit, match=r"bad\.jsonl:1: bad Mooncake row"):
        harness.load_trace(bad)
    with pytest.raises(SystemExit, match="trace not found"):
        harness.load_trace(tmp_path / "missing.csv")


def test_percentiles_need_enough_samples(harness: ModuleType) -> None:
    values = [float(i) for i in range(199)]
    assert harness.reportable_percentile(values, 99) is None
    assert harness.reportable_percentile([*values, 199.0], 99) == pytest.approx(197.0)
    assert harness.reportable_percentile(values[:99], 95) is None
    assert harness.reportable_percentile(values[:100], 95) is not None
    assert harness.reportable_percentile(values[:9], 50) is None


def test_paired_overhead_stops_when_the_interval_is_narrow_enough(harness: ModuleType) -> None:
    steady = iter([100.0, 99.0] * 50)  # always 1% slower with the treatment
    paired = harness.PairedOverhead(target=0.02, min_pairs=4, max_pairs=40).run(lambda _: next(steady), "t")
    summary = paired.summary()
    assert summary["n"] == 4 and summary["stopped"] == "interval below target"
    rng = random.Random(0)  # +-10% noise on both sides: never narrower than 2% within the cap
    capped = harness.PairedOverhead(target=0.02, min_pairs=4, max_pairs=10).run(lambda _: rng.uniform(90, 110), "t")
    assert capped.summary()["n"] == 10 and capped.summary()["stopped"] == "cap of 10 pairs"
    assert capped.summary()["met"] is False  # judged on the upper bound, not the mean


def test_a_result_names_what_it_measured_and_where(harness: ModuleType) -> None:
    stamp = harness.stamp("kv_pool")
    assert "benchmarks/kv_pool.py" in stamp["code"]["files"]
    assert set(stamp) >= {"commit", "code", "date", "cpu_count"}
    assert isinstance(stamp["commit"]["dirty"], list)
    with pytest.raises(KeyError, match=r"measured_paths\.py"):
        harness.stamp("no_such_benchmark")
