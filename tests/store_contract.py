"""One contract for the reconciler's store (:class:`pliant.coordinator.contract.JobStore`), run against the unit tests'
fake store (tests/unit/test_store_contract.py) and a real etcd (tests/contract/test_store_contract.py): every write is
fenced by leadership and by the revision of the record it replaces, a finished job's state is never overwritten, an
eviction holds only while the members whose word it is are still members. A backend gives the store, the leader's
fence, and ways to make jobs and members and to depose the leader.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import pytest

from pliant.coordinator.contract import FencingError, JobSpec, JobState, JobStatus, JobStore, NewGeneration, NotFound
from pliant.coordinator.planner import plan

__all__ = ["Backend", "JobStoreContract"]


class Backend(Protocol):
    """A store under test, with what the contract needs around it."""

    store: JobStore
    fence: Any  # the current leader's fence

    def add_job(self, spec: JobSpec) -> None: ...

    def join(self, job: str, node: str) -> None: ...

    def depose(self) -> Any:
        """Another leader takes over; returns the deposed one's fence."""
        ...


class JobStoreContract:
    """The store's contract; a subclass gives the ``backend`` fixture."""

    @staticmethod
    def _publish_first(backend: Backend, job: str = "job", nodes: tuple[str, ...] = ("a",)) -> None:
        backend.add_job(JobSpec(job, 1, 8, join_grace_s=0))
        for node in nodes:
            backend.join(job, node)
        snap = backend.store.read_job(job)
        decision = plan(snap, time.time())
        assert isinstance(decision, NewGeneration)
        backend.store.publish(snap, decision.generation, JobStatus(decision.state, time.time()), backend.fence)

    def test_a_published_generation_is_read_back(self, backend: Backend) -> None:
        self._publish_first(backend, nodes=("a", "b"))
        snap = backend.store.read_job("job")
        assert snap.generation is not None and snap.generation.number == 1
        assert snap.generation.node_ids == ("a", "b") and snap.status.state is JobState.RUNNING
        assert sorted(m.node_id for m in snap.members) == ["a", "b"]

    def test_a_write_from_a_stale_snapshot_writes_nothing(self, backend: Backend) -> None:
        backend.add_job(JobSpec("job", 1, 8, join_grace_s=0))
        backend.join("job", "a")
        stale = backend.store.read_job("job")
        decision = plan(stale, time.time())
        assert isinstance(decision, NewGeneration)
        status = JobStatus(decision.state, time.time())
        backend.store.publish(stale, decision.generation, status, backend.fence)
        with pytest.raises(FencingError):
            backend.store.publish(stale, decision.generation, status, backend.fence)
        with pytest.raises(FencingError):
            backend.store.set_status(stale, JobStatus(JobState.WAITING, time.time()), backend.fence)
        assert backend.store.read_job("job").status.state is JobState.RUNNING

    def test_a_deposed_leaders_fence_writes_nothing(self, backend: Backend) -> None:
        backend.add_job(JobSpec("job", 1, 8, join_grace_s=0))
        backend.join("job", "a")
        old = backend.depose()
        snap = backend.store.read_job("job")
        decision = plan(snap, time.time())
        assert isinstance(decision, NewGeneration)
        status = JobStatus(decision.state, time.time())
        with pytest.raises(FencingError):
            backend.store.publish(snap, decision.generation, status, old)
        assert backend.store.read_job("job").generation is None, "the deposed leader's write must not land"
        backend.store.publish(snap, decision.generation, status, backend.fence)
        assert backend.store.read_job("job").generation.number == 1  # type: ignore[union-attr]

    def test_a_finished_jobs_state_is_never_overwritten(self, backend: Backend) -> None:
        self._publish_first(backend)
        snap = backend.store.read_job("job")
        backend.store.set_status(snap, JobStatus(JobState.SUCCEEDED, time.time(), "done"), backend.fence)
        done = backend.store.read_job("job")
        assert done.status.state is JobState.SUCCEEDED
        with pytest.raises(FencingError):
            backend.store.set_status(done, JobStatus(JobState.RUNNING, time.time()), backend.fence)
        assert backend.store.read_job("job").status.state is JobState.SUCCEEDED

    def test_an_eviction_holds_only_while_the_members_whose_word_it_is_remain(self, backend: Backend) -> None:
        self._publish_first(backend, nodes=("a", "b", "c"))
        before = backend.store.read_job("job")
        backend.store.evict(before, ("b",), backend.fence, keep=("a",))
        assert sorted(m.node_id for m in backend.store.read_job("job").members) == ["a", "c"]
        with pytest.raises(FencingError):  # b, whose word this would be, is gone since ``before``
            backend.store.evict(before, ("c",), backend.fence, keep=("b",))
        assert sorted(m.node_id for m in backend.store.read_job("job").members) == ["a", "c"]

    def test_hundreds_of_members_evicted_at_once_all_go(self, backend: Backend) -> None:
        """More members than one etcd transaction takes (128 operations) go in one eviction: a job of hundreds of
        nodes that all went silent at once."""
        backend.add_job(JobSpec("big", 1, 400, join_grace_s=0))
        nodes = tuple(f"n{i}" for i in range(300))
        for node in nodes:
            backend.join("big", node)
        snap = backend.store.read_job("big")
        backend.store.evict(snap, nodes[1:], backend.fence, keep=nodes[:1])
        assert [m.node_id for m in backend.store.read_job("big").members] == ["n0"]

    def test_lease_ages_are_given_for_live_members(self, backend: Backend) -> None:
        self._publish_first(backend, nodes=("a", "b"))
        snap = backend.store.read_job("job")
        ages = backend.store.lease_ages("job", snap.members)
        assert set(ages) == {"a", "b"} and all(0.0 <= age < 5.0 for age in ages.values())

    def test_unknown_and_deleted_jobs_are_not_found(self, backend: Backend) -> None:
        with pytest.raises(NotFound):
            backend.store.read_job("nope")
        self._publish_first(backend)
        assert "job" in backend.store.list_job_ids()
        snap = backend.store.read_job("job")
        backend.store.set_status(snap, JobStatus(JobState.FAILED, time.time(), "failed"), backend.fence)
        backend.store.delete_job("job")  # the reconciler deletes finished jobs only
        assert "job" not in backend.store.list_job_ids()
        with pytest.raises(NotFound):
            backend.store.read_job("job")
