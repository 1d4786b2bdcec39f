"""An Envoy bootstrap that sends a pool's completions through coserve's endpoint picker, as GAIE gateways do.

Who calls it: the endpoint picker's tests and benchmarks (a real Envoy in front of the picker), and users
without a managed gateway (``coserve epp --envoy-config``). Managed gateways (kgateway, Istio, Envoy Gateway,
GKE) build the equivalent from an InferencePool; this is that configuration, small enough to read:

- a listener whose HTTP filters are ext_proc (the picker, over gRPC) and the router;
- ext_proc sends the request headers and body, and the response headers (the answer's status) and body, in
  ``FULL_DUPLEX_STREAMED`` mode with trailers, as GAIE's gateways configure it: the picker answers the headers
  once the body is whole (it admits and places it, and may rewrite it: engine fields stripped, the class, a
  prefiller's transfer parameters) and sends the body back, and it echoes the response body's chunks (the
  tokens pass the picker). ``body_mode="buffered"`` is the cheaper exchange for a gateway of your own: the
  request body buffered whole and the response body never sent, so Envoy streams the tokens itself;
- the picker fails closed (``failure_mode_allow: false``): when it is unreachable, or does not answer within
  ``message_timeout_s`` (turn 1's prefill happens inside its answer), Envoy refuses the request rather than
  sending it to an engine the picker did not choose;
- ``picker_tls``: Envoy reaches the picker over TLS (``coserve epp --secure-serving``), checking its
  certificate against ``picker_ca`` when given (a pair of your own, ``--cert-path``), else not checking it, as
  GAIE's gateways reach a picker's self-signed certificate;
- the engines' cluster is ``ORIGINAL_DST``: the upstream is the ``ip:port`` the picker put in
  ``x-gateway-destination-endpoint`` (``coserve.gaie``).

Pure: returns the configuration as data; the caller writes it (YAML or JSON; Envoy reads either).
"""

from __future__ import annotations

import ipaddress
from typing import Any, Literal

from coserve.gaie import DESTINATION_HEADER

__all__ = ["BodyMode", "envoy_bootstrap"]

BodyMode = Literal["full-duplex", "buffered"]

_HCM_NAME = "envoy.filters.network.http_connection_manager"
_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_HTTP_OPTIONS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
_UPSTREAM_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def envoy_bootstrap(
    *,
    listen_port: int,
    picker_host: str,
    picker_port: int,
    listen_host: str = "0.0.0.0",  # noqa: S104 - a gateway listens for its clients
    admin_port: int | None = None,
    message_timeout_s: float = 60.0,
    max_request_bytes: int = 8 * 1024 * 1024,
    body_mode: BodyMode = "full-duplex",
    idle_timeout_s: float = 300.0,
    picker_tls: bool = False,
    picker_ca: str | None = None,
) -> dict[str, Any]:
    """The bootstrap: clients on ``listen_host:listen_port``, the picker at ``picker_host:picker_port`` (a DNS
    name, such as the picker's Service, or an IP). ``max_request_bytes`` bounds a buffered request (the
    router's ``maxBodyBytes``); ``admin_port`` opens Envoy's admin on loopback (readiness, stats);
    ``body_mode``: how ext_proc sends bodies (module docstring); ``idle_timeout_s``:
    how long a request may go without a byte either way, which bounds a picker that does not answer in full
    duplex mode (where Envoy runs no ``message_timeout``) and a stalled decode (0: unbounded); ``picker_tls``,
    ``picker_ca`` (a PEM file's path): TLS to the picker (module docstring)."""
    manager = _manager(message_timeout_s, body_mode, idle_timeout_s)
    listener = {
        "name": "gateway",
        "address": _address(listen_host, listen_port),
        "per_connection_buffer_limit_bytes": max_request_bytes,
        "filter_chains": [{"filters": [{"name": _HCM_NAME, "typed_config": manager}]}],
    }
    picker = _picker_cluster(picker_host, picker_port)
    if picker_tls:
        picker["transport_socket"] = _picker_tls(picker_host, picker_ca)
    clusters = [picker, _engines_cluster(max_request_bytes)]
    bootstrap: dict[str, Any] = {"static_resources": {"listeners": [listener], "clusters": clusters}}
    if admin_port is not None:
        bootstrap["admin"] = {"address": _address("127.0.0.1", admin_port)}
    return bootstrap


def _processing_mode(body_mode: BodyMode) -> dict[str, str]:
    if body_mode == "buffered":
        request, response, trailers = "BUFFERED", "NONE", "SKIP"
    else:  # full duplex needs the trailers sent (Envoy refuses the configuration otherwise)
        request, response, trailers = "FULL_DUPLEX_STREAMED", "FULL_DUPLEX_STREAMED", "SEND"
    return {
        "request_header_mode": "SEND",
        "request_body_mode": request,
        "request_trailer_mode": trailers,
        "response_header_mode": "SEND",
        "response_body_mode": response,
        "response_trailer_mode": trailers,
    }


def _manager(message_timeout_s: float, body_mode: BodyMode, idle_timeout_s: float) -> dict[str, Any]:
    """HTTP: every request through ext_proc (the picker), then to the ``pool`` cluster."""
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _EXT_PROC,
            "grpc_service": {"envoy_grpc": {"cluster_name": "endpoint_picker"}},
            "failure_mode_allow": False,
            "message_timeout": f"{message_timeout_s:g}s",
            "processing_mode": _processing_mode(body_mode),
        },
    }
    return {
        "@type": _HCM,
        "stat_prefix": "gateway",
        "stream_idle_timeout": f"{idle_timeout_s:g}s",
        "route_config": {
            "name": "pool",
            "virtual_hosts": [
                {
                    "name": "pool",
                    "domains": ["*"],
                    # no route timeout: a stream lasts as long as its decode
                    "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": "0s"}}],
                }
            ],
        },
        "http_filters": [ext_proc, {"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}}],
    }


# Envoy's default circuit breakers allow 1,024 requests in flight per cluster, and fail the rest at once (a 500,
# since the picker's stream is part of every request). Each request holds a picker stream until its last token,
# so a gateway streaming long answers passes 1,024 well before the engines are full: the limits here are the
# engines' to set (their queues), not the proxy's.
_CIRCUIT_BREAKERS = {
    "thresholds": [{"max_connections": 1_000_000, "max_pending_requests": 1_000_000, "max_requests": 1_000_000}]
}


def _picker_cluster(host: str, port: int) -> dict[str, Any]:
    """The picker, over HTTP/2 (gRPC); a DNS name is resolved and followed."""
    return {
        "name": "endpoint_picker",
        "type": "STRICT_DNS",
        "connect_timeout": "5s",
        "circuit_breakers": _CIRCUIT_BREAKERS,
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _HTTP_OPTIONS,
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": "endpoint_picker",
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(host, port)}}]}],
        },
    }


def _picker_tls(host: str, ca_file: str | None) -> dict[str, Any]:
    """TLS to the picker, offering HTTP/2 (gRPC): the certificate checked against ``ca_file`` (and the name
    against ``host``), or, without one, taken as it comes (a picker's self-signed certificate)."""
    try:
        ipaddress.ip_address(host)
        san_type = "IP_ADDRESS"
    except ValueError:
        san_type = "DNS"
    context: dict[str, Any] = {"alpn_protocols": ["h2"]}
    if ca_file is not None:
        context["validation_context"] = {
            "trusted_ca": {"filename": ca_file},
            "match_typed_subject_alt_names": [{"san_type": san_type, "matcher": {"exact": host}}],
        }
    tls: dict[str, Any] = {"@type": _UPSTREAM_TLS, "common_tls_context": context}
    if san_type == "DNS":  # server name indication carries names, never addresses
        tls["sni"] = host
    return {"name": "envoy.transport_sockets.tls", "typed_config": tls}


def _engines_cluster(max_request_bytes: int) -> dict[str, Any]:
    """The engines: whichever ``ip:port`` the picker names in the destination header."""
    return {
        "name": "pool",
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "5s",
        "circuit_breakers": _CIRCUIT_BREAKERS,
        "per_connection_buffer_limit_bytes": max_request_bytes,
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
    }
