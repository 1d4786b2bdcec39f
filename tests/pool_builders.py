"""The sample CoServePool the operator tests share: 2 conversations/s of 2k-token prompts and 500 output tokens."""

from __future__ import annotations

import copy
from typing import Any

SAMPLE_SPEC: dict[str, Any] = {
    "model": {"name": "Qwen/Qwen3-8B"},
    "workload": {"arrivalRatePerS": 2.0, "inputTokens": 2000, "outputTokens": 500, "lifetimeS": 60.0},
    "profile": {
        "prefillLatency": {"constantS": 0.01, "perTokenS": 0.0001},
        "decodeThroughputTokensPerS": 2000.0,
        "kvCapacityTokens": 400000,
    },
}


def sample_pool(**metadata: Any) -> dict[str, Any]:
    """A fresh CoServePool named ``chat`` in ``serving``; ``metadata`` adds or overrides fields."""
    return {
        "apiVersion": "coserve.dev/v1alpha1",
        "kind": "CoServePool",
        "metadata": {"name": "chat", "namespace": "serving", **metadata},
        "spec": copy.deepcopy(SAMPLE_SPEC),
    }
