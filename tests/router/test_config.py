"""The router's configuration (coserve.router.config): defaults, bounds, and one named problem per bad key."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from coserve.api import parse_pool
from coserve.api.problems import InvalidInput
from coserve.operator.resources import ROUTER_CONFIG_KEY, config_data, engine_service_host
from coserve.router.config import RouterConfig, parse_router_config
from coserve.scheduling.config import DEFAULT_CLASSES

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
BASE: dict[str, Any] = {"model": "m", "decoders": ["http://d"]}
KNOWN_KEYS = [field.alias or name for name, field in RouterConfig.model_fields.items()]
PYTHON_NAMES = {field.alias or name: name for name, field in RouterConfig.model_fields.items()}  # JSON -> Python


def problems(data: Any) -> dict[str, str]:
    """path -> reason of every problem ``data`` has."""
    with pytest.raises(InvalidInput) as error:
        parse_router_config(data)
    return {p.path: p.reason for p in error.value.problems}


def test_the_operators_router_json_is_enough() -> None:
    config = parse_router_config(
        {"model": "m", "prefillerService": "p.ns.svc", "decoderService": "d.ns.svc", "enginePort": 8000}
    )
    assert config.decoder_service == "d.ns.svc" and config.placement == "conversation" and not config.decoders


@pytest.mark.parametrize("path", sorted(EXAMPLES_DIR.glob("pool*.yaml")), ids=lambda p: p.name)
def test_the_router_json_the_operator_renders_parses(path: Path) -> None:
    pool = parse_pool(yaml.safe_load(path.read_text()))
    rendered = json.loads(config_data(pool)[ROUTER_CONFIG_KEY])

    config = parse_router_config(rendered)  # an unknown key would raise

    assert config.model == (pool.spec.model.served_model_name or pool.spec.model.name)
    assert sorted(config.classes.names) == sorted(c.name for c in pool.spec.priority_classes)
    assert config.decoder_service == engine_service_host(pool, "decoder")
    assert config.batch_dir is not None and config.offline == rendered["offline"]
    latency = pool.spec.profile.prefill_latency
    assert config.prefill_latency == (
        None if latency is None else (latency.constant_s, latency.per_token_s, latency.per_token_squared_s)
    )


@pytest.mark.parametrize("per_token_s", [0.0, 5.2e-6, 1.0])
def test_the_pools_kv_transfer_cost_reaches_the_router_as_set(per_token_s: float) -> None:
    """``spec.router.kvTransferSPerToken`` is rendered into router.json and read back as the same number; unset
    (0, the router's default) it is left out, so a pool's config, and its pods, stay as they were."""
    document = yaml.safe_load((EXAMPLES_DIR / "pool.yaml").read_text())
    document["spec"].setdefault("router", {})["kvTransferSPerToken"] = per_token_s
    rendered = json.loads(config_data(parse_pool(document))[ROUTER_CONFIG_KEY])
    assert ("kvTransferSPerToken" in rendered) == (per_token_s > 0)
    assert parse_router_config(rendered).kv_transfer_s_per_token == per_token_s


def test_defaults() -> None:
    config = parse_router_config(BASE)

    assert config.classes.names == [c["name"] for c in DEFAULT_CLASSES]
    assert (config.prefillers, config.decoders) == ((), ("http://d",))
    assert (config.prefiller_service, config.decoder_service, config.engine_port) == (None, None, 8000)
    assert (config.tenants, config.anonymous_class, config.offline) == ({}, None, {})
    assert (config.max_body_bytes, config.pin_ttl_s, config.max_pins) == (8 << 20, 1800.0, 100_000)
    assert (config.decoder_full, config.poll_s, config.decoder_failures) == (0.9, 1.0, 3)
    assert (config.pin_drop_failures, config.pin_drop_window_s) == (3, 30.0)
    assert (config.upstream_timeout_s, config.kv_transfer_params, config.placement) == (600.0, False, "conversation")
    assert (config.batch_dir, config.prefill_latency) == (None, None)


def test_every_key_is_read() -> None:
    data = {
        "model": "m",
        "prefillers": ["http://p:8000/"],
        "prefillerService": "p.ns.svc",
        "decoders": ["https://d:8000/", "http://e"],
        "decoderService": "d.ns.svc",
        "enginePort": 9000,
        "priorityClasses": [{"name": "gold", "weight": 5, "ttftSloMs": 500, "tpotSloMs": 50}],
        "offline": {"enabled": True, "share": 0.25, "className": "gold"},
        "tenants": {"sk-team-a": "gold"},
        "anonymousClass": "gold",
        "maxBodyBytes": 4096,
        "pinTtlS": 60,
        "maxPins": 10,
        "decoderFull": 0.5,
        "pollS": 0.25,
        "decoderFailures": 5,
        "pinDropFailures": 2,
        "pinDropWindowS": 10,
        "upstreamTimeoutS": 30,
        "kvTransferParams": True,
        "placement": "turn",
        "batchDir": "/b",
        "batchLock": "lease",
        "prefillLatency": {"constantS": 0.01, "perTokenS": 1e-4, "perTokenSquaredS": 1e-9},
        "prefillSite": "prefiller",
        "kvTransferSPerToken": 5e-6,
    }
    assert sorted(data) == sorted(KNOWN_KEYS)  # this test names every key the router knows

    config = parse_router_config(data)

    assert config.prefillers == ("http://p:8000",) and config.decoders == ("https://d:8000", "http://e")
    assert (config.prefiller_service, config.decoder_service, config.engine_port) == ("p.ns.svc", "d.ns.svc", 9000)
    assert config.classes.names == ["gold"] and config.classes.get("gold").ttft_slo_s == 0.5
    assert config.offline == {"enabled": True, "share": 0.25, "className": "gold"}
    assert (config.tenants, config.anonymous_class) == ({"sk-team-a": "gold"}, "gold")
    assert (config.max_body_bytes, config.pin_ttl_s, config.max_pins) == (4096, 60.0, 10)
    assert (config.decoder_full, config.poll_s, config.decoder_failures) == (0.5, 0.25, 5)
    assert (config.pin_drop_failures, config.pin_drop_window_s) == (2, 10.0)
    assert (config.upstream_timeout_s, config.kv_transfer_params, config.placement) == (30.0, True, "turn")
    assert (config.batch_dir, config.batch_lock, config.prefill_latency) == ("/b", "lease", (0.01, 1e-4, 1e-9))
    assert isinstance(config.pin_ttl_s, float) and isinstance(config.prefill_latency, tuple)
    assert (config.prefill_site, config.kv_transfer_s_per_token) == ("prefiller", 5e-6)


@pytest.mark.parametrize(
    ("data", "path"),
    [
        ({"decoders": ["http://d"]}, "model"),
        ({"model": "", "decoders": ["http://d"]}, "model"),
        ({"model": "m"}, "decoders"),
        ({"model": "m", "decoders": ["d:8000"]}, "decoders"),
        ({"model": "m", "decoders": ["ftp://d"]}, "decoders"),
        ({"model": "m", "decoders": "http://d"}, "decoders"),
        ({**BASE, "prefillers": ["http://p", 5]}, "prefillers"),
        ({**BASE, "tenants": {"sk-abcdefgh": "gold"}}, "tenants[sk-abc...]"),
        ({**BASE, "tenants": ["sk-abcdefgh"]}, "tenants"),
        ({**BASE, "pollS": 5}, "pollS"),
        ({**BASE, "placement": "random"}, "placement"),
        ({**BASE, "anonymousClass": "vip"}, "anonymousClass"),
        ({**BASE, "priorityClasses": [{"name": "gold"}]}, "priorityClasses"),
        ({**BASE, "priorityClasses": {"name": "gold"}}, "priorityClasses"),
        ({**BASE, "prefillLatency": 0.01}, "prefillLatency"),
        ({**BASE, "prefillLatency": {"perTokenS": -1}}, "prefillLatency.perTokenS"),
        ({**BASE, "prefillLatency": {"constantS": "fast"}}, "prefillLatency.constantS"),
        ({**BASE, "kvTransferParams": "yes"}, "kvTransferParams"),
        ({**BASE, "decoderService": 5}, "decoderService"),
        ({**BASE, "offline": "on"}, "offline"),
    ],
)
def test_a_bad_key_is_named(data: dict[str, Any], path: str) -> None:
    with pytest.raises(InvalidInput) as error:
        parse_router_config(data)
    assert [p.path for p in error.value.problems] == [path]


def test_every_problem_is_reported_at_once() -> None:
    found = problems({"model": "", "decoders": ["d"], "pollS": 0, "placement": "x", "pinTtl": 5})
    assert sorted(found) == ["decoders", "model", "pinTtl", "placement", "pollS"]


@pytest.mark.parametrize(
    ("key", "low", "high", "step"),
    [  # step: how far outside a bound the first bad value lies (1 for integer keys)
        ("enginePort", 1, 65535, 1),
        ("maxBodyBytes", 1024, 1 << 30, 1),
        ("pinTtlS", 1.0, 7 * 86400.0, 0.01),
        ("maxPins", 1, 10_000_000, 1),
        ("decoderFull", 0.05, 1.0, 0.01),
        ("pollS", 0.05, 1.0, 0.01),
        ("decoderFailures", 1, None, 1),
        ("pinDropFailures", 1, 1000, 1),
        ("pinDropWindowS", 1.0, 3600.0, 0.01),
        ("upstreamTimeoutS", 1.0, 86400.0, 0.01),
    ],
)
def test_each_number_has_bounds(key: str, low: float, high: float | None, step: float) -> None:
    for good in (low, high):
        if good is not None:
            assert getattr(parse_router_config({**BASE, key: good}), PYTHON_NAMES[key]) == good
    bad_values: list[Any] = [low - step, True, "5", math.nan, math.inf, None]
    if high is not None:
        bad_values.append(high + step)
    if isinstance(step, int):
        bad_values.append(low + 0.5)
    for bad in bad_values:
        assert list(problems({**BASE, key: bad})) == [key], bad


def test_integer_keys_take_only_integers() -> None:
    assert problems({**BASE, "maxPins": 1e5}) == {"maxPins": "input should be a valid integer (got 100000.0)"}


@pytest.mark.parametrize(
    ("key", "reason"),
    [
        ("pinTtl", "unknown key; did you mean pinTtlS?"),
        ("pollSeconds", "unknown key; did you mean pollS?"),
        ("decoderservice", "unknown key; did you mean decoderService?"),  # only the case differs
        ("decoder", "unknown key; did you mean decoders or decoderFull?"),
        ("PrefillLatency", "unknown key; did you mean prefillLatency?"),
    ],
)
def test_an_unknown_key_is_named_with_a_suggestion(key: str, reason: str) -> None:
    assert problems({**BASE, key: 1}) == {key: reason}


def test_an_unknown_key_far_from_any_lists_the_known_ones() -> None:
    (reason,) = problems({**BASE, "zebra": 1}).values()
    assert reason == f"unknown key (known: {', '.join(KNOWN_KEYS)})"
    assert "pinTtlS" in reason and "decoderFailures" in reason


def test_an_unknown_key_in_prefill_latency_is_named_with_its_path() -> None:
    found = problems({**BASE, "prefillLatency": {"constantS": 0.01, "perTokenSquared": 1e-9, "bogus": 1}})
    assert found == {
        "prefillLatency.perTokenSquared": "unknown key; did you mean perTokenSquaredS or perTokenS?",
        "prefillLatency.bogus": "unknown key (known: constantS, perTokenS, perTokenSquaredS)",
    }


@given(st.from_regex(r"[a-z][A-Za-z0-9]{0,15}", fullmatch=True))
def test_any_other_key_is_rejected_by_its_name(key: str) -> None:
    if key in KNOWN_KEYS or key in RouterConfig.model_fields:  # Python names are accepted too
        return
    assert list(problems({**BASE, key: 1})) == [key]


@pytest.mark.parametrize(
    "tenants",
    [
        {"sk-live-0123456789": "gold"},  # an unknown class
        {"sk-live-0123456789": 5},  # not a class name
        "sk-live-0123456789",  # not a mapping
    ],
)
def test_a_tenants_api_key_is_never_echoed(tenants: Any) -> None:
    with pytest.raises(InvalidInput) as error:
        parse_router_config({**BASE, "tenants": tenants})
    assert "0123456789" not in str(error.value)
    assert "sk-live-0123456789" not in repr(error.value.problems)


def test_tenants_are_checked_against_the_configured_classes() -> None:
    gold = [{"name": "gold", "weight": 1, "ttftSloMs": 1000, "tpotSloMs": 100}]
    config = parse_router_config({**BASE, "priorityClasses": gold, "tenants": {"sk-a": "gold"}})
    assert config.tenants == {"sk-a": "gold"}
    assert list(problems({**BASE, "priorityClasses": gold, "tenants": {"sk-a": "interactive"}})) == ["tenants[sk-a...]"]
    # a wrong class list is reported once, not again for every tenant
    assert list(problems({**BASE, "priorityClasses": [{"name": "x"}], "tenants": {"sk-a": "x"}})) == ["priorityClasses"]


@pytest.mark.parametrize("value", [None, []])
def test_no_priority_classes_means_the_default_ones(value: Any) -> None:
    assert parse_router_config({**BASE, "priorityClasses": value}).classes.names == [c["name"] for c in DEFAULT_CLASSES]


def test_empty_service_and_batch_dir_mean_none() -> None:
    config = parse_router_config({**BASE, "prefillerService": "", "decoderService": "", "batchDir": ""})
    assert (config.prefiller_service, config.decoder_service, config.batch_dir) == (None, None, None)
    assert list(problems({"model": "m", "decoderService": ""})) == ["decoders"]


@pytest.mark.parametrize(
    ("latency", "terms"),
    [
        (None, None),
        ({}, (0.0, 0.0, 0.0)),
        ({"constantS": 0.01}, (0.01, 0.0, 0.0)),
        ({"constantS": 0, "perTokenS": 1e-4, "perTokenSquaredS": 2e-9}, (0.0, 1e-4, 2e-9)),
    ],
)
def test_prefill_latency_terms_default_to_zero(latency: Any, terms: Any) -> None:
    assert parse_router_config({**BASE, "prefillLatency": latency}).prefill_latency == terms


def test_it_can_be_built_with_python_names_and_is_frozen() -> None:
    config = RouterConfig(model="m", decoders=("http://d/",), pin_ttl_s=5, prefill_latency=(0.01, 1e-4, 0))
    assert config.decoders == ("http://d",) and config.pin_ttl_s == 5.0
    assert config.prefill_latency == (0.01, 1e-4, 0.0)
    with pytest.raises(ValidationError):
        config.poll_s = 0.5


def test_every_key_is_described_under_its_json_name() -> None:
    for name, field in RouterConfig.model_fields.items():
        assert field.description and field.description.startswith(f"{field.alias or name} "), name
