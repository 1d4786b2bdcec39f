"""Gateway mode: the pool's placement behind a Gateway API Inference Extension gateway.

``GatewaySpec`` is ``spec.gateway``. With ``enabled``, ``coserve.operator.resources`` renders, beside the
router, an InferencePool (``inference.networking.k8s.io/v1``) that selects the pool's decoders and names the
pool's endpoint picker (``coserve epp``, a Deployment and a Service) as its ``endpointPickerRef``; an example
HTTPRoute that sends the gateway's completions to that InferencePool and its batch API to the router; and a
NetworkPolicy that admits the gateway's proxies to the decoders' port. The router stays: it serves the batch
API and clients that call it directly.
"""

from __future__ import annotations

from typing import Self

from pydantic import ConfigDict, Field, model_validator

from coserve.api._base import ApiModel
from coserve.api.spec._rules import _cel, _fail
from coserve.api.spec.core import DNS_LABEL_PATTERN, DNS_SUBDOMAIN_PATTERN, ResourceRequirements
from coserve.api.spec.engine import ScraperPeer

# Gateway API's Duration (GEP-2257): 1 to 4 of <number><unit>, units h, m, s and ms.
GATEWAY_DURATION_PATTERN = r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"


_CERT_NEEDS_TLS = (
    "!has(self.pickerCertSecret) || !has(self.secureServing) || self.secureServing",
    "pickerCertSecret is served only with secureServing",
    ".pickerCertSecret",
)


class GatewaySpec(ApiModel):
    """Gateway mode: an InferencePool and coserve's endpoint picker, for a Gateway API Inference Extension gateway."""

    model_config = ConfigDict(json_schema_extra=_cel(_CERT_NEEDS_TLS))

    enabled: bool = Field(
        default=False,
        description="enabled renders an InferencePool (inference.networking.k8s.io/v1) over the pool's decoders, "
        "with coserve's endpoint picker (a Deployment and a Service running `coserve epp`) as its "
        "endpointPickerRef, so a gateway (kgateway, Istio, Envoy Gateway, GKE's) forwards each request straight "
        "to the decoder the picker names. The Gateway API and Inference Extension CRDs must be installed; "
        "status.conditions GatewayReady says what is missing. The router stays.",
    )
    gateway_name: str = Field(
        default="inference-gateway",
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="gatewayName is the Gateway the example HTTPRoute attaches to.",
    )
    gateway_namespace: str | None = Field(
        default=None,
        min_length=1,
        max_length=63,
        pattern=DNS_LABEL_PATTERN,
        description="gatewayNamespace is the Gateway's namespace; unset: the pool's. A Gateway in another "
        "namespace must allow routes from the pool's (its listeners' allowedRoutes).",
    )
    http_route: bool = Field(
        default=True,
        description="httpRoute renders the example HTTPRoute <pool>-route: the batch API (/v1/files, /v1/batches) "
        "to the router, everything else to the InferencePool. false: route to the InferencePool yourself.",
    )
    request_timeout: str = Field(
        default="300s",
        max_length=32,
        pattern=GATEWAY_DURATION_PATTERN,
        description="requestTimeout bounds one request through the gateway (the HTTPRoute's timeouts.request), "
        "streamed answers included: a Gateway API duration such as 300s or 1h; 0s: no bound.",
    )
    picker_replicas: int = Field(
        default=2,
        ge=1,
        le=100,
        description="pickerReplicas is the endpoint picker Deployment's replicas. Replicas share conversations' "
        "pins through the decoders, as router replicas do. The picker runs spec.router.image with spec.router's "
        "pod options.",
    )
    picker_resources: ResourceRequirements = Field(
        default_factory=lambda: ResourceRequirements(
            requests={"cpu": "500m", "memory": "256Mi"}, limits={"memory": "1Gi"}
        ),
        description="pickerResources are the endpoint picker container's resources.",
    )
    secure_serving: bool = Field(
        default=True,
        description="secureServing serves the picker's ext_proc over TLS, as GAIE's endpoint pickers do: gateways "
        "that follow GAIE's charts connect to a picker over TLS without checking its certificate (NGINX Gateway "
        "Fabric by default, Istio with the chart's DestinationRule). The certificate is pickerCertSecret's, else "
        "a self-signed one made at start. false: cleartext HTTP/2 (the Service's appProtocol says "
        "kubernetes.io/h2c), for gateways configured so. Health probes use a cleartext port either way.",
    )
    picker_cert_secret: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="pickerCertSecret names a kubernetes.io/tls Secret (tls.crt, tls.key) in the pool's "
        "namespace whose certificate the picker serves, for gateways that check it (cert-manager's, say). The "
        "picker reads it again on each new connection, so a renewed Secret is served without a restart.",
    )
    proxies: list[ScraperPeer] = Field(
        default_factory=list,
        max_length=16,
        description="proxies are the gateway's proxy pods, which forward requests to the decoders' port, each "
        "named by namespace and pod labels. Empty: any pod may reach the decoders' port (the gateway's "
        "controller decides where its proxies run). Engines trust a request's priority class only with the "
        "pool's router token, which the picker adds.",
    )

    @model_validator(mode="after")
    def _cert_needs_tls(self) -> Self:
        if self.picker_cert_secret is not None and not self.secure_serving:
            _fail([(("pickerCertSecret",), _CERT_NEEDS_TLS[1], self.picker_cert_secret)])
        return self
