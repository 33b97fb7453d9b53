"""An in-memory :class:`pliant.coordinator.contract.JobStore` for the reconciler's unit tests.

It keeps the real store's fencing rules: every write compares the leadership fence and the mod revision of the record
it replaces, so the tests exercise the same races the etcd store refuses. Lease ages are set by the test (the real
store reads them from etcd's lease TTLs).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pliant.coordinator.contract import (
    CorruptRecord,
    FailureReport,
    FencingError,
    Generation,
    JobSnapshot,
    JobSpec,
    JobState,
    JobStatus,
    Member,
    NotFound,
    Unavailable,
)
from pliant.coordinator.policy import may_overwrite


@dataclasses.dataclass
class _Job:
    spec: JobSpec
    status: JobStatus
    status_rev: int
    members: dict[str, Member] = dataclasses.field(default_factory=dict)
    generation: Generation | None = None
    generation_rev: int = 0
    corrupt: str = ""
    failures: list[FailureReport] = dataclasses.field(default_factory=list)


class FakeStore:
    """Jobs in dictionaries, one global revision counter, and the real store's fences."""

    def __init__(self) -> None:
        self.revision = 0
        self.fence: Any = "term-1"
        self.jobs: dict[str, _Job] = {}
        self.ages: dict[tuple[str, str], float] = {}
        self.down = False
        self.published: list[Generation] = []
        self.evicted: list[tuple[str, tuple[str, ...]]] = []

    def _next(self) -> int:
        self.revision += 1
        return self.revision

    def _check(self) -> None:
        if self.down:
            raise Unavailable("etcd is down (fake)")

    # -- test helpers --------------------------------------------------------------------------------------------------

    def add_job(self, spec: JobSpec) -> None:
        self.jobs[spec.job_id] = _Job(spec, JobStatus(JobState.WAITING, 0.0), self._next())

    def join(self, job: str, node: str, joined_at: float = 0.0) -> None:
        self.members_of(job)[node] = Member(node, f"{node}:1", 0, joined_at, self._next(), self.revision)
        self.ages[(job, node)] = 0.0

    def members_of(self, job: str) -> dict[str, Member]:
        return self.jobs[job].members

    def finish(self, job: str, state: JobState) -> None:
        entry = self.jobs[job]
        entry.status, entry.status_rev = JobStatus(state, 0.0, "finished by a test"), self._next()

    # -- JobStore ------------------------------------------------------------------------------------------------------

    def list_job_ids(self) -> list[str]:
        self._check()
        return sorted(self.jobs)

    def read_job(self, job: str) -> JobSnapshot:
        self._check()
        if job not in self.jobs:
            raise NotFound(job)
        entry = self.jobs[job]
        if entry.corrupt:
            raise CorruptRecord(entry.corrupt)
        members = tuple(sorted(entry.members.values(), key=lambda m: m.order))
        return JobSnapshot(
            entry.spec,
            entry.status,
            members,
            entry.generation,
            tuple(entry.failures),
            frozenset(),
            entry.generation_rev,
            entry.status_rev,
        )

    def lease_ages(self, job: str, members: tuple[Member, ...]) -> dict[str, float]:
        self._check()
        return {m.node_id: self.ages.get((job, m.node_id), -1.0) for m in members}

    def _fenced(self, snap: JobSnapshot, fence: Any, generation: bool = False) -> _Job:
        self._check()
        entry = self.jobs[snap.spec.job_id]
        if fence != self.fence or entry.status_rev != snap.status_mod_revision or not may_overwrite(snap.status):
            raise FencingError("fake fence")
        if generation and entry.generation_rev != snap.generation_mod_revision:
            raise FencingError("fake generation fence")
        return entry

    def warrant(self, generation: Generation) -> str:
        """The warrant the real store's sealing root would sign (a fixed root here)."""
        from pliant.security import warrant

        world = warrant.World(generation.job_id, generation.incarnation, generation.number, generation.created_at)
        return warrant.sign(b"f" * 32, world)

    def publish(self, snap: JobSnapshot, generation: Generation, status: JobStatus, fence: Any) -> None:
        entry = self._fenced(snap, fence, generation=True)
        entry.generation, entry.generation_rev = generation, self._next()
        entry.status, entry.status_rev = status, self.revision
        self.published.append(generation)

    def set_status(self, snap: JobSnapshot, status: JobStatus, fence: Any) -> None:
        entry = self._fenced(snap, fence)
        entry.status, entry.status_rev = status, self._next()

    def evict(self, snap: JobSnapshot, nodes: tuple[str, ...], fence: Any, keep: tuple[str, ...] = ()) -> None:
        self._check()
        if fence != self.fence:
            raise FencingError("fake fence")
        if any(node not in self.jobs[snap.spec.job_id].members for node in keep):
            raise FencingError("fake member fence")
        for node in nodes:
            self.jobs[snap.spec.job_id].members.pop(node, None)
        self.evicted.append((snap.spec.job_id, nodes))

    def delete_job(self, job: str) -> None:
        self._check()
        del self.jobs[job]
