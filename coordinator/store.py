"""The coordinator's state in etcd v3: jobs, leased members, fenced generations, failure reports.

Key layout under the prefix (default ``/pliant/v1``)::

    leader                              elected replica id (leased; its create revision is the fencing token)
    jobs/<job>/spec                     JobSpec JSON
    jobs/<job>/state                    JobStatus JSON (waiting | running | succeeded | failed)
    jobs/<job>/members/<node>           Member JSON, attached to the node's lease
    jobs/<job>/generation               the current Generation JSON
    jobs/<job>/generations/<n:012d>     history of the last HISTORY generations (resumable watches)
    jobs/<job>/failures/<n:012d>/<node> FailureReport JSON for generation n
    jobs/<job>/departed/<node>          marker of a graceful Leave (cleared by the next generation or a re-join)
    progress/<job>/<node>               MemberProgress JSON (latest step), attached to the node's lease; outside
                                        jobs/ so that its writes never wake the reconciler

Every mutation is one etcd transaction, so nothing is ever written half-way. etcd errors are wrapped into
:class:`Unavailable`; a generation write whose fence fails raises :class:`FencingError`.
"""

from __future__ import annotations

import functools
import logging
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import etcd3
import etcd3.exceptions
import etcd3.watch
import grpc

from pliant.coordinator.contract import (
    AlreadyExists,
    CoordinatorError,
    FailedPrecondition,
    FailureReport,
    FencingError,
    Generation,
    InvalidArgument,
    JobSnapshot,
    JobSpec,
    JobState,
    JobStatus,
    Member,
    MemberProgress,
    NotFound,
    Unavailable,
)
from pliant.coordinator.keepalive import KeepAliveStream
from pliant.net import parse_host_port

__all__ = ["HISTORY", "EtcdObserver", "EtcdStore", "Fence"]

logger = logging.getLogger(__name__)

HISTORY = 100  # generations kept per job for resumable watches

if not hasattr(etcd3.watch, "six"):
    # python3-etcd3 0.13.0's watch thread calls six.itervalues() without importing six, so a broken watch stream
    # never reaches its callbacks (and PrefixWatch would never re-arm). Give it the one function it uses.
    etcd3.watch.six = types.SimpleNamespace(itervalues=lambda d: iter(d.values()))  # type: ignore[attr-defined]
_T = TypeVar("_T")


@dataclass(frozen=True)
class Fence:
    """Proof of leadership: the leader key and the create revision it had when this replica won the election."""

    key: str
    revision: int


EtcdObserver = Callable[[str, float, bool], None]
"""Called with (store operation, seconds, failed) after each store operation; used by metrics."""


def _wrap_etcd(fn: Callable[..., _T]) -> Callable[..., _T]:
    """Turn etcd client errors into :class:`Unavailable` naming the endpoints, and report each call's duration."""

    @functools.wraps(fn)
    def wrapper(self: EtcdStore, *args: Any, **kwargs: Any) -> _T:
        started, failed = time.perf_counter(), True
        try:
            result = fn(self, *args, **kwargs)
            failed = False
            return result
        except CoordinatorError:
            failed = False  # a domain answer (NotFound, ...): etcd itself worked
            raise
        except (etcd3.exceptions.Etcd3Exception, grpc.RpcError, ValueError) as exc:
            # etcd3 raises a bare ValueError for an endpoint it marked failed; other ValueErrors are bugs.
            if type(exc) is ValueError and "failed node" not in str(exc):
                raise
            raise Unavailable(
                f"etcd at {','.join(self.endpoints)} did not answer {fn.__name__} ({type(exc).__name__}: {exc}); "
                f"the call is safe to retry once etcd is reachable"
            ) from exc
        finally:
            if self.observer is not None:
                self.observer(fn.__name__, time.perf_counter() - started, failed)

    return wrapper


def _range_end(prefix: str) -> bytes:
    return etcd3.utils.prefix_range_end(prefix.encode())


class EtcdStore:
    """All of the coordinator's reads and writes of etcd.

    Args:
        endpoints: etcd client URLs or host:port strings.
        prefix: root of every key.
        timeout_s: per-request deadline.
        observer: called with (operation, seconds, failed) after each operation (metrics).
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        prefix: str = "/pliant/v1",
        timeout_s: float = 5.0,
        observer: EtcdObserver | None = None,
    ) -> None:
        self.observer = observer
        self._specs: dict[str, tuple[JobSpec, int]] = {}  # job -> (spec, create revision of its key)
        self.timeout_s = timeout_s
        self._keepalive = KeepAliveStream(lambda: self.client.leasestub)
        if not endpoints:
            raise InvalidArgument("no etcd endpoint given; pass --etcd http://HOST:PORT[,...]")
        self.endpoints = tuple(endpoints)
        self.prefix = prefix.rstrip("/")
        eps = []
        for url in self.endpoints:
            host, port = parse_host_port(url, what="etcd endpoint")
            eps.append(etcd3.Endpoint(host, port, secure=False, time_retry=0.5))
        self.client = etcd3.MultiEndpointEtcd3Client(endpoints=eps, timeout=timeout_s, failover=True)
        self.tx = self.client.transactions

    def close(self) -> None:
        self._keepalive.close()
        self.client.close()

    # -- keys ----------------------------------------------------------------------------------------------------------

    @property
    def leader_key(self) -> str:
        return f"{self.prefix}/leader"

    @property
    def jobs_prefix(self) -> str:
        return f"{self.prefix}/jobs/"

    def job_key(self, job: str, *parts: str) -> str:
        return "/".join((f"{self.prefix}/jobs/{job}", *parts))

    def progress_key(self, job: str, node: str = "") -> str:
        return f"{self.prefix}/progress/{job}/{node}"

    def history_key(self, job: str, number: int) -> str:
        return self.job_key(job, "generations", f"{number:012d}")

    def _txn(self, compare: list[Any], success: list[Any], failure: list[Any] | None = None) -> tuple[bool, list[Any]]:
        return self.client.transaction(compare=compare, success=success, failure=failure or [])

    def _prefix_get(self, prefix: str) -> Any:
        return self.tx.get(prefix, _range_end(prefix))

    # -- leadership ----------------------------------------------------------------------------------------------------

    @_wrap_etcd
    def campaign(self, replica_id: str, ttl_s: float) -> tuple[Fence, int] | None:
        """Take the leader key if nobody holds it. Returns (fence, lease id) when won, else None."""
        if self.client.get(self.leader_key)[0] is not None:
            return None
        lease = self.client.lease(max(2, round(ttl_s)))
        ok, responses = self._txn(
            [self.tx.create(self.leader_key) == 0], [self.tx.put(self.leader_key, replica_id, lease=lease.id)]
        )
        if not ok:
            self._revoke_quietly(lease.id)
            return None
        return Fence(self.leader_key, responses[0].response_put.header.revision), lease.id

    @_wrap_etcd
    def leader(self) -> tuple[str, int]:
        """The current leader's replica id and fencing revision, ("", 0) when none."""
        value, meta = self.client.get(self.leader_key)
        return (value.decode(), meta.create_revision) if value is not None else ("", 0)

    @_wrap_etcd
    def resign(self, fence: Fence, lease_id: int) -> None:
        """Delete the leader key if it is still ours, and revoke our lease."""
        self._txn([self.tx.create(fence.key) == fence.revision], [self.tx.delete(fence.key)])
        self._revoke_quietly(lease_id)

    # -- jobs ----------------------------------------------------------------------------------------------------------

    @_wrap_etcd
    def create_job(self, spec: JobSpec, now: float) -> tuple[JobSpec, bool]:
        """Create ``spec``'s job; an identical existing job is returned with ``created=False``.

        Raises:
            AlreadyExists: a job with that id exists with a different spec.
        """
        spec_key = self.job_key(spec.job_id, "spec")
        ok, responses = self._txn(
            compare=[self.tx.create(spec_key) == 0],
            success=[
                self.tx.put(spec_key, spec.to_json()),
                self.tx.put(self.job_key(spec.job_id, "state"), JobStatus(JobState.WAITING, now).to_json()),
            ],
            failure=[self.tx.get(spec_key)],
        )
        if ok:
            logger.info("job %s created: %s", spec.job_id, spec)
            return spec, True
        existing = JobSpec.from_json(responses[0][0][0])
        diff = existing.differences(spec)
        if diff:
            raise AlreadyExists(
                f"job {spec.job_id!r} already exists with a different spec ({'; '.join(diff)}); "
                f"use another job id or the existing spec"
            )
        return existing, False

    @_wrap_etcd
    def list_job_ids(self) -> list[str]:
        ids = set()
        for _value, meta in self.client.get_prefix(self.jobs_prefix, keys_only=True):
            rest = meta.key.decode()[len(self.jobs_prefix) :]
            ids.add(rest.split("/", 1)[0])
        return sorted(ids)

    @_wrap_etcd
    def read_job(self, job: str) -> JobSnapshot:
        """Read everything the planner needs about ``job`` in one transaction (a single etcd revision).

        Raises:
            NotFound: no such job.
        """
        key = functools.partial(self.job_key, job)
        _, (spec, state, members, current, failures, departed) = self._txn(
            compare=[],
            success=[
                self.tx.get(key("spec")),
                self.tx.get(key("state")),
                self._prefix_get(key("members") + "/"),
                self.tx.get(key("generation")),
                self._prefix_get(key("failures") + "/"),
                self._prefix_get(key("departed") + "/"),
            ],
        )
        if not spec:
            raise NotFound(f"job {job!r} does not exist; create it first (pliant run / CreateJob) or check --job")
        generation = Generation.from_json(current[0][0]) if current else None
        gen_prefix = key("failures", f"{generation.number:012d}") + "/" if generation else None
        return JobSnapshot(
            spec=JobSpec.from_json(spec[0][0]),
            status=JobStatus.from_json(state[0][0]) if state else JobStatus(JobState.WAITING, 0.0),
            members=tuple(
                Member.from_json(v, order=m.create_revision, lease_id=m.lease_id)
                for v, m in sorted(members, key=lambda vm: vm[1].create_revision)
            ),
            generation=generation,
            failures=tuple(
                FailureReport.from_json(v) for v, m in failures if gen_prefix and m.key.decode().startswith(gen_prefix)
            ),
            departed=frozenset(m.key.decode().rsplit("/", 1)[1] for _v, m in departed),
            generation_mod_revision=current[0][1].mod_revision if current else 0,
        )

    @_wrap_etcd
    def finish_job(self, job: str, succeeded: bool, reason: str, now: float) -> JobStatus:
        """Mark ``job`` succeeded or failed. Finishing twice the same way is a no-op.

        Raises:
            NotFound: no such job.
            FailedPrecondition: the job already finished the other way.
        """
        state_key = self.job_key(job, "state")
        wanted = JobState.SUCCEEDED if succeeded else JobState.FAILED
        for _attempt in range(5):
            value, meta = self.client.get(state_key)
            if value is None:
                self.read_job(job)  # raises NotFound for an unknown job
                raise NotFound(f"job {job!r} has no state record; it is being created or deleted, retry")
            status = JobStatus.from_json(value)
            if status.state.terminal:
                if status.state == wanted:
                    return status
                raise FailedPrecondition(
                    f"job {job!r} already {status.state.value} ({status.reason or 'no reason given'}); "
                    f"it cannot become {wanted.value}"
                )
            new = JobStatus(wanted, now, reason)
            ok, _ = self._txn(
                compare=[self.tx.mod(state_key) == meta.mod_revision], success=[self.tx.put(state_key, new.to_json())]
            )
            if ok:
                logger.info("job %s %s: %s", job, wanted.value, reason or "(no reason)")
                return new
        raise Unavailable(f"job {job!r} state kept changing while finishing it; retry")

    # -- members -------------------------------------------------------------------------------------------------------

    @_wrap_etcd
    def join(self, job: str, member: Member, _retry: bool = True) -> tuple[int, int, float]:
        """Grant a lease of the job's heartbeat TTL and write ``member``'s key on it.

        Returns:
            (lease id, current generation number or 0, heartbeat TTL in seconds).

        Raises:
            NotFound: no such job. FailedPrecondition: the job finished. AlreadyExists: the node id holds a live lease.
        """
        spec, spec_revision = self._spec(job)
        member_key = self.job_key(job, "members", member.node_id)
        ttl_s = spec.heartbeat_ttl_s
        lease = self.client.lease(max(2, round(ttl_s)))
        stored = Member(member.node_id, member.address, member.slots, member.joined_at, 0, lease.id)
        # One transaction: the member key must be free and the spec the one cached (a job deleted and re-created under
        # the same id has another create revision); it also reads the state and generation the answer needs.
        ok, responses = self._txn(
            compare=[self.tx.create(member_key) == 0, self.tx.create(self.job_key(job, "spec")) == spec_revision],
            success=[
                self.tx.put(member_key, stored.to_json(), lease=lease.id),
                self.tx.delete(self.job_key(job, "departed", member.node_id)),
                self.tx.get(self.job_key(job, "state")),
                self.tx.get(self.job_key(job, "generation")),
            ],
            failure=[self.tx.get(member_key)],
        )
        if not ok:
            self._revoke_quietly(lease.id)
            if responses and responses[0]:
                holder = Member.from_json(responses[0][0][0])
                raise AlreadyExists(
                    f"node id {member.node_id!r} already holds a live membership in job {job!r} (address "
                    f"{holder.address}, lease {holder.lease_id:x}); give each agent a unique --node-id, or wait "
                    f"{ttl_s:g}s for the old lease to expire"
                )
            self._specs.pop(job, None)  # deleted, or re-created with another spec: read it again
            if _retry:
                return self.join(job, member, _retry=False)
            raise NotFound(f"job {job!r} was deleted while node {member.node_id!r} joined it")
        state_kv, gen_kv = responses[2], responses[3]
        status = JobStatus.from_json(state_kv[0][0]) if state_kv else JobStatus(JobState.WAITING, 0.0)
        if status.state.terminal:  # rare: undo the membership (checked here to save a read on every join)
            written = responses[0].response_put.header.revision
            self._txn([self.tx.mod(member_key) == written], [self.tx.delete(member_key)])
            self._revoke_quietly(lease.id)
            raise FailedPrecondition(
                f"job {job!r} already {status.state.value} ({status.reason}); start a new job id to train again"
            )
        generation = Generation.from_json(gen_kv[0][0]).number if gen_kv else 0
        logger.info("node %s joined job %s (lease %x, address %s)", member.node_id, job, lease.id, member.address)
        return lease.id, generation, ttl_s

    def _spec(self, job: str) -> tuple[JobSpec, int]:
        """The job's spec and its key's create revision; cached, since a job's spec never changes.

        Raises:
            NotFound: no such job.
        """
        cached = self._specs.get(job)
        if cached is not None:
            return cached
        value, meta = self.client.get(self.job_key(job, "spec"))
        if value is None:
            raise NotFound(f"job {job!r} does not exist; create it first (pliant run / CreateJob) or check --job")
        if len(self._specs) > 10_000:
            self._specs.clear()
        self._specs[job] = JobSpec.from_json(value), meta.create_revision
        return self._specs[job]

    @_wrap_etcd
    def heartbeat(self, lease_id: int) -> float:
        """Refresh ``lease_id`` and return its TTL.

        Raises:
            NotFound: the lease expired or was revoked; the node must Join again.
        """
        ttl = self._keepalive.refresh(lease_id, self.timeout_s)
        if ttl <= 0:
            raise NotFound(f"lease {lease_id:x} expired or was revoked; the node's membership is gone, Join again")
        return float(ttl)

    @_wrap_etcd
    def leave(self, job: str, node_id: str, lease_id: int) -> bool:
        """Gracefully remove ``node_id`` (marking the departure) and revoke its lease; False if it was not a member."""
        member_key = self.job_key(job, "members", node_id)
        ok, _ = self._txn(
            compare=[self.tx.create(member_key) > 0],
            success=[self.tx.delete(member_key), self.tx.put(self.job_key(job, "departed", node_id), "leave")],
        )
        if lease_id:
            self._revoke_quietly(lease_id)
        if ok:
            logger.info("node %s left job %s", node_id, job)
        return ok

    @_wrap_etcd
    def record_progress(self, job: str, node_id: str, lease_id: int, progress: MemberProgress) -> None:
        """Store ``node_id``'s latest step on its membership lease (gone with the membership)."""
        self.client.put(self.progress_key(job, node_id), progress.to_json(), lease=lease_id)

    @_wrap_etcd
    def progress(self, job: str, members: Sequence[Member]) -> dict[str, MemberProgress]:
        """Each member's progress: the recorded step and the age of its last heartbeat (from its lease's TTL)."""
        recorded = {
            meta.key.decode().rsplit("/", 1)[1]: MemberProgress.from_json(value)
            for value, meta in self.client.get_prefix(self.progress_key(job))
        }
        out = {}
        for member in members:
            age = -1.0
            if member.lease_id:
                info = self.client.get_lease_info(member.lease_id)
                if info.TTL > 0:
                    age = float(max(0, info.grantedTTL - info.TTL))
            step = recorded.get(member.node_id, MemberProgress())
            out[member.node_id] = MemberProgress(age, step.step, step.step_at)
        return out

    def _revoke_quietly(self, lease_id: int) -> None:
        try:
            self.client.revoke_lease(lease_id)
        except (etcd3.exceptions.Etcd3Exception, grpc.RpcError) as exc:
            logger.debug("revoking lease %x failed (it expires by itself): %s", lease_id, exc)

    def _current(self, job: str) -> tuple[Generation | None, int]:
        """The current generation and the mod revision of its key (NotFound for an unknown job)."""
        value, meta = self.client.get(self.job_key(job, "generation"))
        if value is None:
            self.read_job(job)  # NotFound for an unknown job
            return None, 0
        return Generation.from_json(value), meta.mod_revision

    @_wrap_etcd
    def report_failure(self, job: str, report: FailureReport, unreachable: Sequence[str] = ()) -> tuple[bool, int]:
        """Record a worker failure of the current generation, evicting the ``unreachable`` nodes in the same txn.

        Eviction deletes the nodes' member keys (so the planner sees their loss together with the failure) and then
        revokes their leases (so a node that was only partitioned learns at its next heartbeat and joins again).

        Returns:
            (accepted, current generation number): not accepted when the report names an older generation.
        """
        current, mod_revision = self._current(job)
        if current is None or report.generation != current.number:
            return False, current.number if current else 0
        suspects = [n for n in dict.fromkeys(unreachable) if n in current.node_ids and n != report.node_id]
        leases = []
        for node in suspects:
            value, _meta = self.client.get(self.job_key(job, "members", node))
            if value is not None:
                leases.append(Member.from_json(value).lease_id)
        key = self.job_key(job, "failures", f"{current.number:012d}", report.node_id)
        ops = [self.tx.put(key, report.to_json())]
        ops += [self.tx.delete(self.job_key(job, "members", n)) for n in suspects]
        ok, _ = self._txn([self.tx.mod(self.job_key(job, "generation")) == mod_revision], ops)
        if ok:
            for lease_id in leases:
                self._revoke_quietly(lease_id)
            logger.info(
                "failure reported in job %s generation %d by %s (exit %d)%s",
                job,
                current.number,
                report.node_id,
                report.exit_code,
                f"; evicted unreachable {suspects}" if suspects else "",
            )
        return ok, current.number

    @_wrap_etcd
    def report_success(self, job: str, node_id: str, generation: int, now: float) -> tuple[bool, int]:
        """A node's workers of ``generation`` all exited 0: mark the job succeeded if that generation is current."""
        current, _ = self._current(job)
        if current is None or generation != current.number or node_id not in current.node_ids:
            return False, current.number if current else 0
        status = self.finish_job(job, True, f"node {node_id}'s workers completed generation {generation}", now)
        return status.state is JobState.SUCCEEDED, current.number

    # -- generations and state (leader only) ---------------------------------------------------------------------------

    @_wrap_etcd
    def publish(self, snap: JobSnapshot, generation: Generation, status: JobStatus, fence: Fence) -> None:
        """Write ``generation`` as the job's current one and record ``status``, fenced.

        The transaction checks that the leader key still has the fence's create revision (this replica still leads)
        and that the current-generation key is unchanged since ``snap`` was read, so a deposed leader or a stale view
        can never publish, and no generation number is ever written twice.

        Raises:
            FencingError: either check failed; nothing was written.
        """
        job = snap.spec.job_id
        ops = [
            self.tx.put(self.job_key(job, "generation"), generation.to_json()),
            self.tx.put(self.history_key(job, generation.number), generation.to_json()),
            self.tx.put(self.job_key(job, "state"), status.to_json()),
            self.tx.delete(self.job_key(job, "departed") + "/", _range_end(self.job_key(job, "departed") + "/")),
        ]
        if snap.generation:
            old = self.job_key(job, "failures", f"{snap.generation.number:012d}") + "/"
            ops.append(self.tx.delete(old, _range_end(old)))
        if generation.number > HISTORY:
            ops.append(self.tx.delete(self.history_key(job, generation.number - HISTORY)))
        self._fenced(fence, [self.tx.mod(self.job_key(job, "generation")) == snap.generation_mod_revision], ops)

    @_wrap_etcd
    def set_status(self, job: str, status: JobStatus, fence: Fence) -> None:
        """Record the job's state (leader only, fenced)."""
        self._fenced(fence, [], [self.tx.put(self.job_key(job, "state"), status.to_json())])

    def _fenced(self, fence: Fence, compare: list[Any], ops: list[Any]) -> None:
        ok, _ = self._txn(compare=[self.tx.create(fence.key) == fence.revision, *compare], success=ops)
        if not ok:
            raise FencingError(
                f"write rejected: leadership (create revision {fence.revision}) or the job's generation changed"
            )

    @_wrap_etcd
    def generations_since(self, job: str, first: int) -> tuple[list[Generation], JobStatus]:
        """Generations numbered >= ``first`` still in the history (oldest first), and the job's state.

        Raises:
            NotFound: no such job.
        """
        start = self.history_key(job, max(first, 0))
        end = _range_end(self.job_key(job, "generations") + "/")
        _, (spec, state, history) = self._txn(
            compare=[],
            success=[
                self.tx.get(self.job_key(job, "spec")),
                self.tx.get(self.job_key(job, "state")),
                self.tx.get(start, end),
            ],
        )
        if not spec:
            raise NotFound(f"job {job!r} does not exist; check the job id")
        status = JobStatus.from_json(state[0][0]) if state else JobStatus(JobState.WAITING, 0.0)
        return [Generation.from_json(v) for v, _m in history], status
