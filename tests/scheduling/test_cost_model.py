"""The step-latency cost model: least-squares fit and budget inversion."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coserve.scheduling import CostSample, StepCostModel, fit_cost_model

TRUE = StepCostModel(k1=2e-5, k2=3e-9, k3=1e-5, k4=4e-7, k5=0.004)


def grid(model: StepCostModel, noise: float = 0.0, seed: int = 0) -> list[CostSample]:
    rng = random.Random(seed)
    samples = []
    for p in (1, 8, 32, 128, 512, 1024, 2048):
        for c in (0, 256, 1024, 4096, 8192):
            latency = model.latency_s(p, c) * (1 + rng.uniform(-noise, noise))
            samples.append(CostSample(p, c, latency))
    return samples


def test_exact_data_recovers_the_model_with_k1_and_k3_merged() -> None:
    samples = grid(TRUE)
    report = fit_cost_model(samples[::2], samples[1::2])
    fitted = report.model
    assert fitted.k1 == pytest.approx(TRUE.k1 + TRUE.k3, rel=1e-6)
    assert fitted.k3 == 0.0
    assert (fitted.k2, fitted.k4, fitted.k5) == pytest.approx((TRUE.k2, TRUE.k4, TRUE.k5), rel=1e-6)
    assert report.r2_holdout == pytest.approx(1.0)
    assert report.max_relative_error_holdout < 1e-6


def test_noisy_data_still_fits_well() -> None:
    samples = grid(TRUE, noise=0.05, seed=7)
    report = fit_cost_model(samples[::2], samples[1::2])
    assert report.r2_holdout > 0.95
    assert report.max_relative_error_holdout < 0.2


@pytest.mark.parametrize(
    ("train", "holdout", "message"),
    [
        (3, 1, "at least 4 training samples"),
        (5, 0, "held-out"),
    ],
)
def test_too_little_data_is_refused(train: int, holdout: int, message: str) -> None:
    samples = grid(TRUE)
    with pytest.raises(ValueError, match=message):
        fit_cost_model(samples[:train], samples[train : train + holdout])


@given(budget_s=st.floats(min_value=0.0, max_value=2.0), context=st.integers(0, 100_000), limit=st.integers(0, 8192))
def test_max_new_tokens_is_the_exact_inverse(budget_s: float, context: int, limit: int) -> None:
    tokens = TRUE.max_new_tokens(budget_s, context, limit)
    assert 0 <= tokens <= limit
    if tokens > 0:
        assert TRUE.latency_s(tokens, context) <= budget_s
    if tokens < limit:
        assert TRUE.latency_s(tokens + 1, context) > budget_s


def test_from_dict_names_bad_keys() -> None:
    assert StepCostModel.from_dict(TRUE.to_dict()) == TRUE
    with pytest.raises(ValueError, match=r"costModel\.k5: required"):
        StepCostModel.from_dict({"k1": 1, "k2": 1, "k3": 1, "k4": 1})
    with pytest.raises(ValueError, match=r"costModel\.k2: must be a finite number"):
        StepCostModel.from_dict({"k1": 1, "k2": float("nan"), "k3": 1, "k4": 1, "k5": 1})
