"""A TLS directory (``--tls-dir`` / ``PLIANT_TLS_DIR``): three PEM files, ``ca.crt`` (the CA every peer is checked
against), ``tls.crt`` (this process's certificate) and ``tls.key`` (its private key), and their checks: each
parses, the key is the certificate's, the CA signed it, it is valid now and names a pliant role
(:mod:`pliant.security.identity`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from pliant.errors import ConfigError
from pliant.security.identity import Identity, Role, identity_from_pem, now_utc

__all__ = ["CA_CERT", "TLS_CERT", "TLS_KEY", "TlsConfig", "TlsMaterial"]

logger = logging.getLogger(__name__)

CA_CERT, TLS_CERT, TLS_KEY = "ca.crt", "tls.crt", "tls.key"


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
        now = now_utc()
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
