"""The Coordinator gRPC service: validates requests, calls the store, and maps domain errors to status codes.

Any replica serves every call: all state lives in etcd. Domain errors become gRPC status codes here only, through
:func:`pliant.coordinator.contract.status_for_error`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from pliant.coordinator.contract import (
    CoordinatorError,
    FailureReport,
    InvalidArgument,
    JobInfo,
    Member,
    MemberProgress,
    status_for_error,
    validate_address,
    validate_id,
)
from pliant.coordinator.convert import generation_to_pb, job_info_to_pb, spec_from_pb, state_to_pb
from pliant.coordinator.store import EtcdStore
from pliant.coordinator.watch_hub import WatchHub
from pliant.v1 import coordinator_pb2 as pb
from pliant.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = ["CoordinatorServicer"]

logger = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])
RpcObserver = Callable[[str, grpc.StatusCode, float], None]


def _abort(context: grpc.ServicerContext, exc: CoordinatorError) -> None:
    context.abort(status_for_error(exc), str(exc))


def _rpc(fn: _F) -> _F:
    """Run a unary handler, turning domain errors into their status codes and reporting (method, code, seconds)."""

    @functools.wraps(fn)
    def handler(self: CoordinatorServicer, request: Any, context: grpc.ServicerContext) -> Any:
        started, code = time.perf_counter(), grpc.StatusCode.OK
        try:
            return fn(self, request, context)
        except CoordinatorError as exc:
            code = status_for_error(exc)
            logger.debug("%s -> %s: %s", fn.__name__, code.name, exc)
            _abort(context, exc)
        except Exception:
            code = grpc.StatusCode.INTERNAL
            logger.exception("%s failed unexpectedly", fn.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{fn.__name__} failed inside the coordinator; see its log")
        finally:
            self.observe(fn.__name__, code, time.perf_counter() - started)

    return handler  # type: ignore[return-value]


def _lease_id(value: int, node_id: str) -> int:
    if value == 0:
        raise InvalidArgument(f"lease_id for node {node_id!r} is 0; send the lease_id that Join returned")
    return value


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """Implements pliant.v1.Coordinator over an :class:`EtcdStore`.

    Args:
        store: the etcd store.
        hub: the replica's watch hub.
        clock: wall clock for timestamps.
        observe: called with (method, status code, seconds) after each unary call.
        poke: called after a write that the reconciler should look at soon.
        stream_poll_s: how often a WatchGenerations stream checks that its client is still there.
        progress_interval_s: a node's reported step is written to etcd at most this often (heartbeats themselves
            write nothing).
    """

    def __init__(
        self,
        store: EtcdStore,
        hub: WatchHub,
        clock: Callable[[], float] = time.time,
        observe: RpcObserver | None = None,
        poke: Callable[[], None] | None = None,
        stream_poll_s: float = 1.0,
        progress_interval_s: float = 5.0,
    ) -> None:
        self._store = store
        self._hub = hub
        self._clock = clock
        self.observe: RpcObserver = observe or (lambda method, code, seconds: None)
        self._poke = poke or (lambda: None)
        self._stream_poll_s = stream_poll_s
        self._progress_interval_s = progress_interval_s
        self._progress_written: dict[tuple[str, str], tuple[float, int]] = {}  # (job, node) -> (monotonic, step)

    # -- jobs ----------------------------------------------------------------------------------------------------------

    def _info(self, job: str) -> JobInfo:
        snap = self._store.read_job(validate_id(job, "job_id"))
        return JobInfo(snap.spec, snap.status, snap.generation, snap.members)

    def _info_with_progress(self, job: str) -> JobInfo:
        info = self._info(job)
        return JobInfo(info.spec, info.status, info.generation, info.members, self._store.progress(job, info.members))

    @_rpc
    def CreateJob(self, request: pb.CreateJobRequest, context: grpc.ServicerContext) -> pb.CreateJobResponse:
        spec = spec_from_pb(request.spec)
        _spec, created = self._store.create_job(spec, self._clock())
        self._poke()
        return pb.CreateJobResponse(job=job_info_to_pb(self._info(spec.job_id)), created=created)

    @_rpc
    def GetJob(self, request: pb.GetJobRequest, context: grpc.ServicerContext) -> pb.JobStatus:
        info = self._info_with_progress if request.include_progress else self._info
        return job_info_to_pb(info(request.job_id))

    @_rpc
    def ListJobs(self, request: pb.ListJobsRequest, context: grpc.ServicerContext) -> pb.ListJobsResponse:
        info = self._info_with_progress if request.include_progress else self._info
        jobs = [job_info_to_pb(info(job)) for job in self._store.list_job_ids()]
        return pb.ListJobsResponse(jobs=jobs)

    @_rpc
    def FinishJob(self, request: pb.FinishJobRequest, context: grpc.ServicerContext) -> pb.JobStatus:
        job = validate_id(request.job_id, "job_id")
        self._store.finish_job(job, request.succeeded, request.reason, self._clock())
        return job_info_to_pb(self._info(job))

    # -- members -------------------------------------------------------------------------------------------------------

    @_rpc
    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinResponse:
        job = validate_id(request.job_id, "job_id")
        node = validate_id(request.node_id, "node_id")
        member = Member(node, validate_address(request.address), request.slots, self._clock())
        lease_id, generation, ttl = self._store.join(job, member)
        self._poke()
        return pb.JoinResponse(
            lease_id=lease_id, heartbeat_ttl_s=ttl, heartbeat_interval_s=max(0.2, ttl / 4), generation=generation
        )

    @_rpc
    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        ttl = self._store.heartbeat(_lease_id(request.lease_id, request.node_id))
        if request.step:
            self._record_progress(request)
        return pb.HeartbeatResponse(ttl_s=ttl)

    def _record_progress(self, request: pb.HeartbeatRequest) -> None:
        """Write the node's step to etcd when it changed and the last write is ``progress_interval_s`` old."""
        key = (validate_id(request.job_id, "job_id"), validate_id(request.node_id, "node_id"))
        now = time.monotonic()
        last_at, last_step = self._progress_written.get(key, (-float("inf"), -1))
        if request.step == last_step or now - last_at < self._progress_interval_s:
            return
        self._store.record_progress(*key, request.lease_id, MemberProgress(step=request.step, step_at=self._clock()))
        if len(self._progress_written) > 100_000:  # nodes come and go: forget them all now and then
            self._progress_written.clear()
        self._progress_written[key] = (now, request.step)

    @_rpc
    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveResponse:
        job = validate_id(request.job_id, "job_id")
        node = validate_id(request.node_id, "node_id")
        self._store.read_job(job)  # NotFound for an unknown job
        self._store.leave(job, node, request.lease_id)
        self._poke()
        return pb.LeaveResponse()

    @_rpc
    def ReportFailure(
        self, request: pb.ReportFailureRequest, context: grpc.ServicerContext
    ) -> pb.ReportFailureResponse:
        job = validate_id(request.job_id, "job_id")
        node = validate_id(request.node_id, "node_id")
        if request.generation == 0:
            raise InvalidArgument("generation 0 in ReportFailure; report the generation the failed worker ran in")
        report = FailureReport(node, request.generation, request.exit_code, request.message[:4096], self._clock())
        unreachable = [validate_id(n, "unreachable node id") for n in request.unreachable_nodes]
        accepted, current = self._store.report_failure(job, report, unreachable)
        self._poke()
        return pb.ReportFailureResponse(accepted=accepted, current_generation=current)

    @_rpc
    def ReportSuccess(
        self, request: pb.ReportSuccessRequest, context: grpc.ServicerContext
    ) -> pb.ReportSuccessResponse:
        job = validate_id(request.job_id, "job_id")
        node = validate_id(request.node_id, "node_id")
        if request.generation == 0:
            raise InvalidArgument("generation 0 in ReportSuccess; report the generation the workers completed")
        accepted, current = self._store.report_success(job, node, request.generation, self._clock())
        return pb.ReportSuccessResponse(accepted=accepted, current_generation=current)

    # -- watch ---------------------------------------------------------------------------------------------------------

    def WatchGenerations(
        self, request: pb.WatchGenerationsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.WatchGenerationsResponse]:
        """Stream generations from ``from_generation`` on, in order, plus job state changes, until the client leaves."""
        try:
            sub = self._hub.subscribe(validate_id(request.job_id, "job_id"), request.from_generation)
        except CoordinatorError as exc:
            self.observe("WatchGenerations", status_for_error(exc), 0.0)
            _abort(context, exc)
            return
        try:
            while context.is_active():
                event = sub.get(self._stream_poll_s)
                if event is None:
                    continue
                msg = pb.WatchGenerationsResponse(
                    job_state=state_to_pb(event.status.state), job_reason=event.status.reason
                )
                if event.generation is not None:
                    msg.generation.CopyFrom(generation_to_pb(event.generation))
                yield msg
        finally:
            sub.close()
