"""The router's configuration (``router.json``): what the operator renders, or ``coserve up`` writes.

    {"model": "Qwen/Qwen3-8B",
     "prefillers": ["http://127.0.0.1:8001"],         # a static list (local pool), or
     "prefillerService": "chat-prefiller.ns.svc",     # a headless Service, resolved every poll
     "decoders": [...], "decoderService": "...", "enginePort": 8000,
     "priorityClasses": [...], "offline": {...},
     "tenants": {"sk-team-a": "interactive"},         # API key -> the highest class it may use
     "anonymousClass": "standard",                    # requests without a known key (default: the default class)
     "maxBodyBytes": 8388608, "pinTtlS": 1800, "maxPins": 100000,
     "decoderFull": 0.9, "pollS": 1.0, "decoderFailures": 3, "upstreamTimeoutS": 600,
     "pinDropFailures": 3, "pinDropWindowS": 30,      # a decoder loses its pins after 3 failed requests
                                                      # in a row within 30 s (one is retried elsewhere)
     "kvTransferParams": false,                       # true: vLLM's P/D transfer parameters (NixlConnector)
     "placement": "conversation",                     # "turn" / "request": baselines (see RouterConfig)
     "batchDir": "/var/lib/coserve/batches",          # offline batches persist here (absent: no batch API)
     "batchLock": "file",                             # or "lease": one runner per batch across replicas
     "prefillLatency": {"constantS": 0.01, "perTokenS": 1e-4, "perTokenSquaredS": 0},
                                                      # the engine profile's prefill cost: prefillers that
                                                      # cannot meet a request's TTFT SLO are avoided
     "prefillSite": "fastest",                        # turn 1 on a prefiller or its decoder, the sooner
     "kvTransferSPerToken": 5.2e-6}                   # the KV move's cost per prompt token (0: uncounted)

Every key but ``model`` is optional; an unknown key is an error (a typo must not vanish silently).

Who calls it: ``coserve router --config FILE`` and ``coserve up`` at start-up. Errors raise
``InvalidInput`` with one ``field: reason`` problem each; a tenant's API key appears in them
cut to its first six characters.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetPydanticSchema,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import ErrorDetails, core_schema

from coserve.api.problems import InvalidInput, Problem, format_path
from coserve.scheduling.config import DEFAULT_CLASSES
from coserve.scheduling.requests import ClassRegistry

__all__ = ["PrefillLatency", "RouterConfig", "parse_router_config"]

_MAX_INPUT_REPR = 60
_LATENCY_KEYS = ("constantS", "perTokenS", "perTokenSquaredS")

# snake_case in Python, camelCase in router.json; strict as JSON is (no "8000" for 8000, no true for 1).
_CONFIG = ConfigDict(
    alias_generator=to_camel,
    validate_by_name=True,
    validate_by_alias=True,
    frozen=True,
    extra="forbid",
    strict=True,
    allow_inf_nan=False,
)


class PrefillLatency(BaseModel):
    """``prefillLatency``: one prefill of n tokens takes constantS + perTokenS·n + perTokenSquaredS·n² seconds."""

    model_config = _CONFIG

    constant_s: float = Field(0.0, ge=0, description="constantS is the fixed cost of one prefill, in seconds.")
    per_token_s: float = Field(0.0, ge=0, description="perTokenS is the cost of each prompt token, in seconds.")
    per_token_squared_s: float = Field(
        0.0, ge=0, description="perTokenSquaredS is the attention term, in seconds per token squared."
    )

    def terms(self) -> tuple[float, float, float]:
        return (self.constant_s, self.per_token_s, self.per_token_squared_s)


def _latency_schema(_source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
    """``{"constantS": ..}`` (router.json) or a 3-tuple (Python) -> the tuple, errors under their JSON names."""
    return core_schema.no_info_before_validator_function(
        _latency_mapping,
        core_schema.chain_schema(
            [
                handler.generate_schema(PrefillLatency),
                core_schema.no_info_plain_validator_function(PrefillLatency.terms),
            ]
        ),
    )


def _latency_mapping(value: object) -> object:
    if isinstance(value, tuple) and len(value) == len(_LATENCY_KEYS):
        return dict(zip(_LATENCY_KEYS, value, strict=True))
    if not isinstance(value, Mapping):
        raise ValueError("must map constantS, perTokenS, perTokenSquaredS to numbers >= 0")
    return value


def _known_class(name: str, info: ValidationInfo) -> str:
    classes = info.data.get("classes")  # absent when priorityClasses itself is wrong: reported there
    if classes is not None and name not in classes.names:
        raise ValueError(f"unknown class {name!r}")
    return name


# (constant s, s per token, s per token squared) of one prefill
PrefillLatencyTerms = Annotated[tuple[float, float, float], GetPydanticSchema(_latency_schema)]
ClassName = Annotated[str, AfterValidator(_known_class)]


class RouterConfig(BaseModel):
    """What ``coserve router`` serves with, validated when built.

    Who builds it: ``parse_router_config`` from ``router.json`` (camelCase keys); code and tests may
    construct it with the Python names. Fields that check another field come after it.
    """

    model_config = ConfigDict(**_CONFIG, arbitrary_types_allowed=True)

    model: str = Field(min_length=1, description="model is the model name clients ask for.")
    classes: ClassRegistry = Field(
        default_factory=lambda: ClassRegistry(DEFAULT_CLASSES),
        alias="priorityClasses",
        description="priorityClasses lists the pool's classes (name, weight, ttftSloMs, tpotSloMs); "
        "absent or empty: the default interactive, standard and offline classes.",
    )
    prefillers: tuple[str, ...] = Field(
        (), description="prefillers lists the prefillers' http(s) base URLs (a local pool)."
    )
    prefiller_service: str | None = Field(
        None, description="prefillerService is the prefillers' headless Service, resolved on every poll."
    )
    decoder_service: str | None = Field(
        None, description="decoderService is the decoders' headless Service, resolved on every poll."
    )
    decoders: tuple[str, ...] = Field(
        (),
        validate_default=True,
        description="decoders lists the decoders' http(s) base URLs; give decoders, a decoderService or both.",
    )
    engine_port: int = Field(
        8000, ge=1, le=65535, description="enginePort is the port of the engines a Service resolves to."
    )
    offline: Mapping[str, Any] = Field(
        default_factory=dict,
        description="offline is the pool's offline co-serving setting as the engines get it; the router "
        "does not read it.",
    )
    tenants: Mapping[str, ClassName] = Field(
        default_factory=dict, description="tenants maps an API key to the highest class its requests may use."
    )
    anonymous_class: str | None = Field(
        None, description="anonymousClass is the class of requests without a known key; absent: the default class."
    )
    max_body_bytes: int = Field(
        8 << 20, ge=1024, le=1 << 30, description="maxBodyBytes is the largest request body accepted, in bytes."
    )
    pin_ttl_s: float = Field(
        1800.0,
        ge=1,
        le=7 * 86400,
        description="pinTtlS is how long an idle conversation stays pinned to its decoder, in seconds.",
    )
    max_pins: int = Field(
        100_000,
        ge=1,
        le=10_000_000,
        description="maxPins bounds the pinned conversations; the least recently used pin goes first.",
    )
    decoder_full: float = Field(
        0.9,
        ge=0.05,
        le=1.0,
        description="decoderFull is the KV cache usage at which a decoder takes no new conversations.",
    )
    poll_s: float = Field(
        1.0, ge=0.05, le=1.0, description="pollS is the time between two polls of every engine's load, in seconds."
    )
    decoder_failures: int = Field(
        3, ge=1, description="decoderFailures is how many polls in a row must fail before a decoder is marked down."
    )
    pin_drop_failures: int = Field(
        3,
        ge=1,
        le=1000,
        description="pinDropFailures is how many forwarded requests in a row must fail (HTTP 502/503/504 or "
        "a connection error) within pinDropWindowS before a decoder is down and its conversations lose their "
        "pins; one failure re-places only the conversation whose request failed.",
    )
    pin_drop_window_s: float = Field(
        30.0,
        ge=1,
        le=3600,
        description="pinDropWindowS is the time, in seconds, within which pinDropFailures failed requests in a "
        "row drop a decoder's pins; older failures are forgotten.",
    )
    upstream_timeout_s: float = Field(
        600.0, ge=1, le=86400, description="upstreamTimeoutS bounds one request to an engine, in seconds."
    )
    kv_transfer_params: bool = Field(
        False,
        description="kvTransferParams sends vLLM's P/D transfer parameters with the prefill (NixlConnector "
        "on GPUs); the shm handoff needs none.",
    )
    placement: Literal["conversation", "turn", "request"] = Field(
        "conversation",
        description="placement is conversation (pin a conversation's turns to one decoder), or a baseline: "
        "turn (every turn placed as if new: prefilled on a prefiller, handed to the emptiest decoder) or "
        "request (every request to the emptiest decoder, no prefiller: a per-request load balancer).",
    )
    batch_dir: str | None = Field(
        None, description="batchDir keeps offline batches (/v1/files, /v1/batches); absent: the batch API is off."
    )
    batch_lock: Literal["file", "lease"] = Field(
        "file",
        description="batchLock is how router replicas sharing batchDir make sure one runs each batch: file (an "
        "flock on batchDir, one machine or a filesystem with POSIX locks) or lease (a coordination.k8s.io "
        "Lease per batch in POD_NAMESPACE).",
    )
    prefill_latency: PrefillLatencyTerms | None = Field(
        None,
        description="prefillLatency is the engine profile's prefill cost: prefillers that cannot meet a "
        "request's TTFT SLO are avoided, and a new conversation goes to the decoder, among those about as "
        "occupied as the emptiest, where its first token comes soonest; absent: no deadline estimates, and the "
        "emptiest decoder by KV occupancy.",
    )
    prefill_site: Literal["fastest", "prefiller"] = Field(
        "fastest",
        description="prefillSite is where turn 1 prefills: fastest (a prefiller or the decoder that will hold "
        "the conversation, whichever gives the first token soonest by prefillLatency, the decoder only while "
        "its streams keep their TPOT objective) or prefiller (always a prefiller while one is up).",
    )
    kv_transfer_s_per_token: float = Field(
        0.0,
        ge=0,
        le=1,
        description="kvTransferSPerToken is the KV move's cost per prompt token from a prefiller to a decoder, "
        "in seconds (KV bytes per token over the link's bytes per second); 0: not counted.",
    )

    @field_validator("classes", mode="before")
    @classmethod
    def _build_classes(cls, value: object) -> object:
        if isinstance(value, ClassRegistry):
            return value
        if value is None or value == []:
            return ClassRegistry(DEFAULT_CLASSES)
        if not isinstance(value, list) or not all(isinstance(item, Mapping) for item in value):
            raise ValueError("must be a list of classes (name, weight, ttftSloMs, tpotSloMs)")
        return ClassRegistry(value)

    @field_validator("prefiller_service", "decoder_service", "batch_dir", mode="before")
    @classmethod
    def _empty_is_absent(cls, value: object) -> object:
        return None if value == "" else value

    @field_validator("prefillers", "decoders", mode="before")
    @classmethod
    def _base_urls(cls, value: object) -> object:
        if not isinstance(value, (list, tuple)):
            raise ValueError("must be a list of http(s) base URLs")
        for url in value:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError(f"must be a list of http(s) base URLs, got {url!r}")
        return tuple(url.rstrip("/") for url in value)

    @field_validator("decoders")
    @classmethod
    def _some_decoder(cls, value: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        # NOTE: when decoderService itself is wrong it is missing from info.data and reported on its own.
        if not value and "decoder_service" in info.data and info.data["decoder_service"] is None:
            raise ValueError("give decoder URLs or a decoderService to resolve")
        return value

    @field_validator("anonymous_class")
    @classmethod
    def _anonymous_class_exists(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else _known_class(value, info)


def parse_router_config(data: Mapping[str, Any]) -> RouterConfig:
    """Validate ``router.json``'s object; raise ``InvalidInput`` with one problem per error."""
    try:
        return RouterConfig.model_validate(data)
    except ValidationError as error:
        problems = [_problem(item) for item in error.errors(include_url=False)]
        raise InvalidInput(problems, source="router config") from None


def _problem(item: ErrorDetails) -> Problem:
    loc = item["loc"]
    secret = loc[:1] == ("tenants",)
    if secret and len(loc) > 1:
        # NOTE: a tenant's key is an API key: name at most its first six characters, anywhere.
        path = format_path(loc[2:], prefix=f"tenants[{str(loc[1])[:6]}...]")
    else:
        path = format_path(loc)
    if item["type"] == "extra_forbidden":
        return Problem(path, _unknown_key(loc))
    if item["type"] == "missing":
        return Problem(path, "required field is missing")
    message = str(item["msg"]).removeprefix("Value error, ")
    reason = f"{message[0].lower()}{message[1:]}"
    # our own checks say what they got; pydantic's do not, and nothing under tenants is echoed
    if item["type"] != "value_error" and not secret and not isinstance(item.get("input"), (dict, list)):
        text = repr(item.get("input"))
        reason += f" (got {text if len(text) <= _MAX_INPUT_REPR else text[: _MAX_INPUT_REPR - 3] + '...'})"
    return Problem(path, reason)


def _unknown_key(loc: tuple[str | int, ...]) -> str:
    model: type[BaseModel] = PrefillLatency if loc[:-1] == ("prefillLatency",) else RouterConfig
    known = [field.alias or name for name, field in model.model_fields.items()]
    by_lower = {key.lower(): key for key in known}
    key = str(loc[-1]).lower()
    close = [by_lower[key]] if key in by_lower else [by_lower[k] for k in difflib.get_close_matches(key, by_lower, n=2)]
    if close:
        return f"unknown key; did you mean {' or '.join(close)}?"
    return f"unknown key (known: {', '.join(known)})"
