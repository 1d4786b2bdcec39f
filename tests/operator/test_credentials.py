"""The operator's two API clients (kopf's watches, coserve's lightkube ``KubeClient``) authenticate alike.

An authenticating proxy (``tls_proxy``) stands in front of kmock's emulator and checks what a real API server
checks: a client certificate signed by the cluster CA, or a bearer token it currently accepts. Each test
loads the credentials as ``coserve operator`` does (``load_cluster``: a kubeconfig file or the in-cluster
ServiceAccount), runs the real kopf operator, and looks at what reached the proxy from which client.

Guards against a real failure: with a client-certificate kubeconfig the former client sent no certificate
(httpx 0.28 ignores ``cert=`` beside a CA path), so its writes were anonymous (403) while kopf's watches worked.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import kmock as kmocklib
import pytest
import yaml

kopf = pytest.importorskip("kopf")

from coserve.operator.kube import fetch_credential, load_cluster  # noqa: E402 - after the importorskip
from operator_kmock import (  # noqa: E402
    CHILDREN,
    MERGE,
    NS,
    POOLS_URL,
    create_pool,
    eventually,
    exists,
    running_operator,
)
from tls_proxy import CLIENT_CN, AuthProxy, Seen, auth_proxy, make_pki  # noqa: E402

pytestmark = pytest.mark.asyncio

DECODER = ("apps/v1/deployments", NS, "chat-decoder")
DECODER_PATH = f"/apis/apps/v1/namespaces/{NS}/deployments/chat-decoder"
WATCHED = {"coservepools", "deployments", "services", "configmaps"}
# the bearer tokens the proxy takes before and after a rotation (named so: S105 reads `token == "..."` as a secret)
FIRST, SECOND = "token-1", "token-2"
EXEC_FIRST, EXEC_SECOND = "exec-token-1", "exec-token-2"
CHILD_COLLECTIONS = {
    f"/api/v1/namespaces/{NS}/configmaps",
    f"/api/v1/namespaces/{NS}/services",
    f"/apis/apps/v1/namespaces/{NS}/deployments",
}


def write_kubeconfig(directory: Path, server: str, cluster: dict[str, Any], user: dict[str, Any]) -> Path:
    path = directory / "kubeconfig"
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "proxy", "cluster": {"server": server, **cluster}}],
        "users": [{"name": "operator", "user": user}],
        "contexts": [{"name": "test", "context": {"cluster": "proxy", "user": "operator", "namespace": NS}}],
        "current-context": "test",
    }
    path.write_text(yaml.safe_dump(config))
    return path


def b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def plural(seen: Seen) -> str:
    """The resource of a request path: /api/v1/namespaces/NS/PLURAL[/name[/status]]."""
    parts = seen.path.strip("/").split("/")
    index = parts.index("namespaces") + 2 if "namespaces" in parts else len(parts) - 1
    return parts[index] if index < len(parts) else ""


def watching_with(proxy: AuthProxy, token: str | None, mark: int = 0) -> set[str]:
    """The resources kopf has opened a watch on (answered 2xx) with ``token``, since ``mark``."""
    return {plural(s) for s in proxy.since(mark) if s.kopf and s.watch and s.ok and s.token == token}


def operator_tasks() -> list[asyncio.Task[Any]]:
    """The running ``kopf.operator`` task(s): a restart would show as a different or a finished task."""
    return [task for task in asyncio.all_tasks() if getattr(task.get_coro(), "__qualname__", "") == "operator"]


async def change_the_spec(operator: httpx.AsyncClient) -> None:
    """More arrivals: the plan asks for more decoders, which the operator must patch in place (test_operator_kmock)."""
    response = await operator.patch(
        f"{POOLS_URL}/chat",
        headers=MERGE,
        json={"metadata": {"generation": 2}, "spec": {"workload": {"arrivalRatePerS": 8.0}}},
    )
    assert response.status_code == 200, response.text


# --- client certificates ------------------------------------------------------------------------------------


@pytest.mark.parametrize("embedded", [False, True], ids=["file-paths", "base64-data"])
async def test_a_client_certificate_authenticates_kopf_and_coserve_alike(
    kmock: kmocklib.KubernetesEmulator, tmp_path: Path, embedded: bool
) -> None:
    pki = make_pki(tmp_path / "pki")
    async with auth_proxy(str(kmock.url), ssl_context=pki.server_context(require_client_cert=True)) as proxy:
        # the proxy admits nobody without the client certificate, not even to the TLS handshake's end
        async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=pki.ca), timeout=5) as anonymous:
            with pytest.raises(httpx.TransportError):
                await anonymous.get(f"{proxy.url}/api")
        assert proxy.seen == []

        if embedded:
            cluster = {"certificate-authority-data": b64(pki.ca)}
            user = {"client-certificate-data": b64(pki.client_cert), "client-key-data": b64(pki.client_key)}
        else:
            cluster = {"certificate-authority": str(pki.ca)}
            user = {"client-certificate": str(pki.client_cert), "client-key": str(pki.client_key)}
        kubeconfig = write_kubeconfig(tmp_path, proxy.url, cluster, user)

        async with running_operator(kmock, cluster=lambda: load_cluster(kubeconfig)) as operator:
            await create_pool(operator)
            await eventually(lambda: all(exists(kmock, r, n) for r, n in CHILDREN), "all seven children")

        assert watching_with(proxy, None) >= WATCHED, "kopf watches through the proxy"
        coserve = [s for s in proxy.seen if not s.kopf]
        created = {s.path for s in coserve if s.method == "POST" and s.ok}
        assert created >= CHILD_COLLECTIONS, f"coserve's client created the children through the proxy: {coserve}"
        assert {s.cn for s in proxy.seen} == {CLIENT_CN}
        assert all(s.status != 403 for s in proxy.seen)


# --- token files --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["kubeconfig-tokenFile", "in-cluster-serviceaccount"])
async def test_a_rotated_token_file_is_read_again_by_both_clients_without_a_restart(
    kmock: kmocklib.KubernetesEmulator, tmp_path: Path, where: str
) -> None:
    ssl_context: ssl.SSLContext | None = None
    account = tmp_path / "serviceaccount"
    account.mkdir()
    token_file = account / "token"
    token_file.write_text(FIRST + "\n")
    if where.startswith("in-cluster"):
        # the in-cluster API server is https with the cluster CA in ca.crt beside the token
        pki = make_pki(tmp_path / "pki")
        (account / "ca.crt").write_bytes(pki.ca.read_bytes())
        (account / "namespace").write_text(NS)
        ssl_context = pki.server_context(require_client_cert=False)

    async with auth_proxy(str(kmock.url), ssl_context=ssl_context, tokens={FIRST}) as proxy:
        load: Callable[[], Any]
        if where.startswith("in-cluster"):
            environ = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(proxy.port)}
            load = lambda: load_cluster(service_account_dir=account, environ=environ)  # noqa: E731
        else:
            kubeconfig = write_kubeconfig(tmp_path, proxy.url, {}, {"tokenFile": str(token_file)})
            load = lambda: load_cluster(kubeconfig)  # noqa: E731

        async with running_operator(kmock, cluster=load) as operator:
            await create_pool(operator)
            await eventually(lambda: all(exists(kmock, r, n) for r, n in CHILDREN), "all seven children")
            assert watching_with(proxy, FIRST) >= WATCHED
            assert {s.path for s in proxy.seen if not s.kopf and s.method == "POST" and s.ok} >= CHILD_COLLECTIONS
            (kopf_task,) = operator_tasks()
            decoders = kmock.objects[DECODER]["spec"]["replicas"]

            # the kubelet rotates the token: the API server takes only the new one from now on
            mark = len(proxy.seen)
            token_file.write_text(SECOND + "\n")
            proxy.tokens = {SECOND}
            assert proxy.close_watches() >= len(WATCHED), "kopf's watches were open"
            await change_the_spec(operator)

            await eventually(lambda: kmock.objects[DECODER]["spec"]["replicas"] > decoders, "more decoders")
            await eventually(lambda: watching_with(proxy, SECOND, mark) >= WATCHED, "kopf watching with token-2")
            assert operator_tasks() == [kopf_task] and not kopf_task.done(), "the operator was not restarted"

        after = proxy.since(mark)
        assert any(s.kopf and s.token == FIRST and s.status == 401 for s in after), "kopf met the 401 first"
        patched = [s for s in after if not s.kopf and s.method == "PATCH" and s.path == DECODER_PATH and s.ok]
        assert patched and all(s.token == SECOND for s in patched), after


# --- exec plugins -------------------------------------------------------------------------------------------

EXEC_PLUGIN = """\
import datetime, json, pathlib
here = pathlib.Path(__file__).parent
with open(here / "runs", "a") as runs:
    runs.write("ran\\n")
generation = 2 if (here / "rotated").exists() else 1
expires = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)
print(json.dumps({
    "apiVersion": "client.authentication.k8s.io/v1beta1",
    "kind": "ExecCredential",
    "status": {"token": f"exec-token-{generation}", "expirationTimestamp": expires.strftime("%Y-%m-%dT%H:%M:%SZ")},
}))
"""


async def test_an_exec_plugin_logs_both_clients_in_and_again_when_its_token_is_refused(
    kmock: kmocklib.KubernetesEmulator, tmp_path: Path
) -> None:
    plugin_dir = tmp_path / "plugin"
    plugin_dir.mkdir()
    script = plugin_dir / "credential.py"
    script.write_text(EXEC_PLUGIN)
    runs = plugin_dir / "runs"

    def ran() -> int:
        return len(runs.read_text().splitlines()) if runs.exists() else 0

    async with auth_proxy(str(kmock.url), tokens={EXEC_FIRST}) as proxy:
        plugin = {
            "apiVersion": "client.authentication.k8s.io/v1beta1",
            "command": sys.executable,
            "args": [str(script)],
        }
        kubeconfig = write_kubeconfig(tmp_path, proxy.url, {}, {"exec": plugin})
        async with running_operator(kmock, cluster=lambda: load_cluster(kubeconfig)) as operator:
            await create_pool(operator)
            await eventually(lambda: all(exists(kmock, r, n) for r, n in CHILDREN), "all seven children")
            assert watching_with(proxy, EXEC_FIRST) >= WATCHED
            created = {s.path for s in proxy.seen if not s.kopf and s.method == "POST" and s.ok}
            assert created >= CHILD_COLLECTIONS
            assert ran() >= 2, "the plugin ran for kopf's login and for coserve's client"
            (kopf_task,) = operator_tasks()
            decoders = kmock.objects[DECODER]["spec"]["replicas"]

            # the credential is revoked: the plugin hands out a new one, the API server takes only that
            mark, runs_before = len(proxy.seen), ran()
            (plugin_dir / "rotated").touch()
            proxy.tokens = {EXEC_SECOND}
            assert proxy.close_watches() >= len(WATCHED)
            await change_the_spec(operator)

            await eventually(lambda: kmock.objects[DECODER]["spec"]["replicas"] > decoders, "more decoders")
            await eventually(
                lambda: watching_with(proxy, EXEC_SECOND, mark) >= WATCHED, "kopf watching with exec-token-2"
            )
            assert operator_tasks() == [kopf_task] and not kopf_task.done(), "the operator was not restarted"

        after = proxy.since(mark)
        patched = [s for s in after if not s.kopf and s.method == "PATCH" and s.path == DECODER_PATH and s.ok]
        assert patched and all(s.token == EXEC_SECOND for s in patched), after
        assert ran() >= runs_before + 2, "the plugin ran again for each client"


@pytest.mark.asyncio
async def test_a_relative_token_file_is_read_beside_the_kubeconfig_by_both_clients(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "cfg"
    folder.mkdir()
    (folder / "token").write_text("relative-token\n")
    kubeconfig = folder / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:9"}}],
                "users": [{"name": "u", "user": {"tokenFile": "token"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    monkeypatch.chdir(tmp_path)  # not the kubeconfig's folder
    config = load_cluster(kubeconfig)
    assert config.user is not None and config.user.token_file == str(folder / "token")
    assert (await fetch_credential(config)).token == "relative-token"  # noqa: S105 - a test token
