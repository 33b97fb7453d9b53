"""Which port is which: every port pliant derives from another one, in one place.

A control plane's seat (``pliant coordinator`` with a signing CA, ``pliant run``'s embedded control plane, a seat
taken by another node) listens on a block of ports from its API port P, the one ``--listen`` and the join line name:

====== ==========================================================================================
P      the coordinator's gRPC API
P + 1  the Bootstrap service: a node that joins by bootstrap fetches the CA and its certificate there
P + 2  its etcd member's client port (the other seats' replicas reach it)
P + 3  its etcd member's peer port
====== ==========================================================================================

An agent with a fixed store port S (``--store-port``) serves the stores of the generations it is node rank 0 of on
the :data:`GENERATION_PORTS` ports after it, in turn (S + 1 + generation mod :data:`GENERATION_PORTS`), so that a
firewall can name them all; without one, every store takes a free port.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from pliant.errors import ConfigError
from pliant.net import cannot_listen, free_port

__all__ = ["GENERATION_PORTS", "SeatPorts", "free_api_port", "generation_port"]

GENERATION_PORTS = 3
"""How many generation stores one agent serves at once (the two newest and the next), each on a port of its own."""


@dataclass(frozen=True)
class SeatPorts:
    """The ports of one control-plane seat (0: a free one, picked when the service starts)."""

    api: int
    bootstrap: int
    etcd_client: int
    etcd_peer: int

    @classmethod
    def of(cls, api: int) -> SeatPorts:
        """The block of ports from ``api`` (none fixed when ``api`` is 0)."""
        if not api:
            return cls(0, 0, 0, 0)
        return cls(api, api + 1, api + 2, api + 3)

    def described(self) -> tuple[tuple[int, str], ...]:
        """Each fixed port after the API's, with what it is in words (for a message about a port that is taken)."""
        if not self.api:
            return ()
        return (
            (self.bootstrap, "--listen's port + 1 (the bootstrap join's port)"),
            (self.etcd_client, "--listen's port + 2 (etcd's client port)"),
            (self.etcd_peer, "--listen's port + 3 (etcd's peer port)"),
        )

    def free_on(self, host: str) -> bool:
        """Whether every port of the block can be listened on at ``host`` now."""
        return not any(
            cannot_listen(host, port) for port in (self.api, self.bootstrap, self.etcd_client, self.etcd_peer)
        )


def bootstrap_of(api: int) -> int:
    """The Bootstrap service's port of a coordinator whose API listens on ``api``."""
    return SeatPorts.of(api).bootstrap


def free_api_port(host: str = "127.0.0.1", attempts: int = 50) -> int:
    """An API port P such that P and its Bootstrap port are both free on ``host`` right now.

    Raises:
        ConfigError: no such pair was found.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(attempts):
        port = free_port(host)
        if port >= 65535:
            continue
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, bootstrap_of(port)))
            except OSError:
                continue
        return port
    raise ConfigError(f"no two adjacent free ports on {host}; pass --listen {host}:PORT with PORT and PORT+1 free")


def generation_port(store_port: int, generation: int) -> int:
    """The port ``generation``'s store takes at an agent whose store port is ``store_port`` (0: a free one)."""
    return store_port + 1 + generation % GENERATION_PORTS if store_port else 0
