"""The fidelity ladder's pure parts: how pairs are judged, the figures of a run, the step rung and the twin replay.

No engine runs here: the pairing arithmetic on hand-made values, a run's figures on hand-made token times,
the step rung on the H200 grid in ``data/gpu`` (the twin's step time is the cost model's per-request form),
and the engine rung's twin replaying a hand-made run on one simulated engine.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from coserve.scheduling import CostSample, StepCostModel
from coserve.scheduling.cost_model import hold_out_interior


@pytest.mark.parametrize(
    ("measured_value", "simulated", "error", "within"),
    [
        (10.0, 10.5, 0.05, True),
        (10.0, 11.0, 0.10, True),  # the tolerance itself passes
        (10.0, 8.0, 0.20, False),
        (0.5, 1.0, 1.0, False),
        (0.0, 0.0, 0.0, True),
        (0.0, 1.0, None, False),  # undefined against a measured zero
        (10.0, None, None, False),  # no simulated value (too few simulated samples)
    ],
)
def test_a_pair_is_within_when_its_relative_error_is_at_most_its_tolerance(
    fidelity: ModuleType, measured_value: float, simulated: float | None, error: float | None, within: bool
) -> None:
    pair = fidelity.compare("engine", "arm", "ttft_p50_s", measured_value, simulated, 0.10)
    assert pair["relative_error"] == (pytest.approx(error) if error is not None else None)
    assert pair["within"] is within


def test_met_needs_pairs_and_every_pair_within(fidelity: ModuleType) -> None:
    good = fidelity.compare("engine", "a", "ttft_p50_s", 1.0, 1.05, 0.10)
    bad = fidelity.compare("engine", "a", "ttft_p95_s", 1.0, 2.0, 0.10)
    assert fidelity.met([good, good])
    assert not fidelity.met([good, bad])
    assert not fidelity.met([])


def test_unreportable_figures_and_zero_preemptions_are_skipped_with_their_reason(fidelity: ModuleType) -> None:
    mine = {"ttft_p50_s": 0.3, "ttft_p95_s": None, "tpot_p50_s": 0.1, "tpot_p95_s": None,
            "output_tokens_per_s": 100.0, "preemptions": 0}  # fmt: skip
    twin = {"ttft_p50_s": 0.31, "ttft_p95_s": 0.9, "tpot_p50_s": 0.2, "tpot_p95_s": 0.3,
            "output_tokens_per_s": 95.0, "preemptions": 0}  # fmt: skip
    pairs, skipped = fidelity.judge("engine", "1x", mine, twin, 0.10)
    assert [(p["figure"], p["within"]) for p in pairs] == [
        ("ttft_p50_s", True), ("tpot_p50_s", False), ("output_tokens_per_s", True),
    ]  # fmt: skip
    assert [s["figure"] for s in skipped] == ["ttft_p95_s", "tpot_p95_s", "preemptions"]
    assert skipped[0]["why"] == "measured null: fewer than 100 samples"
    # preemptions the engine made and the twin did not are a judged pair (the twin never preempts)
    pairs, _ = fidelity.judge("engine", "1.5x", {**mine, "preemptions": 7}, twin, 0.10)
    assert pairs[-1]["figure"] == "preemptions" and not pairs[-1]["within"]


def test_run_figures_time_tokens_from_each_requests_send(fidelity: ModuleType) -> None:
    arrivals = [0.0] * 60 + [10.0] * 60
    times = [[1.0, 1.5, 2.0]] * 60 + [[10.5, 11.5]] * 60
    figures = fidelity.run_figures(arrivals, times)
    assert figures["ttft_p50_s"] == pytest.approx(0.5, abs=0.5)
    assert figures["tpot_p95_s"] == pytest.approx(1.0)
    assert figures["tpot_p50_s"] in (pytest.approx(0.5), pytest.approx(1.0))
    assert figures["ttft_p95_s"] == pytest.approx(1.0)
    assert figures["output_tokens_per_s"] == pytest.approx((60 * 3 + 60 * 2) / 11.5)
    assert fidelity.run_figures([0.0] * 5, [[1.0, 2.0]] * 5)["ttft_p50_s"] is None  # too few for a p50


def test_the_step_rung_judges_the_twins_per_request_step_on_held_out_h200_steps(fidelity: ModuleType) -> None:
    train, holdout = hold_out_interior(fidelity.h200_samples())
    grid = fidelity.step_grid("H200", train, holdout)
    assert grid["decode_batches_held_out"] > 0 and grid["holdout"] == len(holdout)
    assert grid["worst_relative_error"] == max(r["relative_error"] for r in grid["steps"])
    # the twin's decode batch is B requests of their own context, not one request of the batch's totals
    model = StepCostModel(k1=0.0, k2=1.0, k3=0.0, k4=0.0, k5=0.0)
    (row,) = fidelity.step_errors(model, [CostSample(4, 400, 1.0, requests=4)])
    assert row["simulated_s"] == pytest.approx(4 * 1 * (1 + 100))


def test_the_engine_twin_replays_the_measured_requests_at_their_send_times(fidelity: ModuleType) -> None:
    profile = {"costModel": {"k1": 1e-3, "k2": 0.0, "k3": 0.0, "k4": 0.0, "k5": 0.01}, "kvCapacityTokens": 100_000}
    run = {
        "load": 1.0,
        "rate_per_s": 1.0,
        "preemptions": 0,
        "requests": [
            {"sent_s": 5.0 * i, "prompt_tokens": 100, "output_tokens": 3, "cls": "standard",
             "token_times": [5.0 * i + 0.11, 5.0 * i + 0.122, 5.0 * i + 0.133]}
            for i in range(10)
        ],
    }  # fmt: skip
    config = fidelity.parse_engine_config(fidelity.engine_config(profile["costModel"]), fidelity.BUDGET)
    requests, engine = fidelity.simulate_engine(run, config, 100_000)
    # alone on the engine, each request prefills in one 0.11 s step, then decodes at 0.011 s a token
    for i, request in enumerate(requests):
        assert request.token_times == pytest.approx([5.0 * i + 0.11, 5.0 * i + 0.121, 5.0 * i + 0.132])
    assert engine.steps == 30


def test_the_twin_adds_the_api_path_measured_on_the_calibration_load(fidelity: ModuleType) -> None:
    profile = {"costModel": {"k1": 1e-3, "k2": 0.0, "k3": 0.0, "k4": 0.0, "k5": 0.01}}
    config = fidelity.parse_engine_config(fidelity.engine_config(profile["costModel"]), fidelity.BUDGET)
    timing = config.cost_model
    requests = [
        {"sent_s": 5.0 * i, "prompt_tokens": 100, "output_tokens": 3, "cls": "standard", "token_times": [5.0 * i + 1],
         "http_in_s": 0.002 + 0.001 * (i % 3), "egress_s": 0.010 if i % 2 else 0.020}
        for i in range(101)
    ]  # fmt: skip
    calibration = {"load": fidelity.LOADS[0], "requests": requests}
    burst = {"load": None, "requests": [{**r, "http_in_s": 5.0, "egress_s": 5.0} for r in requests]}
    api, report = fidelity.api_path_of([calibration, burst])
    assert (api.in_s, api.out_s) == (pytest.approx(0.003), pytest.approx(0.020))  # medians; the burst left out
    assert report["measured"] and report["requests"] == 101
    assert fidelity.api_path_of([{"load": fidelity.LOADS[0], "requests": [{"sent_s": 0.0}]}])[0] == fidelity.ApiPath()
    # alone on the engine: the request reaches it in_s after its send, prefills in one 0.11 s step, and the
    # client has the first token out_s after that step
    run = {"requests": requests}
    plain = fidelity.twin_figures(run, config, 100_000, timing)
    pathed = fidelity.twin_figures(run, config, 100_000, timing, api)
    assert plain["ttft_p50_s"] == pytest.approx(0.11)
    assert pathed["ttft_p50_s"] == pytest.approx(0.11 + 0.003 + 0.020)
    assert pathed["tpot_p50_s"] == pytest.approx(plain["tpot_p50_s"])  # the way out delays every token alike


def test_arrivals_match_in_send_order_even_when_sends_tie(fidelity: ModuleType) -> None:
    sent = [(1.0, 50), (1.0, 50), (0.5, 80), (2.0, 50)]
    arrivals = [
        {"arrive": 1.30, "prompt": 50, "server_arrival": 1.01},
        {"arrive": 1.20, "prompt": 50, "server_arrival": 1.01},
        {"arrive": 0.60, "prompt": 80, "server_arrival": 0.51},
        {"arrive": 0.40, "prompt": 50, "server_arrival": 0.41},  # before any 50-token send: nobody's
    ]
    matched = fidelity.match_arrivals(sent, arrivals)
    assert [m["arrive"] if m else None for m in matched] == [1.20, 1.30, 0.60, None]
    assert fidelity.egress_of(1.25, [0.5, 1.0, 1.2, 1.4]) == pytest.approx(0.05)
    assert fidelity.egress_of(0.4, [0.5, 1.0]) is None


def test_a_load_is_judged_against_the_mean_of_its_two_runs(fidelity: ModuleType) -> None:
    first = {"ttft_p50_s": 0.2, "ttft_p95_s": None, "preemptions": 0.0, "requests": 200}
    second = {"ttft_p50_s": 0.3, "ttft_p95_s": 0.9, "preemptions": 10.0, "requests": 200}
    assert fidelity.mean_figures(first, second) == {
        "ttft_p50_s": pytest.approx(0.25), "ttft_p95_s": None, "preemptions": 5.0, "requests": 200,
    }  # fmt: skip


def test_a_load_of_several_runs_is_judged_against_their_mean_and_spread(fidelity: ModuleType) -> None:
    """Three runs: the mean of all three, and the spread as the largest over the smallest (a run without the
    figure gives no spread); a result from before, with one repeat stored as a dict, still reads."""
    runs = [{"ttft_p95_s": 1.0, "preemptions": 0.0}, {"ttft_p95_s": 1.5, "preemptions": 3.0},
            {"ttft_p95_s": 1.2, "preemptions": 6.0}]  # fmt: skip
    assert fidelity.mean_figures(*runs)["ttft_p95_s"] == pytest.approx(3.7 / 3)
    assert fidelity.run_spread(runs, "ttft_p95_s") == pytest.approx(0.5)
    assert fidelity.run_spread(runs, "preemptions") is None  # a zero has no ratio
    assert fidelity.run_spread(runs[:1], "ttft_p95_s") is None  # one run has no spread
    old = {"measured_again": {"ttft_p95_s": 1.5}, "step_time_bias": {"served_fit_again": 0.02}}
    assert fidelity.again_of(old) == [{"ttft_p95_s": 1.5}] and fidelity.biases_again(old) == [0.02]
    new = {"measured_again": [{"ttft_p95_s": 1.5}, {"ttft_p95_s": 1.2}],
           "step_time_bias": {"served_fit_again": [0.1, 0.2]}}  # fmt: skip
    assert len(fidelity.again_of(new)) == 2 and fidelity.biases_again(new) == [0.1, 0.2]


def test_the_pairs_outside_the_engines_own_spread_are_listed_with_which_way_the_twin_is_off(
    fidelity: ModuleType,
) -> None:
    """A pair 20 % off where the engine's runs spread 30 % is within what a twin can show; 20 % off where they
    spread 5 % is not, and is listed (the twin lower, its step time 15 % short on that load)."""

    def pair(figure: str, measured: float, simulated: float, spread: float | None) -> dict[str, Any]:
        made = fidelity.compare("engine", "1x capacity", figure, measured, simulated, fidelity.ENGINE_TOLERANCE)
        error = made["relative_error"]
        made["engine_spread"] = spread
        made["within_engine_spread"] = error <= max(made["tolerance"], spread or 0.0)
        return made

    noisy = pair("ttft_p95_s", 1.0, 0.8, 0.30)
    steady = pair("output_tokens_per_s", 100.0, 80.0, 0.05)
    arms = [{"arm": "1x capacity", "step_time_bias": {"served_fit": -0.15, "served_fit_again": [-0.1]}}]
    outside = fidelity.outside_spread([noisy, steady], arms)
    assert [(o["figure"], o["twin"]) for o in outside] == [("output_tokens_per_s", "lower")]
    assert outside[0]["served_fit_step_bias"] == [-0.15, -0.1]
    assert fidelity.outside_spread([noisy], arms) == []
