"""The benchmark harness's guarantees: any trace, percentiles only from enough samples, paired intervals,
Student's t with and without scipy, the best of a sweep and its Pareto frontier, tables and figures."""

from __future__ import annotations

import random
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats as scipy_stats


def test_an_azure_csv_and_a_mooncake_jsonl_read_alike(harness: SimpleNamespace, tmp_path: Path) -> None:
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
    workload = harness.workload
    rows = workload.load_trace(azure)
    assert [(r.offset_s, r.context_tokens, r.generated_tokens) for r in rows] == [(0.0, 374, 44), (2.5, 10, 2)]
    rows = workload.load_trace(mooncake)
    assert [(r.offset_s, r.context_tokens, r.generated_tokens) for r in rows] == [(0.0, 6758, 500), (2.5, 7, 5)]
    assert workload.trace_label(mooncake) == str(mooncake)  # not a shared trace: named by its path


def test_a_file_that_is_no_trace_is_a_clear_error(harness: SimpleNamespace, tmp_path: Path) -> None:
    other = tmp_path / "x.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(SystemExit, match="not a trace"):
        harness.workload.load_trace(other)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    with pytest.raises(SystemExit, match=r"bad\.jsonl:1: bad Mooncake row"):
        harness.workload.load_trace(bad)
    with pytest.raises(SystemExit, match="trace not found"):
        harness.workload.load_trace(tmp_path / "missing.csv")


# --- percentiles ----------------------------------------------------------------------------------------


def hand_written_percentile(values: list[float], q: float) -> float:
    """The rule the benchmarks used before numpy: the sorted values' element at round(q/100 · (n - 1))."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


samples = st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=300)
quantiles = st.one_of(st.sampled_from([50, 90, 95, 99]), st.integers(0, 100), st.floats(0, 100))


@given(samples, quantiles)
def test_numpys_nearest_percentile_is_the_hand_written_rule(
    harness: SimpleNamespace, values: list[float], q: float
) -> None:
    assert harness.stats.percentile(values, q) == hand_written_percentile(values, q)


def test_a_percentile_of_nothing_is_nan(harness: SimpleNamespace) -> None:
    assert harness.stats.percentile([], 50) != harness.stats.percentile([], 50)


def test_percentiles_need_enough_samples(harness: SimpleNamespace) -> None:
    stats = harness.stats
    values = [float(i) for i in range(199)]
    assert stats.reportable_percentile(values, 99) is None
    assert stats.reportable_percentile([*values, 199.0], 99) == pytest.approx(197.0)
    assert stats.reportable_percentile(values[:99], 95) is None
    assert stats.reportable_percentile(values[:100], 95) is not None
    assert stats.reportable_percentile(values[:9], 50) is None


def test_a_percentile_ratio_interval_holds_the_ratio_and_needs_enough_samples(harness: SimpleNamespace) -> None:
    stats = harness.stats
    rng = random.Random(3)
    ours = [rng.expovariate(1.0) * 2 for _ in range(300)]
    theirs = [rng.expovariate(1.0) for _ in range(300)]
    low, high = stats.percentile_ratio_interval(ours, theirs, 95)
    point = stats.percentile(ours, 95) / stats.percentile(theirs, 95)
    assert low < point < high
    assert low > 1.0 and high < 4.0  # twice as slow, told apart from "the same"
    same = stats.percentile_ratio_interval(theirs, theirs, 95)
    assert same[0] < 1.0 < same[1]
    assert stats.percentile_ratio_interval(ours[:99], theirs, 95) is None  # p95 needs 100


# --- Student's t ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("df", [1, 2, 3, 4, 7, 10, 29, 30, 31, 50, 199, 1000])
def test_t975_is_scipys_quantile(harness: SimpleNamespace, df: int) -> None:
    assert harness.stats.t975(df) == pytest.approx(float(scipy_stats.t.ppf(0.975, df)), rel=1e-12)


def test_without_scipy_t975_is_within_a_fifth_of_a_percent_from_3_degrees_of_freedom(
    harness: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU lender's image has no scipy: the Cornish-Fisher expansion stands in, and gives no interval
    (inf) where it would be too narrow."""
    exact = {df: float(scipy_stats.t.ppf(0.975, df)) for df in range(1, 2001)}
    monkeypatch.setattr(harness.stats, "_scipy_stats", None)
    assert harness.stats.t975(1) == float("inf")
    assert harness.stats.t975(2) == float("inf")
    worst = max(abs(harness.stats.t975(df) / t - 1) for df, t in exact.items() if df >= 3)
    assert worst <= 0.002
    _, half = harness.stats.mean_interval([1.0, 2.0, 3.0])  # 2 degrees of freedom: no interval
    assert half == float("inf")


def test_paired_overhead_stops_when_the_interval_is_narrow_enough(harness: SimpleNamespace) -> None:
    steady = iter([100.0, 99.0] * 50)  # always 1% slower with the treatment
    paired = harness.stats.PairedOverhead(target=0.02, min_pairs=4, max_pairs=40).run(lambda _: next(steady), "t")
    summary = paired.summary()
    assert summary["n"] == 4 and summary["stopped"] == "interval below target"
    rng = random.Random(0)  # +-10% noise on both sides: never narrower than 2% within the cap
    capped = harness.stats.PairedOverhead(target=0.02, min_pairs=4, max_pairs=10)
    capped.run(lambda _: rng.uniform(90, 110), "t")
    assert capped.summary()["n"] == 10 and capped.summary()["stopped"] == "cap of 10 pairs"
    assert capped.summary()["met"] is False  # judged on the upper bound, not the mean


# --- sweeps ---------------------------------------------------------------------------------------------


def test_the_best_of_a_sweep_skips_arms_without_the_figure(harness: SimpleNamespace) -> None:
    best_of = harness.sweep.best_of
    rows = [{"arm": "a", "p99": None}, {"arm": "b", "p99": 3.0}, {"arm": "c", "p99": 2.0}, {"arm": "d", "p99": 2.0}]
    assert best_of(rows, "p99")["arm"] == "c"  # the lowest; the first on a tie
    assert best_of(rows, "p99", highest=True)["arm"] == "b"  # None is never the best, even at the top
    assert best_of([{"arm": "a"}, *rows], "p99")["arm"] == "c"  # a row without the column is skipped too
    with pytest.raises(ValueError, match="p99"):
        best_of([{"arm": "a", "p99": None}], "p99")


def test_the_best_of_a_sweep_by_a_score(harness: SimpleNamespace) -> None:
    best_of = harness.sweep.best_of
    runs = [SimpleNamespace(name="x", gain=5.0), SimpleNamespace(name="y", gain=9.0), SimpleNamespace(name="z")]
    assert best_of(runs, lambda run: getattr(run, "gain", None), highest=True).name == "y"
    # a tuple breaks ties on its first figure with the next: fewest minutes, then fewest hours
    sweep = [{"minutes": 0, "hours": 3.0}, {"minutes": 0, "hours": 2.5}, {"minutes": 1, "hours": 1.0}]
    assert best_of(sweep, lambda s: (s["minutes"], s["hours"])) == {"minutes": 0, "hours": 2.5}
    with pytest.raises(ValueError, match="a score"):
        best_of(runs, lambda run: None)


def test_the_pareto_frontier_keeps_each_unbeaten_point_once(harness: SimpleNamespace) -> None:
    points = [
        ("a", 0.0, 0.98),
        ("b", 100.0, 0.97),
        ("c", 90.0, 0.90),  # beaten by b on both
        ("d", 300.0, 0.80),
        ("e", 300.0, 0.70),  # tied with d on throughput, lower attainment: beaten
        ("f", 100.0, 0.97),  # the same point as b: kept once, as the first
        ("g", 0.0, 0.98),  # the same as a
        ("h", 50.0, 0.975),  # between a and b on both: unbeaten
    ]
    front = harness.sweep.pareto(points, lambda p: (p[1], p[2]))
    assert [p[0] for p in front] == ["a", "h", "b", "d"]  # sorted by the first score
    # lower is better: negated scores (cost, violations), sorted by the first negated score
    costs = [(2.0, 8.0), (2.5, 6.0), (2.2, 4.0), (2.8, 0.0), (3.5, 0.0), (2.2, 4.0)]
    assert harness.sweep.pareto(costs, lambda p: (-p[0], -p[1])) == [(2.8, 0.0), (2.2, 4.0), (2.0, 8.0)]
    assert harness.sweep.pareto([], lambda p: p) == []


# --- results --------------------------------------------------------------------------------------------


def test_a_table_prints_its_rows_and_a_missing_figure_as_a_dash(
    harness: SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    results = harness.results
    table = results.Table("arm", [("p50 s", 8), ("ratio", 7)], label_width=6)
    table.row("stock", 0.123, None)
    table.row("ours", "fast", results.ratio(3.0, 2.0))
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["", "arm      p50 s  ratio", "stock     0.12      -", "ours      fast   1.50"]
    assert table.rows == [["stock", "0.12", "-"], ["ours", "fast", "1.50"]]
    assert results.ratio(1.0, 0.0) is None and results.ratio(None, 1.0) is None
    assert results.show(0.5, "{:.0%}") == "50%" and results.show(None) == "-"


def test_a_figure_saves_its_grid_where_it_is_asked_to(harness: SimpleNamespace, tmp_path: Path) -> None:
    path = tmp_path / "new" / "grid.png"  # its folder is made
    with harness.results.figure(path, rows=2, columns=1, size=(3, 3), dpi=50, squeeze=False) as axes:
        assert len(axes) == 2 and len(axes[0]) == 1
        axes[1][0].plot([0, 1], [1, 0])
        axes[0][0].figure.suptitle("two rows")
    assert path.read_bytes().startswith(b"\x89PNG")


def test_a_result_names_what_it_measured_and_where(freshness: ModuleType) -> None:
    stamp = freshness.stamp("kv_pool")
    assert "benchmarks/kv_pool.py" in stamp["code"]["files"]
    assert "benchmarks/harness/results.py" in stamp["code"]["files"]  # reached through its imports
    assert set(stamp) >= {"commit", "code", "date", "cpu_count"}
    assert isinstance(stamp["commit"]["dirty"], list)
    with pytest.raises(KeyError, match=r"measured_paths\.py"):
        freshness.stamp("no_such_benchmark")
