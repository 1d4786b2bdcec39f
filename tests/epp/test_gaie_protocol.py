"""The endpoint picker protocol, spoken to the picker over real gRPC by a client standing in for the gateway.

GAIE's protocol lets a gateway narrow the endpoints (``envoy.lb.subset_hint``), which the Envoy configuration
coserve writes never does; this client sends it. The picker is the real one (``coserve.epp.server`` over
grpc.aio, the router's state); the engines are test doubles (``scripted_engine.ScriptedEngine``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from google.protobuf import struct_pb2

from coserve.gaie import DESTINATION_HEADER, LB_NAMESPACE, SUBSET_KEY, SUBSET_NAMESPACE
from coserve.router.config import parse_router_config
from epp_gateway import Gateway, Picker
from router_served import MODEL
from scripted_engine import ScriptedEngine


@pytest.fixture
def pool() -> Iterator[dict[str, Any]]:
    busy, light = ScriptedEngine("d0", kv_usage=0.6), ScriptedEngine("d1", kv_usage=0.2)
    picker = Picker(parse_router_config({"model": MODEL, "decoders": [busy.url, light.url]}))
    try:
        yield {"picker": picker, "busy": busy, "light": light}
    finally:
        picker.stop()
        busy.stop()
        light.stop()


def address(engine: ScriptedEngine) -> str:
    return engine.url.split("://", 1)[1]


def exchange(port: int, conversation: str, subset: list[str] | None = None) -> list[ext_proc.ProcessingResponse]:
    """One request as a gateway sends it: headers, then the buffered body (the subset hint on both)."""
    context = base_pb2.Metadata()
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({SUBSET_KEY: subset})
        context.filter_metadata[SUBSET_NAMESPACE].CopyFrom(hint)
    headers = {":method": "POST", ":path": "/v1/completions", "content-type": "application/json",
               "x-conversation-id": conversation}  # fmt: skip
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2}).encode()
    fields = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    messages = [
        ext_proc.ProcessingRequest(
            request_headers=ext_proc.HttpHeaders(headers=base_pb2.HeaderMap(headers=fields)), metadata_context=context
        ),
        ext_proc.ProcessingRequest(
            request_body=ext_proc.HttpBody(body=body, end_of_stream=True), metadata_context=context
        ),
    ]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return list(ext_proc_grpc.ExternalProcessorStub(channel).Process(iter(messages), timeout=10))


def destination(answer: ext_proc.ProcessingResponse) -> tuple[str, str]:
    """The picked endpoint as the header mutation says and as the dynamic metadata says."""
    mutation = answer.request_body.response.header_mutation
    header = next(h.header.raw_value.decode() for h in mutation.set_headers if h.header.key == DESTINATION_HEADER)
    return header, answer.dynamic_metadata[LB_NAMESPACE][DESTINATION_HEADER]


def test_the_header_and_the_metadata_name_the_same_endpoint(pool: dict[str, Any]) -> None:
    answers = exchange(pool["picker"].port, "free")
    assert answers[0].WhichOneof("response") == "request_headers"
    assert destination(answers[1]) == (address(pool["light"]),) * 2  # the emptier decoder, said twice alike


def test_the_picker_picks_only_from_the_gateways_subset(pool: dict[str, Any]) -> None:
    answers = exchange(pool["picker"].port, "narrowed", subset=[address(pool["busy"])])
    assert destination(answers[1]) == (address(pool["busy"]),) * 2  # not the emptier one: it is outside


def test_a_pin_outside_the_subset_is_placed_anew_within_it(pool: dict[str, Any]) -> None:
    first = exchange(pool["picker"].port, "moved")
    assert destination(first[1])[0] == address(pool["light"])
    again = exchange(pool["picker"].port, "moved", subset=[address(pool["busy"])])
    assert destination(again[1])[0] == address(pool["busy"])


def test_a_subset_with_no_eligible_endpoint_is_a_503(pool: dict[str, Any]) -> None:
    answers = exchange(pool["picker"].port, "nowhere", subset=["10.255.255.1:8000"])
    refused = answers[-1].immediate_response
    assert refused.status.code == 503
    assert json.loads(refused.body)["error"]["code"] == 503


def test_a_conversation_placed_by_one_picker_is_found_by_another() -> None:
    """Pins are shared across picker replicas as across router replicas: the decoders record the conversations
    sent to them (the engines' real coserve middleware here), and a replica without the pin asks them. Each
    replica has its own real Envoy in front of it, which forwards the request to the decoder."""
    first, second = ScriptedEngine("d0", kv_usage=0.6, conversations=True), ScriptedEngine("d1", conversations=True)
    config = parse_router_config({"model": MODEL, "decoders": [first.url, second.url], "pollS": 0.1})
    pickers = [Picker(config), Picker(config)]
    gateways = [Gateway(picker.port) for picker in pickers]
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    headers = {"x-conversation-id": "shared"}
    try:
        turn1 = httpx.post(f"{gateways[0].url}/v1/completions", json=body, headers=headers, timeout=30)
        assert turn1.json()["choices"][0]["text"] == "d1"  # the emptier decoder
        second.kv_usage, first.kv_usage = 0.8, 0.1  # now the other is emptier: a new placement would move
        time.sleep(0.5)  # the second replica's polls see the new occupancy (the found count below is the check)
        turn2 = httpx.post(f"{gateways[1].url}/v1/completions", json=body, headers=headers, timeout=30)
        assert turn2.json()["choices"][0]["text"] == "d1"  # the second replica found where it lives
        found = pickers[1].router.metrics.registry.get_sample_value("coserve_router_found_conversations_total")
        assert found == 1
    finally:
        for front in (*gateways, *pickers):
            front.stop()
        first.stop()
        second.stop()
