"""The router follows a rotated router token: the operator regenerates an emptied one and the kubelet swaps
the mounted file; the router sends the new one from its next poll on, without a restart (the engines keep
accepting the old one for a grace period, tests/engine/test_router_proof.py)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from coserve.router.app import ROUTER_TOKEN_HEADER, build_app
from coserve.router.config import parse_router_config
from router_served import MODEL, FakeEngine, Served


def test_requests_carry_the_token_the_mounted_file_holds_now(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = tmp_path / "token"
    token.write_text("first-token\n")
    monkeypatch.setenv("COSERVE_ROUTER_TOKEN_FILE", str(token))
    decoder = FakeEngine("d")
    app = build_app(parse_router_config({"model": MODEL, "decoders": [decoder.url], "pollS": 0.05}))
    router = Served(app)
    try:
        body = {"model": MODEL, "prompt": "hello there", "max_tokens": 1}
        assert httpx.post(f"{router.url}/v1/completions", json=body, timeout=10).status_code == 200
        assert decoder.headers[-1][ROUTER_TOKEN_HEADER] == "first-token"
        fresh = tmp_path / "token.new"
        fresh.write_text("second-token\n")
        fresh.replace(token)  # as the kubelet swaps a mounted Secret's file
        deadline = time.monotonic() + 10
        while True:  # the file is looked at once a second, at the router's polls
            assert httpx.post(f"{router.url}/v1/completions", json=body, timeout=10).status_code == 200
            if decoder.headers[-1][ROUTER_TOKEN_HEADER] == "second-token":
                break
            assert time.monotonic() < deadline, "the router kept sending the old token"
            time.sleep(0.1)
    finally:
        router.stop()
        decoder.served.stop()
