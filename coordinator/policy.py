"""The store's policies as pure functions: who is evicted, when, and on which clock. No I/O; time is passed in.

The reconciler (the executor) reads etcd, asks these functions, and writes what they decide, fenced.

**Liveness** is judged by the leader from heartbeats the control plane actually had the chance to receive. A member's
lease is long (``membership_lease_s``, the outage it survives); each heartbeat refreshes it, so the lease's age (its
granted TTL less its remaining TTL, kept by etcd) is the time since the member's last heartbeat on etcd's clock. A
member is overdue when that age passes the job's heartbeat TTL, but only once this leader has been able to hear from
everyone for a full TTL: after it won the election and after etcd answered again. A control-plane outage of any length
(shorter than the lease) therefore evicts nobody who kept trying; a node that died is evicted one TTL after the
control plane came back.

**One clock**: deadlines (join batching, the min-nodes timeout, the finished-job TTL) are measured on the leader's
monotonic clock, from when the leader first saw the record that starts them (identified by its etcd revision), never
from times another replica wrote. A new leader starts those clocks again: it may wait up to one grace longer, never
shorter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from pliant.coordinator.contract import JobSnapshot, JobStatus

__all__ = ["LeaderClock", "may_overwrite", "overdue_members"]


def overdue_members(ages: Mapping[str, float], ttl_s: float, heard_since: float, now: float) -> tuple[str, ...]:
    """The members to evict: silent for longer than ``ttl_s`` while the leader could hear them.

    Args:
        ages: node id -> seconds since its last heartbeat (from its lease; a negative age means unknown).
        ttl_s: the job's heartbeat TTL.
        heard_since: leader-clock time since which this leader could receive every heartbeat (it won the election,
            or etcd answered again, whichever is later).
        now: leader-clock time.

    Returns:
        Node ids, sorted; empty during the first TTL after ``heard_since``.
    """
    if now - heard_since < ttl_s:
        return ()
    return tuple(sorted(node for node, age in ages.items() if age > ttl_s))


def may_overwrite(current: JobStatus) -> bool:
    """Whether the leader may write a new state over ``current``: never over a terminal one."""
    return not current.state.terminal


class LeaderClock:
    """When this leader first saw each record that starts a deadline, on its own monotonic clock.

    Records are named by etcd revisions (a state record by its mod revision, a member by its key's create revision),
    so a record rewritten by another replica is a new record, and a record's age never depends on another machine's
    clock.
    """

    def __init__(self) -> None:
        self._seen: dict[str, dict[tuple[str, int], float]] = {}

    def view(self, snap: JobSnapshot, now: float) -> JobSnapshot:
        """``snap`` with the state's ``since`` and each member's ``joined_at`` replaced by the times this leader first
        saw them (leader-clock seconds; pass the same clock's ``now`` to the planner)."""
        job = snap.spec.job_id
        old = self._seen.get(job, {})
        seen: dict[tuple[str, int], float] = {}

        def first(key: tuple[str, int]) -> float:
            seen[key] = old.get(key, now)
            return seen[key]

        since = first(("state", snap.status_mod_revision))
        members = tuple(dataclasses.replace(m, joined_at=first((m.node_id, m.order))) for m in snap.members)
        self._seen[job] = seen  # records no longer in the snapshot are forgotten
        return dataclasses.replace(snap, status=dataclasses.replace(snap.status, since=since), members=members)

    def forget(self, job: str) -> None:
        self._seen.pop(job, None)

    def reset(self) -> None:
        """Forget everything (leadership lost: a later term starts its clocks again)."""
        self._seen.clear()
