"""One coordinator replica: the gRPC server (Coordinator + standard health service), leader election and reconciler.

Every replica serves every API call and every watch; only the elected leader runs the reconciler. The API port is
mutual TLS (``tls``) unless the replica runs with ``insecure=True``. The health service reports SERVING while the
replica reaches etcd (leader or not) and NOT_SERVING while it does not or after a fault, for Kubernetes probes; since
a kubelet's gRPC probe presents no client certificate, it is also served, alone, on a plaintext ``health_listen``
port.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from pliant import settings
from pliant.bootstrap import bootstrap_address
from pliant.coordinator.contract import CoordinatorError
from pliant.coordinator.election import LeaderElection
from pliant.coordinator.etcd_cluster import EtcdMembers
from pliant.coordinator.etcd_watch import PrefixWatch
from pliant.coordinator.limits import CallerLimits, address_key, certificate_key
from pliant.coordinator.metrics import CoordinatorMetrics
from pliant.coordinator.reconciler import Reconciler
from pliant.coordinator.revocation import Denylist
from pliant.coordinator.seat_keeper import SeatKeeper, SeatKit
from pliant.coordinator.servicer import CoordinatorServicer
from pliant.coordinator.signer import BootstrapServicer, Signer
from pliant.coordinator.store import EtcdStore
from pliant.coordinator.watch_hub import WatchHub
from pliant.errors import ConfigError
from pliant.metrics import MetricsServer, serve_metrics
from pliant.net import local_address, parse_host_port
from pliant.ports import free_api_port
from pliant.security.credentials import server_credentials
from pliant.security.identity import Role
from pliant.security.tlsdir import TlsConfig
from pliant.v1 import bootstrap_pb2_grpc, coordinator_pb2, coordinator_pb2_grpc

__all__ = ["CoordinatorConfig", "CoordinatorServer"]

logger = logging.getLogger(__name__)

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name
SEAT_UPKEEP_EVERY_S = 1.0  # the leader looks after an embedded control plane's seats this often
HANDSHAKE_TIMEOUT_S = 10.0  # a connection that has not completed its TLS handshake by then is closed
BOOTSTRAP_THREADS = 32  # the bootstrap port's worker threads
BOOTSTRAP_CALLS_PER_ADDRESS = 2  # bootstrap calls one source address may have in flight
BOOTSTRAP_CONNECTION_AGE_S = 30.0  # a bootstrap connection is closed at this age (its calls get 5 s more)


@dataclass(frozen=True)
class CoordinatorConfig:
    """Settings of one replica.

    Attributes:
        etcd_endpoints: etcd client URLs (``http://host:port``).
        listen: host:port to serve gRPC on (port 0 picks a free one).
        prefix: root of every etcd key; replicas of one deployment share it.
        leader_ttl_s: leader lease TTL: a dead leader is replaced within about this long.
        replica_id: this replica's name (default: hostname-pid).
        etcd_timeout_s: deadline of each etcd request.
        max_workers: gRPC worker threads; each open WatchGenerations stream holds one.
        resync_s: every job is read at least this often, whatever the watch saw (between, a pass reads only the jobs
            that changed or whose deadline came).
        metrics_listen: HOST:PORT to serve Prometheus metrics on (port 0: a free one); "" serves none (the metrics
            are still kept in ``CoordinatorServer.registry``).
        progress_interval_s: a node's reported training step is written to etcd at most this often.
        tls: the replica's TLS files (a coordinator certificate); clients must present a certificate from the same CA.
        insecure: serve plaintext without client authentication (explicitly; logged as a warning). Exactly one of
            ``tls`` and ``insecure`` is required.
        etcd_tls: CA, client certificate and key for etcd over TLS (``https://`` endpoints); None: plaintext etcd.
        health_listen: HOST:PORT of a plaintext port serving only the health service (for kubelet probes); "": none.
        max_jobs: jobs the deployment holds at most; CreateJob past it is RESOURCE_EXHAUSTED (0: no limit).
        finished_job_ttl_s: finished jobs are deleted this long after they finished (0: kept until DeleteJob).
        max_watch_streams: WatchGenerations streams served at once (0: ``max_workers`` less a tenth, at least 4
            threads, kept for unary calls).
        max_concurrent_rpcs: calls in flight at once, streams included; past it a call is RESOURCE_EXHAUSTED (0: ten
            times ``max_workers``: a burst of Joins from thousands of agents waits for the threads instead of being
            refused).
        calls_per_caller: calls one caller (one client certificate's identity) may have in flight on this replica,
            streams included; past it its calls are RESOURCE_EXHAUSTED at once (:mod:`pliant.coordinator.limits`); 0:
            16, or half of ``max_workers`` when that is fewer.
        outage_tolerance_s: the TTL of members' etcd leases: the longest whole control-plane outage (every replica,
            or etcd) that evicts nobody. The leader evicts a silent member after the job's heartbeat TTL, counted only
            while it could hear it (see :mod:`pliant.coordinator.policy`).
        signer: the CA key this replica signs agent certificates with (the bootstrap join and renewals); None: it
            signs none and serves no bootstrap port.
        bootstrap_listen: HOST:PORT of the Bootstrap service (TLS that checks the server only), with ``signer``;
            "": the API's host and its port + 1 (:func:`pliant.bootstrap.bootstrap_address`).
        seal_root: the sealing secret jobs' checkpoint keys derive from (:mod:`pliant.security.seal`;
        ``--seal-root-file``);
            None: the one in etcd (made once). Replicas of one deployment share it.
        seats: an embedded control plane's seats (:mod:`pliant.coordinator.seats`): what a node that takes one gets;
            None: a control plane without seats (a standalone deployment, or an embedded one of one seat).
    """

    etcd_endpoints: tuple[str, ...]
    listen: str = settings.DEFAULT_COORDINATOR
    prefix: str = settings.ETCD_KEY_ROOT
    leader_ttl_s: float = 5.0
    replica_id: str = ""
    etcd_timeout_s: float = 5.0
    max_workers: int = 1100
    resync_s: float = 30.0
    metrics_listen: str = ""
    progress_interval_s: float = 5.0
    tls: TlsConfig | None = None
    insecure: bool = False
    etcd_tls: TlsConfig | None = None
    health_listen: str = ""
    max_jobs: int = 1000
    finished_job_ttl_s: float = 86400.0
    max_watch_streams: int = 0
    max_concurrent_rpcs: int = 0
    calls_per_caller: int = 0
    outage_tolerance_s: float = 3600.0
    signer: Signer | None = None
    bootstrap_listen: str = ""
    seal_root: bytes | None = field(default=None, repr=False)
    seats: SeatKit | None = None

    def __post_init__(self) -> None:
        if not self.etcd_endpoints:
            raise ConfigError("no etcd endpoint: pass --etcd http://HOST:PORT[,http://HOST:PORT...] or set PLIANT_ETCD")
        for url in self.etcd_endpoints:
            parse_host_port(url, what="--etcd endpoint")
        parse_host_port(self.listen, what="--listen", allow_zero=True)
        if self.metrics_listen:
            parse_host_port(self.metrics_listen, what="--metrics-port address", allow_zero=True)
        if not self.prefix.startswith("/"):
            raise ConfigError(f"--prefix {self.prefix!r} must start with '/', e.g. /pliant/v1")
        if not 2 <= self.leader_ttl_s <= 300:
            raise ConfigError(f"--leader-ttl {self.leader_ttl_s!r} must be between 2 and 300 seconds")
        if self.max_workers < 4:
            raise ConfigError(
                f"--max-workers {self.max_workers} must be at least 4: a replica needs threads for its calls, and each "
                f"agent's watch stream holds one (default 1100)"
            )
        if (self.tls is None) == (not self.insecure):
            raise ConfigError(
                "the coordinator needs --tls-dir DIR (ca.crt, tls.crt, tls.key of a coordinator certificate; create "
                "them with `pliant certs`) or an explicit --insecure"
                if self.tls is None
                else "--tls-dir and --insecure contradict each other; drop one"
            )
        if not 10 <= self.outage_tolerance_s <= 7 * 24 * 3600:
            raise ConfigError(f"--outage-tolerance {self.outage_tolerance_s:g} must be between 10 seconds and a week")
        if self.signer is not None and self.tls is None:
            raise ConfigError("--signing-ca-dir needs --tls-dir: the bootstrap join is served over TLS")
        if self.bootstrap_listen:
            parse_host_port(self.bootstrap_listen, what="--bootstrap-listen", allow_zero=True)
        if self.health_listen:
            parse_host_port(self.health_listen, what="--health-port address", allow_zero=True)
        if self.max_jobs < 0 or self.finished_job_ttl_s < 0:
            raise ConfigError(
                f"--max-jobs {self.max_jobs} and --finished-job-ttl {self.finished_job_ttl_s:g} must "
                f"be >= 0 (0: no limit / keep finished jobs)"
            )
        reserve = max(4, self.max_workers // 10)
        if not self.max_watch_streams:
            object.__setattr__(self, "max_watch_streams", self.max_workers - reserve)
        if not 1 <= self.max_watch_streams <= self.max_workers - 4:
            raise ConfigError(
                f"--max-watch-streams {self.max_watch_streams} must be between 1 and max_workers - 4 "
                f"({self.max_workers - 4}): streams must leave threads for heartbeats"
            )
        if not self.max_concurrent_rpcs:
            object.__setattr__(self, "max_concurrent_rpcs", 10 * self.max_workers)
        if not self.calls_per_caller:
            object.__setattr__(self, "calls_per_caller", max(2, min(16, self.max_workers // 2)))
        if not 2 <= self.calls_per_caller < self.max_workers:
            raise ConfigError(
                f"--calls-per-caller {self.calls_per_caller} must be at least 2 (an agent's watch and heartbeat) and "
                f"below max_workers ({self.max_workers}): one caller never holds the replica"
            )
        if not self.replica_id:
            object.__setattr__(self, "replica_id", f"{socket.gethostname()}-{os.getpid()}")


class CoordinatorServer:
    """A running replica. ``start()`` binds and returns; ``stop()`` resigns leadership and shuts down.

    Args:
        config: the replica's settings.
        registry: where its metrics go (default: a new one, served on ``config.metrics_listen`` if set).
    """

    def __init__(self, config: CoordinatorConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.registry = CollectorRegistry(auto_describe=True) if registry is None else registry
        self.tls = config.tls.load(expect=Role.COORDINATOR) if config.tls else None
        etcd_creds = None
        if config.etcd_tls is not None:
            etcd_files = config.etcd_tls.load(need_role=False)
            etcd_creds = grpc.ssl_channel_credentials(etcd_files.ca_pem, etcd_files.key_pem, etcd_files.cert_pem)
        self.store = EtcdStore(
            config.etcd_endpoints,
            config.prefix,
            config.etcd_timeout_s,
            credentials=etcd_creds,
            membership_lease_s=config.outage_tolerance_s,
            seal_root=config.seal_root,
        )
        self.health = health.HealthServicer()
        self.election = LeaderElection(self.store, config.replica_id, config.leader_ttl_s, self._set_health)
        self.metrics = CoordinatorMetrics(self.registry, lambda: self.election.is_leader)
        self.store.observer = self.metrics.observe_etcd
        self.reconciler = Reconciler(
            self.store,
            self.election,
            resync_s=config.resync_s,
            metrics=self.metrics,
            finished_job_ttl_s=config.finished_job_ttl_s,
            jobs_prefix=self.store.jobs_prefix,
        )
        self.hub = WatchHub(self.store)
        # A member key deleted anywhere (a leave, an eviction) ends the node's heartbeats answered from memory here.
        self.member_watch = PrefixWatch(
            self.store,
            self.store.jobs_prefix,
            lambda: None,
            key_filter=self.store.is_member_key,
            on_keys=self.store.members_deleted,
            on_rearm=self.store.forget_heartbeats,
            deletes_only=True,
        )
        self.denylist = Denylist(self.store)
        self.seats: SeatKeeper | None = None
        if config.seats is not None:
            members = EtcdMembers(config.etcd_endpoints, config.etcd_tls, config.etcd_timeout_s)
            self.seats = SeatKeeper(self.store, members, config.seats, node=config.replica_id)
        self.servicer = CoordinatorServicer(
            self.store,
            self.hub,
            observe=self.metrics.observe_rpc,
            poke=self.reconciler.poke,
            progress_interval_s=config.progress_interval_s,
            max_jobs=config.max_jobs,
            max_watch_streams=config.max_watch_streams,
            signer=config.signer,
            denylist=self.denylist,
            seats=self.seats,
        )
        self.metrics_server: MetricsServer | None = None
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix="rpc"),
            # clients ping every few seconds (coordinator/client.py: KEEPALIVE_TIME_MS), also on watch streams that
            # carry no data; gRPC's default answers pings more often than every 5 minutes with GOAWAY
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", 1 << 20),
                # calls gRPC has taken in but no thread has asked for yet: its default (1,000) cancels the rest of a
                # burst of Joins; max_concurrent_rpcs bounds them instead
                ("grpc.server.max_pending_requests", 1 << 20),
                ("grpc.server.max_pending_requests_hard_limit", 1 << 20),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 1000),
                # a connection that has not finished its TLS handshake is dropped after this (gRPC: 120 s), so
                # idle connections never hold the server's slots for long
                ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_TIMEOUT_S * 1000)),
            ],
            maximum_concurrent_rpcs=config.max_concurrent_rpcs,
            interceptors=[
                CallerLimits(config.calls_per_caller, certificate_key, "certificate", self.metrics.observe_rpc)
            ],
        )
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.health_server: grpc.Server | None = None
        self.bootstrap_server: grpc.Server | None = None
        self.port = 0
        self.health_port = 0
        self.bootstrap_port = 0
        self._stopped = threading.Event()

    @property
    def address(self) -> str:
        """HOST:PORT of the API; for a wildcard listen address, this machine's routable address (never a name that a
        peer's resolver may not know)."""
        host, _ = parse_host_port(self.config.listen, allow_zero=True)
        if host in ("0.0.0.0", "::"):
            host = local_address()
        return f"{host}:{self.port}"

    def _set_health(self, ok: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def start(self) -> CoordinatorServer:
        """Bind the port, start election and reconciler.

        Raises:
            ConfigError: the listen address cannot be bound.
        """
        host, port = parse_host_port(self.config.listen, allow_zero=True)
        if port == 0 and self.config.signer is not None and not self.config.bootstrap_listen:
            port = free_api_port(host)  # and its bootstrap port (pliant.ports)
        try:
            if self.tls is not None:
                assert self.config.tls is not None
                creds = server_credentials(self.config.tls, self.tls)
                self.port = self.server.add_secure_port(f"{host}:{port}", creds)  # type: ignore[arg-type]
            else:
                logger.warning(
                    "coordinator %s serves PLAINTEXT without client authentication (--insecure): anyone "
                    "who reaches %s can create, finish and delete jobs",
                    self.config.replica_id,
                    self.config.listen,
                )
                self.port = self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as exc:
            raise ConfigError(f"cannot listen on --listen {self.config.listen}: {exc}; pick a free port") from exc
        if self.port == 0:
            raise ConfigError(f"cannot listen on --listen {self.config.listen}; is the port taken?")
        if self.config.health_listen:
            self.health_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="health"))
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_port = self.health_server.add_insecure_port(self.config.health_listen)
            if self.health_port == 0:
                raise ConfigError(f"cannot listen on health address {self.config.health_listen}; is the port taken?")
            self.health_server.start()
        if self.config.signer is not None:
            self._start_bootstrap(host)
        if self.config.metrics_listen:
            self.metrics_server = serve_metrics(self.registry, self.config.metrics_listen)
        self._set_health(True)
        self.denylist.start()
        self.member_watch.start()
        self.server.start()
        self.election.start()
        self.reconciler.start()
        if self.seats is not None:
            threading.Thread(target=self._keep_seats, name="seats", daemon=True).start()
        logger.info(
            "coordinator %s serving on %s (%s; etcd %s, prefix %s)",
            self.config.replica_id,
            self.address,
            f"mutual TLS as {self.tls.identity}" if self.tls else "plaintext",
            ",".join(self.config.etcd_endpoints),
            self.config.prefix,
        )
        return self

    def _keep_seats(self) -> None:
        """The seat thread: the leader's upkeep of the seats (:meth:`SeatKeeper.upkeep`) every second."""
        assert self.seats is not None
        while not self._stopped.wait(SEAT_UPKEEP_EVERY_S):
            if not self.election.is_leader:
                continue
            try:
                live = {m.node_id for job in self.store.list_job_ids() for m in self.store.read_job(job).members}
                self.seats.upkeep(live)
            except CoordinatorError as exc:
                logger.info("seat upkeep skipped: %s", exc)

    def _start_bootstrap(self, host: str) -> None:
        """Serve the Bootstrap service over TLS that checks the server only (a joining node has no certificate yet),
        presenting the CA certificate after the coordinator's, so the node can pin it before it sends its token.

        Raises:
            ConfigError: the bootstrap address cannot be bound.
        """
        assert self.tls is not None and self.config.signer is not None
        listen = self.config.bootstrap_listen or bootstrap_address(f"{host}:{self.port}")
        self.bootstrap_server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=BOOTSTRAP_THREADS, thread_name_prefix="bootstrap"),
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", 64 << 10),
                ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_TIMEOUT_S * 1000)),
                # a bootstrap join takes one call of a second or less: a connection is closed at this age, so a call
                # opened and never sent holds its thread no longer
                ("grpc.max_connection_age_ms", int(BOOTSTRAP_CONNECTION_AGE_S * 1000)),
                ("grpc.max_connection_age_grace_ms", 5000),
            ],
            maximum_concurrent_rpcs=2 * BOOTSTRAP_THREADS,
            interceptors=[CallerLimits(BOOTSTRAP_CALLS_PER_ADDRESS, address_key, "address", self.metrics.observe_rpc)],
        )
        servicer = BootstrapServicer(
            self.store,
            self.config.signer,
            observe=self.metrics.observe_rpc,
            denylist=self.denylist,
            max_jobs=self.config.max_jobs,
        )
        bootstrap_pb2_grpc.add_BootstrapServicer_to_server(servicer, self.bootstrap_server)
        assert self.config.tls is not None
        creds = server_credentials(self.config.tls, self.tls, bootstrap=True)  # rotated files are picked up too
        try:
            self.bootstrap_port = self.bootstrap_server.add_secure_port(listen, creds)
        except RuntimeError:
            self.bootstrap_port = 0
        if self.bootstrap_port == 0:
            raise ConfigError(
                f"cannot serve the bootstrap join on {listen}; is the port taken? Pick another with "
                f"--bootstrap-listen (agents then pass --bootstrap HOST:PORT)"
            )
        self.bootstrap_server.start()

    @property
    def bootstrap_address(self) -> str:
        """HOST:PORT of the Bootstrap service ("" when this replica serves none)."""
        if not self.bootstrap_port:
            return ""
        return f"{parse_host_port(self.address)[0]}:{self.bootstrap_port}"

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop serving, resign leadership and close etcd connections. Safe to call twice."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s)
        if self.health_server is not None:
            self.health_server.stop(0)
        if self.bootstrap_server is not None:
            self.bootstrap_server.stop(0)
        self.reconciler.stop()
        self.denylist.stop()
        self.member_watch.stop()
        self.hub.close()
        self.election.stop(resign=True)
        self.store.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        logger.info("coordinator %s stopped", self.config.replica_id)

    def wait(self) -> None:
        self.server.wait_for_termination()

    def __enter__(self) -> CoordinatorServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
