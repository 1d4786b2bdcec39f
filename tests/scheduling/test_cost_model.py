"""The step-latency cost model: least-squares fit and budget inversion."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from coserve.scheduling import CostSample, StepCostModel, fit_cost_model
from coserve.scheduling.cost_model import hold_out_interior, served_sample

ROOT = Path(__file__).resolve().parents[2]

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


def decode_batches(model: StepCostModel) -> list[CostSample]:
    """Single-request steps plus decode batches of B requests at c tokens of context each."""
    samples = grid(model)
    for batch in (2, 8, 32, 128):
        for context in (512, 2048, 8192):
            latency = model.step_latency_s([(1, context)] * batch)
            samples.append(CostSample(batch, batch * context, latency, requests=batch))
    return samples


def test_step_latency_charges_each_request_for_its_own_context() -> None:
    one = TRUE.step_latency_s([(1, 16_384)])
    batch = TRUE.step_latency_s([(1, 16_384)] * 64)
    # 64 decodes read 64 times the KV and attend 64 times, each to its own context, not to all of it
    attention_one = TRUE.k2 * (1 + 16_384)
    assert batch - TRUE.k5 == pytest.approx(64 * (one - TRUE.k5), rel=1e-12)
    assert batch == pytest.approx(TRUE.latency_s(64, 64 * 16_384, requests=64), rel=1e-12)
    assert batch < TRUE.latency_s(64, 64 * 16_384) - 60 * 64 * attention_one  # the batch-totals form overcharges
    assert TRUE.step_latency_s([(300, 700)]) == pytest.approx(TRUE.latency_s(300, 700), rel=1e-12)
    assert TRUE.step_latency_s([]) == TRUE.k5


def test_batched_decodes_identify_the_per_request_attention_term() -> None:
    samples = decode_batches(TRUE)
    report = fit_cost_model(samples[::2], samples[1::2])
    assert report.max_relative_error_holdout < 1e-6
    assert report.model.k2 == pytest.approx(TRUE.k2, rel=1e-6)
    assert report.model.k4 == pytest.approx(TRUE.k4, rel=1e-6)


def test_samples_with_no_batch_size_would_misfit_the_decode_batches() -> None:
    """The same steps read as single requests (the attention over the batch's totals) fit far worse."""
    as_totals = [CostSample(s.new_tokens, s.context_tokens, s.latency_s) for s in decode_batches(TRUE)]
    report = fit_cost_model(as_totals[::2], as_totals[1::2])
    assert report.max_relative_error_holdout > 0.1


def test_a_sample_needs_at_least_one_request() -> None:
    with pytest.raises(ValueError, match="requests: must be at least 1"):
        CostSample(1, 10, 0.01, requests=0)


def h200_grid() -> list[CostSample]:
    """The H200 steps in data/gpu (a decode sample is a batch of P requests at C / P context each)."""
    document = json.loads((ROOT / "data/gpu/profile-h200-measured.json").read_text())
    return [
        CostSample(s["P"], s["C"], s["s"], requests=s["P"] if s["kind"] == "decode" else 1) for s in document["samples"]
    ]


def test_h200_grid_held_out_worst_error_is_within_15_percent() -> None:
    train, holdout = hold_out_interior(h200_grid())
    assert (len(train), len(holdout)) == (20, 10)
    report = fit_cost_model(train, holdout)
    assert report.max_relative_error_holdout <= 0.15
    assert report.model.k2 > 0
    # the attention term over the batch's totals cannot: its worst held-out error is about twice that
    totals = fit_cost_model(
        [CostSample(s.new_tokens, s.context_tokens, s.latency_s) for s in train],
        [CostSample(s.new_tokens, s.context_tokens, s.latency_s) for s in holdout],
    )
    assert totals.max_relative_error_holdout > 0.25


def test_the_shipped_h200_profile_is_the_fit_of_its_grid() -> None:
    fitted = fit_cost_model(h200_grid(), h200_grid()).model
    shipped = yaml.safe_load((ROOT / "examples/profile-h200-measured.yaml").read_text())["costModel"]
    for key in ("k1", "k2", "k4", "k5"):
        assert shipped[key] == pytest.approx(getattr(fitted, key), rel=5e-3), key


def test_the_fit_weighs_short_and_long_steps_alike() -> None:
    """A 5 ms step off by 20 % matters as much as a 500 ms one: the fit minimizes the relative error."""
    steps = h200_grid()
    report = fit_cost_model(steps, steps)
    assert report.max_relative_error_holdout < 0.15  # plain least squares: 21 %, on the decode steps


def test_served_steps_fit_with_the_attention_their_scheduler_summed() -> None:
    """Served steps mix a prefill chunk with decodes: only the attention sum the scheduler traced identifies k2."""
    rng = random.Random(3)
    steps = []
    for _ in range(60):
        pieces = [(rng.choice((16, 64, 256)), rng.randrange(0, 2048))] + [(1, rng.randrange(64, 4096))] * rng.randrange(
            0, 60
        )
        steps.append(
            {
                "requests": len(pieces),
                "new": sum(p for p, _ in pieces),
                "context": sum(c for _, c in pieces),
                "attention": sum(p * (p + c) for p, c in pieces),
                "start": 10.0,
                "end": 10.0 + TRUE.step_latency_s(pieces),
            }
        )
    served = [served_sample(step) for step in steps]
    assert served[0].attention == steps[0]["attention"]
    report = fit_cost_model(served[::2], served[1::2])
    assert report.max_relative_error_holdout < 1e-6
    assert report.model.k2 == pytest.approx(TRUE.k2, rel=1e-6)
    # read as uniform batches (no attention sum), the same steps misfit
    uniform = [CostSample(s.new_tokens, s.context_tokens, s.latency_s, s.requests) for s in served]
    assert fit_cost_model(uniform[::2], uniform[1::2]).max_relative_error_holdout > 0.01
