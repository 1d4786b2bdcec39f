"""What the gateway and the endpoint picker must agree on: the names of GAIE's endpoint picker protocol.

Who reads it: ``coserve.epp.server`` (the picker's answers), ``coserve.epp.envoy`` (the Envoy configuration
that obeys them) and the operator's gateway-mode rendering (the ports and files it gives the picker). One
place, so the picker, the proxy and the rendering cannot drift apart. The protocol:
kubernetes-sigs/gateway-api-inference-extension, docs/proposals/004-endpoint-picker-protocol.
"""

from __future__ import annotations

__all__ = [
    "CERT_FILE",
    "DESTINATION_HEADER",
    "DESTINATION_SERVED_KEY",
    "HEALTH_PORT",
    "HEALTH_SERVICES",
    "KEY_FILE",
    "LB_NAMESPACE",
    "LIVENESS_SERVICE",
    "PICKER_PORT",
    "READINESS_SERVICE",
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

# where a picker serves ext_proc (GAIE's endpoint pickers listen on 9002; an InferencePool's endpointPickerRef
# names the port), and the gRPC health services it answers on that port: liveness, readiness and the
# ext_proc service itself (the protocol's "Health Checking"); the kubelet's gRPC probes name the first two
PICKER_PORT = 9002
LIVENESS_SERVICE = "liveness"
READINESS_SERVICE = "readiness"
HEALTH_SERVICES = ("", LIVENESS_SERVICE, READINESS_SERVICE, "envoy.service.ext_proc.v3.ExternalProcessor")
# the same health services in cleartext, on a port of their own, where ext_proc is served over TLS: the kubelet's
# gRPC probes speak no TLS (GAIE's pickers answer their probes on 9003)
HEALTH_PORT = 9003
# the certificate a picker serving TLS reads from its --cert-path: a kubernetes.io/tls Secret's keys, as the
# Secret's volume names its files
CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"
