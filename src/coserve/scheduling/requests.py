"""What the scheduling policy knows about a request: its class, deadlines and progress.

The vLLM adapter (``coserve.engine.scheduler``) converts each vLLM ``Request``
into a ``SchedRequest`` every step; the policy never sees vLLM objects.
Token i (0-based) of a request is due at ``arrival + TTFT SLO + i·TPOT SLO``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = [
    "ClassRegistry",
    "InvalidRequestClass",
    "RequestClass",
    "SchedRequest",
]


class InvalidRequestClass(ValueError):
    """A request named an unknown class or gave an unusable SLO; ``field`` names the request field."""

    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


@dataclass(frozen=True)
class RequestClass:
    """A priority class: gain weights and latency objectives.

    ``rank`` orders classes (0 = most important, by descending weight); the
    first token of a request earns ``first_token_weight``, every later one
    ``weight``.
    """

    name: str
    weight: float
    first_token_weight: float
    ttft_slo_s: float
    tpot_slo_s: float
    rank: int


@dataclass(frozen=True)
class SchedRequest:
    """One request as the policy sees it at one step."""

    request_id: str
    cls: RequestClass
    arrival_s: float
    ttft_slo_s: float
    tpot_slo_s: float
    num_prompt_tokens: int
    num_computed_tokens: int
    num_output_tokens: int
    max_output_tokens: int
    is_running: bool

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens + max(self.num_output_tokens - 1, 0)

    @property
    def remaining_prefill_tokens(self) -> int:
        """Tokens to compute before the request can emit its next token (1 in decode)."""
        due = self.num_prompt_tokens + max(self.num_output_tokens - 1, 0) - self.num_computed_tokens
        return max(due, 1)

    def token_deadline_s(self, index: int) -> float:
        """When output token ``index`` (0-based) is due."""
        return self.arrival_s + self.ttft_slo_s + index * self.tpot_slo_s

    @property
    def next_deadline_s(self) -> float:
        return self.token_deadline_s(self.num_output_tokens)

    def next_token_weight(self) -> float:
        return self.cls.first_token_weight if self.num_output_tokens == 0 else self.cls.weight


class ClassRegistry:
    """The engine's priority classes, built from the operator's configuration.

    Who calls it: the scheduler adapter resolves each new request's class and
    SLO overrides (from the OpenAI ``priority`` field and ``vllm_xargs``) here,
    and rejects bad ones before they reach the queue.
    """

    def __init__(
        self, classes: Iterable[Mapping[str, object]], default_class: str | None = None, first_token_factor: float = 1.0
    ) -> None:
        built: dict[str, RequestClass] = {}
        items = list(classes)
        if not items:
            raise ValueError("priorityClasses: at least one class is required")
        order = sorted(range(len(items)), key=lambda i: -float(_number(items[i], "weight", i)))
        for rank, index in enumerate(order):
            item = items[index]
            name = str(item.get("name", ""))
            if not name or name in built:
                raise ValueError(f"priorityClasses[{index}].name: missing or duplicate class name {name!r}")
            weight = _number(item, "weight", index)
            built[name] = RequestClass(
                name=name,
                weight=weight,
                first_token_weight=weight * first_token_factor,
                ttft_slo_s=_number(item, "ttftSloMs", index) / 1000,
                tpot_slo_s=_number(item, "tpotSloMs", index) / 1000,
                rank=rank,
            )
        self._classes = built  # name -> RequestClass
        if default_class is not None and default_class not in built:
            raise ValueError(f"defaultClass: {default_class!r} is not a configured class")
        # NOTE: without an explicit default, unlabelled traffic gets the middle class, neither
        # jumping ahead of paying tenants nor sinking to the offline class.
        ranked = sorted(built.values(), key=lambda c: c.rank)
        self.default = built[default_class] if default_class is not None else ranked[(len(ranked) - 1) // 2]

    @property
    def names(self) -> list[str]:
        return list(self._classes)

    def get(self, name: str) -> RequestClass:
        if name not in self._classes:
            raise InvalidRequestClass(
                "vllm_xargs.coserve_class", f"unknown class {name!r}; known classes: {', '.join(self._classes)}"
            )
        return self._classes[name]

    def by_priority(self, priority: int) -> RequestClass:
        """Map the OpenAI/vLLM ``priority`` integer (lower runs first) onto the classes by rank."""
        ranked = sorted(self._classes.values(), key=lambda c: c.rank)
        return ranked[min(max(priority, 0), len(ranked) - 1)]

    def resolve(
        self, extra_args: Mapping[str, object] | None, priority: int | None
    ) -> tuple[RequestClass, float, float]:
        """The class and (TTFT, TPOT) SLOs in seconds for one request; ``InvalidRequestClass`` if malformed."""
        args = extra_args or {}
        name = args.get("coserve_class")
        if name is not None:
            if not isinstance(name, str):
                raise InvalidRequestClass("vllm_xargs.coserve_class", f"must be a string, got {name!r}")
            cls = self.get(name)
        elif priority is not None and priority != 0:
            cls = self.by_priority(priority)
        else:
            cls = self.default
        ttft = _slo(args, "ttft_slo_ms", cls.ttft_slo_s)
        tpot = _slo(args, "tpot_slo_ms", cls.tpot_slo_s)
        return cls, ttft, tpot


def _number(item: Mapping[str, object], key: str, index: int) -> float:
    value = item.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"priorityClasses[{index}].{key}: must be a positive number, got {value!r}")
    return float(value)


def _slo(args: Mapping[str, object], key: str, default_s: float) -> float:
    if key not in args:
        return default_s
    value = args[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InvalidRequestClass(f"vllm_xargs.{key}", f"must be a positive number of milliseconds, got {value!r}")
    return float(value) / 1000
