"""The router's configuration (``router.json``): what the operator renders, or ``coserve up`` writes.

    {"model": "Qwen/Qwen3-8B",
     "prefillers": ["http://127.0.0.1:8001"],         # a static list (local pool), or
     "prefillerService": "chat-prefiller.ns.svc",     # a headless Service, resolved every poll
     "decoders": [...], "decoderService": "...", "enginePort": 8000,
     "priorityClasses": [...], "offline": {...},
     "tenants": {"sk-team-a": "interactive"},         # API key -> the highest class it may use
     "anonymousClass": "standard",                    # requests without a known key (default: the default class)
     "maxBodyBytes": 8388608, "pinTtlS": 1800, "maxPins": 100000,
     "decoderFull": 0.9, "pollS": 1.0, "upstreamTimeoutS": 600,
     "kvTransferParams": false,                       # true: vLLM's P/D transfer parameters (NixlConnector)
     "placement": "conversation",                     # "turn" / "request": baselines (see RouterConfig)
     "batchDir": "/var/lib/coserve/batches",          # offline batches persist here (absent: no batch API)
     "prefillLatency": {"constantS": 0.01, "perTokenS": 1e-4, "perTokenSquaredS": 0}}
                                                      # the engine profile's prefill cost: prefillers that
                                                      # cannot meet a request's TTFT SLO are avoided

Who calls it: ``coserve router --config FILE`` at start-up. Errors raise
``InvalidInput`` with one ``field: reason`` problem each.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from coserve.api.problems import InvalidInput, Problem
from coserve.scheduling.config import DEFAULT_CLASSES
from coserve.scheduling.requests import ClassRegistry

__all__ = ["RouterConfig", "parse_router_config"]


@dataclass(frozen=True)
class RouterConfig:
    model: str
    classes: ClassRegistry
    prefillers: tuple[str, ...] = ()
    decoders: tuple[str, ...] = ()
    prefiller_service: str | None = None
    decoder_service: str | None = None
    engine_port: int = 8000
    tenants: Mapping[str, str] = field(default_factory=dict)
    anonymous_class: str | None = None
    max_body_bytes: int = 8 << 20
    pin_ttl_s: float = 1800.0
    max_pins: int = 100_000
    decoder_full: float = 0.9
    poll_s: float = 1.0
    upstream_timeout_s: float = 600.0
    # send vLLM's P/D transfer parameters with the prefill (NixlConnector on GPUs); the shm handoff needs none
    kv_transfer_params: bool = False
    # "conversation": pin a conversation's turns to one decoder. Baselines for the ttfet benchmark:
    # "turn": every turn placed as if new (prefilled on a prefiller, handed to the emptiest decoder);
    # "request": every request to the emptiest decoder, no prefiller (a per-request load balancer)
    placement: str = "conversation"
    # offline batches (/v1/files, /v1/batches) are kept here; None: the batch API is off
    batch_dir: str | None = None
    # (constant s, s per token, s per token squared) of one prefill; None: no deadline estimates
    prefill_latency: tuple[float, float, float] | None = None


def parse_router_config(data: Mapping[str, Any]) -> RouterConfig:
    problems: list[Problem] = []

    def number(key: str, default: float, low: float, high: float) -> float:
        value = data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            problems.append(Problem(key, f"must be a number in [{low:g}, {high:g}], got {value!r}"))
            return default
        return float(value)

    model = data.get("model")
    if not isinstance(model, str) or not model:
        problems.append(Problem("model", "required: the model name clients ask for"))
        model = ""
    endpoints: dict[str, tuple[str, ...]] = {}
    for key in ("prefillers", "decoders"):
        value = data.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) and v.startswith("http") for v in value):
            problems.append(Problem(key, "must be a list of http(s) base URLs"))
            value = []
        endpoints[key] = tuple(v.rstrip("/") for v in value)
    if not endpoints["decoders"] and not data.get("decoderService") and not any(p.path == "decoders" for p in problems):
        problems.append(Problem("decoders", "give decoder URLs or a decoderService to resolve"))
    try:
        classes = ClassRegistry(data.get("priorityClasses") or DEFAULT_CLASSES)
    except ValueError as error:
        problems.append(Problem("priorityClasses", str(error)))
        classes = ClassRegistry(DEFAULT_CLASSES)
    tenants = data.get("tenants", {})
    if not isinstance(tenants, Mapping):
        problems.append(Problem("tenants", "must map API keys to class names"))
        tenants = {}
    for key, name in tenants.items():
        if name not in classes.names:
            problems.append(Problem(f"tenants[{str(key)[:6]}...]", f"unknown class {name!r}"))
    anonymous = data.get("anonymousClass")
    if anonymous is not None and anonymous not in classes.names:
        problems.append(Problem("anonymousClass", f"unknown class {anonymous!r}"))
    latency = data.get("prefillLatency")
    prefill_latency: tuple[float, float, float] | None = None
    if latency is not None:
        terms = [latency.get(k, 0.0) if isinstance(latency, Mapping) else None
                 for k in ("constantS", "perTokenS", "perTokenSquaredS")]  # fmt: skip
        if all(isinstance(t, (int, float)) and not isinstance(t, bool) and t >= 0 for t in terms):
            prefill_latency = (float(terms[0]), float(terms[1]), float(terms[2]))  # type: ignore[arg-type]
        else:
            problems.append(
                Problem("prefillLatency", "must map constantS, perTokenS, perTokenSquaredS to numbers >= 0")
            )
    config = RouterConfig(
        model=model,
        classes=classes,
        prefillers=endpoints["prefillers"],
        decoders=endpoints["decoders"],
        prefiller_service=data.get("prefillerService") or None,
        decoder_service=data.get("decoderService") or None,
        engine_port=int(number("enginePort", 8000, 1, 65535)),
        tenants=dict(tenants),
        anonymous_class=anonymous,
        max_body_bytes=int(number("maxBodyBytes", 8 << 20, 1024, 1 << 30)),
        pin_ttl_s=number("pinTtlS", 1800.0, 1, 7 * 86400),
        max_pins=int(number("maxPins", 100_000, 1, 10_000_000)),
        decoder_full=number("decoderFull", 0.9, 0.05, 1.0),
        poll_s=number("pollS", 1.0, 0.05, 1.0),
        upstream_timeout_s=number("upstreamTimeoutS", 600.0, 1, 86400),
        kv_transfer_params=bool(data.get("kvTransferParams", False)),
        placement=str(data.get("placement", "conversation")),
        batch_dir=data.get("batchDir") or None,
        prefill_latency=prefill_latency,
    )
    if config.placement not in ("conversation", "turn", "request"):
        problems.append(Problem("placement", f"must be conversation, turn or request, got {config.placement!r}"))
    if problems:
        raise InvalidInput(problems, source="router config")
    return config
