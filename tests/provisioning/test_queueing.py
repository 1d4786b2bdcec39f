"""The two queue formulas the plan prices waiting with, against the textbook cases they must reduce to."""

from __future__ import annotations

import math

import pytest

from coserve.provisioning.queueing import Wait, erlang_c, mg1_wait, mgc_wait


def test_erlang_c_matches_the_closed_forms() -> None:
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: an arrival waits with chance ρ
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)  # M/M/2 at a = 1: 2a²/((2 - a)(2 + 2a + a²))... = 1/3
    assert erlang_c(3, 0.0) == 0.0
    assert erlang_c(3, 3.0) == 1.0  # saturated


def test_one_exponential_server_is_m_m_1_either_way() -> None:
    """λ = 0.8, S = 1: mean wait ρ·S/(1 - ρ) = 4 s, from Allen-Cunneen (scv 1) and from Pollaczek-Khinchine."""
    many = mgc_wait(1, 0.8, 1.0, 1.0)
    one = mg1_wait(0.8, 1.0, 2.0)  # E[S²] = 2·S² for exponential service
    assert many.mean_s == pytest.approx(4.0) and one.mean_s == pytest.approx(4.0)
    # M/M/1's wait tail is exactly ρ·exp(-(1 - ρ)·t/S): its p95 is S/(1 - ρ)·ln(ρ/0.05)
    assert one.quantile_s(0.95) == pytest.approx(5.0 * math.log(0.8 / 0.05))


def test_deterministic_service_waits_half_as_long() -> None:
    assert mgc_wait(1, 0.8, 1.0, 0.0).mean_s == pytest.approx(2.0)


def test_saturation_has_no_bounded_wait_and_few_waiters_have_no_p95_wait() -> None:
    assert mgc_wait(2, 2.0, 1.0, 0.0).saturated and math.isinf(mg1_wait(1.0, 1.0, 1.0).quantile_s(0.95))
    assert Wait(0.04, 0.1).quantile_s(0.95) == 0.0  # fewer than 5 % of arrivals wait at all
