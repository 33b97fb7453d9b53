"""The PKI of one ``pliant run`` with its embedded control plane: secure by default, with no step to take.

At start the run makes an ephemeral CA. Its key stays in this process's memory (the embedded coordinator signs the
agent certificates of joining nodes with it: the bootstrap join, :mod:`pliant.bootstrap`) and dies with the run, and
with every node that holds a seat of the control plane (:mod:`pliant.agent.seat`), which gets it over mutual TLS. Into
the run's certificates directory go:

- ``ca.crt``: the CA certificate (its fingerprint is the join command's ``--ca-cert-hash``);
- ``coordinator/``: the embedded coordinator's server certificate, for loopback, this host's name and addresses and
  the address the run advertises;
- ``admin/``: an admin certificate (the run creates its job with it; ``pliant status --tls-dir DIR/admin`` uses it);
- ``self/``: this node's agent certificate, naming its node id;
- ``etcd/``: the embedded etcd's own PKI, from a second ephemeral CA that signs nothing else: ``etcd/server/`` (etcd's
  certificate, for loopback and the addresses the run advertises: its members on other nodes reach it there) and
  ``etcd/client/`` (the coordinator's, the only kind of client etcd accepts). No agent or admin certificate opens
  etcd.

Each holds ``ca.crt``, ``tls.crt`` and ``tls.key``, the ``--tls-dir`` layout. Nothing in it is needed on another
machine: joining nodes make their own keys.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pliant import scratch
from pliant.coordinator.etcd_server import MEMBER_CN
from pliant.security.identity import Role, ca_fingerprint
from pliant.security.issuance import IssuedCert, LocalCA
from pliant.security.tlsdir import TlsConfig

__all__ = ["SCRATCH_KIND", "RunCerts", "make_run_certs"]

SCRATCH_KIND = "pliant-certs-"
"""Where a run's certificates go without ``--certs-dir``: a scratch directory (:mod:`pliant.scratch`), removed
when the run ends or, after a kill -9, by the next run's start."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunCerts:
    """Where the run's certificates are, and the CA that signs joining nodes' certificates.

    Attributes:
        directory: the run's certificates directory.
        ca: the CA certificate and its key (in memory only).
        fingerprint: ``sha256:<hex>`` of the CA's public key, the join command's pin.
        coordinator: the embedded coordinator's TLS files.
        admin: the run's admin certificate.
        agent: this node's agent certificate.
        etcd_server: the embedded etcd's server certificate (clients and its peer port need one of etcd's CA).
        etcd_client: the embedded coordinator's etcd client certificate.
        etcd_ca: etcd's CA and its key (in memory only; a node that takes a control-plane seat gets it, to issue its
            member's certificate).
    """

    directory: Path
    ca: IssuedCert
    fingerprint: str
    coordinator: TlsConfig
    admin: TlsConfig
    agent: TlsConfig
    etcd_server: TlsConfig
    etcd_client: TlsConfig
    etcd_ca: IssuedCert = field(repr=False)


def _server_hosts(hosts: Sequence[str]) -> list[str]:
    names = ["127.0.0.1", "localhost", "::1"]
    name = socket.gethostname()
    names.append(name)
    with contextlib.suppress(OSError):
        names += sorted({info[4][0] for info in socket.getaddrinfo(name, None)})
    names += [h for h in hosts if h not in ("", "0.0.0.0", "::")]
    return list(dict.fromkeys(h.split("%")[0] for h in names))


def make_run_certs(directory: str, node_id: str, hosts: Sequence[str]) -> RunCerts:
    """Create the run's CA and certificates in ``directory`` (a new scratch directory when "").

    Args:
        directory: where to write them; created with mode 0700.
        node_id: this node's id (its agent certificate's name).
        hosts: the addresses the embedded coordinator is reached on (added to its certificate's names).
    """
    path = Path(directory).resolve() if directory else Path(scratch.make(SCRATCH_KIND))
    ca = LocalCA(path, lifetime_days=90)
    coordinator = ca.issue("coordinator", Role.COORDINATOR, "embedded", _server_hosts(hosts))
    admin = ca.issue("admin", Role.ADMIN, "run-admin")
    agent = ca.issue("self", Role.AGENT, node_id)
    etcd_ca = LocalCA(path / "etcd", lifetime_days=90)
    etcd_server = etcd_ca.issue("server", Role.COORDINATOR, MEMBER_CN, _server_hosts(hosts))
    etcd_client = etcd_ca.issue("client", Role.COORDINATOR, "etcd-client")
    logger.info("run certificates (ephemeral CAs) in %s: coordinator, admin, self, etcd", path)
    return RunCerts(
        path, ca.ca, ca_fingerprint(ca.ca.cert_pem), coordinator, admin, agent, etcd_server, etcd_client, etcd_ca.ca
    )
