"""Mutual TLS for every gRPC channel: certificates that carry a role, loading and checking a TLS directory, and the
gRPC credentials built from it.

A TLS directory (``--tls-dir`` / ``PLIANT_TLS_DIR``) holds three PEM files: ``ca.crt`` (the CA every peer is checked
against), ``tls.crt`` (this process's certificate) and ``tls.key`` (its private key). A certificate's subject names
its role and, for agents, the node id::

    O=pliant, OU=<role>, CN=<name>          role: coordinator | agent | admin; name: the node id for agents

``pliant certs`` (see :mod:`pliant.certs`) creates a CA and issues certificates in this layout, as
``cockroach cert create-ca / create-node / create-client`` do. Keys are ECDSA P-256: a handshake costs well under a
millisecond, which keeps mutual TLS cheap on the control plane's hot paths.
"""

from __future__ import annotations

import argparse
import datetime
import enum
import functools
import ipaddress
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pliant import settings
from pliant.errors import ConfigError

__all__ = [
    "CA_CERT",
    "TLS_CERT",
    "TLS_KEY",
    "Identity",
    "IssuedCert",
    "LocalCA",
    "Role",
    "TlsConfig",
    "TlsMaterial",
    "add_tls_flags",
    "ca_fingerprint",
    "certificate_serial",
    "channel_credentials",
    "csr_identity",
    "identity_from_pem",
    "identity_from_subject",
    "issue_cert",
    "new_ca",
    "new_csr",
    "not_after",
    "peer_certificate",
    "peer_identity",
    "read_token_file",
    "server_credentials",
    "sign_csr",
    "subject_name",
    "tls_from_flags",
    "write_tls_dir",
]

logger = logging.getLogger(__name__)

CA_CERT, TLS_CERT, TLS_KEY = "ca.crt", "tls.crt", "tls.key"
_ORG = "pliant"


class Role(enum.Enum):
    """What a certificate's holder may do. COORDINATOR serves the API (and talks to etcd); AGENT acts for its own node
    only; ADMIN creates, finishes, deletes and reads every job."""

    COORDINATOR = "coordinator"
    AGENT = "agent"
    ADMIN = "admin"


JOB_URI = "urn:pliant:job:"
"""The subject alternative name (a URI) that binds an agent certificate to one job: ``urn:pliant:job:<job id>``."""


@dataclass(frozen=True)
class Identity:
    """Who a verified peer certificate says its holder is.

    Attributes:
        role: its role.
        name: the node id (agents), the replica or user name (others).
        job: the one job an agent certificate acts in (a bootstrap-signed one names it, :data:`JOB_URI`); "": any
            job that has the node id as a member (a certificate an operator made with ``pliant certs``).
    """

    role: Role
    name: str
    job: str = ""

    def __str__(self) -> str:
        return f"{self.role.value} {self.name!r}" + (f" of job {self.job!r}" if self.job else "")


@dataclass(frozen=True)
class IssuedCert:
    """A certificate and its private key, PEM-encoded."""

    cert_pem: bytes
    key_pem: bytes


# ----------------------------------------------------------------------------------------------------------------------
# Issuing (the cryptography package)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


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
        [x509.NameAttribute(NameOID.ORGANIZATION_NAME, _ORG), x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    )
    now = _now()
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
    start = not_before or _now() - datetime.timedelta(minutes=5)
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


def subject_name(role: Role, name: str) -> object:
    """The subject of a pliant certificate: ``O=pliant, OU=<role>, CN=<name>``."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, _ORG),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role.value),
            x509.NameAttribute(NameOID.COMMON_NAME, name),
        ]
    )


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
    start = _now() - datetime.timedelta(minutes=5)
    return _sign(ca, public_key, role, name, (), start, _now() + datetime.timedelta(seconds=lifetime_s), job)


def ca_fingerprint(ca_pem: bytes) -> str:
    """``sha256:<hex>`` of the CA certificate's SubjectPublicKeyInfo (kubeadm's --discovery-token-ca-cert-hash).

    Raises:
        ConfigError: ``ca_pem`` is not a PEM certificate.
    """
    import hashlib

    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate(ca_pem)
    except ValueError as exc:
        raise ConfigError(f"the CA certificate is not a PEM certificate ({exc})") from exc
    spki = cert.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return "sha256:" + hashlib.sha256(spki).hexdigest()


def not_after(cert_pem: bytes) -> datetime.datetime:
    """When a PEM certificate expires (UTC)."""
    from cryptography import x509

    return x509.load_pem_x509_certificate(cert_pem).not_valid_after_utc


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


# ----------------------------------------------------------------------------------------------------------------------
# Loading and checking


@functools.lru_cache(maxsize=4096)
def identity_from_pem(cert_pem: bytes) -> Identity | None:
    """The role, name and job a pliant certificate carries; None when its subject names no pliant role, or it names
    more than one job."""
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        return None
    identity = identity_from_subject(cert.subject)
    if identity is None:
        return None
    try:
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        jobs = [
            u[len(JOB_URI) :] for u in uris.get_values_for_type(x509.UniformResourceIdentifier) if u.startswith(JOB_URI)
        ]
    except x509.ExtensionNotFound:
        jobs = []
    if len(jobs) > 1:
        return None
    return Identity(identity.role, identity.name, jobs[0] if jobs else "")


def identity_from_subject(subject: object) -> Identity | None:
    """The role and name of a certificate's (or request's) subject; None when it names no pliant role."""
    from cryptography.x509.oid import NameOID

    get = subject.get_attributes_for_oid  # type: ignore[attr-defined]
    ous, cns = get(NameOID.ORGANIZATIONAL_UNIT_NAME), get(NameOID.COMMON_NAME)
    if len(ous) != 1 or len(cns) != 1:
        return None
    try:
        role = Role(str(ous[0].value))
    except ValueError:
        return None
    return Identity(role, str(cns[0].value))


@dataclass(frozen=True)
class TlsMaterial:
    """The PEM bytes of a TLS directory, checked, and the identity its certificate carries."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes
    identity: Identity | None  # None only for certificates loaded with need_role=False


@dataclass(frozen=True)
class TlsConfig:
    """Where a process's TLS files are. Build it with :meth:`from_dir`; :meth:`load` reads and checks them.

    Attributes:
        ca: the CA certificate peers are checked against.
        cert: this process's certificate.
        key: its private key.
    """

    ca: str
    cert: str
    key: str

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str]) -> TlsConfig:
        """The standard layout: ``DIR/ca.crt``, ``DIR/tls.crt``, ``DIR/tls.key``.

        Raises:
            ConfigError: the directory does not exist.
        """
        path = Path(directory)
        if not path.is_dir():
            raise ConfigError(
                f"--tls-dir {str(directory)[:200]!r} is not a directory; create one with `pliant certs` "
                f"(ca.crt, tls.crt, tls.key) or pass --insecure to run without TLS"
            )
        return cls(str(path / CA_CERT), str(path / TLS_CERT), str(path / TLS_KEY))

    def load(self, expect: Role | None = None, need_role: bool = True) -> TlsMaterial:
        """Read and check the files: each parses, the key matches the certificate, the CA signed it, it is valid now
        and names a pliant role (``expect`` when given; none needed with ``need_role=False``, e.g. for etcd's own
        certificates).

        Raises:
            ConfigError: naming the file and the fix.
        """
        from cryptography import x509
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization

        fix = "create it with `pliant certs` (see docs/operations.md, Security)"
        pems = []
        for what, path in (("CA certificate", self.ca), ("certificate", self.cert), ("private key", self.key)):
            try:
                data = Path(path).read_bytes()
            except OSError as exc:
                raise ConfigError(f"TLS {what} {path} cannot be read ({exc.strerror}); {fix}") from exc
            if not data.strip():
                raise ConfigError(f"TLS {what} {path} is empty; {fix}")
            pems.append(data)
        ca_pem, cert_pem, key_pem = pems
        try:
            ca = x509.load_pem_x509_certificate(ca_pem)
        except ValueError as exc:
            raise ConfigError(f"TLS CA certificate {self.ca} is not a PEM certificate ({exc}); {fix}") from exc
        try:
            cert = x509.load_pem_x509_certificate(cert_pem)
        except ValueError as exc:
            raise ConfigError(f"TLS certificate {self.cert} is not a PEM certificate ({exc}); {fix}") from exc
        try:
            key = serialization.load_pem_private_key(key_pem, password=None)
        except (ValueError, TypeError) as exc:
            raise ConfigError(
                f"TLS private key {self.key} is not an unencrypted PEM private key ({exc}); {fix}"
            ) from exc
        spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        if key.public_key().public_bytes(*spki) != cert.public_key().public_bytes(*spki):
            raise ConfigError(f"TLS private key {self.key} does not belong to certificate {self.cert}; {fix}")
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature) as exc:
            raise ConfigError(
                f"TLS certificate {self.cert} was not issued by the CA in {self.ca}; use certificates from one CA"
            ) from exc
        now = _now()
        for what, path, item in (("certificate", self.cert, cert), ("CA certificate", self.ca, ca)):
            if item.not_valid_after_utc < now:
                raise ConfigError(
                    f"TLS {what} {path} expired on {item.not_valid_after_utc:%Y-%m-%d %H:%M} UTC; "
                    f"issue a new one with `pliant certs`"
                )
            if item.not_valid_before_utc > now:
                raise ConfigError(
                    f"TLS {what} {path} is not valid before {item.not_valid_before_utc:%Y-%m-%d %H:%M} "
                    f"UTC; check this machine's clock"
                )
        identity = identity_from_pem(cert_pem)
        if identity is None and need_role:
            raise ConfigError(
                f"TLS certificate {self.cert} names no pliant role (subject {cert.subject.rfc4514_string()[:100]}); "
                f"issue it with `pliant certs create-coordinator|create-agent|create-admin`"
            )
        if expect is not None and identity.role is not expect:
            article = "an" if expect.value[0] in "aeiou" else "a"
            raise ConfigError(
                f"TLS certificate {self.cert} is for {identity}, but this command needs {article} {expect.value} "
                f"certificate; pass the --tls-dir of {article} {expect.value} (pliant certs create-{expect.value})"
            )
        days_left = (cert.not_valid_after_utc - now).days
        if days_left < 30:
            logger.warning(
                "TLS certificate %s expires in %d days; issue a new one with `pliant certs`", self.cert, days_left
            )
        return TlsMaterial(ca_pem, cert_pem, key_pem, identity)

    def mtimes(self) -> tuple[float, ...]:
        """Modification times of the three files (0 for a missing one): a change means rotated certificates."""
        out = []
        for path in (self.ca, self.cert, self.key):
            try:
                out.append(os.stat(path).st_mtime)
            except OSError:
                out.append(0.0)
        return tuple(out)


# ----------------------------------------------------------------------------------------------------------------------
# gRPC credentials


def server_credentials(config: TlsConfig, material: TlsMaterial, bootstrap: bool = False) -> object:
    """Server credentials that require a client certificate from the CA, and pick up rotated files by themselves.

    The files are checked again whenever their modification time changes (gRPC asks before each handshake); a
    rotation that does not load keeps the previous certificates and logs why. With ``bootstrap``: the credentials of
    the bootstrap join's port, which ask for no client certificate and present the CA after the server's own
    certificate (a joining node pins it; :mod:`pliant.bootstrap`).
    """
    import grpc

    def build(m: TlsMaterial) -> object:
        if bootstrap:
            chain = m.cert_pem.rstrip(b"\n") + b"\n" + m.ca_pem
            return grpc.ssl_server_certificate_configuration([(m.key_pem, chain)])
        return grpc.ssl_server_certificate_configuration([(m.key_pem, m.cert_pem)], root_certificates=m.ca_pem)

    seen = [config.mtimes()]

    def fetch() -> object | None:
        mtimes = config.mtimes()
        if mtimes == seen[0]:
            return None
        seen[0] = mtimes
        try:
            fresh = config.load(expect=material.identity.role if material.identity else None)
        except ConfigError as exc:
            logger.error("rotated TLS files not used: %s", exc)
            return None
        logger.info("TLS certificates reloaded from %s", config.cert)
        return build(fresh)

    return grpc.dynamic_ssl_server_credentials(build(material), fetch, require_client_authentication=not bootstrap)


def channel_credentials(material: TlsMaterial) -> object:
    """Client credentials: check the server against the CA, present this process's certificate."""
    import grpc

    return grpc.ssl_channel_credentials(
        root_certificates=material.ca_pem, private_key=material.key_pem, certificate_chain=material.cert_pem
    )


def peer_identity(context: object) -> Identity | None:
    """The identity of the peer of a gRPC server call (None on a plaintext channel or without a pliant role)."""
    pem = peer_certificate(context)
    return identity_from_pem(pem) if pem else None


def peer_certificate(context: object) -> bytes | None:
    """The PEM client certificate of the peer of a gRPC server call (None on a plaintext channel)."""
    auth: Callable[[], dict[str, list[bytes]]] = context.auth_context  # type: ignore[attr-defined]
    pems = auth().get("x509_pem_cert")
    return pems[0] if pems else None


@functools.lru_cache(maxsize=4096)
def certificate_serial(cert_pem: bytes) -> int:
    """A PEM certificate's serial number."""
    from cryptography import x509

    return x509.load_pem_x509_certificate(cert_pem).serial_number


# ----------------------------------------------------------------------------------------------------------------------
# Command-line flags


def add_tls_flags(parser: argparse.ArgumentParser, role: str) -> None:
    """Add ``--tls-dir`` (env ``PLIANT_TLS_DIR``) and ``--insecure`` to a command run as ``role``."""
    parser.add_argument(
        "--tls-dir",
        default=settings.TLS_DIR.flag_default(),
        help=f"directory with ca.crt, tls.crt and tls.key of a{'n' if role[0] in 'aeiou' else ''} {role} certificate "
        f"(env PLIANT_TLS_DIR; create them with `pliant certs`)",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="plaintext gRPC without certificates: anyone who reaches the coordinator can do anything (not for "
        "shared networks)",
    )


def tls_from_flags(tls_dir: str | None, insecure: bool, command: str) -> TlsConfig | None:
    """The TLS files named by ``--tls-dir``, or None with ``--insecure`` (logged as a warning).

    Raises:
        ConfigError: neither or both were given, or the directory does not exist.
    """
    if tls_dir and insecure:
        raise ConfigError("--tls-dir (or PLIANT_TLS_DIR) and --insecure contradict each other; drop one")
    if insecure:
        logger.warning("%s --insecure: gRPC in plaintext, no certificates checked", command)
        return None
    if not tls_dir:
        raise ConfigError(
            f"TLS is required for `pliant {command}`: pass --tls-dir DIR (or set PLIANT_TLS_DIR) with ca.crt, tls.crt "
            f"and tls.key (create them with `pliant certs`), or --insecure for plaintext"
        )
    return TlsConfig.from_dir(tls_dir)


def read_token_file(path: str) -> str:
    """The join token in ``path`` (surrounding whitespace removed).

    Raises:
        ConfigError: the file cannot be read or is empty.
    """
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"join token file {path} cannot be read ({exc.strerror}); check the path") from exc
    if not token:
        raise ConfigError(
            f"join token file {path} is empty; write the job's token into it (pliant job create --write-token {path})"
        )
    return token
