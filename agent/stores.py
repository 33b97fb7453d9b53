"""This node's TCPStores: one long-lived agent store, and, on node rank 0, one fresh store server per generation.

Workers rendezvous through the generation's store (MASTER_ADDR:MASTER_PORT, reached as clients because the env sets
TORCHELASTIC_USE_AGENT_STORE=True), so every generation starts from an empty namespace: torch's env:// init does not
prefix keys by restart count, and stale keys of a dead generation would otherwise hang the next one. The node-rank-0
agent publishes each generation's port in its long-lived store, where the other agents read it.

Every store listens on the node's advertised address only (torch's TCPStore server would listen on every interface):
the store host binds the socket itself and hands it over with ``master_listen_fd``. The stores run in the store host
(:mod:`pliant.agent.storehost`), so that the agent never imports torch.

TCPStore has no authentication: anyone who reaches a store's port (another local user, another host) may read and
write its keys. The records pliant's agents act on are therefore sealed with the job's agent key
(:func:`pliant.security.seal.tag` under :func:`pliant.security.seal.agent_key`, which only agents hold: not their
workers): ``/pliant/gen/<N>/master_port`` is ``"<port> <tag(key, "port", N, port)>"`` and ``/pliant/agent/renewing`` is
``"<streak> <generation> <tag(key, "renewing", streak, generation)>"``. A record whose seal does not hold is taken as
absent (a port not yet published; a peer that does not answer), so nobody but a member's agent steers where workers
meet or how the self-fence votes. Torch's own rendezvous keys in a generation store are
not sealed (torch writes them); docs/operations.md (Security) says what closes the ports.
"""

from __future__ import annotations

import hmac
import logging
import socket
import time
from collections.abc import Callable

from pliant.agent.contract import AgentError
from pliant.agent.storehost import REPLY_MARGIN_S, START_TIMEOUT_S, StoreHost, StoreHostError, listen
from pliant.net import parse_host_port
from pliant.ports import GENERATION_PORTS, generation_port
from pliant.security.seal import tag

__all__ = ["ARRIVED_KEY", "RESTARTING_KEY", "WARM_KEY", "NodeStore", "reachable", "reserve"]

logger = logging.getLogger(__name__)

_KEEP = GENERATION_PORTS - 1  # generation stores kept alive (the current and the previous one)
PORT_ATTEMPT_S = 2.0  # one attempt to read a generation's store port; see NodeStore.generation_port


_RENEWING_KEY = "/pliant/agent/renewing"  # "<seconds of unbroken renewals (-1: none)> <newest generation seen>"
ARRIVED_KEY = "/pliant/arrived"  # a generation store's count of fresh workers about to join it
# A generation store's count of the workers its nodes' agents are about to fork for it (their zygote's imports done):
# a join by the restart path waits for its newcomers' (their warm-up) before the survivors stop. Any worker of the job
# can add to it, and gains nothing by it: the survivors then restart sooner, as they would without the wait.
WARM_KEY = "/pliant/warm"
# How many nodes of a generation wait for its newcomers before they restart into it (a join by the restart path): a
# newcomer's workers then start only once every node counted in at WARM_KEY, after the others saved and restarted, so
# that no worker reads a checkpoint older than the one the rescale saves. A worker that adds to it delays its own
# job's newcomers by the rescale and stop graces at most.
RESTARTING_KEY = "/pliant/restarting"


def _port_key(generation: int) -> str:
    return f"/pliant/gen/{generation}/master_port"


def reachable(address: str, timeout_s: float = 0.5) -> bool:
    """True if something accepts TCP connections at ``address`` (an agent store)."""
    host, port = parse_host_port(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def reserve(host: str, port: int = 0) -> socket.socket:
    """The long-lived store's listening socket on ``host:port`` (0: a free port), bound by the agent before it joins:
    the port it announces is then its own, whatever else on the machine binds or connects while its store host still
    imports torch (a free port picked and bound later was taken in between once, by another process's connection).
    Peers that connect early wait in its backlog.

    Raises:
        AgentError: the port is taken, or ``host`` is not this machine's.
    """
    try:
        return listen(host, port)
    except OSError as exc:
        raise AgentError(
            f"cannot start the agent store on {host}:{port} ({exc}); pick another --store-port, or a "
            f"--host that is one of this machine's addresses"
        ) from exc


class NodeStore:
    """The agent's stores, run by its store host (:mod:`pliant.agent.storehost`).

    Args:
        stores: the store host.
        host: the address other nodes reach this node on.
        port: the long-lived store's listening socket (:func:`reserve`; handed to the host and closed here), or its
            port (0: a free one).
        store_port: the agent's fixed store port (``--store-port``): the generation stores use the ports after it
            in turn (:func:`pliant.ports.generation_port`; the two kept open and the next never share one), so that a
            firewall can be opened ahead; 0: free ports.
    """

    def __init__(self, stores: StoreHost, host: str, port: int | socket.socket = 0, store_port: int = 0) -> None:
        self.stores = stores
        self.host = host
        listening = reserve(host, port) if isinstance(port, int) else port
        wanted = int(listening.getsockname()[1])
        try:
            bound = int(stores.request("serve", START_TIMEOUT_S, fds=(listening.fileno(),), host=host, port=wanted))
        except StoreHostError as exc:
            raise AgentError(f"cannot start the agent store on {host}:{wanted} ({exc})") from exc
        finally:
            listening.close()  # the host holds its own descriptor of it
        self.address = f"{host}:{bound}"
        self._generation_ports: dict[int, int] = {}
        self._store_port = store_port
        self.key = b""  # the job's agent key, set once the agent joined (its main thread), before any record is written

    def set_renewing(self, streak_s: int, generation: int = 0) -> None:
        """Tell peers for how long this agent has renewed its membership without a break (-1: it is not renewing),
        and the newest generation it has seen; see :meth:`peer_renewing`. A duration on this agent's own clock: no
        clocks are compared across nodes."""
        seal = tag(self.key, "renewing", streak_s, generation)
        self.stores.request(
            "set", REPLY_MARGIN_S, address=self.address, key=_RENEWING_KEY, value=f"{streak_s} {generation} {seal}"
        )

    def peer_renewing(self, address: str, timeout_s: float = 1.0) -> tuple[float, int]:
        """(for how long the agent whose store is at ``address`` has renewed its membership without a break, the
        newest generation it has seen): (-1, -1) when it does not answer, the streak -1 when it is not renewing, the
        generation -1 when its agent does not say (an older version)."""
        try:
            value = self.stores.request(
                "get", timeout_s + REPLY_MARGIN_S, address=address, key=_RENEWING_KEY, timeout=timeout_s, check=True
            )
            if value is None:
                return -1.0, -1
            streak, generation, seal = str(value).split(" ")
            if not hmac.compare_digest(seal, tag(self.key, "renewing", streak, generation)):
                logger.warning(
                    "the renewal record in the agent store at %s is not sealed with the job's agent key; ignored",
                    address,
                )
                return -1.0, -1
            return float(streak), int(generation)
        except (StoreHostError, ValueError):  # unreachable, or not an agent store
            return -1.0, -1

    def longest_renewing(self, addresses: list[str]) -> tuple[float, int]:
        """The longest streak of :meth:`peer_renewing` over the agent stores at ``addresses``, and the newest
        generation any of them has seen ((-1, -1) if none answers)."""
        answers = [self.peer_renewing(address) for address in addresses]
        return max([-1.0, *(streak for streak, _ in answers)]), max([-1, *(seen for _, seen in answers)])

    def open_generation(self, generation: int) -> int:
        """Start generation ``generation``'s store server (node rank 0) and publish its port. Returns the port."""
        if generation in self._generation_ports:  # opened already (before the old group stopped)
            return self._generation_ports[generation]
        wanted = generation_port(self._store_port, generation)
        try:
            port = int(self.stores.request("serve", START_TIMEOUT_S, host=self.host, port=wanted))
        except StoreHostError as exc:
            if not wanted:
                raise
            why = f"store port {wanted} is taken ({exc})"
            logger.warning("generation %d: %s; serving on a free port instead", generation, why)
            port = int(self.stores.request("serve", START_TIMEOUT_S, host=self.host, port=0))
        self._generation_ports[generation] = port
        for old in sorted(self._generation_ports)[:-_KEEP]:
            self.stores.request("close", REPLY_MARGIN_S, port=self._generation_ports.pop(old))
        self.stores.request(
            "set",
            REPLY_MARGIN_S,
            address=self.address,
            key=_port_key(generation),
            value=f"{port} {tag(self.key, 'port', generation, port)}",
        )
        logger.info("generation %d: store serving on %s:%d", generation, self.host, port)
        return port

    def generation_port(
        self, store_address: str, generation: int, timeout_s: float, superseded: Callable[[], bool] = lambda: False
    ) -> int:
        """Read generation ``generation``'s store port from the agent store of node rank 0 at ``store_address``, in
        attempts of :data:`PORT_ATTEMPT_S`: between them, ``superseded()`` (a newer generation was seen) ends the wait,
        which the agent's main thread would otherwise spend on a node rank 0 that died.

        Raises:
            AgentError: that store did not answer or never published the port within ``timeout_s``, or the
                generation was superseded first.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            attempt = max(0.1, min(PORT_ATTEMPT_S, deadline - time.monotonic()))
            started = time.monotonic()
            try:
                value = self.stores.request(
                    "get", attempt + REPLY_MARGIN_S, address=store_address, key=_port_key(generation), timeout=attempt
                )
                return self._sealed_port(str(value), generation, store_address)
            except (StoreHostError, TypeError, ValueError) as exc:
                if superseded():
                    raise AgentError(
                        f"generation {generation} was superseded while its store port was read from {store_address}"
                    ) from exc
                if time.monotonic() >= deadline:
                    raise AgentError(
                        f"the agent store of node rank 0 at {store_address} did not give generation {generation}'s "
                        f"store port within {timeout_s:g}s ({exc})"
                    ) from exc
                time.sleep(max(0.0, min(0.1, attempt - (time.monotonic() - started))))  # a refused connect: not a spin

    def _sealed_port(self, value: str, generation: int, store_address: str) -> int:
        """The port in a generation's port record.

        Raises:
            ValueError: the record is not sealed with the job's agent key (someone else wrote it: it is not the port).
        """
        port, _, seal = value.partition(" ")
        if not hmac.compare_digest(seal, tag(self.key, "port", generation, port)):
            raise ValueError(
                f"the port record of generation {generation} at {store_address} is not sealed with the "
                f"job's agent key (written by another process than its agent)"
            )
        return int(port)

    def arrivals(self, host: str, port: int, key: str = ARRIVED_KEY) -> int:
        """How many fresh workers announced that they are about to join the generation whose store is at
        ``host:port`` (see :func:`pliant.worker.inplace.groups.announce_arrival`), or with ``key`` :data:`WARM_KEY`
        how many workers the nodes' agents are about to fork for it (:meth:`count_in`). The host keeps the client for
        the next poll.

        Raises:
            StoreHostError: that store is not reachable (yet).
        """
        return self.count_in(host, port, key, 0)

    def count_in(self, host: str, port: int, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key`` of the generation store at ``host:port``; returns its new value.

        Raises:
            StoreHostError: that store is not reachable (yet).
        """
        return int(
            self.stores.request(
                "add", 1.0 + REPLY_MARGIN_S, address=f"{host}:{port}", key=key, amount=amount, timeout=1.0, keep=True
            )
        )

    def close(self) -> None:
        for port in self._generation_ports.values():
            try:
                self.stores.request("close", REPLY_MARGIN_S, port=port)
            except StoreHostError:
                break  # the host is gone, and its servers with it
        self._generation_ports.clear()
