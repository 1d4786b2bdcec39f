"""The reconcile benchmark's mocked Prometheus answers every query the autoscaler runs (a new signal once broke
its autoscaled hour with a KeyError)."""

from __future__ import annotations

from types import ModuleType

from coserve.autoscaling.queries import DEFAULT_QUERIES


def test_the_steady_answers_cover_every_default_query(reconcile: ModuleType) -> None:
    assert set(reconcile.STEADY) == set(DEFAULT_QUERIES)
