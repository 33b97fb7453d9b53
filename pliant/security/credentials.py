"""gRPC credentials from a TLS directory: mutual TLS for every channel (a server that requires a client certificate
from its CA and picks up rotated files by itself; a client that checks the server against the CA), the Bootstrap
port's server-only TLS, and the identity of a call's peer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pliant.errors import ConfigError
from pliant.security.identity import Identity, identity_from_pem
from pliant.security.tlsdir import TlsConfig, TlsMaterial

__all__ = ["channel_credentials", "peer_certificate", "peer_identity", "server_credentials"]

logger = logging.getLogger(__name__)


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
