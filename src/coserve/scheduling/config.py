"""The engine-side coserve configuration: what ``engine.json`` (the operator's ConfigMap) says.

    {"priorityClasses": [...], "offline": {...}, "kvOffload": {...},
     "scheduler": {"maxTokensPerStep": 2048, "urgencyFactor": 2.0, "maxWaitS": 30,
                   "promotedShare": 0.25,
                   "minStepS": 0.01, "maxStepS": 2.0, "firstTokenFactor": 2.0,
                   "defaultClass": "standard"},
     "costModel": {"k1": ..., "k5": ...}}

Every key is optional; a missing file means the defaults. Errors raise
``ValueError`` naming the setting, when the engine starts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coserve.scheduling.cost_model import StepCostModel
from coserve.scheduling.requests import ClassRegistry
from coserve.scheduling.slide_batching import SlideConfig

__all__ = ["CONFIG_ENV", "DEFAULT_CLASSES", "DEFAULT_COST_MODEL", "EngineSchedulingConfig", "load_engine_config"]

# The environment variable naming the engine's scheduling config file: the operator sets it in the engine
# containers, `coserve.engine.launch` for local engines, and the scheduler, connector and validation read it.
CONFIG_ENV = "COSERVE_CONFIG"

DEFAULT_CLASSES: list[dict[str, Any]] = [
    {"name": "interactive", "weight": 10.0, "ttftSloMs": 1_000, "tpotSloMs": 100},
    {"name": "standard", "weight": 3.0, "ttftSloMs": 5_000, "tpotSloMs": 200},
    {"name": "offline", "weight": 1.0, "ttftSloMs": 3_600_000, "tpotSloMs": 10_000},
]
# A deliberately pessimistic default (a mid-size model on one GPU) until `coserve profile` measures one.
DEFAULT_COST_MODEL = StepCostModel(k1=6e-5, k2=2e-10, k3=0.0, k4=2e-7, k5=0.008)

_SCHEDULER_KEYS = {
    "maxTokensPerStep",
    "urgencyFactor",
    "maxWaitS",
    "promotedShare",
    "minStepS",
    "maxStepS",
    "firstTokenFactor",
    "defaultClass",
}


@dataclass(frozen=True)
class EngineSchedulingConfig:
    """Everything the scheduler adapter needs, validated."""

    classes: ClassRegistry
    slide: SlideConfig
    cost_model: StepCostModel
    offline_class: str | None


def load_engine_config(path: str | Path | None, max_tokens_per_step: int) -> EngineSchedulingConfig:
    """Read ``path`` (``None`` or empty: defaults) and build the scheduler's configuration."""
    data: Mapping[str, Any] = {}
    if path:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as error:
            raise ValueError(f"{CONFIG_ENV}: cannot read {path}: {error.strerror or error}") from None
        except json.JSONDecodeError as error:
            raise ValueError(f"{CONFIG_ENV}: {path} is not JSON: {error}") from None
        if not isinstance(data, Mapping):
            raise ValueError(f"{CONFIG_ENV}: {path} must hold a JSON object")
    return parse_engine_config(data, max_tokens_per_step)


def parse_engine_config(data: Mapping[str, Any], max_tokens_per_step: int) -> EngineSchedulingConfig:
    scheduler = data.get("scheduler", {})
    if not isinstance(scheduler, Mapping):
        raise ValueError("scheduler: must be an object")
    unknown = set(scheduler) - _SCHEDULER_KEYS
    if unknown:
        raise ValueError(
            f"scheduler.{sorted(unknown)[0]}: unknown setting (known: {', '.join(sorted(_SCHEDULER_KEYS))})"
        )
    slide = SlideConfig(
        max_tokens_per_step=int(_number(scheduler, "maxTokensPerStep", max_tokens_per_step)),
        urgency_factor=_number(scheduler, "urgencyFactor", 2.0),
        max_wait_s=_number(scheduler, "maxWaitS", 30.0),
        promoted_share=_number(scheduler, "promotedShare", 0.25),
        min_step_s=_number(scheduler, "minStepS", 0.01),
        max_step_s=_number(scheduler, "maxStepS", 2.0),
    )
    default_class = scheduler.get("defaultClass")
    if default_class is not None and not isinstance(default_class, str):
        raise ValueError(f"scheduler.defaultClass: must be a class name, got {default_class!r}")
    classes = ClassRegistry(
        data.get("priorityClasses") or DEFAULT_CLASSES,
        default_class=default_class,
        first_token_factor=_number(scheduler, "firstTokenFactor", 2.0),
    )
    cost = data.get("costModel")
    cost_model = StepCostModel.from_dict(cost) if cost is not None else DEFAULT_COST_MODEL
    offline = data.get("offline") or {}
    offline_class = offline.get("className", "offline") if offline.get("enabled") else None
    if offline_class is not None and offline_class not in classes.names:
        raise ValueError(f"offline.className: {offline_class!r} is not one of the priority classes")
    return EngineSchedulingConfig(classes, slide, cost_model, offline_class)


def _number(data: Mapping[str, Any], key: str, default: float) -> float:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"scheduler.{key}: must be a number, got {value!r}")
    return float(value)
