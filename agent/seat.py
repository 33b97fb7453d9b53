"""A node's seat in an embedded control plane (:mod:`pliant.coordinator.seats`): it asks for one until it holds one
or the seats are full, then runs the etcd member and the coordinator replica the seat holds until the agent stops.

The node listens for them on its own address (the one it advertises): the coordinator on the port the node joined
the control plane with when it is free here (the Bootstrap service on the next one), etcd's client and peer ports on
the two after (free ones where those are taken). What it gets with the seat (the run's CA and etcd's CA with their
keys, the sealing root) goes into a directory only this user reads, and the certificates it issues itself from those
CAs name its address.

Thread ownership: :meth:`SeatHolder.run` runs on its own thread, which starts ``etcd`` and ``coordinator`` and lives
until :meth:`SeatHolder.close` (the agent's main thread, at exit) sets ``stop``, joins it, and stops them: the etcd
member is started with a parent-death signal, which the kernel sends when the thread that started it ends.
"""

from __future__ import annotations

import logging
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry

from pliant.backoff import Backoff
from pliant.coordinator.client import CoordinatorClient
from pliant.coordinator.contract import CoordinatorError, FailedPrecondition
from pliant.coordinator.etcd_server import EtcdServer
from pliant.coordinator.seat_keeper import SeatKit
from pliant.coordinator.server import CoordinatorConfig, CoordinatorServer
from pliant.coordinator.signer import Signer
from pliant.net import free_port, free_port_pair, parse_host_port
from pliant.tls import IssuedCert, LocalCA, Role
from pliant.v1 import coordinator_pb2 as pb

__all__ = ["SeatHolder", "seat_ports"]

logger = logging.getLogger(__name__)

ASK_EVERY_S = (1.0, 5.0)  # a node without a seat asks again after this backoff (first, longest)


def _free(host: str, port: int) -> bool:
    if not 0 < port < 65536:
        return False
    try:
        socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET).close()
    except OSError:
        return False
    return True


def seat_ports(host: str, joined_port: int) -> tuple[int, int, int]:
    """Where a seat's coordinator, etcd client and etcd peer listen on ``host``: ``joined_port`` (the control plane's
    port the node joined on; the Bootstrap service on the next) and the two after, when all four are free here (the
    ports a firewall already opens), else free ones."""
    block = [joined_port + i for i in range(4)]
    if all(_free(host, port) for port in block):
        return block[0], block[2], block[3]
    return free_port_pair(host), free_port(host), free_port(host)


class SeatHolder:
    """This node's seat: asked for on :meth:`run`'s thread, held until :meth:`close`.

    Args:
        job: the job this node is a member of.
        node_id: this node's id (its etcd member's name and its replica's id).
        host: the address this node advertises; the seat listens there.
        client: the agent's coordinator client.
        registry: where the replica's metrics go (the node's endpoint).
        said: called with a line for the console when the seat is taken.
    """

    def __init__(
        self,
        job: str,
        node_id: str,
        host: str,
        client: CoordinatorClient,
        registry: CollectorRegistry,
        said: Callable[[str], None],
    ) -> None:
        self.job = job
        self.node_id = node_id
        self.host = host
        self.client = client
        self.registry = registry
        self.said = said
        self.stop = threading.Event()
        self.etcd: EtcdServer | None = None
        self.coordinator: CoordinatorServer | None = None
        self.directory = Path(tempfile.mkdtemp(prefix="pliant-seat-"))
        self._thread = threading.Thread(target=self.run, name="seat", daemon=True)

    def start(self) -> SeatHolder:
        self._thread.start()
        return self

    def run(self) -> None:
        """Ask for a seat until granted (then take it), the seats are full, or the agent stops."""
        port = parse_host_port(self.client.targets[0], what="--coordinator")[1]
        ports = seat_ports(self.host, port)
        backoff = Backoff(*ASK_EVERY_S)
        while not self.stop.is_set():
            try:
                answer = self.client.claim_seat(self.job, self.node_id, self.host, *ports)
            except FailedPrecondition as exc:  # no seats in this control plane
                logger.info("agent %s: no control-plane seat to take: %s", self.node_id, exc)
                return
            except CoordinatorError as exc:
                logger.info("agent %s: asking for a control-plane seat failed (%s); asking again", self.node_id, exc)
                self.stop.wait(backoff.next())
                continue
            if answer.granted:
                try:
                    self._take(answer, ports)
                except Exception:  # its etcd or replica did not start: the leader gives the seat up in time
                    logger.exception(
                        "agent %s: taking the control-plane seat failed; this node holds none", self.node_id
                    )
                    self._stop_services()
                    return
                # etcd dies with the thread that started it (PR_SET_PDEATHSIG is a thread's): this one lives on.
                self.stop.wait()
                return
            logger.info("agent %s: no control-plane seat yet: %s", self.node_id, answer.reason)
            self.stop.wait(backoff.next())

    def _take(self, answer: pb.ClaimSeatResponse, ports: tuple[int, int, int]) -> None:
        """Start this seat's etcd member (joining the cluster) and its coordinator replica."""
        hosts = [self.host, "127.0.0.1", "localhost"]
        ca = LocalCA(self.directory / "pki", ca=IssuedCert(answer.ca_cert_pem, answer.ca_key_pem))
        etcd_ca = LocalCA(self.directory / "etcd-pki", ca=IssuedCert(answer.etcd_ca_cert_pem, answer.etcd_ca_key_pem))
        coordinator_port, client_port, peer_port = ports
        self.etcd = EtcdServer(
            data_dir=str(self.directory / "etcd"),
            host=self.host,
            client_port=client_port,
            peer_port=peer_port,
            die_with_parent=True,
            tls=etcd_ca.issue("server", Role.COORDINATOR, f"etcd-{self.node_id}", hosts),
            name=answer.member_name,
            initial_cluster=answer.initial_cluster,
            cluster_state="existing",
        )
        self.etcd.start(timeout_s=60.0)
        kit = SeatKit(
            ca=ca.ca,
            etcd_ca=etcd_ca.ca,
            seal_root=answer.seal_root,
            leader_ttl_s=answer.leader_ttl_s,
            wanted=0,  # a record exists: only the first seat writes it
        )
        config = CoordinatorConfig(
            etcd_endpoints=(*answer.etcd_endpoints, self.etcd.endpoint),  # voting members first: a learner refuses
            listen=f"{'[' + self.host + ']' if ':' in self.host else self.host}:{coordinator_port}",
            leader_ttl_s=answer.leader_ttl_s,
            replica_id=self.node_id,
            tls=ca.issue("coordinator", Role.COORDINATOR, f"seat-{self.node_id}", hosts),
            etcd_tls=etcd_ca.issue("client", Role.COORDINATOR, f"etcd-client-{self.node_id}"),
            signer=Signer(ca.ca),
            seal_root=answer.seal_root,
            seats=kit,
        )
        self.coordinator = CoordinatorServer(config, self.registry).start()
        self.said(
            f"this node holds a control-plane seat: coordinator on {self.coordinator.address}, etcd member "
            f"{self.etcd.endpoint}"
        )

    def close(self) -> None:
        """Stop asking, and stop the seat's replica and etcd member (the leader gives the seat up once this node is
        gone)."""
        self.stop.set()
        if self._thread.is_alive():
            self._thread.join(70)
        self._stop_services()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _stop_services(self) -> None:
        if self.coordinator is not None:
            self.coordinator.stop()
            self.coordinator = None
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None
