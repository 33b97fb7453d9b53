"""Members in etcd: Join (with the job's token), the lease binding that authorizes a member's calls, heartbeats,
graceful leaves, progress, and failure and success reports.

A member acts only through the lease its member key is bound to: :meth:`MemberStore.check_member` is the one place
that proves it.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
from collections.abc import Sequence
from typing import Any

from etcd3 import etcdrpc

from pliant.coordinator.contract import (
    Admission,
    AlreadyExists,
    FailureCause,
    FailureReport,
    Generation,
    InvalidArgument,
    JobFinished,
    JobSpec,
    JobState,
    JobStatus,
    Member,
    MemberProgress,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from pliant.coordinator.liveness import ProgressWrite
from pliant.coordinator.policy import (
    BACKOFF_MAX_S,
    CHURN_WINDOW_S,
    LIFTS_PER_STRIKE,
    STRIKE_WINDOW_S,
    Reported,
    backoff_s,
    check_report,
    judge_report,
    next_strike,
    silent_members,
)
from pliant.coordinator.store_base import EtcdBase, StrikeRecord, decode, etcd_call, read_strike, token_digest

__all__ = ["MemberStore"]

logger = logging.getLogger(__name__)

LOOKUPS_IN_FLIGHT = 128
"""Lease lookups a sweep keeps in flight at once."""


class MemberStore(EtcdBase):
    """The member operations of the store (see :class:`pliant.coordinator.store.EtcdStore`)."""

    @etcd_call
    def join(self, job: str, member: Member, token: str, _retry: bool = True) -> Admission:
        """Check the join token, grant a lease of the job's heartbeat TTL and write ``member``'s key on it.

        The token's digest is compared inside the transaction that writes the member key, so a token rotated on
        another replica takes effect at once; a wrong token is refused before any lease is granted.

        Returns:
            the lease, the current generation number (0: none yet), the heartbeat TTL and the job's checkpoint key.

        Raises:
            NotFound: no such job. JobFinished: the job finished. AlreadyExists: the node id holds a live lease.
            Unauthenticated: the token is missing or wrong. InvalidArgument: ``member.slots`` exceeds the spec's
            ``nproc_per_node``.
        """
        spec, spec_revision = self._spec(job)
        if member.slots > spec.nproc_per_node:
            raise InvalidArgument(
                f"slots={member.slots} exceeds job {job!r}'s nproc_per_node={spec.nproc_per_node}: a node runs at most "
                f"that many workers; pass --nproc-per-node {spec.nproc_per_node} or less"
            )
        with self._joining:
            admitted = self._join(job, spec, spec_revision, member, token)
        if admitted is not None:
            return admitted
        if _retry:  # the spec changed under the cached one: read it again, once
            return self.join(job, member, token, _retry=False)
        raise NotFound(f"job {job!r} was deleted while node {member.node_id!r} joined it")

    def _join(self, job: str, spec: JobSpec, spec_revision: int, member: Member, token: str) -> Admission | None:
        """:meth:`join` with the spec read; None when the job's spec is no longer the one read."""
        member_key = self.job_key(job, "members", member.node_id)
        token_key = self.job_key(job, "token")
        digest = self._check_token(job, token)
        ttl_s = spec.heartbeat_ttl_s
        # A long lease: the leader, not etcd, decides when a silent member goes (coordinator.policy), so a
        # control-plane outage shorter than the lease evicts nobody.
        lease = self.client.lease(max(2, round(max(ttl_s, self.membership_lease_s))))
        stored = Member(member.node_id, member.address, member.slots, member.joined_at, 0, lease.id)
        # One transaction: the member key must be free and the spec the one cached (a job deleted and re-created under
        # the same id has another create revision); it also reads the state and generation the answer needs.
        ok, responses = self._txn(
            compare=[
                self.tx.create(member_key) == 0,
                self.tx.create(self.job_key(job, "spec")) == spec_revision,
                self.tx.value(token_key) == digest,
            ],
            success=[
                self.tx.put(member_key, stored.to_json(), lease=lease.id),
                self.tx.delete(self.job_key(job, "departed", member.node_id)),
                self.tx.get(self.job_key(job, "state")),
                self.tx.get(self.job_key(job, "generation")),
            ],
            failure=[self.tx.get(member_key), self.tx.get(token_key)],
        )
        if not ok:
            self._revoke_quietly(lease.id)
            if responses and responses[0]:
                holder = decode(member_key, Member.from_json, responses[0][0][0])
                raise AlreadyExists(
                    f"node id {member.node_id!r} already holds a live membership in job {job!r} (address "
                    f"{holder.address}); give each agent a unique --node-id, or wait {ttl_s:g}s for the old lease to "
                    f"expire"
                )
            self._token_digests.pop(job, None)
            if responses and responses[1] and responses[1][0][0].decode() != digest:
                raise Unauthenticated(
                    f"the join token for job {job!r} was rotated while node {member.node_id!r} "
                    f"joined; ask the job's admin for the new token"
                )
            self._specs.pop(job, None)  # deleted, or re-created with another spec: read it again
            return None
        state_kv, gen_kv = responses[2], responses[3]
        status = JobStatus(JobState.WAITING, 0.0)
        if state_kv:
            status = decode(self.job_key(job, "state"), JobStatus.from_json, state_kv[0][0])
        if status.state.terminal:  # rare: undo the membership (checked here to save a read on every join)
            written = responses[0].response_put.header.revision
            self._txn([self.tx.mod(member_key) == written], [self.tx.delete(member_key)])
            self._revoke_quietly(lease.id)
            raise JobFinished(job, status.state, status.reason)
        generation = decode(self.job_key(job, "generation"), Generation.from_json, gen_kv[0][0]).number if gen_kv else 0
        self._bound[lease.id] = (job, member.node_id)
        logger.info("node %s joined job %s (address %s)", member.node_id, job, member.address)
        keys = self.job_keys(job)
        return Admission(lease.id, generation, ttl_s, keys.checkpoint, keys.agent, keys.control)

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
        self._specs[job] = decode(self.job_key(job, "spec"), JobSpec.from_json, value), meta.create_revision
        return self._specs[job]

    def _check_token(self, job: str, token: str) -> str:
        """Raise Unauthenticated unless ``token`` is ``job``'s join token; return its digest. A digest that matches the
        cached one is not read again (the caller's transaction re-checks it where it writes)."""
        digest = token_digest(token)
        cached = self._token_digests.get(job)
        if cached is None or not hmac.compare_digest(cached, digest):
            value = self.client.get(self.job_key(job, "token"))[0]
            cached = value.decode() if value is not None else ""
            if len(self._token_digests) > 10_000:
                self._token_digests.clear()
            self._token_digests[job] = cached
        if not token or not hmac.compare_digest(cached, digest):
            raise _token_refused(job, token)
        return digest

    @etcd_call
    def check_token(self, job: str, token: str) -> None:
        """Prove that ``token`` is ``job``'s join token (the bootstrap join's proof that a node may join).

        Raises:
            Unauthenticated: the token is missing or wrong, or there is no such job (the same answer: a caller without
                the token learns nothing, not even whether the job exists). JobFinished: the job finished.
        """
        try:
            self._spec(job)
        except NotFound:
            raise _token_refused(job, token) from None
        self._check_token(job, token)
        state = self.client.get(self.job_key(job, "state"))[0]
        status = decode(self.job_key(job, "state"), JobStatus.from_json, state) if state is not None else None
        if status is not None and status.state.terminal:
            raise JobFinished(job, status.state, status.reason)

    @etcd_call
    def check_member(self, job: str, node_id: str, lease_id: int) -> None:
        """Prove that ``lease_id`` is the lease ``node_id``'s member key in ``job`` is bound to.

        A lease once seen bound to a member key stays bound to it until it dies (Join grants a fresh lease every time),
        so the answer is cached: a heartbeat reads etcd only the first time a replica sees its lease.

        Raises:
            NotFound: the node has no live membership (it must Join again).
            PermissionDenied: the membership is bound to another lease; nothing is touched.
        """
        if self._bound.get(lease_id) == (job, node_id):
            return
        value, meta = self.client.get(self.job_key(job, "members", node_id))
        if value is None:
            raise NotFound(
                f"node {node_id!r} has no live membership in job {job!r} (its lease expired or was revoked: "
                f"it went silent, left or was evicted); Join again"
            )
        if meta.lease_id != lease_id:
            raise PermissionDenied(
                f"the lease sent is not the one node {node_id!r}'s membership in job {job!r} holds; a node acts only "
                f"with the lease_id its own Join returned"
            )
        if len(self._bound) > 100_000:  # leases come and go: forget them all now and then
            self._bound.clear()
        self._bound[lease_id] = (job, node_id)

    @etcd_call
    def is_member(self, job: str, node_id: str) -> bool:
        """True while ``node_id`` holds a live membership in ``job``."""
        return self.client.get(self.job_key(job, "members", node_id))[0] is not None

    @etcd_call
    def heartbeat(self, job: str, node_id: str, lease_id: int) -> float:
        """Keep ``node_id``'s membership lease alive and return the job's heartbeat TTL. The caller proved the lease is
        the node's own with :meth:`check_member` (the servicer's ``_authorize``); ``job`` and ``node_id`` name it in
        errors. A lease etcd confirmed lately is answered from memory and refreshed with the next batch; any other is
        refreshed now (:mod:`pliant.coordinator.liveness`).

        Raises:
            NotFound: the lease expired or was revoked; the node must Join again.
        """
        ttl = self._spec(job)[0].heartbeat_ttl_s
        if self._pump.beat(lease_id, ttl):
            return ttl
        try:
            self._pump.refresh_now(lease_id, lambda: self.refresh_lease(lease_id))
        except NotFound:
            self._bound.pop(lease_id, None)
            raise NotFound(
                f"node {node_id!r}'s membership lease in job {job!r} expired or was revoked; Join again"
            ) from None
        return ttl

    @etcd_call
    def leave(self, job: str, node_id: str, lease_id: int) -> bool:
        """Gracefully remove ``node_id`` (marking the departure) and revoke its lease; False if it was not a member.

        Raises:
            PermissionDenied: ``lease_id`` is not the node's membership lease (nothing is touched).
        """
        member_key = self.job_key(job, "members", node_id)
        value, meta = self.client.get(member_key)
        if value is None:
            return False
        if meta.lease_id != lease_id:
            raise PermissionDenied(
                f"the lease sent is not the one node {node_id!r}'s membership in job {job!r} "
                f"holds; a node leaves only with the lease_id its own Join returned"
            )
        ok, _ = self._txn(
            compare=[self.tx.mod(member_key) == meta.mod_revision],
            success=[self.tx.delete(member_key), self.tx.put(self.job_key(job, "departed", node_id), "leave")],
        )
        if ok:
            self._revoke_quietly(lease_id)
            self._bound.pop(lease_id, None)
            logger.info("node %s left job %s", node_id, job)
            self._count_churn(job, node_id, decode(member_key, Member.from_json, value).address)
        return ok

    def _count_churn(self, job: str, node_id: str, address: str) -> None:
        """Count a graceful leave of ``node_id``; from the second within :data:`CHURN_WINDOW_S` on, each earns a
        strike at ``address`` (:func:`pliant.coordinator.policy.held_back`): a node that leaves and joins again and
        again waits ever longer before it is admitted, so one member cannot make a generation a second."""
        churn_key, strike_key = self.job_key(job, "churn", node_id), self.job_key(job, "strikes", node_id)
        value, _ = self.client.get(churn_key)
        count = (int(value) if value is not None and value.isdigit() else 0) + 1
        self.client.put(churn_key, str(count), lease=self.client.lease(CHURN_WINDOW_S).id)
        if count < 2:
            return
        raw, _ = self.client.get(strike_key)
        old = read_strike(strike_key, raw) if raw else StrikeRecord(0, address)
        same = old.address == address
        record = StrikeRecord(old.count + 1 if same else 1, address, lifts=old.lifts if same else 0)
        self.client.put(strike_key, record.to_json(), lease=self.client.lease(STRIKE_WINDOW_S).id)
        logger.warning(
            "node %s left job %s %d times in %gs: held back %gs before it is admitted again",
            node_id,
            job,
            count,
            CHURN_WINDOW_S,
            backoff_s(record.count),
        )

    @etcd_call
    def record_probe(self, job: str, node_id: str, generation: int, reaches: bool) -> bool:
        """Record what ``node_id``'s agent, a spare, found when it connected to the agent of every member of
        ``generation`` (see :func:`pliant.coordinator.policy.held_back`), while that generation is current, the node
        is not in it and its strikes are not lifted.

        - It ``reaches`` them all: the cut that earned the strikes healed. Their hold is lifted (the count stays; a
          strike that follows clears the lift), at most once per two strikes (:data:`LIFTS_PER_STRIKE`): a cut that
          only this node's connects get through (a firewall that lets one side open connections) still backs off,
          every other try. Either way a miss recorded before no longer holds it.
        - It missed one: the hold lasts past its backoff while that is so, since a readmission would fail again.

        Returns:
            Whether the record changed.
        """
        key = self.job_key(job, "strikes", node_id)
        value, meta = self.client.get(key)
        if value is None:
            return False
        old = read_strike(key, value)
        current, mod_revision = self._current(job)
        if old.lifted or current is None or current.number != generation or node_id in current.node_ids:
            return False
        lift = reaches and old.lifts < old.count * LIFTS_PER_STRIKE
        new = old._replace(lifted=lift, lifts=old.lifts + lift, missed=not reaches)
        if new == old:
            return False
        ok, _ = self._txn(
            [self.tx.mod(key) == meta.mod_revision, self.tx.mod(self.job_key(job, "generation")) == mod_revision],
            [self.tx.put(key, new.to_json(), lease=meta.lease_id)],
        )
        if ok and lift:
            logger.info(
                "job %s: the hold of %s (%d strikes) lifted: its agent reaches every member of generation %d",
                job,
                node_id,
                old.count,
                generation,
            )
        elif ok and reaches:
            logger.info(
                "job %s: %s's agent reaches every member of generation %d again; held back for the rest of "
                "its backoff (%d strikes; a hold is lifted at most once per two)",
                job,
                node_id,
                generation,
                old.count,
            )
        elif ok:
            logger.info(
                "job %s: %s's agent cannot reach every member of generation %d: held back until it does "
                "(%d strikes; at most %gs after the last)",
                job,
                node_id,
                generation,
                old.count,
                BACKOFF_MAX_S,
            )
        return ok

    def record_progress(self, job: str, node_id: str, lease_id: int, progress: MemberProgress) -> None:
        """Store ``node_id``'s latest step on its membership lease (gone with the membership), with the heartbeat
        pump's next batch."""
        self._pump.write(ProgressWrite(self.progress_key(job, node_id), progress.to_json(), lease_id))

    @etcd_call
    def lease_ages(self, job: str, members: Sequence[Member]) -> dict[str, float]:
        """Seconds since each member's last heartbeat, on etcd's clock: its lease's granted TTL less the TTL left
        (rounded up to whole seconds; -1 when the lease is gone or unknown).

        A lease whose keepalive this replica sent within half the job's heartbeat TTL, and etcd confirmed, is not
        looked up: its age is at most the time since that keepalive (:func:`pliant.coordinator.liveness.age_bound`),
        which is reported instead; it is neither overdue nor silent. The other leases are looked up, pipelined,
        :data:`LOOKUPS_IN_FLIGHT` at a time (etcd has no lookup of many leases at once), so a sweep over thousands of
        members takes a few round trips, not thousands. The leader calls this only when a member could be overdue
        (see the reconciler's sweep).
        """
        out = {m.node_id: -1.0 for m in members}
        stub, client = self.client.leasestub, self.client
        leased = [m for m in members if m.lease_id]
        bounds = self._pump.age_bounds([m.lease_id for m in leased], self._spec(job)[0].heartbeat_ttl_s)
        for member in leased:
            if member.lease_id in bounds:
                out[member.node_id] = bounds[member.lease_id]
        leased = [m for m in leased if m.lease_id not in bounds]
        for start in range(0, len(leased), LOOKUPS_IN_FLIGHT):
            window = leased[start : start + LOOKUPS_IN_FLIGHT]
            lookups = [
                stub.LeaseTimeToLive.future(
                    etcdrpc.LeaseTimeToLiveRequest(ID=member.lease_id),
                    self.timeout_s,
                    credentials=client.call_credentials,
                    metadata=client.metadata,
                )
                for member in window
            ]
            for member, lookup in zip(window, lookups, strict=True):
                info = lookup.result()
                if info.TTL > 0:
                    out[member.node_id] = float(max(0, info.grantedTTL - info.TTL))
        return out

    @etcd_call
    def progress(self, job: str, members: Sequence[Member]) -> dict[str, MemberProgress]:
        """Each member's progress: the recorded step and goodput, the age of its last heartbeat (from its lease's TTL)
        and its strikes."""
        recorded = {
            meta.key.decode().rsplit("/", 1)[1]: decode(meta.key, MemberProgress.from_json, value)
            for value, meta in self.client.get_prefix(self.progress_key(job))
        }
        prefix = self.job_key(job, "strikes") + "/"
        strikes = {
            meta.key.decode()[len(prefix) :]: read_strike(meta.key, value).count
            for value, meta in self.client.get_prefix(prefix)
        }
        ages = self.lease_ages(job, members)
        out = {}
        for member in members:
            step = recorded.get(member.node_id, MemberProgress())
            out[member.node_id] = MemberProgress(
                ages[member.node_id], step.step, step.step_at, strikes.get(member.node_id, 0), step.goodput
            )
        return out

    @etcd_call
    def report_failure(self, job: str, report: FailureReport) -> tuple[bool, int]:
        """Record a worker failure of the current generation (:func:`pliant.coordinator.policy.check_report` says
        whether it may be), and evict in the same txn the nodes that the generation's reports, this one last, evict at
        once, with a strike (on a lease of :data:`STRIKE_WINDOW_S`) for each of them that earns one: the policy
        decides both (:func:`pliant.coordinator.policy.judge_report`, :func:`pliant.coordinator.policy.next_strike`).

        Eviction deletes the nodes' member keys (so the planner sees their loss together with the failure) and then
        revokes their leases (so a node that was only partitioned learns at its next heartbeat and joins again).

        Returns:
            (accepted, current generation number): not accepted when the report names an older generation.
        """
        for _attempt in range(3):
            current, mod_revision = self._current(job)
            if current is None or report.generation != current.number:
                return False, current.number if current else 0
            check_report(job, current, report)
            prefix = self.job_key(job, "members") + "/"
            live = {
                meta.key.decode()[len(prefix) :]: dataclasses.replace(
                    decode(meta.key, Member.from_json, value), lease_id=meta.lease_id
                )
                for value, meta in self.client.get_prefix(prefix)
            }
            key = self.job_key(job, "failures", f"{current.number:012d}", report.node_id)
            earlier = [
                decode(meta.key, FailureReport.from_json, value)
                for value, meta in sorted(self.client.get_prefix(key.rsplit("/", 1)[0] + "/"), key=_recorded)
                if meta.key.decode() != key
            ]
            reports = [*earlier, report]
            named = {n for f in reports for n in f.unreachable if n in live}
            ttl = self._spec(job)[0].heartbeat_ttl_s
            silent = silent_members(self.lease_ages(job, [live[n] for n in sorted(named)]), ttl) if named else ()
            judgement = judge_report(current, reports, list(live), silent, ttl)
            evicted, reported = judgement.evicted, judgement.reported
            compare = [self.tx.mod(self.job_key(job, "generation")) == mod_revision]
            ops = [self.tx.put(key, report.to_json())]
            if evicted:  # only while the reporters are still members (their keys exist), and they are too: two
                # reports at once would otherwise both evict them, and both count a strike
                compare += [self.tx.version(prefix + node) > 0 for node in sorted(judgement.reporters) + list(evicted)]
                ops += [self.tx.delete(prefix + node) for node in evicted]
            lease = self.client.lease(STRIKE_WINDOW_S) if judgement.struck else None
            strikes = {}
            for node in judgement.struck:
                strike_key, address = self.job_key(job, "strikes", node), live[node].address
                value, _ = self.client.get(strike_key)
                old = read_strike(strike_key, value) if value else StrikeRecord(0, address)
                strikes[node], lifts = next_strike(old.count, old.address, old.lifts, address)
                record = StrikeRecord(strikes[node], address, lifts=lifts)
                ops.append(self.tx.put(strike_key, record.to_json(), lease=lease.id))  # type: ignore[union-attr]
            ok, _ = self._txn(compare, ops)
            if not ok:
                if lease is not None:
                    self._revoke_quietly(lease.id)
                continue  # the generation moved on (stale now), or the reporter or they were evicted since: read again
            for node in evicted:
                self._revoke_quietly(live[node].lease_id)
            self._log_report(job, current.number, report, reported, strikes)
            return True, current.number
        raise Unavailable(f"job {job!r} kept changing while recording a failure report; retry")

    @staticmethod
    def _log_report(job: str, number: int, report: FailureReport, reported: Reported, strikes: dict[str, int]) -> None:
        """One line for a recorded failure report: whom it evicted (by whose word), or whom it names and waits on."""
        evicted = [
            f"{n} (strike {strikes[n]}: held back {backoff_s(strikes[n]):g}s)" if n in strikes else n
            for n in reported.nodes
        ]
        by = sorted({r.node_id for r, _nodes in reported.evicted})
        waits = [n for n in report.unreachable if n not in reported.nodes and n != report.node_id]
        if evicted:
            outcome = f"; evicted as unreachable: {', '.join(evicted)} (named by {', '.join(by)}, corroborated)"
        elif waits:
            outcome = (
                f"; names {', '.join(waits)} unreachable, not evicted at once (not corroborated yet: no other "
                f"member's report or silent lease; or the smaller side, or a newcomer's word against older members)"
            )
        else:
            outcome = ""
        logger.info(
            "failure reported in job %s generation %d by %s (%s)%s",
            job,
            number,
            report.node_id,
            f"exit {report.exit_code}" if report.cause is FailureCause.EXITED else report.cause.value,
            outcome,
        )

    @etcd_call
    def report_success(
        self, job: str, node_id: str, generation: int, now: float, untrained: bool = False
    ) -> tuple[bool, int]:
        """A node's workers of ``generation`` all exited 0: record it, if that generation is current; once every
        member of it has, the job succeeded. No member decides for the others.

        ``untrained``: the node's workers completed no step in ``generation``: they ran the job's last steps in the
        world before it while its newcomers' workers started, and those newcomers (its members that were not members
        of the generation before) can never complete it. Once one report says so, the job succeeds when every member
        but those newcomers has reported: the members that trained the job to its end, whose power to end it is what
        it was before the newcomers came (they could have reported in the generation before).

        Returns:
            (accepted, current generation number): not accepted when the report names another generation.
        """
        current, mod_revision = self._current(job)
        if current is None or generation != current.number:
            return False, current.number if current else 0
        if node_id not in current.node_ids:
            raise PermissionDenied(
                f"node {node_id!r} is not a member of job {job!r}'s generation {current.number}; "
                f"only its members report its success"
            )
        prefix = self.job_key(job, "successes", f"{current.number:012d}") + "/"
        record = json.dumps({"at": now, "untrained": untrained})
        ok, responses = self._txn(
            [self.tx.mod(self.job_key(job, "generation")) == mod_revision],
            [self.tx.put(prefix + node_id, record), self._prefix_get(prefix)],
        )
        if not ok:  # a newer generation was published meanwhile: this report is stale
            return False, self._current(job)[0].number  # type: ignore[union-attr]
        done = {meta.key.decode()[len(prefix) :]: _untrained(value) for value, meta in responses[1]}
        waiting = [n for n in current.node_ids if n not in done]
        newcomers = self._newcomers(job, current) if waiting and any(done.values()) else set()
        if waiting and set(waiting) <= newcomers:
            reason = (
                f"every node's workers completed the job; {', '.join(waiting)} joined generation {generation} as its "
                f"last steps ran and never trained in it"
            )
            self.finish_job(job, True, reason, now, current)
            return True, current.number
        if waiting:
            logger.info(
                "job %s generation %d: node %s's workers completed; waiting for %s",
                job,
                current.number,
                node_id,
                ", ".join(waiting),
            )
            return True, current.number
        self.finish_job(job, True, f"every node's workers completed generation {generation}", now, current)
        return True, current.number

    def _newcomers(self, job: str, current: Generation) -> set[str]:
        """The members of ``current`` that were not members of the generation before it (none when that one is no
        longer in the history)."""
        if current.number <= 1:
            return set()
        key = self.history_key(job, current.number - 1)
        value, _meta = self.client.get(key)
        if value is None:
            return set()
        before = decode(key, Generation.from_json, value)
        return set(current.node_ids) - set(before.node_ids)


def _untrained(value: bytes) -> bool:
    """Whether a success record says its node's workers completed no step in the generation (a record of an earlier
    version is the time alone: they did)."""
    try:
        record = json.loads(value)
    except ValueError:
        return False
    return isinstance(record, dict) and record.get("untrained") is True


def _recorded(item: tuple[bytes, Any]) -> int:
    """Sort key of a (value, metadata) pair from a range read: the order etcd recorded the values in."""
    return item[1].mod_revision


def _token_refused(job: str, token: str) -> Unauthenticated:
    return Unauthenticated(
        f"{'no' if not token else 'a wrong'} join token for job {job!r}; pass the token the job's creator was given "
        f"(the join command `pliant run` prints, `pliant job create`) with --join-token-file or PLIANT_JOIN_TOKEN"
    )
