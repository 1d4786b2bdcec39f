"""The endpoint picker's TLS: the certificate its ext_proc port serves, as GAIE's endpoint pickers serve one.

Who calls it: ``coserve.epp.server.serve`` (``coserve epp --secure-serving``), which the operator renders for a
pool's picker by default. Gateways that follow GAIE's charts connect to the picker over TLS without checking
its certificate (NGINX Gateway Fabric by default; Istio with the chart's DestinationRule); a gateway that
checks it trusts the certificate a Secret provides.

- ``--cert-path DIR`` (a ``kubernetes.io/tls`` Secret mounted there: ``tls.crt``, ``tls.key``): served, and
  read again on each new connection, so a rotated Secret (cert-manager's renewal, which the kubelet swaps in)
  is served without a restart. A pair that does not load is refused at start (``CertificateError``); a rotated
  pair that does not load, or files caught mid-swap, leave the last good pair served, with a warning.
- no directory: a self-signed pair made at start (an EC P-256 key, valid for ten years), as GAIE's pickers
  make one.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import socket
from collections.abc import Sequence
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from coserve.gaie import CERT_FILE, KEY_FILE

__all__ = ["CertificateError", "load_pair", "self_signed", "server_credentials"]

logger = logging.getLogger("coserve.epp")

_SELF_SIGNED_DAYS = 3650

Pair = tuple[bytes, bytes]  # (private key PEM, certificate chain PEM), as gRPC takes them


class CertificateError(ValueError):
    """A certificate directory whose pair cannot be served: the file and the reason."""


def self_signed(hosts: Sequence[str] = ()) -> Pair:
    """A new EC P-256 key and a self-signed certificate for ``hosts`` (DNS names or IP addresses; the
    machine's name and ``localhost`` always), valid from five minutes ago for ten years."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "coserve-endpoint-picker")])
    names = list(dict.fromkeys([*hosts, socket.gethostname(), "localhost"]))
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=_SELF_SIGNED_DAYS))
        .add_extension(x509.SubjectAlternativeName([_general_name(n) for n in names]), critical=False)
        .sign(key, hashes.SHA256())
    )
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())  # fmt: skip
    return private, certificate.public_bytes(serialization.Encoding.PEM)


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def load_pair(directory: Path) -> Pair:
    """``directory``'s ``tls.key`` and ``tls.crt``, checked: both PEM, the key unencrypted and the
    certificate's own. Raises ``CertificateError`` naming the file and what is wrong."""
    pair = _read_pair(directory)
    _check_pair(directory, pair)
    return pair


def _read_pair(directory: Path) -> Pair:
    try:
        return (directory / KEY_FILE).read_bytes(), (directory / CERT_FILE).read_bytes()
    except OSError as error:
        raise CertificateError(f"{error.filename}: {error.strerror}") from error


def _check_pair(directory: Path, pair: Pair) -> None:
    key_file, cert_file = directory / KEY_FILE, directory / CERT_FILE
    try:
        certificate = x509.load_pem_x509_certificate(pair[1])
    except ValueError as error:
        raise CertificateError(f"{cert_file}: not a PEM certificate ({error})") from error
    try:
        key = serialization.load_pem_private_key(pair[0], password=None)
    except (ValueError, TypeError) as error:
        raise CertificateError(f"{key_file}: not an unencrypted PEM private key ({error})") from error
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.PEM, public) != certificate.public_key().public_bytes(
        serialization.Encoding.PEM, public
    ):
        raise CertificateError(f"{key_file}: not the key of {cert_file}")


class _Rotating:
    """gRPC's certificate fetcher for a mounted directory: called before each new connection's handshake; a
    new configuration when the files changed and load, else None (the last one stays). Unchanged bytes are
    not parsed again, and a pair that does not load is warned about once."""

    def __init__(self, directory: Path, pair: Pair) -> None:
        self.directory = directory
        self.pair = pair
        self.refused: Pair | None = None

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        try:
            pair = _read_pair(self.directory)
        except CertificateError as error:  # files caught mid-swap, or gone
            logger.warning("endpoint picker: serving the last good certificate; the new one does not load: %s", error)
            return None
        if pair in (self.pair, self.refused):
            return None
        try:
            _check_pair(self.directory, pair)
        except CertificateError as error:
            self.refused = pair
            logger.warning("endpoint picker: serving the last good certificate; the new one does not load: %s", error)
            return None
        self.pair = pair
        logger.info("endpoint picker: serving the new certificate in %s", self.directory)
        return grpc.ssl_server_certificate_configuration([pair])


def server_credentials(cert_dir: Path | None, hosts: Sequence[str] = ()) -> grpc.ServerCredentials:
    """TLS for the picker's ext_proc port: ``cert_dir``'s pair, followed as it rotates, or (None) a self-signed
    pair for ``hosts``. Raises ``CertificateError`` when ``cert_dir``'s pair does not load."""
    if cert_dir is None:
        return grpc.ssl_server_credentials([self_signed(hosts)])
    pair = load_pair(cert_dir)
    return grpc.dynamic_ssl_server_credentials(
        grpc.ssl_server_certificate_configuration([pair]), _Rotating(cert_dir, pair)
    )
