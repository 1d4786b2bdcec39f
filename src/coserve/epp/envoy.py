"""An Envoy bootstrap that sends a pool's completions through coserve's endpoint picker, as GAIE gateways do.

Who calls it: the endpoint picker's tests and benchmarks (a real Envoy in front of the picker), and users
without a managed gateway (``coserve epp --envoy-config``). Managed gateways (kgateway, Istio, Envoy Gateway,
GKE) build the equivalent from an InferencePool; this is that configuration, small enough to read:

- a listener whose HTTP filters are ext_proc (the picker, over gRPC) and the router;
- ext_proc sends the request headers, the request body buffered whole (the picker admits and places it, and
  may rewrite it: engine fields stripped, the class, a prefiller's transfer parameters) and the response
  headers (the answer's status); it does not see the response body, so Envoy streams the tokens itself;
- the picker fails closed (``failure_mode_allow: false``): when it is unreachable, or does not answer within
  ``message_timeout_s`` (turn 1's prefill happens inside its answer), Envoy refuses the request rather than
  sending it to an engine the picker did not choose;
- the engines' cluster is ``ORIGINAL_DST``: the upstream is the ``ip:port`` the picker put in
  ``x-gateway-destination-endpoint`` (``coserve.gaie``).

Pure: returns the configuration as data; the caller writes it (YAML or JSON; Envoy reads either).
"""

from __future__ import annotations

from typing import Any

from coserve.gaie import DESTINATION_HEADER

__all__ = ["envoy_bootstrap"]

_HCM_NAME = "envoy.filters.network.http_connection_manager"
_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_HTTP_OPTIONS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


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
) -> dict[str, Any]:
    """The bootstrap: clients on ``listen_host:listen_port``, the picker at ``picker_host:picker_port`` (a DNS
    name, such as the picker's Service, or an IP). ``max_request_bytes`` bounds a buffered request (the
    router's ``maxBodyBytes``); ``admin_port`` opens Envoy's admin on loopback (readiness, stats)."""
    listener = {
        "name": "gateway",
        "address": _address(listen_host, listen_port),
        "per_connection_buffer_limit_bytes": max_request_bytes,
        "filter_chains": [{"filters": [{"name": _HCM_NAME, "typed_config": _manager(message_timeout_s)}]}],
    }
    clusters = [_picker_cluster(picker_host, picker_port), _engines_cluster(max_request_bytes)]
    bootstrap: dict[str, Any] = {"static_resources": {"listeners": [listener], "clusters": clusters}}
    if admin_port is not None:
        bootstrap["admin"] = {"address": _address("127.0.0.1", admin_port)}
    return bootstrap


def _manager(message_timeout_s: float) -> dict[str, Any]:
    """HTTP: every request through ext_proc (the picker), then to the ``pool`` cluster."""
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _EXT_PROC,
            "grpc_service": {"envoy_grpc": {"cluster_name": "endpoint_picker"}},
            "failure_mode_allow": False,
            "message_timeout": f"{message_timeout_s:g}s",
            "processing_mode": {
                "request_header_mode": "SEND",
                "request_body_mode": "BUFFERED",
                "request_trailer_mode": "SKIP",
                "response_header_mode": "SEND",
                "response_body_mode": "NONE",
                "response_trailer_mode": "SKIP",
            },
        },
    }
    return {
        "@type": _HCM,
        "stat_prefix": "gateway",
        "stream_idle_timeout": "0s",  # a long decode may pause between tokens; the engines time out, not Envoy
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


def _picker_cluster(host: str, port: int) -> dict[str, Any]:
    """The picker, over HTTP/2 (gRPC); a DNS name is resolved and followed."""
    return {
        "name": "endpoint_picker",
        "type": "STRICT_DNS",
        "connect_timeout": "5s",
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


def _engines_cluster(max_request_bytes: int) -> dict[str, Any]:
    """The engines: whichever ``ip:port`` the picker names in the destination header."""
    return {
        "name": "pool",
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": "5s",
        "per_connection_buffer_limit_bytes": max_request_bytes,
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
    }
