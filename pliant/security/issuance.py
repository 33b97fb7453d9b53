"""Issuing certificates (the cryptography package): a CA, certificates for a role and name signed by it, signing
requests made with a key that never leaves its process and the CA's signature on them, the TLS directories that hold
the result, and :class:`LocalCA`, a CA whose key lives in one process. Keys are ECDSA P-256: a handshake costs well
under a millisecond, which keeps mutual TLS cheap on the control plane's hot paths.

``pliant certs`` (see :mod:`pliant.certs`) creates a CA and issues certificates in this layout, as ``cockroach cert
create-ca / create-node / create-client`` do.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pliant.errors import ConfigError
from pliant.security.identity import JOB_URI, ORG, Identity, Role, identity_from_subject, now_utc, subject_name
from pliant.security.tlsdir import CA_CERT, TLS_CERT, TLS_KEY, TlsConfig

__all__ = ["IssuedCert", "LocalCA", "csr_identity", "issue_cert", "new_ca", "new_csr", "sign_csr", "write_tls_dir"]


@dataclass(frozen=True)
class IssuedCert:
    """A certificate and its private key, PEM-encoded."""

    cert_pem: bytes
    key_pem: bytes


def _new_key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def new_ca(common_name: str = "pliant CA", lifetime_days: float = 3650) -> IssuedCert:
    """Create a self-signed CA certificate and its key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    key = _new_key()
    name = x509.Name(
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORG), x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    )
    now = now_utc()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=lifetime_days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return IssuedCert(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def issue_cert(
    ca: IssuedCert,
    role: Role,
    name: str,
    hosts: Sequence[str] = (),
    lifetime_days: float = 365,
    not_before: datetime.datetime | None = None,
) -> IssuedCert:
    """Issue a certificate for ``role``/``name`` signed by ``ca``.

    Args:
        ca: the CA certificate and key.
        role: the holder's role.
        name: the node id (agents), the replica or user name (others).
        hosts: DNS names and IP addresses the holder serves on (coordinators, etcd); they become SANs.
        lifetime_days: validity from now.
        not_before: start of validity (default: 5 minutes ago, for clock skew); tests pass a past time to make
            an expired certificate.

    Raises:
        ConfigError: the CA files do not parse or ``name`` is empty.
    """
    key = _new_key()
    start = not_before or now_utc() - datetime.timedelta(minutes=5)
    cert_pem = _sign(ca, key.public_key(), role, name, hosts, start, start + datetime.timedelta(days=lifetime_days))
    return IssuedCert(cert_pem, _key_pem(key))


def _sign(
    ca: IssuedCert,
    public_key: object,
    role: Role,
    name: str,
    hosts: Sequence[str],
    start: datetime.datetime,
    end: datetime.datetime,
    job: str = "",
) -> bytes:
    """A PEM certificate for ``public_key`` naming ``role``/``name`` (and ``job``, a URI SAN, when given), valid from
    ``start`` to ``end``, signed by ``ca``.

    Raises:
        ConfigError: the CA files do not parse or ``name`` is empty.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID

    if not name or len(name) > 128:
        raise ConfigError(f"certificate name {name[:100]!r} must be 1-128 characters (a node id or user name)")
    try:
        ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
        ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    except ValueError as exc:
        raise ConfigError(
            f"the CA certificate or key does not parse ({exc}); create one with pliant certs create-ca"
        ) from exc
    sans: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    if job:
        sans.append(x509.UniformResourceIdentifier(JOB_URI + job))
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if role is Role.COORDINATOR or hosts:
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject_name(role, name))
        .issuer_name(ca_cert.subject)
        .public_key(public_key)  # type: ignore[arg-type]
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(min(end, ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    return cert.public_bytes(serialization.Encoding.PEM)


def new_csr(role: Role, name: str) -> tuple[bytes, bytes]:
    """A fresh private key and a certificate signing request for ``role``/``name`` made with it.

    Returns:
        (key PEM, CSR PEM): the key never leaves the process that made it; only the request is sent.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    key = _new_key()
    csr = x509.CertificateSigningRequestBuilder().subject_name(subject_name(role, name)).sign(key, hashes.SHA256())
    return _key_pem(key), csr.public_bytes(serialization.Encoding.PEM)


def csr_identity(csr_pem: bytes) -> Identity | None:
    """The role and name a certificate signing request asks for (None: no pliant role).

    Raises:
        ValueError: the request does not parse, or its signature does not verify.
    """
    from cryptography import x509

    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as exc:
        raise ValueError(f"the certificate request is not a PEM PKCS#10 request ({exc})") from None
    if not csr.is_signature_valid:
        raise ValueError("the certificate request's signature does not verify")
    return identity_from_subject(csr.subject)


def sign_csr(ca: IssuedCert, csr_pem: bytes, role: Role, name: str, lifetime_s: float, job: str = "") -> bytes:
    """Sign ``csr_pem`` as a certificate for exactly ``role``/``name`` (of ``job``, when given), valid for
    ``lifetime_s`` from now (never past the CA's own expiry), for client use only.

    Raises:
        ValueError: the request does not parse, its signature does not verify, or it asks for another role or name.
    """
    from cryptography import x509

    asked = csr_identity(csr_pem)
    if asked != Identity(role, name):
        raise ValueError(f"the request asks for {asked or 'no pliant role'}; only the {Identity(role, name)} is signed")
    public_key = x509.load_pem_x509_csr(csr_pem).public_key()
    start = now_utc() - datetime.timedelta(minutes=5)
    return _sign(ca, public_key, role, name, (), start, now_utc() + datetime.timedelta(seconds=lifetime_s), job)


def write_tls_dir(directory: str | os.PathLike[str], ca_cert_pem: bytes, issued: IssuedCert) -> Path:
    """Write ``ca.crt``, ``tls.crt`` and ``tls.key`` (mode 0600) into ``directory`` (created 0700)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    (path / CA_CERT).write_bytes(ca_cert_pem)
    (path / TLS_CERT).write_bytes(issued.cert_pem)
    key_path = path / TLS_KEY
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a file that existed keeps its mode at open: an overwritten key gets this one
    with os.fdopen(fd, "wb") as out:
        out.write(issued.key_pem)
    return path


class LocalCA:
    """A CA whose key lives only in this process, issuing ``--tls-dir`` directories under one folder on demand: the
    ephemeral PKI of ``pliant run``, the tests and the benches.

    Args:
        directory: where ``ca.crt`` and the issued directories go (created 0700).
        lifetime_days: validity of the CA and of what it issues.
        ca: the CA to issue with (its certificate and key); None: a new one.
    """

    def __init__(
        self, directory: str | os.PathLike[str], lifetime_days: float = 365, ca: IssuedCert | None = None
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.lifetime_days = lifetime_days
        self.ca = ca or new_ca("pliant ephemeral CA", lifetime_days)
        (self.directory / CA_CERT).write_bytes(self.ca.cert_pem)
        self._issued: dict[str, TlsConfig] = {}

    def issue(self, sub: str, role: Role, name: str, hosts: Sequence[str] = ()) -> TlsConfig:
        """The TLS directory ``DIRECTORY/sub`` for ``role``/``name``, issued the first time it is asked for."""
        if sub not in self._issued:
            issued = issue_cert(self.ca, role, name, hosts, self.lifetime_days)
            self._issued[sub] = TlsConfig.from_dir(write_tls_dir(self.directory / sub, self.ca.cert_pem, issued))
        return self._issued[sub]
