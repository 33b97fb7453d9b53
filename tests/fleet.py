"""Coordinator clients as a deployment's admin and nodes use them, over mutual TLS, for the tests and the benches.

A :class:`Fleet` holds one admin client and one client per node id, each with its own certificate from a test CA
(:class:`pliant.security.issuance.LocalCA`), and remembers each job's join token and each node's lease, so a test reads
as the API's story (create a job, join nodes, heartbeat, report) while every call is authorized the way a real one is.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from pliant.coordinator.client import CoordinatorClient, JoinGrant
from pliant.coordinator.contract import CoordinatorError, FailureCause, JobInfo, JobSpec, WatchEvent
from pliant.security.credentials import channel_credentials
from pliant.security.identity import Role
from pliant.security.issuance import LocalCA
from pliant.security.tlsdir import TlsConfig, TlsMaterial

__all__ = ["COORDINATOR_HOSTS", "Fleet", "Heartbeats", "admin_tls", "agent_tls", "coordinator_tls", "secure_channel"]

COORDINATOR_HOSTS = ("127.0.0.1", "localhost", "::1")


def coordinator_tls(ca: LocalCA) -> TlsConfig:
    """The test coordinators' TLS directory (every replica shares it)."""
    return ca.issue("coordinator", Role.COORDINATOR, "test-coordinator", COORDINATOR_HOSTS)


def admin_tls(ca: LocalCA) -> TlsConfig:
    return ca.issue("admin", Role.ADMIN, "test-admin")


def agent_tls(ca: LocalCA, node_id: str) -> TlsConfig:
    return ca.issue(f"agent-{node_id}", Role.AGENT, node_id)


def secure_channel(ca: LocalCA | None, address: str, who: str = "admin") -> grpc.Channel:
    """A gRPC channel to ``address`` as ``who`` ("admin" or a node id); plaintext when ``ca`` is None."""
    if ca is None:
        return grpc.insecure_channel(address)
    tls = admin_tls(ca) if who == "admin" else agent_tls(ca, who)
    return grpc.secure_channel(address, channel_credentials(tls.load()))  # type: ignore[arg-type]


class Fleet:
    """An admin and any number of nodes talking to one coordinator deployment.

    Args:
        ca: the test CA (None: plaintext, for a coordinator run with ``insecure=True``).
        targets: the replicas' addresses.
        client_kwargs: passed to every :class:`CoordinatorClient` (e.g. ``retry_for_s``).
    """

    def __init__(self, ca: LocalCA | None, targets: str | Sequence[str], **client_kwargs: Any) -> None:
        self.ca = ca
        self.targets = targets
        self.kwargs = client_kwargs
        self.admin = self._client(admin_tls(ca).load() if ca else None)
        self.tokens: dict[str, str] = {}
        self.leases: dict[tuple[str, str], int] = {}
        self._nodes: dict[str, CoordinatorClient] = {}

    def _client(self, tls: TlsMaterial | None) -> CoordinatorClient:
        return CoordinatorClient(self.targets, tls, **self.kwargs)

    def node(self, node_id: str) -> CoordinatorClient:
        """The client of node ``node_id`` (its own agent certificate)."""
        if node_id not in self._nodes:
            self._nodes[node_id] = self._client(agent_tls(self.ca, node_id).load() if self.ca else None)
        return self._nodes[node_id]

    def close(self) -> None:
        self.admin.close()
        for client in self._nodes.values():
            client.close()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- admin calls ---------------------------------------------------------------------------------------------------

    def create_job(self, spec: JobSpec, join_token: str = "") -> tuple[JobInfo, bool, str]:
        info, created, token = self.admin.create_job(spec, join_token)
        if token:
            self.tokens[spec.job_id] = token
        return info, created, token

    def get_job(self, job_id: str, progress: bool = False) -> JobInfo:
        return self.admin.get_job(job_id, progress)

    def list_jobs(self, progress: bool = False) -> list[JobInfo]:
        return self.admin.list_jobs(progress)

    def finish_job(self, job_id: str, succeeded: bool, reason: str = "") -> JobInfo:
        return self.admin.finish_job(job_id, succeeded, reason)

    def delete_job(self, job_id: str) -> None:
        self.admin.delete_job(job_id)

    def watch(self, job_id: str, from_generation: int = 0) -> Iterator[WatchEvent]:
        return self.admin.watch(job_id, from_generation)

    # -- node calls ----------------------------------------------------------------------------------------------------

    def join(self, job_id: str, node_id: str, address: str, slots: int = 0) -> JoinGrant:
        grant = self.node(node_id).join(job_id, node_id, address, slots, self.tokens.get(job_id, ""))
        self.leases[(job_id, node_id)] = grant.lease_id
        return grant

    def heartbeat(self, job_id: str, node_id: str, lease_id: int, **options: Any) -> float:
        return self.node(node_id).heartbeat(job_id, node_id, lease_id, **options)

    def leave(self, job_id: str, node_id: str, lease_id: int) -> None:
        self.node(node_id).leave(job_id, node_id, lease_id)

    def beating(self, job_id: str, nodes: Sequence[str], every_s: float = 0.5) -> Heartbeats:
        """Heartbeat ``nodes`` (joined through this fleet) every ``every_s`` on a thread until the returned
        :class:`Heartbeats` is closed, as their agents would."""
        return Heartbeats(self, job_id, nodes, every_s)

    def report_failure(
        self,
        job_id: str,
        node_id: str,
        generation: int,
        exit_code: int,
        message: str = "",
        unreachable_nodes: Sequence[str] = (),
        arrived: bool = False,
        cause: FailureCause = FailureCause.EXITED,
    ) -> tuple[bool, int]:
        lease = self.leases.get((job_id, node_id), 0)
        return self.node(node_id).report_failure(
            job_id, node_id, generation, exit_code, message, unreachable_nodes, lease, arrived, cause
        )

    def report_success(self, job_id: str, node_id: str, generation: int, untrained: bool = False) -> tuple[bool, int]:
        lease = self.leases.get((job_id, node_id), 0)
        return self.node(node_id).report_success(job_id, node_id, generation, lease, untrained)


class Heartbeats:
    """The heartbeats of some nodes of one job, sent on a thread of their own until :meth:`close`; a node stops
    beating when :meth:`stop` names it (it died) or when its membership is gone (it was evicted).

    Threads: the caller's thread starts, stops and closes; the beat thread sends. ``_beating`` is shared, under
    ``_lock``.
    """

    def __init__(self, fleet: Fleet, job_id: str, nodes: Sequence[str], every_s: float) -> None:
        self._fleet, self._job, self._every_s = fleet, job_id, every_s
        self._lock = threading.Lock()
        self._beating = set(nodes)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeats-{job_id}", daemon=True)
        self._thread.start()

    def stop(self, *nodes: str) -> None:
        """Stop beating for ``nodes`` (as if they died)."""
        with self._lock:
            self._beating.difference_update(nodes)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=10)

    def __enter__(self) -> Heartbeats:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        while not self._closed.wait(self._every_s):
            with self._lock:
                nodes = sorted(self._beating)
            for node in nodes:
                try:
                    self._fleet.heartbeat(self._job, node, self._fleet.leases[(self._job, node)])
                except CoordinatorError:  # evicted: its membership is gone
                    self.stop(node)
