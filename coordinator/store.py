"""The coordinator's state in etcd v3: jobs, leased members, fenced generations, failure reports.

Key layout under the prefix (default ``/pliant/v1``)::

    leader                              elected replica id (leased; its create revision is the fencing token)
    jobs/<job>/spec                     JobSpec JSON
    jobs/<job>/token                    "sha256:<hex>" of the job's join token (never the token itself)
    jobs/<job>/incarnation              a UUID written once with the spec: the job's incarnation
    (pliant.security.seal's fence)
    jobs/<job>/state                    JobStatus JSON (waiting | running | succeeded | failed)
    jobs/<job>/members/<node>           Member JSON, attached to the node's lease
    jobs/<job>/generation               the current Generation JSON
    jobs/<job>/generations/<n:012d>     history of the last HISTORY generations (resumable watches)
    jobs/<job>/failures/<n:012d>/<node> FailureReport JSON for generation n
    jobs/<job>/successes/<n:012d>/<node> {"at", "untrained"}: a member's report that its workers of generation n all
                                        exited 0; the job succeeds once every member of the current generation has
                                        one, or, when one says its workers never stepped in n, every member but n's
                                        newcomers (MemberStore.report_success)
    jobs/<job>/departed/<node>          marker of a graceful Leave (cleared by the next generation or a re-join)
    jobs/<job>/strikes/<node>           {"address", "count", "lifted", "lifts"}: failed readmissions (policy.struck;
                                        on a lease that lapses STRIKE_WINDOW_S after the last strike; see policy)
    seal-root                           the sealing secret, hex (pliant.security.seal), unless the coordinator is given
    one
    revoked/<serial hex>                a revoked certificate (Revocation JSON), on a lease that lapses after it expires
    certs/<node>                        {"serial", "not_after"} of the agent certificate last signed for the node id
    namespaces/<ns>/token               "sha256:<hex>" of namespace <ns>'s join token: it creates jobs "<ns>.<name>"
                                        at the bootstrap join, which then have it as their token
    index/<job>                         one empty key per job: lists and counts jobs without reading their keys
    progress/<job>/<node>               MemberProgress JSON (latest step), attached to the node's lease; outside
                                        jobs/ so that its writes never wake the reconciler

Every mutation is one etcd transaction, so nothing is ever written half-way. etcd's lost connections are wrapped into
:class:`Unavailable` (safe to retry), its size and space-quota errors into :class:`ResourceExhausted` (not); a
generation write whose fence fails raises :class:`FencingError`. A member acts only through the lease its member key is
bound to: :meth:`EtcdStore.check_member` is the one place that proves it.
"""

from __future__ import annotations

import functools
import hmac
import json
import logging
import uuid
from typing import Any

from pliant.coordinator.contract import (
    AlreadyExists,
    FailedPrecondition,
    FailureReport,
    FencingError,
    Generation,
    JobSnapshot,
    JobSpec,
    JobState,
    JobStatus,
    Member,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Revocation,
    Strike,
    Unauthenticated,
    Unavailable,
    job_namespace,
)
from pliant.coordinator.outcome import outcome_of
from pliant.coordinator.policy import may_overwrite
from pliant.coordinator.seats import Seats
from pliant.coordinator.store_base import (
    HISTORY,
    EtcdObserver,
    Fence,
    decode,
    etcd_call,
    range_end,
    read_strike,
    token_digest,
)
from pliant.coordinator.store_members import MemberStore

__all__ = ["HISTORY", "EtcdObserver", "EtcdStore", "Fence"]

logger = logging.getLogger(__name__)

_NO_STATE = JobStatus(JobState.WAITING, 0.0)
REVOKED_KEEP_S = 400 * 24 * 3600.0  # a revocation whose certificate's expiry is unknown is kept this long


def _strike(value: bytes, meta: Any) -> Strike:
    """A strike record, its node id from its key (see :func:`pliant.coordinator.store_base.read_strike`)."""
    record = read_strike(meta.key, value)
    return Strike(
        meta.key.decode().rsplit("/", 1)[1], record.address, record.count, lifted=record.lifted, missed=record.missed
    )


EVICTIONS_PER_TXN = 120
"""Members evicted in one etcd transaction (etcd's --max-txn-ops is 128 by default, compares and operations each)."""


class EtcdStore(MemberStore):
    """All of the coordinator's reads and writes of etcd: leadership, jobs and generations here, members in
    :class:`MemberStore`, the client and keys in :class:`EtcdBase`.
    """

    # -- leadership ----------------------------------------------------------------------------------------------------

    @etcd_call
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

    @etcd_call
    def leader(self) -> tuple[str, int]:
        """The current leader's replica id and fencing revision, ("", 0) when none."""
        value, meta = self.client.get(self.leader_key)
        return (value.decode(), meta.create_revision) if value is not None else ("", 0)

    @etcd_call
    def resign(self, fence: Fence, lease_id: int) -> None:
        """Delete the leader key if it is still ours, and revoke our lease."""
        self._txn([self.tx.create(fence.key) == fence.revision], [self.tx.delete(fence.key)])
        self._revoke_quietly(lease_id)

    # -- jobs ----------------------------------------------------------------------------------------------------------

    @etcd_call
    def create_job(
        self, spec: JobSpec, now: float, token: str, max_jobs: int = 0, same_token: bool = True
    ) -> tuple[JobSpec, bool]:
        """Create ``spec``'s job with join token ``token`` (only its digest is stored); an identical existing job is
        returned with ``created=False`` (when ``same_token``, only if it has that token).

        Raises:
            AlreadyExists: a job with that id exists with a different spec or join token.
            ResourceExhausted: ``max_jobs`` jobs exist already (0: no limit).
        """
        job = spec.job_id
        spec_key, token_key = self.job_key(job, "spec"), self.job_key(job, "token")
        if max_jobs and self.client.get(spec_key)[0] is None:
            count = len(self.list_job_ids())
            if count >= max_jobs:
                raise ResourceExhausted(
                    f"this coordinator holds {count} jobs, its limit (--max-jobs {max_jobs}); delete finished jobs "
                    f"(DeleteJob), wait for --finished-job-ttl to remove them, or raise --max-jobs"
                )
        ok, responses = self._txn(
            compare=[self.tx.create(spec_key) == 0],
            success=[
                self.tx.put(spec_key, spec.to_json()),
                self.tx.put(self.job_key(job, "state"), JobStatus(JobState.WAITING, now).to_json()),
                self.tx.put(token_key, token_digest(token)),
                self.tx.put(self.job_key(job, "incarnation"), uuid.uuid4().hex),
                self.tx.put(self.index_key(job), ""),
            ],
            failure=[self.tx.get(spec_key), self.tx.get(token_key)],
        )
        if ok:
            logger.info("job %s created: %s", job, spec)
            return spec, True
        existing = decode(spec_key, JobSpec.from_json, responses[0][0][0])
        diff = existing.differences(spec)
        if diff:
            raise AlreadyExists(
                f"job {job!r} already exists with a different spec ({'; '.join(diff)}); use another job id or the "
                f"existing spec"
            )
        stored = responses[1][0][0].decode() if responses[1] else ""
        if same_token and not hmac.compare_digest(stored, token_digest(token)):
            raise AlreadyExists(
                f"job {job!r} already exists with another join token; join it with the token its creator was given, "
                f"or rotate the token (RotateJoinToken, admin)"
            )
        return existing, False

    def namespace_token_key(self, namespace: str) -> str:
        return f"{self.prefix}/namespaces/{namespace}/token"

    @etcd_call
    def set_namespace_token(self, namespace: str, token: str, rotate: bool = False) -> bool:
        """Register ``token`` as ``namespace``'s join token; returns whether anything changed (the same token again is
        a no-op). With ``rotate`` a registered token is replaced, and so is the token of every job of the namespace
        that had it (jobs its holders created), so that their pods join with the new one.

        Raises:
            AlreadyExists: another token is registered and ``rotate`` is not set.
        """
        key, digest = self.namespace_token_key(namespace), token_digest(token)
        ok, responses = self._txn([self.tx.create(key) == 0], [self.tx.put(key, digest)], [self.tx.get(key)])
        if ok:
            logger.info("namespace %s: join token registered", namespace)
            return True
        stored = responses[0][0][0].decode()
        if hmac.compare_digest(stored, digest):
            return False
        if not rotate:
            raise AlreadyExists(
                f"namespace {namespace!r} has a join token already (its Secret is in that namespace); pass --rotate "
                f"to replace it"
            )
        ok, _ = self._txn([self.tx.value(key) == stored], [self.tx.put(key, digest)])
        if not ok:
            raise Unavailable(f"namespace {namespace!r}'s join token changed while it was being rotated; retry")
        for job in self.list_job_ids():
            if job_namespace(job) == namespace:
                token_key = self.job_key(job, "token")
                self._txn([self.tx.value(token_key) == stored], [self.tx.put(token_key, digest)])
                self._token_digests.pop(job, None)
        logger.info("namespace %s: join token rotated", namespace)
        return True

    @etcd_call
    def create_namespaced_job(self, spec: JobSpec, now: float, token: str, max_jobs: int = 0) -> tuple[JobSpec, bool]:
        """:meth:`create_job` for the holder of a namespace's join token: only a job of that namespace
        (``<namespace>.<name>``), whose join token is then the namespace's.

        Raises:
            PermissionDenied: the job id names no namespace. Unauthenticated: ``token`` is not its namespace's.
            AlreadyExists: the job exists with another spec or token.
        """
        namespace = job_namespace(spec.job_id)
        if not namespace:
            raise PermissionDenied(
                f"job {spec.job_id[:100]!r} belongs to no namespace: a namespace's join token creates only jobs named "
                f"<namespace>.<name>; have an admin create it (pliant job create)"
            )
        stored = self.client.get(self.namespace_token_key(namespace))[0]
        if not token or stored is None or not hmac.compare_digest(stored.decode(), token_digest(token)):
            raise Unauthenticated(
                f"the join token is not namespace {namespace!r}'s: use the token of the Secret `pliant k8s namespace "
                f"--namespace {namespace}` printed"
            )
        return self.create_job(spec, now, token, max_jobs, same_token=True)

    @etcd_call
    def list_job_ids(self) -> list[str]:
        prefix = self.index_key("")
        return sorted(meta.key.decode()[len(prefix) :] for _v, meta in self.client.get_prefix(prefix, keys_only=True))

    @etcd_call
    def delete_job(self, job: str, force: bool = False) -> None:
        """Delete a finished job (with ``force``, any job): every key of it, and the leases of members still holding
        one. A forced delete uses plain deletes, which etcd serves under its NOSPACE alarm (where a job cannot be
        finished first), so it is how space is freed then.

        Raises:
            NotFound: no such job. FailedPrecondition: the job has not finished (and no ``force``).
        """
        snap = self.read_job(job)
        prefix = self.job_key(job) + "/"
        if force:
            self.client.delete_prefix(prefix)
            self.client.delete_prefix(self.progress_key(job))
            self.client.delete(self.index_key(job))
            self._forget(job, snap)
            logger.warning("job %s deleted while %s (forced)", job, snap.status.state.value)
            return
        if not snap.status.state.terminal:
            raise FailedPrecondition(
                f"job {job!r} is {snap.status.state.value}; finish it first (FinishJob / pliant job finish), then "
                f"delete it, or delete it unfinished with --force"
            )
        ok, _ = self._txn(
            compare=[self.tx.mod(self.job_key(job, "state")) == snap.status_mod_revision],
            success=[
                self.tx.delete(prefix, range_end(prefix)),
                self.tx.delete(self.progress_key(job), range_end(self.progress_key(job))),
                self.tx.delete(self.index_key(job)),
            ],
        )
        if not ok:
            raise Unavailable(f"job {job!r} changed while it was being deleted; retry")
        self._forget(job, snap)

    def _forget(self, job: str, snap: JobSnapshot) -> None:
        """``job`` was deleted: revoke its members' leases and drop what this replica cached of it."""
        for member in snap.members:
            self._revoke_quietly(member.lease_id)
        self._specs.pop(job, None)
        self._token_digests.pop(job, None)
        logger.info("job %s deleted (%s)", job, snap.status.state.value)

    @etcd_call
    def rotate_token(self, job: str, token: str) -> None:
        """Replace ``job``'s join token (members already joined keep their leases).

        Raises:
            NotFound: no such job.
        """
        token_key = self.job_key(job, "token")
        spec_exists = self.tx.create(self.job_key(job, "spec")) > 0
        ok, _ = self._txn(compare=[spec_exists], success=[self.tx.put(token_key, token_digest(token))])
        if not ok:
            raise NotFound(f"job {job!r} does not exist; check the job id")
        self._token_digests[job] = token_digest(token)
        logger.info("job %s: join token rotated", job)

    @etcd_call
    def read_job(self, job: str) -> JobSnapshot:
        """Read everything the planner needs about ``job`` at a single etcd revision: one range read of the job's
        keys (a read, so it is served under etcd's NOSPACE alarm too, where every transaction is refused).

        Raises:
            NotFound: no such job.
        """
        key = functools.partial(self.job_key, job)
        prefix = key() + "/"
        found: dict[str, list[tuple[bytes, Any]]] = {}
        for value, meta in self.client.get_prefix(prefix):
            name = meta.key.decode()[len(prefix) :]
            kind = name.split("/", 1)[0] if "/" in name else name
            found.setdefault(kind, []).append((value, meta))
        if "spec" not in found:
            raise NotFound(f"job {job!r} does not exist; create it first (pliant run / CreateJob) or check --job")
        spec, state, current = found["spec"][0], found.get("state"), found.get("generation")
        incarnation = found.get("incarnation")
        generation = decode(key("generation"), Generation.from_json, current[0][0]) if current else None
        gen_prefix = key("failures", f"{generation.number:012d}") + "/" if generation else None
        members = found.get("members", [])
        return JobSnapshot(
            spec=decode(key("spec"), JobSpec.from_json, spec[0]),
            status=decode(key("state"), JobStatus.from_json, state[0][0]) if state else _NO_STATE,
            members=tuple(
                decode(m.key, lambda v, m=m: Member.from_json(v, order=m.create_revision, lease_id=m.lease_id), v)
                for v, m in sorted(members, key=lambda vm: vm[1].create_revision)
            ),
            generation=generation,
            failures=tuple(
                decode(m.key, FailureReport.from_json, v)
                for v, m in sorted(found.get("failures", []), key=lambda vm: vm[1].mod_revision)
                if gen_prefix and m.key.decode().startswith(gen_prefix)
            ),
            departed=frozenset(m.key.decode().rsplit("/", 1)[1] for _v, m in found.get("departed", [])),
            strikes=tuple(_strike(v, m) for v, m in found.get("strikes", [])),
            generation_mod_revision=current[0][1].mod_revision if current else 0,
            status_mod_revision=state[0][1].mod_revision if state else 0,
            # A job created before incarnations were written: its spec key's create revision stands in.
            incarnation=incarnation[0][0].decode() if incarnation else f"rev-{spec[1].create_revision}",
        )

    @etcd_call
    def finish_job(
        self, job: str, succeeded: bool, reason: str, now: float, generation: Generation | None = None
    ) -> JobStatus:
        """Mark ``job`` succeeded or failed, with its outcome (:func:`pliant.coordinator.outcome.outcome_of` of
        ``generation``, by default its current one); the reason of a finish with ``generation`` (the members' reports)
        leads with what the outcome names. Finishing twice the same way is a no-op.

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
            status = decode(state_key, JobStatus.from_json, value)
            if status.state.terminal:
                if status.state == wanted:
                    return status
                raise FailedPrecondition(
                    f"job {job!r} already {status.state.value} ({status.reason or 'no reason given'}); "
                    f"it cannot become {wanted.value}"
                )
            gen = generation if generation is not None or not succeeded else self._current(job)[0]
            outcome, text = outcome_of(succeeded, gen, reason)
            # The members' reports are narrated with the outcome; an admin's FinishJob keeps its own words.
            new = JobStatus(wanted, now, text if generation is not None else reason, outcome)
            ok, _ = self._txn(
                compare=[self.tx.mod(state_key) == meta.mod_revision], success=[self.tx.put(state_key, new.to_json())]
            )
            if ok:
                logger.info("job %s %s: %s", job, wanted.value, new.reason or "(no reason)")
                return new
        raise Unavailable(f"job {job!r} state kept changing while finishing it; retry")

    # -- an embedded control plane's seats (pliant.coordinator.seats) -------------------------------------------------

    @property
    def seats_key(self) -> str:
        return f"{self.prefix}/control-plane/seats"

    @etcd_call
    def read_seats(self) -> tuple[Seats | None, int]:
        """The seats record and its mod revision (None, 0: this control plane has no seats)."""
        value, meta = self.client.get(self.seats_key)
        if value is None:
            return None, 0
        return decode(self.seats_key, Seats.from_json, value), meta.mod_revision

    @etcd_call
    def write_seats(self, seats: Seats, mod_revision: int) -> bool:
        """Write the seats record if it is still at ``mod_revision`` (0: absent); False when it changed meanwhile."""
        key = self.seats_key
        compare = [self.tx.mod(key) == mod_revision] if mod_revision else [self.tx.version(key) == 0]
        ok, _ = self._txn(compare=compare, success=[self.tx.put(key, seats.to_json())])
        return bool(ok)

    # -- certificates: the denylist and the agent certificate each node id holds -------------------------------------

    @property
    def revoked_prefix(self) -> str:
        return f"{self.prefix}/revoked/"

    @etcd_call
    def revoke(self, record: Revocation, now: float) -> None:
        """Add ``record`` to the denylist, on a lease that lapses once its certificate has expired anyway (a record
        whose expiry is unknown lasts :data:`REVOKED_KEEP_S`)."""
        left = record.not_after - now if record.not_after else REVOKED_KEEP_S
        lease = self.client.lease(int(min(max(left, 0.0), REVOKED_KEEP_S)) + 3600)
        self.client.put(f"{self.revoked_prefix}{record.serial:x}", record.to_json(), lease=lease.id)
        logger.warning("certificate serial %x (%s) revoked: %s", record.serial, record.subject, record.reason)

    @etcd_call
    def revoked(self) -> dict[int, Revocation]:
        """The denylist: serial -> its record (unreadable records are skipped, and logged)."""
        out = {}
        for value, meta in self.client.get_prefix(self.revoked_prefix):
            try:
                record = Revocation.from_json(value)
            except (ValueError, TypeError) as exc:
                logger.warning("denylist record %s is unreadable (%s); skipped", meta.key.decode(), exc)
                continue
            out[record.serial] = record
        return out

    @etcd_call
    def replace_agent_cert(
        self, job: str, node: str, serial: int, not_after: float, now: float
    ) -> tuple[int, float] | None:
        """Record that node id ``node`` now holds the agent certificate ``serial`` of job ``job``; returns the
        (serial, expiry) of the one it held before in that job, if any (the caller revokes it: one node id, one
        certificate, one job).

        Raises:
            AlreadyExists: the node id holds a certificate of another job that is valid at ``now``; nothing written.
        """
        key = f"{self.prefix}/certs/{node}"
        record = json.dumps({"serial": f"{serial:x}", "not_after": not_after, "job": job})
        for _attempt in range(5):
            value, meta = self.client.get(key)
            old = None
            if value is not None:
                try:
                    data = json.loads(value)
                    old = (int(data["serial"], 16), float(data["not_after"]), str(data.get("job", job)))
                except (ValueError, KeyError, TypeError):
                    old = None
            if old is not None and old[2] != job and old[1] > now:
                raise AlreadyExists(
                    f"node id {node!r} holds a certificate of another job until it expires; give this node another "
                    f"--node-id (the default, HOSTNAME-PID, is unique)"
                )
            unchanged = self.tx.mod(key) == meta.mod_revision if meta is not None else self.tx.version(key) == 0
            ok, _ = self._txn([unchanged], [self.tx.put(key, record)])
            if ok:
                return old[:2] if old is not None and old[2] == job else None
        raise Unavailable(f"the certificate record of node {node!r} kept changing; try again")

    # -- generations and state (leader only) ---------------------------------------------------------------------------

    @etcd_call
    def publish(self, snap: JobSnapshot, generation: Generation, status: JobStatus, fence: Fence) -> None:
        """Write ``generation`` as the job's current one and record ``status``, fenced.

        The transaction checks that the leader key still has the fence's create revision (this replica still leads)
        and that the current-generation and state keys are unchanged since ``snap`` was read, so a deposed leader or a
        stale view can never publish, no generation number is ever written twice, and a job finished meanwhile
        (FinishJob) stays finished.

        Raises:
            FencingError: either check failed; nothing was written.
        """
        job = snap.spec.job_id
        ops = [
            self.tx.put(self.job_key(job, "generation"), generation.to_json()),
            self.tx.put(self.history_key(job, generation.number), generation.to_json()),
            self.tx.put(self.job_key(job, "state"), status.to_json()),
            self.tx.delete(self.job_key(job, "departed") + "/", range_end(self.job_key(job, "departed") + "/")),
        ]
        if snap.generation:
            for kind in ("failures", "successes"):
                old = self.job_key(job, kind, f"{snap.generation.number:012d}") + "/"
                ops.append(self.tx.delete(old, range_end(old)))
        if generation.number > HISTORY:
            ops.append(self.tx.delete(self.history_key(job, generation.number - HISTORY)))
        self._guard(snap)
        self._fenced(
            fence,
            [
                self.tx.mod(self.job_key(job, "generation")) == snap.generation_mod_revision,
                self.tx.mod(self.job_key(job, "state")) == snap.status_mod_revision,
            ],
            ops,
        )

    @etcd_call
    def set_status(self, snap: JobSnapshot, status: JobStatus, fence: Fence) -> None:
        """Record the job's state (leader only), fenced by leadership and by the state record read in ``snap``.

        Raises:
            FencingError: leadership or the state record changed since ``snap``; or the state read is terminal.
        """
        self._guard(snap)
        key = self.job_key(snap.spec.job_id, "state")
        self._fenced(fence, [self.tx.mod(key) == snap.status_mod_revision], [self.tx.put(key, status.to_json())])

    @etcd_call
    def evict(self, snap: JobSnapshot, nodes: tuple[str, ...], fence: Fence, keep: tuple[str, ...] = ()) -> None:
        """Remove members (leader only, fenced): delete their member keys, if still the ones read in ``snap`` (and the
        keys of the ``keep`` members too: those whose reports evict them), then revoke their leases, so a node that
        was only cut off learns it at its next heartbeat and joins again."""
        job = snap.spec.job_id
        gone = [m for m in snap.members if m.node_id in nodes]
        held = [(self.job_key(job, "members", m.node_id), m) for m in snap.members if m.node_id in keep]
        held = held[:EVICTIONS_PER_TXN]  # etcd takes at most 128 compares in one transaction
        # In transactions of at most EVICTIONS_PER_TXN members, the first one also checking the kept members: a job
        # of thousands whose nodes all went silent at once is evicted in a few.
        first = max(1, EVICTIONS_PER_TXN - len(held))
        chunks = [gone[:first]] + [gone[i : i + EVICTIONS_PER_TXN] for i in range(first, len(gone), EVICTIONS_PER_TXN)]
        for chunk in chunks:
            keys = [self.job_key(job, "members", m.node_id) for m in chunk]
            compare = [self.tx.create(k) == m.order for k, m in [*zip(keys, chunk, strict=True), *held]]
            self._fenced(fence, compare, [self.tx.delete(k) for k in keys])
            held = []
            for member in chunk:
                self._revoke_quietly(member.lease_id)
                self._bound.pop(member.lease_id, None)

    @staticmethod
    def _guard(snap: JobSnapshot) -> None:
        if not may_overwrite(snap.status):
            raise FencingError(
                f"job {snap.spec.job_id!r} is {snap.status.state.value}; a finished job's state is never overwritten"
            )

    def _fenced(self, fence: Fence, compare: list[Any], ops: list[Any]) -> None:
        ok, _ = self._txn(compare=[self.tx.create(fence.key) == fence.revision, *compare], success=ops)
        if not ok:
            raise FencingError(
                f"write rejected: leadership (create revision {fence.revision}) or the job's generation changed"
            )

    @etcd_call
    def generations_since(self, job: str, first: int) -> tuple[list[Generation], JobStatus]:
        """Generations numbered >= ``first`` still in the history (oldest first), and the job's state.

        Raises:
            NotFound: no such job.
        """
        start = self.history_key(job, max(first, 0))
        end = range_end(self.job_key(job, "generations") + "/")
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
        status = JobStatus(JobState.WAITING, 0.0)
        if state:
            status = decode(self.job_key(job, "state"), JobStatus.from_json, state[0][0])
        return [decode(m.key, Generation.from_json, v) for v, m in history], status
