"""This node's TCPStores: one long-lived agent store, and, on node rank 0, one fresh store server per generation.

Workers rendezvous through the generation's store (MASTER_ADDR:MASTER_PORT, reached as clients because the env sets
TORCHELASTIC_USE_AGENT_STORE=True), so every generation starts from an empty namespace: torch's env:// init does not
prefix keys by restart count, and stale keys of a dead generation would otherwise hang the next one. The node-rank-0
agent publishes each generation's port in its long-lived store, where the other agents read it.

Every store listens on the node's advertised address only (torch's TCPStore server would listen on every interface):
pliant binds the socket itself and hands it over with ``master_listen_fd``. TCPStore has no authentication; see
docs/operations.md (Security) for what the NetworkPolicy closes.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta

from pliant.agent.contract import AgentError
from pliant.net import parse_host_port

__all__ = ["ARRIVED_KEY", "NodeStore", "reachable"]

logger = logging.getLogger(__name__)

_KEEP = 2  # generation stores kept alive (the current and the previous one)
PORT_ATTEMPT_S = 2.0  # one attempt to read a generation's store port; see NodeStore.generation_port


_RENEWING_KEY = "/pliant/agent/renewing"  # seconds of unbroken membership renewals ("-1": not renewing)
ARRIVED_KEY = "/pliant/arrived"  # a generation store's count of fresh workers about to join it


def _port_key(generation: int) -> str:
    return f"/pliant/gen/{generation}/master_port"


def _listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` only (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def _store_server(host: str, port: int) -> object:
    """A TCPStore server listening on ``host:port`` only. The store owns the socket (it closes it when deleted)."""
    from torch.distributed import TCPStore  # imported here: the agent joins before paying for torch

    sock = _listen(host, port)
    bound = sock.getsockname()[1]
    fd = sock.detach()
    try:
        return TCPStore(host, bound, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30),
                        master_listen_fd=fd, use_libuv=True)  # fmt: skip
    except Exception:
        os.close(fd)
        raise


def reachable(address: str, timeout_s: float = 0.5) -> bool:
    """True if something accepts TCP connections at ``address`` (an agent store)."""
    host, port = parse_host_port(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class NodeStore:
    """The agent's stores.

    Args:
        host: the address other nodes reach this node on.
        port: the long-lived store's port (0: a free one).
    """

    def __init__(self, host: str, port: int = 0) -> None:
        self.host = host
        try:
            self.server = _store_server(host, port)
        except Exception as exc:
            raise AgentError(
                f"cannot start the agent store on {host}:{port} ({exc}); pick another --store-port, or a --host "
                f"that is one of this machine's addresses"
            ) from exc
        self.address = f"{host}:{self.server.port}"  # type: ignore[attr-defined]
        self._generation_stores: dict[int, object] = {}

    def set_renewing(self, streak_s: int) -> None:
        """Tell peers for how long this agent has renewed its membership without a break (-1: it is not renewing);
        see :meth:`peer_renewing`. A duration on this agent's own clock: no clocks are compared across nodes."""
        self.server.set(_RENEWING_KEY, str(streak_s))  # type: ignore[attr-defined]

    @staticmethod
    def peer_renewing(address: str, timeout_s: float = 1.0) -> float:
        """For how long the agent whose store is at ``address`` has renewed its membership without a break (-1 when it
        is not renewing or does not answer)."""
        from torch.distributed import TCPStore

        host, port = parse_host_port(address)
        try:
            client = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
            if not client.check([_RENEWING_KEY]):
                return -1.0
            return float(client.get(_RENEWING_KEY))
        except Exception:  # unreachable, or not an agent store
            return -1.0

    def open_generation(self, generation: int) -> int:
        """Start generation ``generation``'s store server (node rank 0) and publish its port. Returns the port."""
        if generation in self._generation_stores:  # opened already (before the old group stopped)
            return int(self._generation_stores[generation].port)  # type: ignore[attr-defined]
        store = _store_server(self.host, 0)
        self._generation_stores[generation] = store
        for old in sorted(self._generation_stores)[:-_KEEP]:
            del self._generation_stores[old]
        port = int(store.port)  # type: ignore[attr-defined]
        self.server.set(_port_key(generation), str(port))  # type: ignore[attr-defined]
        logger.info("generation %d: store serving on %s:%d", generation, self.host, port)
        return port

    @staticmethod
    def generation_port(store_address: str, generation: int, timeout_s: float,
                        superseded: Callable[[], bool] = lambda: False) -> int:  # fmt: skip
        """Read generation ``generation``'s store port from the agent store of node rank 0 at ``store_address``, in
        attempts of :data:`PORT_ATTEMPT_S`: between them, ``superseded()`` (a newer generation was seen) ends the wait,
        which the agent's main thread would otherwise spend on a node rank 0 that died.

        Raises:
            AgentError: that store did not answer or never published the port within ``timeout_s``, or the
                generation was superseded first.
        """
        from torch.distributed import TCPStore

        host, port = parse_host_port(store_address)
        deadline = time.monotonic() + timeout_s
        while True:
            attempt = max(0.1, min(PORT_ATTEMPT_S, deadline - time.monotonic()))
            try:
                client = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=attempt))
                return int(client.get(_port_key(generation)))
            except Exception as exc:
                if superseded():
                    raise AgentError(f"generation {generation} was superseded while its store port was read from "
                                     f"{store_address}") from exc  # fmt: skip
                if time.monotonic() >= deadline:
                    raise AgentError(
                        f"the agent store of node rank 0 at {store_address} did not give generation {generation}'s "
                        f"store port within {timeout_s:g}s ({type(exc).__name__})"
                    ) from exc

    @staticmethod
    def arrivals(client: object) -> int:
        """How many fresh workers announced that they are about to join the generation whose store ``client``
        (a TCPStore client) reaches; see :func:`pliant.worker.rescale.announce_arrival`."""
        return int(client.add(ARRIVED_KEY, 0))  # type: ignore[attr-defined]

    @staticmethod
    def client(host: str, port: int, timeout_s: float = 5.0) -> object:
        """A TCPStore client of a generation's store."""
        from torch.distributed import TCPStore

        return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))

    def close(self) -> None:
        self._generation_stores.clear()
        del self.server
