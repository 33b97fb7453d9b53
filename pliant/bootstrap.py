"""The bootstrap join: how a node with nothing but a join command gets its agent certificate (kubeadm's model).

The join command carries the coordinator's address, the job, its join token and the CA's fingerprint::

    pliant run --coordinator 10.0.0.5:29400 --join-token=TOKEN --ca-cert-hash sha256:HEX --job J ... train.py

Wire format and order (the coordinator side is :mod:`pliant.coordinator.signer`):

1. **Discovery.** The node opens TLS to the Bootstrap port (the API port + 1 unless ``--bootstrap HOST:PORT`` says
   otherwise) without checking the server, and takes the CA certificate from the chain the server presents
   (coordinator certificate, then CA). It computes ``sha256:<hex>`` of the CA's DER SubjectPublicKeyInfo and
   compares it with ``--ca-cert-hash``. A mismatch ends the join there: the token is never sent.
2. **Request.** The node makes an ECDSA P-256 key (it never leaves the node) and a PKCS#10 request for the subject
   ``O=pliant, OU=agent, CN=<node id>``, then calls ``pliant.v1.Bootstrap/IssueAgentCertificate`` (job, node id, join
   token, request) over gRPC on TLS that checks the server against the pinned CA.
3. **Answer.** The coordinator checks the token and the subject and that no live member holds the node id, and
   returns the signed certificate (client use only, short-lived) and the CA. The node keeps both, and the key, in
   memory: nothing is written to disk.
4. **Renewal.** Before two thirds of the certificate's lifetime have passed, the agent sends a new request (a fresh
   key) to ``pliant.v1.Coordinator/RenewAgentCertificate`` over its mutual TLS channel, and uses the answer for every
   connection from then on.
"""

from __future__ import annotations

import hmac
import re
import socket
import ssl
from dataclasses import dataclass
from typing import Any

from pliant.errors import ConfigError, PliantError
from pliant.net import parse_host_port
from pliant.ports import bootstrap_of
from pliant.security.identity import Role, ca_fingerprint, identity_from_pem, not_after
from pliant.security.issuance import new_csr
from pliant.security.tlsdir import TlsMaterial

__all__ = [
    "BootstrapError",
    "CertificateLifetime",
    "bootstrap_address",
    "fetch_ca",
    "material",
    "parse_pin",
    "pinned_ca",
    "renewal_due",
    "request_certificate",
]

_PIN = re.compile(r"sha256:[0-9a-f]{64}")


class BootstrapError(PliantError):
    """The bootstrap join failed. ``code`` is the gRPC status name of a refusal ("UNAVAILABLE" when nothing answered,
    "PIN" for a CA that does not match the pin)."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


def parse_pin(text: str) -> str:
    """Check a ``--ca-cert-hash`` value: ``sha256:`` and 64 hex digits (lower case is returned).

    Raises:
        ConfigError: naming the value and where the right one is printed.
    """
    pin = (text or "").strip().lower()
    if not _PIN.fullmatch(pin):
        raise ConfigError(
            f"--ca-cert-hash {text[:100]!r} is not sha256:<64 hex digits>; copy it from the join command that the "
            f"first node printed (or `pliant certs fingerprint --certs-dir DIR` for a CA of your own)"
        )
    return pin


def bootstrap_address(coordinator: str) -> str:
    """The Bootstrap service's HOST:PORT by convention (:mod:`pliant.ports`): the coordinator API's port + 1."""
    host, port = parse_host_port(coordinator, what="--coordinator", allow_zero=True)
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{bootstrap_of(port)}"


def fetch_ca(address: str, timeout_s: float = 5.0) -> bytes:
    """The CA certificate (PEM) that the server at ``address`` presents after its own, read without checking it.

    Raises:
        BootstrapError: nothing answers there (code UNAVAILABLE), or it presents no CA certificate.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    host, port = parse_host_port(address, what="bootstrap address")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # the pin, not the handshake, decides whether this CA is trusted
    context.set_alpn_protocols(["h2"])
    try:
        with (
            socket.create_connection((host, port), timeout=timeout_s) as raw,
            context.wrap_socket(raw, server_hostname=host) as tls,
        ):
            # Python 3.13 made the chain public; 3.10-3.12 have it on the SSL object.
            chain_of = getattr(tls, "get_unverified_chain", None) or tls._sslobj.get_unverified_chain  # type: ignore[union-attr]
            chain = [x509.load_der_x509_certificate(_der(item)) for item in chain_of() or ()]
    except (OSError, ssl.SSLError) as exc:
        raise BootstrapError(
            f"no bootstrap service answered at {address} ({exc}); check the address and that the port is open "
            f"(the coordinator's API port + 1)",
            "UNAVAILABLE",
        ) from exc
    for cert in chain:
        if cert.subject == cert.issuer and _is_ca(cert):
            return cert.public_bytes(serialization.Encoding.PEM)
    raise BootstrapError(
        f"the server at {address} presents no CA certificate; is it a pliant coordinator's bootstrap port?", "PIN"
    )


def _der(item: object) -> bytes:
    """DER bytes of a certificate from ``get_unverified_chain`` (objects with ``public_bytes`` or DER already)."""
    if isinstance(item, bytes):
        return item
    return item.public_bytes(ssl._ssl.ENCODING_DER)  # type: ignore[attr-defined]


def _is_ca(cert: object) -> bool:
    from cryptography import x509

    try:
        return bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)  # type: ignore[attr-defined]
    except x509.ExtensionNotFound:
        return False


def pinned_ca(address: str, pin: str, timeout_s: float = 5.0) -> bytes:
    """The CA certificate at ``address``, once its fingerprint is the pinned one.

    Raises:
        BootstrapError: nothing answers (UNAVAILABLE), or the fingerprint differs (PIN: nothing secret was sent).
    """
    ca_pem = fetch_ca(address, timeout_s)
    found = ca_fingerprint(ca_pem)
    if not hmac.compare_digest(found, pin):
        raise BootstrapError(
            f"the CA at {address} has fingerprint {found}, but the join command pins {pin}: not sending the join "
            f"token. Copy --ca-cert-hash from the command the first node printed, and check that --coordinator names "
            f"its control plane",
            "PIN",
        )
    return ca_pem


def request_certificate(
    address: str, pin: str, job: str, node_id: str, token: str, timeout_s: float = 5.0, create: Any = None
) -> TlsMaterial:
    """Run the bootstrap join against ``address``: pin the CA, make a key, have the request signed; with ``create``
    (a ``pliant.v1.JobSpec``, and a namespace's join token as ``token``), the coordinator creates that job first
    unless it exists.

    Returns:
        The CA, the signed agent certificate and the key, all in memory.

    Raises:
        BootstrapError: with the coordinator's refusal (``code`` its status name) or why nothing answered.
    """
    import grpc

    from pliant.v1 import bootstrap_pb2, bootstrap_pb2_grpc

    ca_pem = pinned_ca(address, pin, timeout_s)
    key_pem, csr_pem = new_csr(Role.AGENT, node_id)
    with grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca_pem)) as channel:
        stub = bootstrap_pb2_grpc.BootstrapStub(channel)
        request = bootstrap_pb2.IssueAgentCertificateRequest(
            job_id=job, node_id=node_id, join_token=token, csr_pem=csr_pem, create=create
        )
        try:
            answer = stub.IssueAgentCertificate(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            code = exc.code().name if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED else "UNAVAILABLE"
            raise BootstrapError(f"bootstrap join at {address} refused: {exc.details()}", code) from exc
    return material(ca_pem, answer.cert_pem, key_pem)


def material(ca_pem: bytes, cert_pem: bytes, key_pem: bytes) -> TlsMaterial:
    """TLS material from a signed agent certificate (checked to name a pliant role).

    Raises:
        BootstrapError: the certificate names no pliant agent.
    """
    identity = identity_from_pem(cert_pem)
    if identity is None or identity.role is not Role.AGENT:
        raise BootstrapError(
            f"the coordinator returned a certificate for {identity or 'no pliant role'}, not an agent; is it a pliant "
            f"coordinator?",
            "PIN",
        )
    return TlsMaterial(ca_pem, cert_pem, key_pem, identity)


@dataclass(frozen=True)
class CertificateLifetime:
    """When this process received a certificate and when it expires (seconds since the epoch)."""

    received_at: float
    not_after: float

    @classmethod
    def of(cls, cert_pem: bytes, received_at: float) -> CertificateLifetime:
        return cls(received_at, not_after(cert_pem).timestamp())


def renewal_due(lifetime: CertificateLifetime, now: float) -> bool:
    """True once two thirds of the time between receiving the certificate and its expiry have passed (kubelet
    rotates at 70-90 % of a certificate's lifetime)."""
    return now >= lifetime.received_at + (lifetime.not_after - lifetime.received_at) * 2 / 3
