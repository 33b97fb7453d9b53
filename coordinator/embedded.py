"""One seat of an embedded control plane, composed in one place: an etcd member and a coordinator replica on one node,
the replica signing agent certificates with the run's CA and sealing with its root.

Every node that runs a seat builds it here: the first node of ``pliant run`` (the one member of a new cluster, or with
``--insecure`` a plaintext one on loopback) and a node that takes a seat or comes back to its own
(:mod:`pliant.agent.seat`: a member that joins the cluster, or starts again from its data). Which ports a seat
listens on is :mod:`pliant.ports`' block of its API port; where its files live and who issues its certificates is
its caller's (the run's certificate directory, or the seat's home).

Thread ownership: the thread that calls :meth:`EmbeddedSeat.start` owns the seat (the launcher's main thread, or the
agent's seat thread) and is the only one that starts or stops it; the etcd member is started with a parent-death
signal, so it dies with that thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from pliant.coordinator.etcd_server import EtcdServer
from pliant.coordinator.seat_keeper import SeatKit
from pliant.coordinator.server import CoordinatorConfig, CoordinatorServer
from pliant.coordinator.signer import Signer
from pliant.security.issuance import IssuedCert
from pliant.security.tlsdir import TlsConfig

__all__ = ["EMBEDDED_LEADER_TTL_S", "EmbeddedSeat", "SeatPlan"]

EMBEDDED_LEADER_TTL_S = 2.0
"""The leader lease of an embedded control plane: shorter than a standalone deployment's, since a seat's node may be
the first to go."""


@dataclass(frozen=True)
class SeatPlan:
    """What one seat runs.

    Attributes:
        host: the address its etcd member listens on and advertises.
        listen: its replica's API address (HOST:PORT; port 0: a free one).
        member_name: its etcd member's name.
        replica_id: its replica's id.
        client_port: its etcd member's client port (None: a free one).
        peer_port: its etcd member's peer port (None: a free one).
        etcd_tls: the member's server certificate (None: plaintext).
        coordinator_tls: the replica's certificate (None: plaintext, without client authentication).
        etcd_client_tls: the replica's client certificate for etcd (None: plaintext).
        ca: the run's CA: the replica signs agent certificates with it and serves the Bootstrap service (None: none).
        seal_root: the sealing secret jobs' checkpoint keys derive from.
        seats: what a node that takes a seat of this control plane gets (None: a control plane without seats).
        leader_ttl_s: the leader lease's TTL.
        data_dir: the member's data (None: a temporary directory of its own).
        initial_cluster: etcd's ``--initial-cluster`` of a member that joins a cluster ("": a new cluster of one).
        cluster_state: etcd's ``--initial-cluster-state`` (``new`` or ``existing``).
        peers: the other members' client URLs, voting members first: the replica uses them before its own member
            (a learner refuses clients).
        log_path: where the member logs (None: its own output).
    """

    host: str
    listen: str
    member_name: str
    replica_id: str
    client_port: int | None = None
    peer_port: int | None = None
    etcd_tls: TlsConfig | None = None
    coordinator_tls: TlsConfig | None = None
    etcd_client_tls: TlsConfig | None = None
    ca: IssuedCert | None = None
    seal_root: bytes | None = field(default=None, repr=False)
    seats: SeatKit | None = None
    leader_ttl_s: float = EMBEDDED_LEADER_TTL_S
    data_dir: str | None = None
    initial_cluster: str = ""
    cluster_state: str = "new"
    peers: tuple[str, ...] = ()
    log_path: str | None = None


class EmbeddedSeat:
    """A seat's etcd member and coordinator replica: started by :meth:`start`, stopped (the replica first) by
    :meth:`stop`.

    Args:
        plan: what the seat runs.
        registry: where the replica's metrics go (the node's endpoint); None: a registry of its own.
    """

    def __init__(self, plan: SeatPlan, registry: CollectorRegistry | None = None) -> None:
        self.plan = plan
        self.registry = registry
        self.etcd = EtcdServer(
            data_dir=plan.data_dir,
            host=plan.host,
            client_port=plan.client_port,
            peer_port=plan.peer_port,
            log_path=plan.log_path,
            die_with_parent=True,
            tls=plan.etcd_tls,
            name=plan.member_name,
            initial_cluster=plan.initial_cluster,
            cluster_state=plan.cluster_state,
        )
        self.coordinator: CoordinatorServer | None = None

    def start(self, etcd_timeout_s: float = 20.0) -> EmbeddedSeat:
        """Start the etcd member (within ``etcd_timeout_s``: a member started from its data waits for its peers),
        then the replica on it.

        Raises:
            EtcdError: the member did not start.
            ConfigError: the replica's address cannot be bound.
        """
        plan = self.plan
        self.etcd.start(timeout_s=etcd_timeout_s)
        try:
            config = CoordinatorConfig(
                etcd_endpoints=(*(e for e in plan.peers if e != self.etcd.endpoint), self.etcd.endpoint),
                listen=plan.listen,
                leader_ttl_s=plan.leader_ttl_s,
                replica_id=plan.replica_id,
                tls=plan.coordinator_tls,
                etcd_tls=plan.etcd_client_tls,
                insecure=plan.coordinator_tls is None,
                signer=Signer(plan.ca) if plan.ca is not None else None,
                seal_root=plan.seal_root,
                seats=plan.seats,
            )
            self.coordinator = CoordinatorServer(config, self.registry).start()
        except BaseException:
            self.etcd.stop()
            raise
        return self

    def stop_replica(self) -> None:
        """Stop the replica (the member runs on)."""
        coordinator, self.coordinator = self.coordinator, None
        if coordinator is not None:
            coordinator.stop()

    def stop(self) -> None:
        """Stop the replica, then the member: a replica whose etcd is gone only warns until it stops."""
        self.stop_replica()
        self.etcd.stop()

    def __enter__(self) -> EmbeddedSeat:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
