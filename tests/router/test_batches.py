"""Offline batches through the router over real HTTP (fake engines, as in test_app.py).

The runner's exactly-once takeover and its locks: test_batch_runner.py and test_batch_lock.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from coserve.router.app import build_app
from coserve.router.config import parse_router_config
from router_served import MODEL, FakeEngine, Served


@pytest.fixture
def engines() -> Iterator[list[FakeEngine]]:
    decoders = [FakeEngine("d0", kv_usage=0.9), FakeEngine("d1", kv_usage=0.9)]  # no spare capacity yet
    yield decoders
    for engine in decoders:
        engine.served.stop()


def router_for(engines: list[FakeEngine], batch_dir: Path) -> Served:
    config = {"model": MODEL, "decoders": [e.url for e in engines], "batchDir": str(batch_dir), "pollS": 0.05}
    return Served(build_app(parse_router_config(config)))


def jsonl(items: list[dict[str, Any]]) -> bytes:
    return "\n".join(json.dumps(item) for item in items).encode()


def upload(base: str, content: bytes) -> httpx.Response:
    return httpx.post(f"{base}/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"})


def wait_for(base: str, batch_id: str, status: str) -> dict[str, Any]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        batch = httpx.get(f"{base}/v1/batches/{batch_id}").json()
        if batch["status"] == status:
            return dict(batch)
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} never reached {status}: {batch}")


def test_an_accepted_batch_survives_a_router_restart_and_runs_on_spare_capacity_at_the_lowest_class(
    engines: list[FakeEngine], tmp_path: Path
) -> None:
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": {"model": MODEL, "prompt": f"q{i}"}}
        for i in range(5)
    ]
    router = router_for(engines, tmp_path)
    file_id = upload(router.url, jsonl(lines)).json()["id"]
    created = httpx.post(f"{router.url}/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions"})
    batch_id = created.json()["id"]
    time.sleep(0.3)
    assert not any(e.requests for e in engines)  # the decoders are busy: the batch waits
    router.stop()  # and the router goes away

    for engine in engines:
        engine.kv_usage = 0.1  # spare capacity
    router = router_for(engines, tmp_path)  # a new router on the same directory
    try:
        batch = wait_for(router.url, batch_id, "completed")
        assert batch["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
        output = httpx.get(f"{router.url}/v1/files/{batch['output_file_id']}/content").text.splitlines()
        assert sorted(json.loads(line)["custom_id"] for line in output) == [f"r{i}" for i in range(5)]
        assert all(json.loads(line)["response"]["status_code"] == 200 for line in output)
        sent = [r for e in engines for r in e.requests]
        assert len(sent) == 5 and {r["vllm_xargs"]["coserve_class"] for r in sent} == {"offline"}
    finally:
        router.stop()


def test_a_batch_can_be_cancelled(engines: list[FakeEngine], tmp_path: Path) -> None:
    router = router_for(engines, tmp_path)
    try:
        content = jsonl([{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}])
        file_id = upload(router.url, content).json()["id"]
        batch_id = httpx.post(
            f"{router.url}/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions"}
        ).json()["id"]
        assert httpx.post(f"{router.url}/v1/batches/{batch_id}/cancel").json()["status"] == "cancelling"
        wait_for(router.url, batch_id, "cancelled")
        assert not any(e.requests for e in engines)
    finally:
        router.stop()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"{not json", "line 1: not JSON"),
        (jsonl([{"url": "/v1/completions", "body": {}}]), "line 1: needs a string custom_id"),
        (jsonl([{"custom_id": "a", "url": "/v1/embeddings", "body": {}}]), "line 1: url must be one of"),
        (jsonl([{"custom_id": "a", "url": "/v1/completions", "body": {}}] * 2), "line 2: custom_id 'a' repeats"),
    ],
)
def test_a_bad_batch_file_is_a_400_naming_the_line(
    engines: list[FakeEngine], tmp_path: Path, content: bytes, message: str
) -> None:
    router = router_for(engines, tmp_path)
    try:
        response = upload(router.url, content)
        assert response.status_code == 400 and response.json()["error"]["message"].startswith(message)
        missing = httpx.post(
            f"{router.url}/v1/batches", json={"input_file_id": "file-x", "endpoint": "/v1/completions"}
        )
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "input_file_id"
    finally:
        router.stop()


def test_batch_lines_go_straight_to_a_decoder_while_the_prefiller_has_a_queue(tmp_path: Path) -> None:
    """Decoders are the over-provisioned role: a line is prefilled and decoded on a decoder with spare KV; the
    prefiller, the bottleneck, takes lines only when nothing waits there."""
    prefiller, decoder = FakeEngine("p", waiting=3), FakeEngine("d", kv_usage=0.1)
    config = {"model": MODEL, "prefillers": [prefiller.url], "decoders": [decoder.url], "batchDir": str(tmp_path),
              "pollS": 0.05}  # fmt: skip
    router = Served(build_app(parse_router_config(config)))
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": {"model": MODEL, "prompt": f"q{i}"}}
        for i in range(5)
    ]
    try:
        file_id = upload(router.url, jsonl(lines)).json()["id"]
        created = httpx.post(f"{router.url}/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions"})
        wait_for(router.url, created.json()["id"], "completed")
        assert prefiller.requests == []
        assert len(decoder.requests) == 5
        assert {r["vllm_xargs"]["coserve_class"] for r in decoder.requests} == {"offline"}
        assert all(r.get("max_tokens") != 1 for r in decoder.requests)  # whole answers, not prefills

        prefiller.waiting = 0  # its queue empties: it is idle, and prefills lines again
        time.sleep(0.2)  # a poll sees it
        file_id = upload(router.url, jsonl(lines)).json()["id"]
        created = httpx.post(f"{router.url}/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions"})
        wait_for(router.url, created.json()["id"], "completed")
        assert prefiller.requests and all(r["max_tokens"] == 1 for r in prefiller.requests)
    finally:
        router.stop()
        prefiller.served.stop()
        decoder.served.stop()
