"""``coserve epp`` as users run it: the command, its gRPC health, its metrics, and the Envoy bootstrap it writes.

The engine is a test double (``scripted_engine.ScriptedEngine``); the picker and Envoy are the real processes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp_gateway import envoy_binary
from router_served import MODEL, free_port
from scripted_engine import ScriptedEngine

COSERVE = str(Path(sys.executable).parent / "coserve")


def serving(port: int, service: str) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
        except grpc.RpcError:
            return False
    return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)


def test_the_command_serves_health_metrics_and_a_gateway_from_its_own_envoy_config(tmp_path: Path) -> None:
    decoder = ScriptedEngine("d0", conversations=True)
    config = tmp_path / "router.json"
    config.write_text(json.dumps({"model": MODEL, "decoders": [decoder.url]}))
    port, metrics, gateway = free_port(), free_port(), free_port()
    envoy_config = tmp_path / "envoy.json"
    written = subprocess.run(
        [COSERVE, "epp", "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
         "--envoy-config", str(envoy_config), "--gateway-port", str(gateway)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert written.returncode == 0, written.stderr
    listener = json.loads(envoy_config.read_text())["static_resources"]["listeners"][0]
    filters = listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
    (ext_proc,) = [f for f in filters if "ext_proc" in f["name"]]
    assert ext_proc["typed_config"]["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"  # as GAIE's
    picker = subprocess.Popen(
        [COSERVE, "epp", "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
         "--metrics-port", str(metrics)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    envoy = subprocess.Popen(
        [envoy_binary(), "-c", str(envoy_config), "--concurrency", "1", "--base-id", str(gateway)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        services = ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")
        while not all(serving(port, s) for s in services):
            assert picker.poll() is None, picker.stdout.read().decode() if picker.stdout else ""
            assert time.monotonic() < deadline, "the picker never reported SERVING"
            time.sleep(0.2)
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        while True:
            try:
                answer = httpx.post(f"http://127.0.0.1:{gateway}/v1/completions", json=body, timeout=10)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "envoy never listened"
                time.sleep(0.2)
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "d0"
        text = httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=5).text
        assert 'coserve_router_requests_total{endpoint="completions",status="200"} 1.0' in text
    finally:
        for process in (envoy, picker):
            process.terminate()
            process.wait(10)
        decoder.stop()


def test_a_missing_config_is_a_clear_error_not_a_traceback(tmp_path: Path) -> None:
    result = subprocess.run(
        [COSERVE, "epp", "--config", str(tmp_path / "nope.json")], capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert "--config: cannot read" in result.stderr and "Traceback" not in result.stderr
