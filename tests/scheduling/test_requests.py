"""Request classes, SLO resolution and token deadlines."""

from __future__ import annotations

import pytest

from coserve.scheduling import ClassRegistry, InvalidRequestClass

CLASSES = [
    {"name": "interactive", "weight": 10, "ttftSloMs": 1000, "tpotSloMs": 100},
    {"name": "standard", "weight": 3, "ttftSloMs": 5000, "tpotSloMs": 200},
    {"name": "offline", "weight": 1, "ttftSloMs": 3_600_000, "tpotSloMs": 10_000},
]


@pytest.fixture
def registry() -> ClassRegistry:
    return ClassRegistry(CLASSES, first_token_factor=2.0)


def test_ranks_follow_weight_and_default_is_the_middle_class(registry: ClassRegistry) -> None:
    assert [registry.get(n).rank for n in ("interactive", "standard", "offline")] == [0, 1, 2]
    assert registry.default.name == "standard"
    assert registry.get("interactive").first_token_weight == 20.0


@pytest.mark.parametrize(
    ("extra", "priority", "expected"),
    [
        ({"coserve_class": "offline"}, None, ("offline", 3600.0, 10.0)),
        ({"coserve_class": "interactive", "ttft_slo_ms": 250}, None, ("interactive", 0.25, 0.1)),
        ({"tpot_slo_ms": 50.5}, None, ("standard", 5.0, 0.0505)),
        (None, 2, ("offline", 3600.0, 10.0)),
        (None, 99, ("offline", 3600.0, 10.0)),
        (None, 0, ("standard", 5.0, 0.2)),
        ({}, None, ("standard", 5.0, 0.2)),
    ],
)
def test_resolve(
    registry: ClassRegistry, extra: dict[str, object] | None, priority: int | None, expected: tuple[str, float, float]
) -> None:
    cls, ttft, tpot = registry.resolve(extra, priority)
    assert (cls.name, ttft, tpot) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"coserve_class": "gold"}, "vllm_xargs.coserve_class"),
        ({"coserve_class": 3}, "vllm_xargs.coserve_class"),
        ({"ttft_slo_ms": -5}, "vllm_xargs.ttft_slo_ms"),
        ({"ttft_slo_ms": 0}, "vllm_xargs.ttft_slo_ms"),
        ({"tpot_slo_ms": "fast"}, "vllm_xargs.tpot_slo_ms"),
        ({"tpot_slo_ms": True}, "vllm_xargs.tpot_slo_ms"),
        ({"tpot_slo_ms": float("inf")}, "vllm_xargs.tpot_slo_ms"),
    ],
)
def test_bad_request_fields_name_the_field(registry: ClassRegistry, extra: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequestClass) as caught:
        registry.resolve(extra, None)
    assert caught.value.field == field


@pytest.mark.parametrize(
    ("classes", "message"),
    [
        ([], "at least one class"),
        ([{"name": "a", "weight": 0, "ttftSloMs": 1, "tpotSloMs": 1}], r"priorityClasses\[0\]\.weight"),
        ([CLASSES[0], CLASSES[0]], "duplicate"),
    ],
)
def test_bad_configuration_raises_at_build(classes: list[dict[str, object]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClassRegistry(classes)
