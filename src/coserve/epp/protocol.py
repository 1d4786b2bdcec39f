"""What the gateway and the endpoint picker must agree on: the names of GAIE's endpoint picker protocol.

Who reads it: ``coserve.epp.server`` (the picker's answers), ``coserve.epp.envoy`` (the Envoy configuration
that obeys them) and the operator's gateway-mode rendering. One place, so the picker and the proxy cannot
drift apart. The protocol: kubernetes-sigs/gateway-api-inference-extension,
docs/proposals/004-endpoint-picker-protocol.
"""

from __future__ import annotations

__all__ = [
    "DESTINATION_HEADER",
    "DESTINATION_SERVED_KEY",
    "LB_NAMESPACE",
    "SUBSET_KEY",
    "SUBSET_NAMESPACE",
]

# the picked endpoint, ``ip:port``: a request header and a dynamic-metadata key in the ``envoy.lb`` namespace
DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
# the endpoint that served the request, in the response's metadata context (same namespace)
DESTINATION_SERVED_KEY = "x-gateway-destination-endpoint-served"
# the endpoints a gateway allows for this request, when it narrows them (filter metadata)
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
