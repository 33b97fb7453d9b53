"""Who a pliant certificate says its holder is: a role (coordinator, agent, admin), a name (a node id for agents) and,
for an agent certificate signed by bootstrap, the one job it acts in. A certificate's subject names its role and its
name::

    O=pliant, OU=<role>, CN=<name>          role: coordinator | agent | admin; name: the node id for agents

and a job-bound agent certificate carries ``urn:pliant:job:<job>`` (:data:`JOB_URI`) as a URI subject alternative
name. Also read here: a certificate's expiry and serial, and a CA's fingerprint (the pin a join line carries).
"""

from __future__ import annotations

import datetime
import enum
import functools
from dataclasses import dataclass

from pliant.errors import ConfigError

__all__ = [
    "JOB_URI",
    "ORG",
    "Identity",
    "Role",
    "ca_fingerprint",
    "certificate_serial",
    "identity_from_pem",
    "identity_from_subject",
    "not_after",
    "now_utc",
    "subject_name",
]

ORG = "pliant"
"""The organisation every pliant certificate's subject names."""


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


def now_utc() -> datetime.datetime:
    """The time now, in UTC (certificates' validity is in UTC)."""
    return datetime.datetime.now(datetime.timezone.utc)


def subject_name(role: Role, name: str) -> object:
    """The subject of a pliant certificate: ``O=pliant, OU=<role>, CN=<name>``."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORG),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role.value),
            x509.NameAttribute(NameOID.COMMON_NAME, name),
        ]
    )


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


@functools.lru_cache(maxsize=4096)
def certificate_serial(cert_pem: bytes) -> int:
    """A PEM certificate's serial number."""
    from cryptography import x509

    return x509.load_pem_x509_certificate(cert_pem).serial_number


def not_after(cert_pem: bytes) -> datetime.datetime:
    """When a PEM certificate expires (UTC)."""
    from cryptography import x509

    return x509.load_pem_x509_certificate(cert_pem).not_valid_after_utc
