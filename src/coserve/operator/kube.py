"""A thin async Kubernetes API client for the operator's handlers: get, list, create, merge-patch.

Who calls it: ``coserve.operator.handlers``, once per reconcile. It speaks plain
HTTP (httpx) to the API server with the credentials in ``ClusterAccess``:
in-cluster service-account credentials, or the current kubeconfig context
(loaded by the ``kubernetes`` client's config loader, so exec plugins and client
certificates work as in kubectl). Only the kinds the operator manages are known.

Errors come back as ``KubeError`` with the API server's status, reason and
message, so handlers can report them in the pool's conditions.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

__all__ = ["PATHS", "ClusterAccess", "KubeClient", "KubeError"]

# kind -> (API prefix, plural)
PATHS: dict[str, tuple[str, str]] = {
    "ConfigMap": ("/api/v1", "configmaps"),
    "Service": ("/api/v1", "services"),
    "Event": ("/api/v1", "events"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "CoServePool": ("/apis/coserve.dev/v1alpha1", "coservepools"),
}

_SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeError(RuntimeError):
    """The API server answered with an error status."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"HTTP {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class ClusterAccess:
    """Where the API server is and how to authenticate."""

    server: str
    token: str | None = None
    ca_file: str | None = None
    client_cert: tuple[str, str] | None = None  # (certificate file, key file)
    verify: bool = True

    @classmethod
    def from_environment(cls) -> ClusterAccess:
        """In a pod: the service account. Elsewhere: the current kubeconfig context (as kubectl uses)."""
        if os.environ.get("KUBERNETES_SERVICE_HOST") and (_SERVICE_ACCOUNT / "token").exists():
            host = os.environ["KUBERNETES_SERVICE_HOST"]
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            host = f"[{host}]" if ":" in host else host
            return cls(
                server=f"https://{host}:{port}",
                token=(_SERVICE_ACCOUNT / "token").read_text().strip(),
                ca_file=str(_SERVICE_ACCOUNT / "ca.crt"),
            )
        from kubernetes import client, config

        configuration = client.Configuration()
        config.load_kube_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        token = (configuration.api_key or {}).get("authorization") or (configuration.api_key or {}).get("BearerToken")
        if token and token.lower().startswith("bearer "):
            token = token[7:]
        cert_file, key_file = configuration.cert_file, configuration.key_file
        cert = (str(cert_file), str(key_file)) if cert_file and key_file else None
        return cls(
            server=str(configuration.host),
            token=token,
            ca_file=configuration.ssl_ca_cert,
            client_cert=cert,
            verify=bool(configuration.verify_ssl),
        )


class KubeClient:
    """Use as ``async with KubeClient(access) as kube``; one connection pool per operator."""

    def __init__(self, access: ClusterAccess, timeout_s: float = 30.0) -> None:
        headers = {"Accept": "application/json"}
        if access.token:
            headers["Authorization"] = f"Bearer {access.token}"
        verify: bool | str = access.ca_file if (access.verify and access.ca_file) else access.verify
        self._http = httpx.AsyncClient(
            base_url=access.server.rstrip("/"),
            headers=headers,
            verify=verify,
            cert=access.client_cert,
            timeout=timeout_s,
        )

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    @staticmethod
    def path(kind: str, namespace: str | None, name: str | None = None, subresource: str | None = None) -> str:
        """The object's (or, without ``name``, the collection's) URL path; ``namespace=None``: every namespace."""
        try:
            prefix, plural = PATHS[kind]
        except KeyError:
            raise ValueError(f"unknown kind {kind!r}; known: {', '.join(PATHS)}") from None
        if namespace is None:
            if name is not None:
                raise ValueError(f"a {kind} named {name!r} needs a namespace")
            return f"{prefix}/{plural}"
        path = f"{prefix}/namespaces/{namespace}/{plural}"
        if name is not None:
            path += f"/{name}"
        if subresource is not None:
            path += f"/{subresource}"
        return path

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or ``None`` if it does not exist."""
        response = await self._http.get(self.path(kind, namespace, name))
        if response.status_code == 404:
            return None
        return self._json(response)

    async def list(self, kind: str, namespace: str | None, label_selector: str | None = None) -> list[dict[str, Any]]:
        """Every object of ``kind`` in ``namespace`` (``None``: all namespaces) matching ``label_selector``.

        Callers that depend on the selector check labels again: not every API server (kmock) applies it.
        """
        params = {"labelSelector": label_selector} if label_selector else None
        items = self._json(await self._http.get(self.path(kind, namespace), params=params)).get("items") or []
        return [item for item in items if isinstance(item, dict)]

    async def create(self, kind: str, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._json(await self._http.post(self.path(kind, namespace), json=body))

    async def merge_patch(
        self, kind: str, namespace: str, name: str, body: dict[str, Any], subresource: str | None = None
    ) -> dict[str, Any]:
        """RFC 7386 merge patch: maps merge, lists and scalars are replaced by ``body``'s."""
        response = await self._http.patch(
            self.path(kind, namespace, name, subresource),
            json=body,
            headers={"Content-Type": "application/merge-patch+json"},
        )
        return self._json(response)

    @staticmethod
    def _json(response: httpx.Response) -> dict[str, Any]:
        if response.status_code >= 400:
            try:
                status = response.json()
                reason, message = str(status.get("reason", "")), str(status.get("message", response.text))
            except ValueError:
                reason, message = response.reason_phrase, response.text[:500]
            raise KubeError(response.status_code, reason or response.reason_phrase, message)
        data = response.json()
        if not isinstance(data, dict):
            raise KubeError(response.status_code, "UnexpectedBody", f"expected an object, got {type(data).__name__}")
        return data
