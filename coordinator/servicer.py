"""The Coordinator gRPC service: authorizes and validates requests, calls the store, and maps domain errors to status
codes.

Any replica serves every call: all state lives in etcd. Every call is authorized in one place, :meth:`_authorize`,
by the rules of :mod:`pliant.coordinator.authz` and, for calls that carry a lease, by the store's proof that the lease
is the caller's own membership. Domain errors become gRPC status codes here only, through
:func:`pliant.coordinator.contract.status_for_error`. No message ever carries a lease id or a token.
"""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from pliant.coordinator.authz import ADMIN_METHODS, Caller, require_admin, require_job, require_node
from pliant.coordinator.contract import (
    JOIN_TOKEN_RULE,
    MAX_ERROR_BYTES,
    CoordinatorError,
    CorruptRecord,
    FailedPrecondition,
    FailureReport,
    InvalidArgument,
    JobInfo,
    Member,
    MemberProgress,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    is_join_token,
    status_for_error,
    truncate_reason,
    validate_address,
    validate_id,
    validate_namespace,
    validate_slots,
)
from pliant.coordinator.convert import (
    cause_from_pb,
    generation_to_pb,
    goodput_from_pb,
    job_info_to_pb,
    outcome_to_pb,
    seat_answer_to_pb,
    spec_from_pb,
    state_to_pb,
    without_addresses,
)
from pliant.coordinator.limits import RateLimit
from pliant.coordinator.revocation import RENEWAL_OVERLAP_S, Denylist, replaced_certificate, revocation_of
from pliant.coordinator.rpc import serve_unary
from pliant.coordinator.seat_keeper import SeatKeeper
from pliant.coordinator.seats import MAX_SEAT_KEY_TTL_S, SEAT_KEY_TTL_S, Seat
from pliant.coordinator.signer import Signer
from pliant.coordinator.store import EtcdStore
from pliant.coordinator.watch_hub import WatchHub
from pliant.security.credentials import peer_certificate
from pliant.security.identity import certificate_serial, identity_from_pem
from pliant.v1 import bootstrap_pb2 as bpb
from pliant.v1 import coordinator_pb2 as pb
from pliant.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = ["STREAMS_PER_CALLER", "CoordinatorServicer"]

logger = logging.getLogger(__name__)

STREAMS_PER_CALLER = 4  # WatchGenerations streams one caller (one certificate identity) holds on a replica at most
RENEWALS_BURST = 3  # renewals one node may make at once; then as many per certificate lifetime
MAX_SECRET_CHARS = 128  # a seat key or a seat's proof is 256 bits (43 characters URL-safe, 32 bytes)
IDLE_PROGRESS_S = 30.0  # a node whose step stands still has its goodput recorded this often

_F = TypeVar("_F", bound=Callable[..., Any])
RpcObserver = Callable[[str, grpc.StatusCode, float], None]


def _abort(context: grpc.ServicerContext, exc: CoordinatorError) -> None:
    context.abort(status_for_error(exc), str(exc))


def _rpc(fn: _F) -> _F:
    """Run a unary handler: authorize the caller (the handler gets the :class:`Caller`, not the context), turn domain
    errors into their status codes, and report (method, code, seconds)."""

    @functools.wraps(fn)
    def handler(self: CoordinatorServicer, request: Any, context: grpc.ServicerContext) -> Any:
        return serve_unary(
            fn.__name__,
            context,
            self.observe,
            lambda: fn(self, request, self._authorize(fn.__name__, request, context)),
        )

    return handler  # type: ignore[return-value]


def _lease_id(value: int, node_id: str) -> int:
    if value == 0:
        raise InvalidArgument(f"lease_id for node {node_id[:100]!r} is 0; send the lease_id that Join returned")
    return value


def _token(value: str) -> str:
    """A join token chosen by the caller (:data:`JOIN_TOKEN_RULE`)."""
    if value and not is_join_token(value):
        raise InvalidArgument(
            f"join_token of {len(value)} characters is invalid: use {JOIN_TOKEN_RULE}, or leave it empty and the "
            f"coordinator generates one"
        )
    return value


def new_token() -> str:
    """A fresh join token: 256 random bits, URL-safe."""
    return secrets.token_urlsafe(32)


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """Implements pliant.v1.Coordinator over an :class:`EtcdStore`.

    Args:
        store: the etcd store.
        hub: the replica's watch hub.
        clock: wall clock for timestamps.
        observe: called with (method, status code, seconds) after each unary call.
        poke: called with the job's id after a write to it that the reconciler should look at soon.
        stream_poll_s: how often a WatchGenerations stream checks that its client is still there.
        progress_interval_s: a node's reported step is written to etcd at most this often (heartbeats themselves
            write nothing).
        max_jobs: jobs this coordinator deployment holds at most (0: no limit); CreateJob past it is
            RESOURCE_EXHAUSTED.
        max_watch_streams: open WatchGenerations streams this replica serves at most (each holds a server thread);
            past it a new stream is RESOURCE_EXHAUSTED, so streams never starve heartbeats of threads.
        signer: the CA key that renews agent certificates (None: this replica renews none).
        denylist: the revoked certificates this replica refuses (None: none are; a test's servicer without etcd).
    """

    def __init__(
        self,
        store: EtcdStore,
        hub: WatchHub,
        clock: Callable[[], float] = time.time,
        observe: RpcObserver | None = None,
        poke: Callable[[str], None] | None = None,
        stream_poll_s: float = 1.0,
        progress_interval_s: float = 5.0,
        max_jobs: int = 0,
        max_watch_streams: int = 0,
        signer: Signer | None = None,
        denylist: Denylist | None = None,
        seats: SeatKeeper | None = None,
    ) -> None:
        self._store = store
        self._seats = seats
        self._hub = hub
        self._clock = clock
        self.observe: RpcObserver = observe or (lambda method, code, seconds: None)
        self._poke = poke or (lambda job: None)
        self._stream_poll_s = stream_poll_s
        self._progress_interval_s = progress_interval_s
        self._progress_written: dict[tuple[str, str], tuple[float, int]] = {}  # (job, node) -> (monotonic, step)
        self._probed: dict[tuple[str, str], tuple[int, int]] = {}  # (job, node) -> its spare agent's last probe
        self._max_jobs = max_jobs
        self._max_watch_streams = max_watch_streams
        self._signer = signer
        self._denylist = denylist
        # A node renews at two thirds of its certificate's life: three renewals at once, then three per lifetime.
        lifetime = signer.lifetime_s if signer is not None else 3600.0
        self._renewals = RateLimit(RENEWALS_BURST, RENEWALS_BURST / lifetime)
        self._watch_streams = 0  # guarded by _watch_lock, as is:
        self._streams_of: dict[str, int] = {}  # caller (its certificate's identity) -> its open streams here
        self._watch_lock = threading.Lock()

    # -- authorization: the one place ----------------------------------------------------------------------------------

    def _authorize(self, method: str, request: Any, context: grpc.ServicerContext) -> Caller:
        """Check that the caller may make this call; return who it is.

        Raises:
            Unauthenticated: the caller's certificate is revoked.
            PermissionDenied: the caller's role, node or lease does not allow the call (nothing was touched).
            NotFound: the call carries a lease for a membership that no longer exists.
        """
        pem = peer_certificate(context)
        caller = Caller(identity_from_pem(pem), certificate_serial(pem)) if pem else Caller(None)
        why = self._denylist.why(caller.serial) if self._denylist is not None and caller.serial else ""
        if why:
            raise Unauthenticated(
                f"{caller}'s certificate (serial {caller.serial:x}) is revoked ({why}); an agent joins again with "
                f"the join token (--ca-cert-hash), others ask their admin for a new certificate"
            )
        if method in ADMIN_METHODS:
            require_admin(caller, method)
        elif method in ("GetJob", "WatchGenerations", "RenewAgentCertificate", "ClaimSeat"):
            # A member of the job; admins too, except for a renewal or a seat (an agent's, for its own node id).
            if method == "ClaimSeat":
                require_node(caller, request.node_id, method, request.job_id)
            if not caller.is_admin or method in ("RenewAgentCertificate", "ClaimSeat"):
                job = validate_id(request.job_id, "job_id")
                require_job(caller, job, method)
                node = caller.node_id
                if node is None or not self._store.is_member(job, node):
                    may = "renew their certificates" if method == "RenewAgentCertificate" else "and admins see a job"
                    raise PermissionDenied(
                        f"{method} of job {job!r} refused: {caller} is not a member of it; only its members {may}"
                    )
        elif method == "Join":
            require_node(caller, request.node_id, method, request.job_id)
        else:  # Heartbeat, Leave, ReportFailure, ReportSuccess: the caller's own node, with its own lease
            require_node(caller, request.node_id, method, request.job_id)
            job = validate_id(request.job_id, "job_id")
            node = validate_id(request.node_id, "node_id")
            if method != "Leave":  # Leave checks the lease in its own transaction
                self._store.check_member(job, node, _lease_id(request.lease_id, node))
        return caller

    # -- jobs ----------------------------------------------------------------------------------------------------------

    def _info(self, job: str) -> JobInfo:
        snap = self._store.read_job(validate_id(job, "job_id"))
        return JobInfo(snap.spec, snap.status, snap.generation, snap.members)

    def _info_with_progress(self, job: str) -> JobInfo:
        info = self._info(job)
        return JobInfo(info.spec, info.status, info.generation, info.members, self._store.progress(job, info.members))

    @_rpc
    def CreateJob(self, request: pb.CreateJobRequest, caller: Caller) -> pb.CreateJobResponse:
        spec = spec_from_pb(request.spec)
        given = _token(request.join_token)
        token = given or new_token()
        _spec, created = self._store.create_job(spec, self._clock(), token, self._max_jobs, same_token=bool(given))
        self._poke(spec.job_id)
        info = job_info_to_pb(self._info(spec.job_id))
        return pb.CreateJobResponse(job=info, created=created, join_token=token if created else "")

    @_rpc
    def GetJob(self, request: pb.GetJobRequest, caller: Caller) -> pb.JobStatus:
        info = self._info_with_progress if request.include_progress else self._info
        msg = job_info_to_pb(info(request.job_id))
        return msg if caller.is_admin else without_addresses(msg)

    @_rpc
    def ListJobs(self, request: pb.ListJobsRequest, caller: Caller) -> pb.ListJobsResponse:
        info = self._info_with_progress if request.include_progress else self._info
        jobs, unreadable = [], []
        for job in self._store.list_job_ids():
            try:
                jobs.append(job_info_to_pb(info(job)))
            except NotFound:  # deleted while listing
                continue
            except CorruptRecord as exc:  # one bad record never hides the other jobs
                unreadable.append(pb.UnreadableJob(job_id=job, error=str(exc)))
        return pb.ListJobsResponse(jobs=jobs, unreadable=unreadable)

    @_rpc
    def FinishJob(self, request: pb.FinishJobRequest, caller: Caller) -> pb.JobStatus:
        job = validate_id(request.job_id, "job_id")
        self._store.finish_job(job, request.succeeded, truncate_reason(request.reason), self._clock())
        return job_info_to_pb(self._info(job))

    @_rpc
    def DeleteJob(self, request: pb.DeleteJobRequest, caller: Caller) -> pb.DeleteJobResponse:
        self._store.delete_job(validate_id(request.job_id, "job_id"), force=request.force)
        return pb.DeleteJobResponse()

    @_rpc
    def RotateJoinToken(self, request: pb.RotateJoinTokenRequest, caller: Caller) -> pb.RotateJoinTokenResponse:
        token = _token(request.join_token) or new_token()
        self._store.rotate_token(validate_id(request.job_id, "job_id"), token)
        return pb.RotateJoinTokenResponse(join_token=token)

    @_rpc
    def SetNamespaceToken(self, request: pb.SetNamespaceTokenRequest, caller: Caller) -> pb.SetNamespaceTokenResponse:
        token = _token(request.join_token) or new_token()
        created = self._store.set_namespace_token(validate_namespace(request.namespace), token, request.rotate)
        return pb.SetNamespaceTokenResponse(join_token=token, created=created)

    # -- members -------------------------------------------------------------------------------------------------------

    @_rpc
    def Join(self, request: pb.JoinRequest, caller: Caller) -> pb.JoinResponse:
        job = validate_id(request.job_id, "job_id")
        node = validate_id(request.node_id, "node_id")
        slots = validate_slots(request.slots)
        member = Member(node, validate_address(request.address), slots, self._clock())
        admitted = self._store.join(job, member, request.join_token)  # the leader's watch sees the member key
        ttl = admitted.heartbeat_ttl_s
        return pb.JoinResponse(
            lease_id=admitted.lease_id,
            heartbeat_ttl_s=ttl,
            heartbeat_interval_s=max(0.2, ttl / 4),
            generation=admitted.generation,
            checkpoint_key=admitted.checkpoint_key,
            agent_key=admitted.agent_key,
            control_key=admitted.control_key,
        )

    @_rpc
    def Heartbeat(self, request: pb.HeartbeatRequest, caller: Caller) -> pb.HeartbeatResponse:
        ttl = self._store.heartbeat(request.job_id, request.node_id, request.lease_id)
        if request.step:
            self._record_progress(request)
        key = (request.job_id, request.node_id)  # checked by _authorize
        probe = (request.reaches_generation, request.misses_generation)
        if any(probe) and self._probed.get(key) != probe:  # a spare's probe of the members: one look per outcome
            if self._store.record_probe(*key, max(probe), reaches=bool(request.reaches_generation)):
                self._poke(request.job_id)
            if len(self._probed) > 100_000:  # nodes come and go: forget them all now and then
                self._probed.clear()
            self._probed[key] = probe
        if self._seats is None:
            return pb.HeartbeatResponse(ttl_s=ttl)
        return pb.HeartbeatResponse(
            ttl_s=ttl,
            coordinators=self._seats.coordinators(),
            control_plane_nodes=self._seats.seats_of(),
            seat_handed=self._seats.handed_to(request.node_id),
        )

    def _record_progress(self, request: pb.HeartbeatRequest) -> None:
        """Write the node's step and goodput to etcd when the step changed, or :data:`IDLE_PROGRESS_S` passed (a node
        that trains no step still adds badput), and the last write is ``progress_interval_s`` old."""
        key = (request.job_id, request.node_id)  # checked by _authorize
        now = time.monotonic()
        last_at, last_step = self._progress_written.get(key, (-float("inf"), -1))
        if (request.step == last_step and now - last_at < IDLE_PROGRESS_S) or now - last_at < self._progress_interval_s:
            return
        goodput = goodput_from_pb(request.goodput)
        progress = MemberProgress(step=request.step, step_at=self._clock(), goodput=goodput)
        self._store.record_progress(*key, request.lease_id, progress)
        if len(self._progress_written) > 100_000:  # nodes come and go: forget them all now and then
            self._progress_written.clear()
        self._progress_written[key] = (now, request.step)

    @_rpc
    def Leave(self, request: pb.LeaveRequest, caller: Caller) -> pb.LeaveResponse:
        job = validate_id(request.job_id, "job_id")
        node = validate_id(request.node_id, "node_id")
        self._store.read_job(job)  # NotFound for an unknown job
        self._store.leave(job, node, _lease_id(request.lease_id, node))
        self._poke(job)
        return pb.LeaveResponse()

    @_rpc
    def ReportFailure(self, request: pb.ReportFailureRequest, caller: Caller) -> pb.ReportFailureResponse:
        job, node = request.job_id, request.node_id  # checked by _authorize
        if request.generation == 0:
            raise InvalidArgument("generation 0 in ReportFailure; report the generation the failed worker ran in")
        unreachable = [validate_id(n, "unreachable node id") for n in request.unreachable_nodes]
        report = FailureReport(
            node,
            request.generation,
            request.exit_code,
            truncate_reason(request.message),
            self._clock(),
            tuple(dict.fromkeys(unreachable)),
            request.arrived,
            cause_from_pb(request.cause, request.exit_code),
            truncate_reason(request.error, MAX_ERROR_BYTES),
        )
        accepted, current = self._store.report_failure(job, report)
        self._poke(job)
        return pb.ReportFailureResponse(accepted=accepted, current_generation=current)

    @_rpc
    def ReportSuccess(self, request: pb.ReportSuccessRequest, caller: Caller) -> pb.ReportSuccessResponse:
        job, node = request.job_id, request.node_id  # checked by _authorize
        if request.generation == 0:
            raise InvalidArgument("generation 0 in ReportSuccess; report the generation the workers completed")
        accepted, current = self._store.report_success(
            job, node, request.generation, self._clock(), untrained=request.untrained
        )
        return pb.ReportSuccessResponse(accepted=accepted, current_generation=current)

    @_rpc
    def RenewAgentCertificate(self, request: pb.RenewAgentCertificateRequest, caller: Caller) -> bpb.AgentCertificate:
        if self._signer is None:
            raise FailedPrecondition(
                "this coordinator holds no signing key (--signing-ca-dir), so it renews no certificates; issue the "
                "agent a new one with `pliant certs create-agent`"
            )
        assert caller.node_id is not None  # checked by _authorize, as is its membership of the job
        wait = self._renewals.take(str(caller))
        if wait:
            raise ResourceExhausted(
                f"{caller} renewed its certificate {RENEWALS_BURST} times lately; renew again in {wait:.0f}s (an "
                f"agent renews at two thirds of its certificate's life)"
            )
        issued = self._signer.sign(request.csr_pem, caller.node_id, request.job_id)
        # The certificate it replaces stays valid a moment, for calls already under way with it.
        replaced_certificate(
            self._store,
            self._denylist,
            request.job_id,
            caller.node_id,
            issued.cert_pem,
            "renewed",
            RENEWAL_OVERLAP_S,
            self._clock(),
        )
        return issued

    @_rpc
    def ClaimSeat(self, request: pb.ClaimSeatRequest, caller: Caller) -> pb.ClaimSeatResponse:
        if self._seats is None or caller.node_id is None:
            raise FailedPrecondition(
                "this control plane has no seats: it is a standalone deployment, or a `pliant run` with one seat"
            )
        host = request.host
        if not host or not (0 < request.coordinator_port < 65535):
            raise InvalidArgument("ClaimSeat needs the node's host and its coordinator port")
        for name, port in (("etcd_client_port", request.etcd_client_port), ("etcd_peer_port", request.etcd_peer_port)):
            if not 0 < port < 65536:
                raise InvalidArgument(f"ClaimSeat: {name} {port} is not a port")
        url_host = f"[{host}]" if ":" in host else host
        validate_address(f"{url_host}:{request.coordinator_port}", "host")
        seat = Seat(
            node=caller.node_id,
            coordinator=f"{url_host}:{request.coordinator_port}",
            etcd_client=f"https://{url_host}:{request.etcd_client_port}",
            etcd_peer=f"https://{url_host}:{request.etcd_peer_port}",
        )
        if len(request.seat_key) > MAX_SECRET_CHARS or len(request.seat_proof) > MAX_SECRET_CHARS:
            raise InvalidArgument(
                f"ClaimSeat: a seat key or proof of more than {MAX_SECRET_CHARS} characters is none this control "
                f"plane made; pass the PLIANT_SEAT_KEY printed with the seat line"
            )
        return seat_answer_to_pb(self._seats.claim(seat, request.seat_key, request.seat_proof))

    @_rpc
    def CreateSeatKey(self, request: pb.CreateSeatKeyRequest, caller: Caller) -> pb.CreateSeatKeyResponse:
        if self._seats is None:
            raise FailedPrecondition(
                "this control plane has no seats: it is a standalone deployment, or a `pliant run` with one seat"
            )
        ttl_s = request.ttl_s or SEAT_KEY_TTL_S
        if not 0 < ttl_s <= MAX_SEAT_KEY_TTL_S:
            raise InvalidArgument(
                f"seat key ttl {ttl_s:g}s must be above 0 and at most {MAX_SEAT_KEY_TTL_S:g}s (a week); make a new "
                f"key when one runs out"
            )
        key, expires_at = self._seats.make_key(ttl_s)
        return pb.CreateSeatKeyResponse(seat_key=key, expires_at=expires_at)

    @_rpc
    def RevokeCertificate(self, request: pb.RevokeCertificateRequest, caller: Caller) -> pb.RevokeCertificateResponse:
        if self._denylist is None:
            raise FailedPrecondition("this replica keeps no denylist")
        record = revocation_of(request.cert_pem, request.serial, request.reason, str(caller), self._clock())
        self._denylist.revoke(record)
        return pb.RevokeCertificateResponse(serial=f"{record.serial:x}", subject=record.subject)

    # -- watch ---------------------------------------------------------------------------------------------------------

    def WatchGenerations(
        self, request: pb.WatchGenerationsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.WatchGenerationsResponse]:
        """Stream generations from ``from_generation`` on, in order, plus job state changes, until the client leaves
        or its certificate is revoked (checked every ``stream_poll_s``). A replica serves ``max_watch_streams``
        streams, and :data:`STREAMS_PER_CALLER` of one caller: a member that opens streams without end locks out
        nobody but itself."""
        caller, serial = "", 0
        try:
            who = self._authorize("WatchGenerations", request, context)
            caller, serial = str(who), who.serial
            with self._watch_lock:
                if self._streams_of.get(caller, 0) >= STREAMS_PER_CALLER:
                    raise ResourceExhausted(
                        f"{caller} already holds {STREAMS_PER_CALLER} WatchGenerations streams on this replica, the "
                        f"most one caller may; close one (an agent needs one)"
                    )
                if self._max_watch_streams and self._watch_streams >= self._max_watch_streams:
                    raise ResourceExhausted(
                        f"this replica serves {self._max_watch_streams} WatchGenerations streams, its limit; retry on "
                        f"another replica, or raise --max-watch-streams (with --max-workers)"
                    )
                self._watch_streams += 1
                self._streams_of[caller] = self._streams_of.get(caller, 0) + 1
            try:
                sub = self._hub.subscribe(validate_id(request.job_id, "job_id"), request.from_generation)
            except CoordinatorError:
                self._stream_closed(caller)
                raise
        except CoordinatorError as exc:
            self.observe("WatchGenerations", status_for_error(exc), 0.0)
            _abort(context, exc)
            return
        try:
            while context.is_active():
                event = sub.get(self._stream_poll_s)
                revoked = self._denylist.why(serial) if self._denylist is not None and serial else ""
                if revoked:  # a certificate revoked while its stream is open: the stream ends with it
                    self.observe("WatchGenerations", grpc.StatusCode.UNAUTHENTICATED, 0.0)
                    context.abort(
                        grpc.StatusCode.UNAUTHENTICATED,
                        f"{caller}'s certificate (serial {serial:x}) was revoked ({revoked}); this stream ends",
                    )
                if event is None:
                    continue
                msg = pb.WatchGenerationsResponse(
                    job_state=state_to_pb(event.status.state),
                    job_reason=event.status.reason,
                    job_outcome=outcome_to_pb(event.status.outcome),
                )
                if event.generation is not None:
                    msg.generation.CopyFrom(generation_to_pb(event.generation))
                yield msg
        finally:
            sub.close()
            self._stream_closed(caller)

    def _stream_closed(self, caller: str) -> None:
        with self._watch_lock:
            self._watch_streams -= 1
            left = self._streams_of.pop(caller, 1) - 1
            if left:
                self._streams_of[caller] = left
