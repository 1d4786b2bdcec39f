"""The router's configuration (coserve.router.config): defaults and one named problem per bad key."""

from __future__ import annotations

from typing import Any

import pytest

from coserve.api.problems import InvalidInput
from coserve.router.config import parse_router_config


def test_the_operators_router_json_is_enough() -> None:
    config = parse_router_config(
        {"model": "m", "prefillerService": "p.ns.svc", "decoderService": "d.ns.svc", "enginePort": 8000}
    )
    assert config.decoder_service == "d.ns.svc" and config.placement == "conversation" and not config.decoders


@pytest.mark.parametrize(
    ("data", "path"),
    [
        ({"decoders": ["http://d"]}, "model"),
        ({"model": "m"}, "decoders"),
        ({"model": "m", "decoders": ["d:8000"]}, "decoders"),
        ({"model": "m", "decoders": ["http://d"], "tenants": {"sk-abcdefgh": "gold"}}, "tenants[sk-abc...]"),
        ({"model": "m", "decoders": ["http://d"], "pollS": 5}, "pollS"),
        ({"model": "m", "decoders": ["http://d"], "placement": "random"}, "placement"),
        ({"model": "m", "decoders": ["http://d"], "anonymousClass": "vip"}, "anonymousClass"),
    ],
)
def test_a_bad_key_is_named(data: dict[str, Any], path: str) -> None:
    with pytest.raises(InvalidInput) as error:
        parse_router_config(data)
    assert [p.path for p in error.value.problems] == [path]
