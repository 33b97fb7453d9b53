"""The certificates of one ``pliant run`` with its embedded control plane: secure by default, with no step to take.

At start the run makes an ephemeral CA (its key stays in memory and dies with the run) and issues, into the run's
certificates directory:

- ``coordinator/``: the embedded coordinator's server certificate, for loopback, this host's name and addresses;
- ``admin/``: an admin certificate (the run creates its job with it; ``pliant status --tls-dir DIR/admin`` uses it);
- ``self/``: this node's agent certificate, naming its node id;
- ``join-1/`` .. ``join-K/``: an agent certificate for each node that may join (node ids ``join-1`` ..), which the
  printed join command passes as ``--tls-dir``.

Each holds ``ca.crt``, ``tls.crt`` and ``tls.key``, the ``--tls-dir`` layout.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pliant.tls import LocalCA, Role, TlsConfig

__all__ = ["MAX_JOIN_BUNDLES", "RunCerts", "make_run_certs"]

logger = logging.getLogger(__name__)

MAX_JOIN_BUNDLES = 16


@dataclass(frozen=True)
class RunCerts:
    """Where the run's certificates are."""

    directory: Path
    coordinator: TlsConfig
    admin: TlsConfig
    agent: TlsConfig
    joiners: tuple[Path, ...]


def _server_hosts(listen_host: str) -> list[str]:
    hosts = ["127.0.0.1", "localhost", "::1"]
    name = socket.gethostname()
    hosts.append(name)
    with contextlib.suppress(OSError):
        hosts += sorted({info[4][0] for info in socket.getaddrinfo(name, None)})
    if listen_host not in ("", "0.0.0.0", "::"):
        hosts.append(listen_host)
    return list(dict.fromkeys(h.split("%")[0] for h in hosts))


def make_run_certs(directory: str, node_id: str, listen_host: str, joiners: int) -> RunCerts:
    """Create the run's CA and certificates in ``directory`` (a new temporary one when "").

    Args:
        directory: where to write them; created with mode 0700.
        node_id: this node's id (its agent certificate's name).
        listen_host: the host the embedded coordinator listens on (added to its certificate's names).
        joiners: how many other nodes get a certificate (capped at MAX_JOIN_BUNDLES).
    """
    path = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="pliant-certs-"))
    ca = LocalCA(path, lifetime_days=90)
    coordinator = ca.issue("coordinator", Role.COORDINATOR, "embedded", _server_hosts(listen_host))
    admin = ca.issue("admin", Role.ADMIN, "run-admin")
    agent = ca.issue("self", Role.AGENT, node_id)
    count = min(joiners, MAX_JOIN_BUNDLES)
    bundles = tuple(Path(ca.issue(f"join-{i}", Role.AGENT, f"join-{i}").cert).parent for i in range(1, count + 1))
    logger.info("run certificates (ephemeral CA) in %s: coordinator, admin, self, %d join bundles", path, len(bundles))
    return RunCerts(path, coordinator, admin, agent, bundles)
