"""The operator's Kubernetes API access: credentials for kopf and coserve alike, and a dict-shaped client.

Who calls it: ``coserve operator`` (``load_cluster`` once at start-up),
``coserve.operator.handlers`` (kopf's login handler calls ``fetch_credential``;
the reconciler, the autoscaler, the event recorder and the leader elector use
``KubeClient``). Tests build a ``SingleConfig`` for a local server with
``config_for``.

NOTE: the client is lightkube (``lightkube.AsyncClient``), chosen over
kubernetes_asyncio and kr8s because it is async, typed, speaks to the API server
with one TLS context that carries the client certificate (httpx's own ``cert=``
is ignored beside a CA path), re-reads a rotated ServiceAccount token file and
re-runs a kubeconfig exec plugin when the server answers 401, and supports
server-side apply should drift handling move to it.

Credentials, in the order kubectl uses them:

- in a pod: the ServiceAccount (``/var/run/secrets/kubernetes.io/serviceaccount``);
  the token *file* is kept, not its contents, so the kubelet's hourly rotation
  is picked up on the next 401 (lightkube) and the next login (kopf);
- elsewhere: ``--kubeconfig`` or ``$KUBECONFIG`` (first file) or
  ``~/.kube/config``, with ``--context`` or the current context: client
  certificates (what kind, minikube and k3s write), tokens, token files and exec
  plugins (EKS, GKE, AKS), whose credential is fetched again when it expires.

Errors come back as ``KubeError`` with the API server's status code, reason and
message (``status`` 0 when the server could not be reached), so handlers can
report them in the pool's conditions.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx2
import lightkube
from lightkube import codecs
from lightkube.config.kubeconfig import KubeConfig, SingleConfig
from lightkube.config.models import Cluster, User
from lightkube.core.exceptions import ApiError, ConfigError
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.apps_v1 import Deployment
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import (
    ConfigMap,
    Event,
    PersistentVolumeClaim,
    Pod,
    Secret,
    Service,
    ServiceAccount,
)
from lightkube.resources.networking_v1 import NetworkPolicy
from lightkube.resources.policy_v1 import PodDisruptionBudget
from lightkube.resources.rbac_authorization_v1 import Role, RoleBinding
from lightkube.types import PatchType

__all__ = [
    "FIELD_MANAGER",
    "SERVICE_ACCOUNT_DIR",
    "Credential",
    "KubeClient",
    "KubeError",
    "NotLeading",
    "WriteFence",
    "config_for",
    "describe",
    "fetch_credential",
    "load_cluster",
    "version_of",
]

FIELD_MANAGER = "coserve-operator"
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")

CoServePoolResource = create_namespaced_resource("coserve.dev", "v1alpha1", "CoServePool", "coservepools")

# Gateway mode's kinds, from the Gateway API (HTTPRoute) and its Inference Extension (InferencePool): served only
# where their CRDs are installed; elsewhere the API server answers 404 to every call on them.
InferencePoolResource = create_namespaced_resource(
    "inference.networking.k8s.io", "v1", "InferencePool", "inferencepools"
)
HTTPRouteResource = create_namespaced_resource("gateway.networking.k8s.io", "v1", "HTTPRoute", "httproutes")

# kind -> lightkube resource class; only the kinds the operator manages are known.
RESOURCES: dict[str, Any] = {
    "ConfigMap": ConfigMap,
    "Service": Service,
    "Event": Event,
    "Deployment": Deployment,
    "Lease": Lease,
    "Secret": Secret,
    "NetworkPolicy": NetworkPolicy,
    "ServiceAccount": ServiceAccount,
    "Role": Role,
    "RoleBinding": RoleBinding,
    "PodDisruptionBudget": PodDisruptionBudget,
    "PersistentVolumeClaim": PersistentVolumeClaim,
    "Pod": Pod,  # read and annotated only (decoders' deletion cost), never created
    "CoServePool": CoServePoolResource,
    "InferencePool": InferencePoolResource,
    "HTTPRoute": HTTPRouteResource,
}


class KubeError(RuntimeError):
    """The API server answered with an error status, or (``status`` 0) could not be reached."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"HTTP {status} {reason}: {message}" if status else f"{reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class NotLeading(Exception):
    """A write was not sent: this replica's Lease may expire before the write's timeout (``KubeClient.fenced``).

    Deliberately not a ``KubeError``: code that reports API errors must not catch it; the
    handlers treat it as "not the leader: skip".
    """


WriteFence = Callable[[str, str, str, float], None]
"""``fence(verb, kind, name, timeout_s)``: returns when the write may be sent, raises ``NotLeading`` otherwise."""


# --- credentials ----------------------------------------------------------------------------------


def load_cluster(
    kubeconfig: str | os.PathLike[str] | None = None,
    context: str | None = None,
    *,
    service_account_dir: str | os.PathLike[str] = SERVICE_ACCOUNT_DIR,
    environ: Mapping[str, str] | None = None,
) -> SingleConfig:
    """Where the API server is and how to authenticate, as kubectl decides it (module docstring).

    An explicit ``kubeconfig`` wins over the in-cluster ServiceAccount. Raises
    ``KubeError`` (reason ``NoCredentials``) naming what was tried.
    """
    env = os.environ if environ is None else environ
    account = Path(service_account_dir)
    try:
        if kubeconfig is None and env.get("KUBERNETES_SERVICE_HOST") and (account / "token").exists():
            return _in_cluster(account, env)
        path = kubeconfig or (env.get("KUBECONFIG") or "").split(os.pathsep)[0] or "~/.kube/config"
        config = KubeConfig.from_file(path).get(context_name=context)
    except (ConfigError, OSError, ValueError) as error:
        raise KubeError(0, "NoCredentials", f"no usable in-cluster or kubeconfig credentials: {error}") from error
    if config is None:
        raise KubeError(0, "NoCredentials", f"kubeconfig {path} has no current context; pass --context")
    user = config.user
    if user is not None and user.token_file and not os.path.isabs(user.token_file):
        # as kubectl does: relative to the kubeconfig's folder (lightkube's token reader would use the cwd)
        user.token_file = str(config.abs_file(user.token_file))
    return config


def _in_cluster(account: Path, env: Mapping[str, str]) -> SingleConfig:
    host, port = env["KUBERNETES_SERVICE_HOST"], env.get("KUBERNETES_SERVICE_PORT", "443")
    host = f"[{host}]" if ":" in host else host
    namespace_file = account / "namespace"
    cluster = Cluster(server=f"https://{host}:{port}", certificate_auth=str(account / "ca.crt"))
    # token_file only (no token): every reader goes back to the file, which the kubelet rotates
    user = User(token_file=str(account / "token"))
    namespace = namespace_file.read_text().strip() if namespace_file.exists() else "default"
    config = KubeConfig.from_one(cluster=cluster, user=user, context_name="in-cluster", namespace=namespace)
    return _current(config)


def config_for(
    server: str,
    *,
    token: str | None = None,
    token_file: str | None = None,
    ca_file: str | None = None,
    client_cert: tuple[str, str] | None = None,
    insecure: bool = False,
    namespace: str = "default",
) -> SingleConfig:
    """A one-context configuration for ``server`` (tests, and ``coserve operator --server``)."""
    cluster = Cluster(server=server, certificate_auth=ca_file, insecure=insecure)
    cert, key = client_cert or (None, None)
    user = User(token=token, token_file=token_file, client_cert=cert, client_key=key)
    return _current(KubeConfig.from_one(cluster=cluster, user=user, namespace=namespace))


def _current(config: KubeConfig) -> SingleConfig:
    single = config.get()
    if single is None:  # from_one always sets the current context
        raise KubeError(0, "NoCredentials", "the configuration has no current context")
    return single


def describe(config: SingleConfig) -> str:
    """How the operator authenticates, for its start-up log line (never the secret itself)."""
    user = config.user
    how = "anonymous"
    if user is not None:
        if user.exec is not None:
            how = f"exec plugin {user.exec.command}"
        elif user.token_file:
            how = f"token file {user.token_file}"
        elif user.token:
            how = "bearer token"
        elif user.client_cert or user.client_cert_data:
            how = "client certificate"
    return f"{config.cluster.server} (context {config.context_name}, {how})"


@dataclass(frozen=True)
class Credential:
    """What kopf needs to authenticate, fetched afresh at each (re-)login."""

    server: str
    ca_path: str | None = None
    ca_data: bytes | None = None
    insecure: bool = False
    token: str | None = None
    certificate_path: str | None = None
    certificate_data: bytes | None = None
    private_key_path: str | None = None
    private_key_data: bytes | None = None
    username: str | None = None
    password: str | None = None
    expiration: datetime | None = None
    namespace: str | None = None


async def fetch_credential(config: SingleConfig) -> Credential:
    """Read the credential now: the token file's current contents, the exec plugin's current output.

    kopf calls its login handler again on a 401 and when ``expiration`` passes,
    so a rotated token or an expired exec credential is replaced without a restart.
    """
    cluster, user = config.cluster, config.user or User()
    ca_path = str(config.abs_file(cluster.certificate_auth)) if cluster.certificate_auth else None
    ca_data = _pem(cluster.certificate_auth_data)
    token, expiration = user.token, None
    cert_path = str(config.abs_file(user.client_cert)) if user.client_cert else None
    key_path = str(config.abs_file(user.client_key)) if user.client_key else None
    cert_data, key_data = _pem(user.client_cert_data), _pem(user.client_key_data)
    if user.token_file:
        token = Path(config.abs_file(user.token_file)).read_text().strip()
    elif user.exec is not None:
        status = await _run_exec(config)
        token = status.get("token") or None
        if status.get("clientCertificateData"):
            cert_path, cert_data = None, str(status["clientCertificateData"]).encode()
        if status.get("clientKeyData"):
            key_path, key_data = None, str(status["clientKeyData"]).encode()
        if status.get("expirationTimestamp"):
            expiration = datetime.fromisoformat(str(status["expirationTimestamp"]).replace("Z", "+00:00"))
    return Credential(
        server=cluster.server,
        ca_path=ca_path,
        ca_data=ca_data,
        insecure=bool(cluster.insecure),
        token=token,
        certificate_path=cert_path,
        certificate_data=cert_data,
        private_key_path=key_path,
        private_key_data=key_data,
        username=user.username,
        password=user.password,
        expiration=expiration,
        namespace=config.namespace,
    )


def _pem(data: str | None) -> bytes | None:
    """kubeconfig ``*-data`` fields are base64 of PEM."""
    return base64.b64decode(data) if data else None


async def _run_exec(config: SingleConfig) -> dict[str, Any]:
    """Run the kubeconfig's exec plugin (client.authentication.k8s.io) and return its ExecCredential status."""
    plugin = config.user.exec if config.user else None
    if plugin is None:
        raise KubeError(0, "ExecPluginFailed", "the kubeconfig user has no exec plugin")
    env = dict(os.environ)
    env.update((var.name, var.value) for var in plugin.env or [])
    process = await asyncio.create_subprocess_exec(
        plugin.command,
        *(plugin.args or []),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await process.communicate()
    if process.returncode != 0:
        hint = f" ({plugin.installHint})" if plugin.installHint else ""
        raise KubeError(0, "ExecPluginFailed", f"{plugin.command} exited {process.returncode}{hint}: "
                        f"{stderr.decode(errors='replace')[-500:]}")  # fmt: skip
    try:
        status = json.loads(stdout)["status"]
    except (ValueError, KeyError, TypeError) as error:
        raise KubeError(0, "ExecPluginFailed", f"{plugin.command} printed no ExecCredential status") from error
    if not isinstance(status, dict):
        raise KubeError(0, "ExecPluginFailed", f"{plugin.command} printed no ExecCredential status")
    return status


# --- the client -----------------------------------------------------------------------------------


class KubeClient:
    """Get, list, create, merge-patch and delete plain dicts; ``async with KubeClient(config) as kube``.

    One per operator. Bodies go out and come back as the API server's JSON, so the
    reconciler compares what the server stores, unmodified.
    """

    def __init__(self, config: SingleConfig, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self._fence: WriteFence | None = None
        self._client = lightkube.AsyncClient(
            config, timeout=httpx2.Timeout(timeout_s), field_manager=FIELD_MANAGER, trust_env=False
        )

    def fenced(self, fence: WriteFence) -> KubeClient:
        """This client (same connection) with every write (create, merge patch, delete) fenced.

        Before a write is sent, ``fence(verb, kind, name, timeout_s)`` must return (it raises
        ``NotLeading`` when the Lease could expire within ``timeout_s``), and the write then gets
        ``timeout_s`` in all: connecting, sending and reading together, not each. The leader
        elector keeps the unfenced client: renewing the Lease is what the fence protects.
        """
        clone = copy.copy(self)
        clone._fence = fence
        return clone

    async def _write(self, verb: str, kind: str, name: str, call: Callable[[], Any]) -> Any:
        """The one way out for writes: fenced (when a fence is set), then sent within ``timeout_s``."""
        if self._fence is None:
            return await self._call(call())
        self._fence(verb, kind, name, self.timeout_s)
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._call(call())
        except TimeoutError:
            raise KubeError(0, "Timeout", f"{verb} {kind} {name}: no answer within {self.timeout_s} s") from None

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._client.close()

    @staticmethod
    def resource(kind: str, subresource: str | None = None) -> Any:
        try:
            res = RESOURCES[kind]
        except KeyError:
            raise ValueError(f"unknown kind {kind!r}; known: {', '.join(RESOURCES)}") from None
        if subresource is None:
            return res
        if subresource != "status":
            raise ValueError(f"unknown subresource {subresource!r}")
        return res.Status

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or ``None`` if it does not exist."""
        try:
            return _plain(await self._call(self._client.get(self.resource(kind), name, namespace=namespace)))
        except KubeError as error:
            if error.status == 404:
                return None
            raise

    async def list(self, kind: str, namespace: str | None, label_selector: str | None = None) -> list[dict[str, Any]]:
        """Every object of ``kind`` in ``namespace`` (``None``: all namespaces) matching ``label_selector``.

        Pages through large collections. Items carry ``apiVersion`` and ``kind`` like
        a GET's answer (the API server leaves them out of list items). Callers that depend on the selector check
        labels again: not every API server (kmock) applies it.
        """
        labels: dict[str, Any] | None = dict(_parse_selector(label_selector)) if label_selector else None
        items: list[dict[str, Any]] = []
        res = self.resource(kind)
        with _translated():
            async for item in self._client.list(
                res, namespace=namespace if namespace is not None else "*", labels=labels
            ):
                # NOTE: list items come without apiVersion and kind; a pool without them would not parse
                items.append({"apiVersion": res._api_info.resource.api_version, "kind": kind, **_plain(item)})
        return items

    async def create(self, kind: str, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        self.resource(kind)  # only the known kinds
        metadata = {**(body.get("metadata") or {}), "namespace": namespace}
        obj = codecs.from_dict({**body, "metadata": metadata})  # the class registered for apiVersion and kind
        return _plain(await self._write("create", kind, str(metadata.get("name")), lambda: self._client.create(obj)))

    async def merge_patch(
        self,
        kind: str,
        namespace: str,
        name: str,
        body: Mapping[str, Any],
        subresource: str | None = None,
        *,
        resource_version: str | None = None,
    ) -> dict[str, Any]:
        """RFC 7386 merge patch: maps merge, lists and scalars are replaced by ``body``'s.

        ``resource_version``: the version of the object the patch was decided from. The API server
        applies the patch only if the object still has it, and answers 409 Conflict otherwise: the
        write fence that holds even for a request that lands late, after another replica wrote. A
        409 means "read again and decide again", never "send the same patch again".
        """
        res = self.resource(kind, subresource)
        if resource_version is not None:
            body = {**body, "metadata": {**(body.get("metadata") or {}), "resourceVersion": resource_version}}

        def call() -> Any:
            return self._client.patch(res, name, dict(body), namespace=namespace, patch_type=PatchType.MERGE)

        return _plain(await self._write("patch", kind if subresource is None else f"{kind}/{subresource}", name, call))

    async def delete(
        self, kind: str, namespace: str, name: str, *, uid: str | None = None, resource_version: str | None = None
    ) -> None:
        """Delete the object; with ``uid``, only that very object (HTTP 409 if the name now holds another); with
        ``resource_version``, only if it is unchanged since it was read (HTTP 409 otherwise, as ``merge_patch``).

        NOTE: preconditions need a DeleteOptions body, which lightkube's ``delete`` cannot send; the
        request is built by lightkube's generic client (auth, retries on 401) with that body added.
        """
        res = self.resource(kind)
        preconditions = {
            key: value for key, value in (("uid", uid), ("resourceVersion", resource_version)) if value is not None
        }
        if not preconditions:
            await self._write("delete", kind, name, lambda: self._client.delete(res, name, namespace=namespace))
            return
        generic: Any = self._client._client
        request = generic.prepare_request("delete", res=res, name=name, namespace=namespace)
        request.data = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": preconditions}

        async def send() -> None:
            response = await generic.send(generic.build_adapter_request(request))
            generic.handle_response("delete", response, request)

        await self._write("delete", kind, name, send)

    @staticmethod
    async def _call(call: Any) -> Any:
        with _translated():
            return await call


def version_of(obj: Mapping[str, Any] | None) -> str | None:
    """The object's ``metadata.resourceVersion`` as read: what a write decided from it carries as its precondition.

    ``None`` for no object, or one without a version (an emulator's): the write is then sent without one.
    """
    version = ((obj or {}).get("metadata") or {}).get("resourceVersion")
    return version if isinstance(version, str) and version else None


@contextlib.contextmanager
def _translated() -> Iterator[None]:
    """lightkube's and httpx2's errors as ``KubeError``: translated once, at the boundary."""
    try:
        yield
    except ApiError as error:
        raise _api_error(error) from None
    except ConfigError as error:  # e.g. the token file vanished, an exec plugin failed
        raise KubeError(0, "NoCredentials", str(error)) from None
    except httpx2.HTTPStatusError as error:  # an error answer without a Kubernetes Status body (a proxy's)
        raise _status_error(error.response) from None
    except httpx2.HTTPError as error:
        raise KubeError(0, "Unreachable", f"{type(error).__name__}: {error}") from None


def _plain(obj: Any) -> dict[str, Any]:
    data = obj.to_dict() if hasattr(obj, "to_dict") else dict(obj)
    if not isinstance(data, dict):
        raise KubeError(200, "UnexpectedBody", f"expected an object, got {type(data).__name__}")
    return data


def _api_error(error: ApiError) -> KubeError:
    status = error.status
    code = int(status.code or error.response.status_code)
    return KubeError(code, str(status.reason or error.response.reason_phrase), str(status.message or ""))


def _status_error(response: httpx2.Response) -> KubeError:
    return KubeError(response.status_code, response.reason_phrase, response.text[:200])


def _parse_selector(selector: str) -> list[tuple[str, str]]:
    """``a=b,c=d`` -> pairs; only equality selectors are used by the operator."""
    pairs = []
    for term in selector.split(","):
        key, sep, value = term.partition("=")
        if not sep:
            raise ValueError(f"unsupported label selector term {term!r}")
        pairs.append((key.strip(), value.strip().lstrip("=")))
    return pairs
