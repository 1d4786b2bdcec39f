"""``coserve epp``: the router's placement behind a gateway, as an Envoy external processor (ext_proc).

Who calls it: ``coserve epp --config router.json`` (``serve``); the gateway's Envoy opens one ``Process`` stream
per HTTP request (``EndpointPicker``); tests run both (``tests/epp``). The decisions are the router's own:
``coserve.router.admission`` reads, strips, checks and classes the request, ``coserve.router.placement`` finds
or makes its conversation's pin and, on turn 1, prefills it where its first token comes soonest. What differs
is who carries the bytes: Envoy forwards the request to the picked decoder and streams its answer back; the
picker sees only the request (headers and the buffered body) and the answer's headers.

One request's exchange, as GAIE's endpoint picker protocol (``coserve.gaie``) and the Envoy
configuration ``coserve.epp.envoy`` writes have it:

1. request headers: continue (the body comes next), or, for a request without a body, pick the
   least-occupied decoder now;
2. request body (buffered whole): on ``/v1/chat/completions`` and ``/v1/completions``, admit and place it as
   the router does, among the endpoints the gateway allows when it names a subset (a pin outside it is
   placed anew; none eligible is a 503, as the protocol says). The answer sets
   ``x-gateway-destination-endpoint`` (and the same in the ``envoy.lb`` dynamic metadata), the engine
   headers the router would send (its token; the conversation), and the body
   as the engine gets it: engine-internal fields stripped, the class in ``vllm_xargs``, and on a turn 1
   prefilled on a prefiller the prefiller's ``kv_transfer_params``, so the decoder pulls the KV once. A
   refusal is an immediate response with the router's OpenAI error body (400, 404, 413; 503 with no
   decoder);
3. response headers: the decoder answered (a 502/503/504 counts as a failed forward, as the router counts
   it); its status is counted by endpoint;
4. the stream's end: the decoder's ledger entry is closed (the turn-1 prefill-site choice reads the ledger).

The picker keeps pins as the router does: in memory, and on the decoders, which every replica (router or
picker) asks about a conversation it holds no pin for. It serves ext_proc in cleartext HTTP/2 or, with
``secure``, over TLS (``coserve.epp.tls``), and its gRPC health on that port and, in cleartext, on a port of
its own for the kubelet's probes.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import Counter
from starlette.responses import Response

from coserve.epp.tls import server_credentials
from coserve.gaie import DESTINATION_HEADER, HEALTH_SERVICES, LB_NAMESPACE, SUBSET_KEY, SUBSET_NAMESPACE
from coserve.router import fastjson
from coserve.router.admission import Admitted, admit, error_response
from coserve.router.app import Router
from coserve.router.config import RouterConfig
from coserve.router.placement import Placed, endpoint_path
from coserve.router.policy import EngineLoad
from coserve.router.routes import HOT_PATHS
from coserve.router.upstream import CONVERSATION_HEADER, Unavailable, output_tokens

__all__ = ["EndpointPicker", "listen", "serve"]

logger = logging.getLogger("coserve.epp")

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_FAILED_FORWARD = {502, 503, 504}
# gRPC core sheds calls the application has not taken up yet: past 1,000 waiting, those older than 30 s, past
# 3,000 all of them, each a CANCELLED stream, which the gateway turns into a 500. Every request holds a picker
# stream until its last token, so a gateway streaming long answers passes those counts long before the engines
# are full: overload shows as queueing in the picker, as in the router, never as refused requests.
SERVER_OPTIONS = (
    ("grpc.server.max_pending_requests", 1_000_000),
    ("grpc.server.max_pending_requests_hard_limit", 1_000_000),
    ("grpc.server_max_unrequested_time_in_server", 3_600),
)
_FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
# a body sent back in full-duplex mode goes in chunks below 64 KiB, which some Envoy builds cap a chunk at
_CHUNK_BYTES = 62_000  # what the router retries elsewhere: the decoder did not answer


class _Buffered:
    """A buffered request as ``coserve.router.admission`` reads one (lower-case headers, the body's chunks)."""

    def __init__(self, headers: Mapping[str, str], body: bytes) -> None:
        self.headers = headers
        self._body = body

    async def stream(self) -> AsyncIterator[bytes]:
        yield self._body


def _headers(message: ext_proc.HttpHeaders) -> dict[str, str]:
    return {h.key.lower(): h.raw_value.decode("latin-1") if h.raw_value else h.value for h in message.headers.headers}


def _set(headers: Mapping[str, str]) -> ext_proc.HeaderMutation:
    return ext_proc.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=k, raw_value=v.encode()), append_action=_OVERWRITE
            )
            for k, v in headers.items()
        ]
    )


def _immediate(response: Response) -> ext_proc.ProcessingResponse:
    """The router's error answer, sent by Envoy without reaching any engine."""
    return ext_proc.ProcessingResponse(
        immediate_response=ext_proc.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=response.status_code),
            headers=_set({"content-type": "application/json"}),
            body=bytes(response.body),
            details="coserve_epp",
        )
    )


def _address(decoder: EngineLoad) -> str:
    """``ip:port`` of an engine URL (``http://10.0.0.7:8000``), as the protocol's header carries it."""
    return decoder.url.split("://", 1)[-1].rstrip("/")


class _Exchange:
    """One HTTP request's conversation with the gateway (module steps 1-4), in either body mode.

    ``BUFFERED`` (``coserve.epp.envoy``'s own configuration): Envoy waits for the answer to the headers, sends
    the body whole, and takes the picked endpoint and the rewritten body from the answer to it; the response
    body passes the picker by. ``FULL_DUPLEX_STREAMED`` (what GAIE's gateways configure, both ways): Envoy
    sends the headers and the body's chunks without waiting, and forwards only what the picker sends back. The
    picker answers the headers once the body is whole (with the endpoint), then sends the body back in
    chunks, and echoes each chunk of the response body (Envoy 1.40 ignores a ``mode_override`` that would take
    the response body off a full-duplex stream: every token passes the picker, as with GAIE's own pickers).
    """

    _ledger_ids = itertools.count()

    def __init__(self, router: Router, echoed: Counter) -> None:
        self.router = router
        self.echoed = echoed
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.endpoint: str | None = None
        self.decoder: EngineLoad | None = None
        self.conversation: str | None = None
        self.ledger: str | None = None
        self.subset: set[str] | None = None  # the endpoints the gateway allows, when it narrows them
        self.duplex_request = False  # FULL_DUPLEX_STREAMED request body (the gateway says so in its first message)
        self.duplex_response = False
        self.decided = False  # the request's answer (endpoint or refusal) is sent
        self.unchanged_body: bytes | None = None  # a body placement does not read, forwarded as it came

    def _excluded(self) -> frozenset[str]:
        """The decoders outside the gateway's subset (``ip:port``), as URLs; none when it sent no subset."""
        if self.subset is None:
            return frozenset()
        return frozenset(url for url, d in self.router.engines.decoders.items() if _address(d) not in self.subset)

    async def answer(self, message: ext_proc.ProcessingRequest) -> list[ext_proc.ProcessingResponse]:
        """What the picker sends back for one message of the gateway: none, one or several responses."""
        kind = message.WhichOneof("request")
        if message.HasField("protocol_config"):
            self.duplex_request = message.protocol_config.request_body_mode == _FULL_DUPLEX
            self.duplex_response = message.protocol_config.response_body_mode == _FULL_DUPLEX
        hint = message.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
        if hint is not None and SUBSET_KEY in hint.fields:
            self.subset = {str(endpoint) for endpoint in hint[SUBSET_KEY]}
        if kind == "request_headers":
            self.headers = _headers(message.request_headers)
            self.endpoint = HOT_PATHS.get(self.headers.get(":path", "").split("?", 1)[0])
            if message.request_headers.end_of_stream:  # no body: nothing to admit, any decoder will do
                return self._decide(self._pick_any())
            # full duplex: the headers are answered with the body, once the endpoint is known
            return (
                [] if self.duplex_request else [ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse())]
            )
        if kind == "request_body":
            self.body += message.request_body.body
            if not message.request_body.end_of_stream:
                return (
                    [] if self.duplex_request else [ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse())]
                )
            return self._decide(await self._place(), end_of_stream=True)
        if kind == "request_trailers":  # a body that ended with trailers: the trailers are its end
            decided = [] if self.decided else self._decide(await self._place(), end_of_stream=False)
            return [*decided, ext_proc.ProcessingResponse(request_trailers=ext_proc.TrailersResponse())]
        if kind == "response_headers":
            self._answered(_headers(message.response_headers).get(":status", "0"))
            return [ext_proc.ProcessingResponse(response_headers=ext_proc.HeadersResponse())]
        if kind == "response_body":
            chunk = message.response_body
            self.echoed.inc(len(chunk.body))
            if not self.duplex_response:
                return [ext_proc.ProcessingResponse(response_body=ext_proc.BodyResponse())]
            return [
                ext_proc.ProcessingResponse(
                    response_body=ext_proc.BodyResponse(response=_streamed(chunk.body, chunk.end_of_stream))
                )
            ]
        if kind == "response_trailers":
            return [ext_proc.ProcessingResponse(response_trailers=ext_proc.TrailersResponse())]
        return []

    async def _place(self) -> Placed | Response:
        """The request's decoder and the body it gets, or the router's refusal; non-completions go anywhere."""
        endpoint = self.endpoint
        if endpoint is None or self.headers.get(":method", "POST") != "POST":
            return self._pick_any(body=bytes(self.body))
        router = self.router
        admitted = await admit(_Buffered(self.headers, bytes(self.body)), endpoint, router.config)
        if not isinstance(admitted, Admitted):
            return admitted
        placement = router.placement
        excluded = self._excluded()
        if router.config.placement == "request":
            return placement.least_occupied(admitted.body, excluded)
        conversation, pin = await placement.known_pin(endpoint, admitted.body, admitted.conversation, admitted.named)
        self.conversation = conversation
        return await placement.place_on(endpoint_path(endpoint), admitted.body, conversation, pin,
                                        admitted.cls.ttft_slo_s, excluded)  # fmt: skip

    def _pick_any(self, body: bytes | None = None) -> Placed | Response:
        """The least-occupied decoder, for a request placement does not read (``body``: kept as it came)."""
        placed = self.router.placement.least_occupied({}, self._excluded())
        if isinstance(placed, Placed):
            self.unchanged_body = body
        return placed

    def _decide(self, placed: Placed | Response, *, end_of_stream: bool = True) -> list[ext_proc.ProcessingResponse]:
        """Envoy's instructions for the request: the decoder, the headers the router would send it and the body
        it gets; or the refusal, as an immediate response."""
        self.decided = True
        if not isinstance(placed, Placed):
            self.router.metrics.requests_of(self.endpoint or "other", str(placed.status_code)).inc()
            return [_immediate(placed)]
        self.decoder = placed.decoder
        self.ledger = f"e{next(self._ledger_ids)}"
        placed.decoder.sent(self.ledger, placed.computes, output_tokens(placed.body))
        destination = _address(placed.decoder)
        headers = {DESTINATION_HEADER: destination, **self.router.upstream.engine_headers()}
        if self.conversation is not None:
            headers[CONVERSATION_HEADER] = self.conversation
        unchanged = self.unchanged_body
        content = unchanged if unchanged is not None else (fastjson.dumps(placed.body) if self.body else None)
        if content is not None and unchanged is None:
            headers["content-length"] = str(len(content))
        metadata = struct_pb2.Struct()
        metadata.update({LB_NAMESPACE: {DESTINATION_HEADER: destination}})
        if not self.body:  # the headers were the whole request: answered in the headers' response
            common = ext_proc.CommonResponse(header_mutation=_set(headers))
            return [ext_proc.ProcessingResponse(dynamic_metadata=metadata,
                                                request_headers=ext_proc.HeadersResponse(response=common))]  # fmt: skip
        if not self.duplex_request:  # buffered: everything in the body's answer
            changed = None if unchanged is not None else ext_proc.BodyMutation(body=content)
            common = ext_proc.CommonResponse(header_mutation=_set(headers), body_mutation=changed)
            return [ext_proc.ProcessingResponse(dynamic_metadata=metadata,
                                                request_body=ext_proc.BodyResponse(response=common))]  # fmt: skip
        common = ext_proc.CommonResponse(header_mutation=_set(headers), clear_route_cache=True)
        answers = [ext_proc.ProcessingResponse(dynamic_metadata=metadata,
                                               request_headers=ext_proc.HeadersResponse(response=common))]  # fmt: skip
        body = content or b""
        chunks = [body[i : i + _CHUNK_BYTES] for i in range(0, len(body), _CHUNK_BYTES)] or [b""]
        for index, chunk in enumerate(chunks):
            last = end_of_stream and index == len(chunks) - 1
            answers.append(
                ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse(response=_streamed(chunk, last)))
            )
        return answers

    def _answered(self, status: str) -> None:
        """The decoder's answer began (or Envoy answered for it: a 503 when it could not connect)."""
        self.router.metrics.requests_of(self.endpoint or "other", status).inc()
        decoder = self.decoder
        if decoder is None:
            return
        code = int(status) if status.isdigit() else 0
        if code in _FAILED_FORWARD:
            self.router.placement.forward_failed(decoder, Unavailable(f"HTTP {code}"), self.conversation)
        else:
            decoder.forward_answered()

    def done(self) -> None:
        """The gateway closed the stream: the request is over (answered, or abandoned by the client)."""
        if self.decoder is not None and self.ledger is not None:
            self.decoder.answered(self.ledger)


def _streamed(chunk: bytes, end_of_stream: bool) -> ext_proc.CommonResponse:
    """A full-duplex body chunk sent back to the gateway, which forwards exactly what it gets."""
    streamed = ext_proc.StreamedBodyResponse(body=chunk, end_of_stream=end_of_stream)
    return ext_proc.CommonResponse(body_mutation=ext_proc.BodyMutation(streamed_response=streamed))


class EndpointPicker(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Envoy's external processor: one ``Process`` stream per HTTP request (module steps)."""

    def __init__(self, router: Router) -> None:
        self.router = router
        # what a gateway that keeps the response body on the picker costs it (0 where it lets the picker opt out)
        self.echoed = Counter(
            "coserve_epp_response_body_bytes",
            "Response body bytes the gateway sent through the picker.",
            registry=router.metrics.registry,
        )

    async def Process(  # the gRPC method's name
        self, request_iterator: AsyncIterator[ext_proc.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        exchange = _Exchange(self.router, self.echoed)
        try:
            async for message in request_iterator:
                try:
                    for response in await exchange.answer(message):
                        yield response
                except Exception:  # never a traceback to the gateway: the client gets the router's 500 body
                    logger.exception("endpoint picker failed on a request")
                    yield _immediate(error_response(500, "internal error in the endpoint picker; it is logged"))
                    return
        finally:
            exchange.done()


async def serve(
    config: RouterConfig,
    host: str,
    port: int,
    metrics_port: int | None = None,
    *,
    health_port: int | None = None,
    secure: bool = False,
    cert_dir: Path | None = None,
) -> None:
    """Run the picker until cancelled: the router's state (engines polled, pins), the ext_proc service, gRPC
    health, and the router's metrics on ``metrics_port``. The router's state is closed however it ends.

    ``secure``: ext_proc over TLS (``coserve.epp.tls``: ``cert_dir``'s pair, or a self-signed one), as GAIE's
    pickers serve it; ``health_port``: gRPC health in cleartext as well (the kubelet's gRPC probes speak no
    TLS), as GAIE's pickers serve it on 9003. The certificate is checked before anything starts."""
    credentials = server_credentials(cert_dir) if secure else None
    router = Router(config.model_copy(update={"batch_dir": None}))  # batches are the router's, not the picker's
    await router.start()
    try:
        await _serve_grpc(router, (host, port, metrics_port, health_port), credentials)
    finally:
        await router.close()


def listen(server: grpc.aio.Server, host: str, port: int, credentials: grpc.ServerCredentials | None) -> int:
    """Bind ``server`` to ``host:port``, over TLS with ``credentials``, else cleartext HTTP/2; the port bound."""
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if not bound:
        raise OSError(f"cannot listen on {address}")
    return int(bound)


async def _serve_grpc(
    router: Router, ports: tuple[str, int, int | None, int | None], credentials: grpc.ServerCredentials | None
) -> None:
    host, port, metrics_port, health_port = ports
    server = grpc.aio.server(options=SERVER_OPTIONS)
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(EndpointPicker(router), server)
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    listen(server, host, port, credentials)
    servers = [server]
    if health_port:  # the same health states, in cleartext, on a server of their own (never ext_proc)
        probes = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(checks, probes)
        listen(probes, host, health_port, None)
        servers.append(probes)
    for each in servers:
        await each.start()
    try:
        for service in HEALTH_SERVICES:  # serving once the engines were read (router.start)
            await checks.set(service, health_pb2.HealthCheckResponse.SERVING)
        if metrics_port:  # last: whoever waits for /metrics to answer finds ext_proc served too
            from prometheus_client import start_http_server

            start_http_server(metrics_port, addr=host, registry=router.metrics.registry)
        logger.info("endpoint picker listening on %s:%d (%s)", host, port, "TLS" if credentials else "cleartext")
        await server.wait_for_termination()
    finally:
        for each in servers:
            with contextlib.suppress(Exception):
                await each.stop(grace=1.0)
