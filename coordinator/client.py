"""A Python client of the coordinator API, for agents, ``pliant status`` and the benches (no torch).

Every channel is mutual TLS when the client is given its TLS files (:class:`pliant.security.tlsdir.TlsMaterial`): the
server is checked against the CA, and this process's certificate says who it is. It spreads over several replicas: an
UNAVAILABLE answer (a replica down, or etcd unreachable behind it) is retried on the next replica with backoff for up
to ``retry_for_s``; no other code is ever retried. Status codes become domain errors through the contract's one
table. Watches resume from the next generation number on another replica, so an agent misses nothing.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from pliant.backoff import Backoff
from pliant.coordinator.contract import (
    FailureCause,
    JobInfo,
    JobSpec,
    JobStatus,
    Unavailable,
    WatchEvent,
    error_for_status,
)
from pliant.coordinator.convert import (
    cause_to_pb,
    generation_from_pb,
    goodput_to_pb,
    job_info_from_pb,
    outcome_from_pb,
    seat_answer_from_pb,
    spec_to_pb,
    state_from_pb,
)
from pliant.coordinator.seats import SeatAnswer
from pliant.net import parse_host_port
from pliant.security.credentials import channel_credentials
from pliant.security.identity import Role
from pliant.security.issuance import new_csr
from pliant.security.tlsdir import TlsMaterial
from pliant.v1 import coordinator_pb2 as pb
from pliant.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = ["KEEPALIVE_TIMEOUT_MS", "KEEPALIVE_TIME_MS", "Beat", "CoordinatorClient", "JoinGrant"]

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

KEEPALIVE_TIME_MS = 3000  # a ping this often on every channel (the server accepts them from every second on) ...
KEEPALIVE_TIMEOUT_MS = 2000  # ... and a call breaks when one is not answered within this


class JoinGrant:
    """What Join returns: the lease to heartbeat, its TTL and interval, the current generation number and the job's
    checkpoint key."""

    def __init__(self, msg: pb.JoinResponse) -> None:
        self.lease_id: int = msg.lease_id
        self.heartbeat_ttl_s: float = msg.heartbeat_ttl_s
        self.heartbeat_interval_s: float = msg.heartbeat_interval_s
        self.generation: int = msg.generation
        self.checkpoint_key: bytes = msg.checkpoint_key  # the job's key for checkpoint markers (pliant.security.seal)
        self.agent_key: bytes = msg.agent_key  # the job's key for agents' store records (pliant.security.seal)
        self.control_key: bytes = msg.control_key  # the job's control public key (pliant.security.warrant)


# What gRPC says when the peer's certificate does not verify (either side): permanent, unlike a refused connection.
_HANDSHAKE_REFUSED = re.compile(
    r"CERTIFICATE_VERIFY_FAILED|certificate verify failed|BAD_SIGNATURE|certificate signature failure|UNKNOWN_CA"
    r"|BAD_CERTIFICATE|unable to get local issuer"
)


@dataclass(frozen=True)
class Beat:
    """A heartbeat's answer: the membership lease's TTL, the coordinators of the control plane as it stands and the
    nodes that hold its seats (empty when it does not list them), and whether a seat is being handed to this node."""

    ttl_s: float
    coordinators: tuple[str, ...] = ()
    seated: tuple[str, ...] = ()
    seat_handed: bool = False


class CoordinatorClient:
    """Client of one coordinator deployment.

    Args:
        targets: ``HOST:PORT`` of one or more replicas, as a list or a comma-separated string.
        tls: this process's TLS files (CA, certificate, key); None: plaintext, for a coordinator run with --insecure.
        timeout_s: deadline of each unary call.
        retry_for_s: how long UNAVAILABLE answers are retried (rotating over replicas) before raising.
    """

    def __init__(
        self,
        targets: str | Sequence[str],
        tls: TlsMaterial | None = None,
        timeout_s: float = 5.0,
        retry_for_s: float = 10.0,
    ) -> None:
        items = targets.split(",") if isinstance(targets, str) else list(targets)
        self.targets = [t.strip() for t in items if t.strip()]
        for target in self.targets:
            parse_host_port(target, what="--coordinator")
        if not self.targets:
            raise ValueError("no coordinator address given; pass --coordinator HOST:PORT")
        self.timeout_s = timeout_s
        self.retry_for_s = retry_for_s
        # Told at each retry what the call waits for and why, e.g. the agent's status line while it joins (the
        # thread that sets it owns it; None: no one is told).
        self.waiting: Callable[[str, str], None] | None = None
        # gRPC's reconnect backoff grows to 2 minutes by default: after a long control-plane outage a node would reach
        # the returning coordinator too late for the grace it gets (one heartbeat TTL). Retry the connection every
        # second at most.
        # HTTP/2 keepalive pings (every KEEPALIVE_TIME_MS, also on a watch stream that carries no data): a replica
        # that went silent (its host lost power, or a cut that resets nothing) breaks the call within
        # KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS and the watch resumes on the next replica; without them a watch
        # waits for TCP, which gives up only when the cut heals.
        options = [
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 1000),
            ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),  # current gRPC's wait for an answer
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.http2.min_time_between_pings_ms", KEEPALIVE_TIME_MS),
        ]
        self._options = options
        self.tls = tls
        self._channels: list[grpc.Channel] = []
        self._retired: list[grpc.Channel] = []
        self._stubs: list[pb_grpc.CoordinatorStub] = []
        self._connect(tls)
        self._current = 0

    def _connect(self, tls: TlsMaterial | None) -> None:
        """Open a channel per replica with ``tls`` and make it the one every later call uses; calls in flight (a
        watch stream) finish on the channels they started on, which are closed with the client."""
        if tls is None:
            channels = [grpc.insecure_channel(t, self._options) for t in self.targets]
        else:
            creds = channel_credentials(tls)
            channels = [grpc.secure_channel(t, creds, self._options) for t in self.targets]  # type: ignore[arg-type]
        self._retired += self._channels
        self._channels, self._stubs, self.tls = channels, [pb_grpc.CoordinatorStub(c) for c in channels], tls

    def use_tls(self, tls: TlsMaterial) -> None:
        """Present ``tls`` (a renewed certificate) on every connection from now on."""
        self._connect(tls)

    def use_targets(self, targets: Sequence[str]) -> None:
        """Call the replicas at ``targets`` from now on (an embedded control plane's coordinators as they change);
        the replica in use stays the first one tried while it is among them."""
        items = [t.strip() for t in targets if t.strip()]
        for target in items:
            parse_host_port(target, what="a coordinator address")
        if not items or items == self.targets:
            return
        current = self.targets[self._current % len(self.targets)]
        if current in items:
            items.remove(current)
            items.insert(0, current)
        self.targets = items
        self._connect(self.tls)
        self._current = 0

    def _stub(self) -> pb_grpc.CoordinatorStub:
        stubs = self._stubs
        return stubs[self._current % len(stubs)]

    def _next_replica(self) -> None:
        self._current = (self._current + 1) % len(self._stubs)

    def close(self) -> None:
        for channel in self._channels + self._retired:
            channel.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing ------------------------------------------------------------------------------------------------------

    def _retrying(
        self, attempt: Callable[[pb_grpc.CoordinatorStub], _T], what: str, retry_for_s: float | None = None
    ) -> _T:
        retry_for_s = self.retry_for_s if retry_for_s is None else retry_for_s
        deadline = time.monotonic() + retry_for_s
        backoff = Backoff(0.05, 1.0)
        while True:
            stub = self._stub()
            try:
                return attempt(stub)
            except grpc.RpcError as exc:
                details = exc.details() or ""
                err = error_for_status(exc.code(), details)
                if not isinstance(err, Unavailable):
                    raise err from exc
                if _HANDSHAKE_REFUSED.search(details):  # a certificate from another CA: no retry makes it answer
                    target = self.targets[self._current % len(self.targets)]
                    raise Unavailable(
                        f"{what}: the TLS handshake with {target} failed ({details[-200:]}); its "
                        f"certificate and this one's (--tls-dir) must come from the same CA: use the control plane's "
                        f"ca.crt, or join by bootstrap (--ca-cert-hash)"
                    ) from exc
                if time.monotonic() >= deadline:
                    raise Unavailable(
                        f"{what}: no coordinator answered at {','.join(self.targets)} for {retry_for_s:g}s "
                        f"({details}); check that a replica runs and reaches etcd"
                    ) from exc
                if not backoff.failing:  # said once: what the retries wait for
                    logger.info(
                        "%s: no coordinator answers at %s yet (%s); retrying for up to %gs",
                        what,
                        self.targets[self._current % len(self.targets)],
                        details[-160:],
                        self.retry_for_s,
                    )
                if self.waiting is not None:
                    self.waiting(
                        f"waiting for a coordinator at {','.join(self.targets)}",
                        f"{what}: {details.rsplit(': ', 1)[-1][:120]}; gives up after {self.retry_for_s:g}s",
                    )
                self._next_replica()
                time.sleep(backoff.next())

    def _call(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        deadline = timeout_s or self.timeout_s
        return self._retrying(lambda stub: getattr(stub, method)(request, timeout=deadline), method)

    # -- API -----------------------------------------------------------------------------------------------------------

    def create_job(self, spec: JobSpec, join_token: str = "") -> tuple[JobInfo, bool, str]:
        """Create the job (admin), or return the identical existing one (created=False).

        The join token is chosen here when not given, so a retried call creates the job with the token this caller
        knows. Returns (job, created, join token): the token is "" when the job already existed.
        """
        token = join_token or secrets.token_urlsafe(32)
        resp = self._call("CreateJob", pb.CreateJobRequest(spec=spec_to_pb(spec), join_token=token))
        return job_info_from_pb(resp.job), resp.created, token if resp.created or join_token else ""

    def revoke_certificate(self, cert_pem: bytes = b"", serial: str = "", reason: str = "") -> tuple[str, str]:
        """Revoke a certificate (admin): its PEM, or its serial in hex. Returns (serial hex, subject)."""
        req = pb.RevokeCertificateRequest(cert_pem=cert_pem, serial=serial, reason=reason)
        resp = self._call("RevokeCertificate", req)
        return resp.serial, resp.subject

    def delete_job(self, job_id: str, force: bool = False) -> None:
        """Delete a finished job (admin); with ``force``, an unfinished one too."""
        self._call("DeleteJob", pb.DeleteJobRequest(job_id=job_id, force=force))

    def rotate_join_token(self, job_id: str, join_token: str = "") -> str:
        """Give the job a new join token (admin); returns it."""
        token = join_token or secrets.token_urlsafe(32)
        return self._call("RotateJoinToken", pb.RotateJoinTokenRequest(job_id=job_id, join_token=token)).join_token

    def set_namespace_token(self, namespace: str, rotate: bool = False, join_token: str = "") -> tuple[str, bool]:
        """Register a namespace's join token (admin), or replace it with ``rotate``; returns the token and whether
        anything changed (an identical registration is a no-op)."""
        token = join_token or secrets.token_urlsafe(32)
        req = pb.SetNamespaceTokenRequest(namespace=namespace, join_token=token, rotate=rotate)
        resp = self._call("SetNamespaceToken", req)
        return resp.join_token, resp.created

    def get_job(self, job_id: str, progress: bool = False) -> JobInfo:
        """The job; with ``progress`` also each member's heartbeat age and step (costs the coordinator a lease
        lookup per member: for ``pliant status``, not for agents)."""
        return job_info_from_pb(self._call("GetJob", pb.GetJobRequest(job_id=job_id, include_progress=progress)))

    def list_jobs(self, progress: bool = False) -> list[JobInfo]:
        return self.list_jobs_and_errors(progress)[0]

    def list_jobs_and_errors(self, progress: bool = False) -> tuple[list[JobInfo], dict[str, str]]:
        """Every job, and the jobs whose records cannot be read (job id -> the error, naming the key and the fix)."""
        resp = self._call("ListJobs", pb.ListJobsRequest(include_progress=progress))
        return [job_info_from_pb(j) for j in resp.jobs], {u.job_id: u.error for u in resp.unreadable}

    def finish_job(self, job_id: str, succeeded: bool, reason: str = "") -> JobInfo:
        msg = self._call("FinishJob", pb.FinishJobRequest(job_id=job_id, succeeded=succeeded, reason=reason))
        return job_info_from_pb(msg)

    def join(self, job_id: str, node_id: str, address: str, slots: int = 0, join_token: str = "") -> JoinGrant:
        req = pb.JoinRequest(job_id=job_id, node_id=node_id, address=address, slots=slots, join_token=join_token)
        return JoinGrant(self._call("Join", req))

    def heartbeat(self, job_id: str, node_id: str, lease_id: int, **options: Any) -> float:
        """Refresh the membership lease; returns its TTL (:meth:`beat`'s answer, and its ``options``)."""
        return self.beat(job_id, node_id, lease_id, **options).ttl_s

    def beat(
        self,
        job_id: str,
        node_id: str,
        lease_id: int,
        step: int = 0,
        timeout_s: float | None = None,
        reaches_generation: int = 0,
        misses_generation: int = 0,
        goodput: Mapping[str, float] | None = None,
    ) -> Beat:
        """Refresh the membership lease (reporting the workers' latest ``step``, 0 if unknown, and the node's
        ``goodput`` seconds by what they went to, :mod:`pliant.agent.goodput`); returns the lease's
        TTL, the control plane's coordinators and seats, and whether a seat is handed to this node. ``timeout_s``: the
        deadline of each attempt (default: the client's), after which the next replica is tried: an agent passes a
        fraction of the heartbeat TTL, so a replica that accepts calls but cannot answer them (cut off from etcd) costs
        less than the TTL. ``reaches_generation``: a spare reached every member of that generation (its hold is
        lifted); ``misses_generation``: it could not reach one (its hold lasts). Raises NotFound once the lease is gone
        (Join again)."""
        request = pb.HeartbeatRequest(
            job_id=job_id,
            node_id=node_id,
            lease_id=lease_id,
            step=step,
            reaches_generation=reaches_generation,
            misses_generation=misses_generation,
            goodput=goodput_to_pb(goodput) if goodput else None,
        )
        resp = self._call("Heartbeat", request, timeout_s)
        return Beat(resp.ttl_s, tuple(resp.coordinators), tuple(resp.control_plane_nodes), resp.seat_handed)

    def claim_seat(
        self,
        job_id: str,
        node_id: str,
        host: str,
        ports: tuple[int, int, int],
        seat_key: str = "",
        seat_proof: bytes = b"",
    ) -> SeatAnswer:
        """Ask for a seat in an embedded control plane (:mod:`pliant.coordinator.seats`) for this node, listening at
        ``host`` on ``ports`` (coordinator, etcd client, etcd peer), with a seat key (a new seat) or the proof of the
        seat it held. Raises FailedPrecondition when the control plane has no seats, PermissionDenied when the key or
        proof admits no seat."""
        req = pb.ClaimSeatRequest(
            job_id=job_id,
            node_id=node_id,
            host=host,
            coordinator_port=ports[0],
            etcd_client_port=ports[1],
            etcd_peer_port=ports[2],
            seat_key=seat_key,
            seat_proof=seat_proof,
        )
        return seat_answer_from_pb(self._call("ClaimSeat", req, 30.0))

    def create_seat_key(self, ttl_s: float = 0.0) -> tuple[str, float]:
        """A new seat key of an embedded control plane (admin): (the key, when it expires, seconds since the epoch)."""
        resp = self._call("CreateSeatKey", pb.CreateSeatKeyRequest(ttl_s=ttl_s))
        return resp.seat_key, resp.expires_at

    def leave(self, job_id: str, node_id: str, lease_id: int, retry_for_s: float | None = None) -> None:
        """Leave the job (``retry_for_s``: how long to retry while no coordinator answers; default the client's)."""
        request = pb.LeaveRequest(job_id=job_id, node_id=node_id, lease_id=lease_id)
        self._retrying(lambda stub: stub.Leave(request, timeout=self.timeout_s), "Leave", retry_for_s)

    def report_failure(
        self,
        job_id: str,
        node_id: str,
        generation: int,
        exit_code: int,
        message: str = "",
        unreachable_nodes: Sequence[str] = (),
        lease_id: int = 0,
        arrived: bool = False,
        cause: FailureCause = FailureCause.EXITED,
        error: str = "",
    ) -> tuple[bool, int]:
        """Report a failure of ``generation`` on this node (``cause``; ``exit_code``: the worker's, when it exited;
        ``error``: the exception it died of), and peers whose agents are unreachable, with this node's membership
        lease; ``arrived``: this node's workers trained a step in ``generation``. Returns (accepted, current
        generation)."""
        req = pb.ReportFailureRequest(
            job_id=job_id,
            node_id=node_id,
            generation=generation,
            exit_code=exit_code,
            message=message,
            unreachable_nodes=list(unreachable_nodes),
            lease_id=lease_id,
            arrived=arrived,
            cause=cause_to_pb(cause),
            error=error,
        )
        resp = self._call("ReportFailure", req)
        return resp.accepted, resp.current_generation

    def report_success(
        self, job_id: str, node_id: str, generation: int, lease_id: int = 0, untrained: bool = False
    ) -> tuple[bool, int]:
        """Report that all of this node's workers of ``generation`` exited 0, with this node's membership lease;
        ``untrained``: they completed no step in it (they ran the job's last steps in the world before it).
        Returns (job succeeded, current gen)."""
        req = pb.ReportSuccessRequest(
            job_id=job_id, node_id=node_id, generation=generation, lease_id=lease_id, untrained=untrained
        )
        resp = self._call("ReportSuccess", req)
        return resp.accepted, resp.current_generation

    def renew_certificate(self, job_id: str) -> tuple[TlsMaterial, float]:
        """A fresh agent certificate for this client's node id (a new key, made here) while it is a live member of
        ``job_id``; the client uses it from then on. Returns (the new TLS material, its expiry in seconds since the
        epoch).

        Raises:
            FailedPrecondition: the replica holds no signing key. PermissionDenied: this node is no live member.
        """
        from pliant.bootstrap import material

        assert self.tls is not None and self.tls.identity is not None, "renewal needs this client's certificate"
        key_pem, csr_pem = new_csr(Role.AGENT, self.tls.identity.name)
        answer = self._call("RenewAgentCertificate", pb.RenewAgentCertificateRequest(job_id=job_id, csr_pem=csr_pem))
        fresh = material(self.tls.ca_pem, answer.cert_pem, key_pem)
        self.use_tls(fresh)
        return fresh, answer.not_after

    def watch(self, job_id: str, from_generation: int = 0) -> Iterator[WatchEvent]:
        """Yield generations (in order, from ``from_generation``; 0: the current one) and job state changes.

        The stream survives replica failures: it reconnects to the next replica, resuming after the last generation
        received. It ends only when the caller stops iterating; UNAVAILABLE for longer than ``retry_for_s`` raises.
        """
        next_number = from_generation
        down_since: float | None = None
        backoff = Backoff(0.05, 1.0)
        while True:
            stub = self._stub()
            call = stub.WatchGenerations(pb.WatchGenerationsRequest(job_id=job_id, from_generation=next_number))
            try:
                for msg in call:
                    down_since = None
                    backoff.reset()
                    gen = generation_from_pb(msg.generation) if msg.HasField("generation") else None
                    if gen is not None:
                        next_number = gen.number + 1
                    status = JobStatus(
                        state_from_pb(msg.job_state), 0.0, msg.job_reason, outcome_from_pb(msg.job_outcome)
                    )
                    yield WatchEvent(gen, status)
            except grpc.RpcError as exc:
                err = error_for_status(exc.code(), exc.details() or "")
                if exc.code() == grpc.StatusCode.CANCELLED and call.cancelled():
                    return
                if not isinstance(err, Unavailable):
                    raise err from exc
                now = time.monotonic()
                down_since = down_since or now
                if now - down_since > self.retry_for_s:
                    raise Unavailable(
                        f"watch of job {job_id!r}: no coordinator answered at {','.join(self.targets)} for "
                        f"{self.retry_for_s:g}s ({exc.details()})"
                    ) from exc
                log = logger.info if down_since == now else logger.debug  # once per outage, not once a second
                log(
                    "watch of job %s broke (%s); resuming from generation %d on the next replica",
                    job_id,
                    exc.code().name,
                    next_number,
                )
            finally:
                call.cancel()
            self._next_replica()
            time.sleep(backoff.next())
