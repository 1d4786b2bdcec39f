"""Shared fixtures: paths and a factory for valid CoServePool documents."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
CRD_FILE = ROOT / "crds" / "coserve.dev_coservepools.yaml"
# The data in this checkout (see each folder's README.md): real serving traces, what a real kube-apiserver returned.
TRACES = ROOT / "data" / "traces"
APISERVER_RECORDINGS = ROOT / "data" / "apiserver"


def sanity_document(**workload: Any) -> dict[str, Any]:
    """The paper's sanity case: 15k in, 1k out, T_p 25k tokens/s, T_d 1k tokens/s, 300k KV tokens."""
    return {
        "apiVersion": "coserve.dev/v1alpha1",
        "kind": "CoServePool",
        "metadata": {"name": "sanity", "namespace": "test"},
        "spec": {
            "model": {"name": "test/model"},
            "workload": {
                "arrivalRatePerS": 25_000 / 15_000,
                "inputTokens": 15_000,
                "outputTokens": 1_000,
                "lifetimeS": 10.0,
                **workload,
            },
            "profile": {
                "prefillLatency": {"perTokenS": 1 / 25_000},
                "decodeThroughputTokensPerS": 1_000.0,
                "kvCapacityTokens": 300_000,
            },
            "headroom": 1.0,
            "shape": "Disaggregated",  # the paper's P/D case (aggregated engines would sustain more: test_shape)
        },
    }


@pytest.fixture
def example_document() -> Callable[[str], dict[str, Any]]:
    def load(name: str = "pool.yaml") -> dict[str, Any]:
        return copy.deepcopy(yaml.safe_load((EXAMPLES / name).read_text()))

    return load
