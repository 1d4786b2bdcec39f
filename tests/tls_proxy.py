"""An authenticating reverse proxy in front of kmock's API server emulator, and a throwaway PKI for it.

kmock speaks plain HTTP and accepts anyone; a real API server checks who is calling. ``AuthProxy`` stands
between the operator and kmock and checks what a real one checks: a client certificate signed by the
cluster CA (TLS with ``CERT_REQUIRED``: without one the handshake fails) and/or a bearer token from a
mutable set (others get the API server's 401 Status). It records every request it answers, so tests can
tell which client (kopf's aiohttp, ``kopf/`` User-Agent, or coserve's lightkube) sent what, with which
credential. Watches are streamed chunk by chunk and can be ended on demand, as an API server ends them
when it times a watch out, so that kopf reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CLIENT_CN = "coserve-operator-test"
UNAUTHORIZED = {
    "kind": "Status",
    "apiVersion": "v1",
    "metadata": {},
    "status": "Failure",
    "message": "Unauthorized",
    "reason": "Unauthorized",
    "code": 401,
}
# RFC 9110 §7.6.1, plus what the proxy sets itself (Host, the body's framing and length)
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


# --- a throwaway PKI --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    """PEM files of a test CA, a server certificate for 127.0.0.1/localhost and a client certificate."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def server_context(self, *, require_client_cert: bool) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.server_cert, self.server_key)
        if require_client_cert:
            context.load_verify_locations(cafile=self.ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context


def make_pki(directory: Path, client_cn: str = CLIENT_CN) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "coserve-test-ca")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(cn: str, usage: x509.ObjectIdentifier, san: list[x509.GeneralName] | None) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        )
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        pem_key = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return cert.public_bytes(serialization.Encoding.PEM), pem_key

    server_san: list[x509.GeneralName] = [
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.DNSName("localhost"),
    ]
    server_cert, server_key = leaf("127.0.0.1", ExtendedKeyUsageOID.SERVER_AUTH, server_san)
    client_cert, client_key = leaf(client_cn, ExtendedKeyUsageOID.CLIENT_AUTH, None)
    pki = Pki(
        ca=directory / "ca.crt",
        server_cert=directory / "server.crt",
        server_key=directory / "server.key",
        client_cert=directory / "client.crt",
        client_key=directory / "client.key",
    )
    pki.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    pki.server_cert.write_bytes(server_cert)
    pki.server_key.write_bytes(server_key)
    pki.client_cert.write_bytes(client_cert)
    pki.client_key.write_bytes(client_key)
    return pki


# --- the proxy ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Seen:
    """One request the proxy answered (``status``: its answer, the proxy's own 401 included)."""

    method: str
    path: str
    query: str
    token: str | None
    watch: bool
    user_agent: str
    cn: str | None
    status: int

    @property
    def kopf(self) -> bool:
        return self.user_agent.startswith("kopf/")

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


@dataclass
class AuthProxy:
    """A reverse proxy to ``upstream``; ``tokens`` (when not ``None``) are the bearer tokens it accepts now."""

    upstream: str
    ssl_context: ssl.SSLContext | None = None
    tokens: set[str] | None = None
    seen: list[Seen] = field(default_factory=list)
    url: str = ""
    port: int = 0
    _watches: set[asyncio.Event] = field(default_factory=set)
    _runner: web.AppRunner | None = None
    _session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False, connector=aiohttp.TCPConnector(limit=0)
        )
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self.ssl_context)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        self.url = f"{'https' if self.ssl_context else 'http'}://127.0.0.1:{self.port}"

    async def close(self) -> None:
        self.close_watches()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def close_watches(self) -> int:
        """End every open watch stream (cleanly, as on a server-side timeout); returns how many."""
        for closing in self._watches:
            closing.set()
        return len(self._watches)

    def since(self, mark: int) -> list[Seen]:
        return self.seen[mark:]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        authorization = request.headers.get("Authorization", "")
        token = authorization[len("Bearer ") :] if authorization.startswith("Bearer ") else None
        peercert = request.transport.get_extra_info("peercert") if request.transport is not None else None
        cn = _common_name(peercert)
        watch = request.query.get("watch") in ("true", "1")

        def record(status: int) -> None:
            self.seen.append(
                Seen(
                    method=request.method,
                    path=request.path,
                    query=request.query_string,
                    token=token,
                    watch=watch,
                    user_agent=request.headers.get("User-Agent", ""),
                    cn=cn,
                    status=status,
                )
            )

        if self.tokens is not None and token not in self.tokens:
            record(401)
            # exactly "application/json", as kube-apiserver writes it (lightkube parses a Status only under that)
            body = json.dumps(UNAUTHORIZED).encode()
            return web.Response(status=401, body=body, headers={"Content-Type": "application/json"})

        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        body = await request.read()
        async with self._session.request(
            request.method,
            f"{self.upstream}{request.rel_url.raw_path_qs}",
            headers=headers,
            data=body if body else None,
            allow_redirects=False,
        ) as upstream:
            record(upstream.status)
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in HOP_BY_HOP:
                    response.headers.add(key, value)
            await response.prepare(request)
            closing = asyncio.Event()
            if watch:
                self._watches.add(closing)
            try:
                await _pump(upstream, response, closing)
            finally:
                self._watches.discard(closing)
            with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionResetError):
                await response.write_eof()
            return response


async def _pump(upstream: aiohttp.ClientResponse, response: web.StreamResponse, closing: asyncio.Event) -> None:
    """Copy the upstream body chunk by chunk until it ends, the client leaves, or ``closing`` is set."""
    closed = asyncio.ensure_future(closing.wait())
    try:
        while True:
            chunk_read = asyncio.ensure_future(upstream.content.readany())
            await asyncio.wait({chunk_read, closed}, return_when=asyncio.FIRST_COMPLETED)
            if not chunk_read.done():
                chunk_read.cancel()
                await asyncio.gather(chunk_read, return_exceptions=True)
                return
            chunk = chunk_read.result()
            if not chunk:
                return
            try:
                await response.write(chunk)
            except (ConnectionError, aiohttp.ClientConnectionResetError):
                return
    finally:
        closed.cancel()
        await asyncio.gather(closed, return_exceptions=True)


def _common_name(peercert: object) -> str | None:
    """The subject CN from ``SSLSocket.getpeercert()``'s dict."""
    if not isinstance(peercert, dict):
        return None
    for rdn in peercert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


@contextlib.asynccontextmanager
async def auth_proxy(
    upstream: str, *, ssl_context: ssl.SSLContext | None = None, tokens: set[str] | None = None
) -> AsyncIterator[AuthProxy]:
    proxy = AuthProxy(upstream.rstrip("/"), ssl_context=ssl_context, tokens=tokens)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()
