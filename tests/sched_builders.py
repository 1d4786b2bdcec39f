"""Builders for SchedRequest objects used by the scheduling tests."""

from __future__ import annotations

from typing import Any

from coserve.scheduling import ClassRegistry, SchedRequest, StepCostModel

REGISTRY = ClassRegistry(
    [
        {"name": "interactive", "weight": 10, "ttftSloMs": 1000, "tpotSloMs": 100},
        {"name": "standard", "weight": 3, "ttftSloMs": 5000, "tpotSloMs": 200},
        {"name": "offline", "weight": 1, "ttftSloMs": 3_600_000, "tpotSloMs": 10_000},
    ]
)
# Roughly the tiny CPU model: 5 ms per step plus 0.1 ms per new token.
COST = StepCostModel(k1=1e-4, k2=1e-9, k3=0.0, k4=1e-7, k5=0.005)


def make_request(
    request_id: str,
    cls: str = "standard",
    *,
    arrival_s: float = 0.0,
    prompt: int = 100,
    computed: int = 0,
    output: int = 0,
    running: bool = False,
    **overrides: Any,
) -> SchedRequest:
    klass = REGISTRY.get(cls)
    fields: dict[str, Any] = {
        "request_id": request_id,
        "cls": klass,
        "arrival_s": arrival_s,
        "ttft_slo_s": klass.ttft_slo_s,
        "tpot_slo_s": klass.tpot_slo_s,
        "num_prompt_tokens": prompt,
        "num_computed_tokens": computed,
        "num_output_tokens": output,
        "max_output_tokens": 256,
        "is_running": running,
    }
    fields.update(overrides)
    return SchedRequest(**fields)


def decoding(
    request_id: str, cls: str = "standard", *, output: int = 5, prompt: int = 100, **overrides: Any
) -> SchedRequest:
    return make_request(
        request_id, cls, prompt=prompt, computed=prompt + output - 1, output=output, running=True, **overrides
    )
