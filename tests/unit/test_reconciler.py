"""The reconciler's decisions with an in-memory store and a fake clock: liveness, fencing, isolation, one clock."""

from __future__ import annotations

import pytest

from pliant.coordinator.contract import (
    FailureCause,
    FailureReport,
    FencingError,
    JobSpec,
    JobState,
    JobStatus,
    NewGeneration,
)
from pliant.coordinator.planner import plan
from pliant.coordinator.policy import REPORT_GRACE_S, SILENCE_POLL_S, LeaderClock, overdue_members
from pliant.coordinator.reconciler import Reconciler, needs_read
from tests.unit.fake_store import FakeStore

pytestmark = pytest.mark.timeout(10)


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _setup(*jobs: JobSpec) -> tuple[FakeStore, Clock, Reconciler]:
    store, clock = FakeStore(), Clock()
    for spec in jobs:
        store.add_job(spec)
    rec = Reconciler(store, None, clock=clock, wall=lambda: 1.7e9)
    rec.lead()
    return store, clock, rec


def _count_reads(store: FakeStore) -> list[str]:
    """The jobs the store is asked to read from now on, in order."""
    reads: list[str] = []
    read_job = store.read_job
    store.read_job = lambda job: reads.append(job) or read_job(job)  # type: ignore[method-assign]
    return reads


def _spec(job: str = "job", **kw: object) -> JobSpec:
    kw.setdefault("join_grace_s", 0.0)
    kw.setdefault("heartbeat_ttl_s", 10.0)
    return JobSpec(job, 1, 4, **kw)  # type: ignore[arg-type]


def test_overdue_members_waits_one_ttl_after_the_leader_could_hear() -> None:
    ages = {"a": 50.0, "b": 2.0, "c": -1.0}
    assert overdue_members(ages, 10, heard_since=100, now=105) == ()
    assert overdue_members(ages, 10, heard_since=100, now=110) == ("a",)


def test_a_whole_control_plane_outage_evicts_nobody_who_heartbeats_again() -> None:
    store, clock, rec = _setup(_spec())
    store.join("job", "a")
    store.join("job", "b")
    rec.pass_once(store.fence)
    assert [g.node_ids for g in store.published] == [("a", "b")]
    # Every replica was down for 60 s: both leases are 60 s old when a new leader takes over.
    clock.now += 60
    store.ages = {("job", "a"): 60.0, ("job", "b"): 60.0}
    rec.lead()
    for _ in range(8):  # the first TTL: sweeps evict nobody; "a" heartbeats again, "b" (dead) does not
        clock.now += 1
        store.ages[("job", "a")] = 0.0
        store.ages[("job", "b")] += 1
        rec.pass_once(store.fence)
    assert store.evicted == [] and len(store.published) == 1
    clock.now += 3
    store.ages[("job", "b")] += 3
    rec.pass_once(store.fence)
    assert store.evicted == [("job", ("b",))]
    rec.pass_once(store.fence)
    assert store.published[-1].node_ids == ("a",) and store.published[-1].reason == "failure"


def test_etcd_coming_back_restarts_the_grace() -> None:
    store, clock, rec = _setup(_spec())
    store.join("job", "a")
    rec.pass_once(store.fence)
    clock.now += 30
    store.ages[("job", "a")] = 30.0
    rec._heard_since = clock.now  # what _run does when a pass succeeds after etcd errors
    rec.pass_once(store.fence)
    assert store.evicted == []


def test_one_unreadable_job_never_stops_the_others() -> None:
    store, _clock, rec = _setup(_spec("a-bad"), _spec("b-good"))
    store.jobs["a-bad"].corrupt = "etcd record /x/jobs/a-bad/state cannot be read (KeyError: 'state')"
    store.join("b-good", "n1")
    rec.pass_once(store.fence)
    assert [g.job_id for g in store.published] == ["b-good"]
    assert "KeyError" in rec.unreadable["a-bad"]
    store.jobs["a-bad"].corrupt = ""
    store.join("a-bad", "n2")
    rec.pass_once(store.fence)
    assert rec.unreadable == {} and [g.job_id for g in store.published] == ["b-good", "a-bad"]


def test_a_bug_in_one_job_is_isolated_too(monkeypatch: pytest.MonkeyPatch) -> None:
    store, _clock, rec = _setup(_spec("a"), _spec("b"))
    store.join("a", "n1")
    store.join("b", "n2")
    original = rec._execute

    def broken(snap, decision, fence):  # type: ignore[no-untyped-def]
        if snap.spec.job_id == "a":
            raise KeyError("boom")
        return original(snap, decision, fence)

    monkeypatch.setattr(rec, "_execute", broken)
    rec.pass_once(store.fence)
    assert [g.job_id for g in store.published] == ["b"] and "boom" in rec.unreadable["a"]


def test_a_finished_job_is_never_overwritten() -> None:
    store, clock, rec = _setup(_spec())
    store.join("job", "a")
    snap = store.read_job("job")
    decision = plan(rec._times.view(snap, clock.now), clock.now)
    assert isinstance(decision, NewGeneration)
    store.finish("job", JobState.SUCCEEDED)  # FinishJob lands between the leader's read and its write
    with pytest.raises(FencingError):
        rec._execute(snap, decision, store.fence)
    rec.pass_once(store.fence)
    assert store.jobs["job"].status.state is JobState.SUCCEEDED and store.published == []
    with pytest.raises(FencingError):  # and a snapshot that already shows it finished is never written over
        store.set_status(store.read_job("job"), JobStatus(JobState.FAILED, 0.0), store.fence)


def test_skewed_replica_clocks_change_no_deadline() -> None:
    """Times other replicas wrote (joined_at, since) are ignored: a join stamped 700 s in the past or 120 s in the
    future is batched for join_grace_s on the leader's clock; min_nodes_timeout_s counts from when the leader saw the
    job waiting."""
    store, clock, rec = _setup(JobSpec("job", 2, 4, join_grace_s=5.0, min_nodes_timeout_s=30.0))
    store.jobs["job"].status = store.jobs["job"].status.__class__(JobState.WAITING, clock.now - 700)
    store.join("job", "a", joined_at=1.7e9 - 700)
    store.join("job", "b", joined_at=1.7e9 + 120)
    rec.pass_once(store.fence)
    assert store.published == [] and store.jobs["job"].status.state is JobState.WAITING
    clock.now += 5
    rec.pass_once(store.fence)
    assert [g.node_ids for g in store.published] == [("a", "b")]


def test_min_nodes_timeout_counts_on_the_leader_clock() -> None:
    store, clock, rec = _setup(JobSpec("job", 2, 4, min_nodes_timeout_s=30.0))
    store.join("job", "a", joined_at=0.0)
    rec.pass_once(store.fence)
    assert store.jobs["job"].status.state is JobState.WAITING
    clock.now += 29
    rec.pass_once(store.fence)
    assert store.jobs["job"].status.state is JobState.WAITING
    clock.now += 2
    rec.pass_once(store.fence)
    assert store.jobs["job"].status.state is JobState.FAILED


def test_leader_clock_forgets_records_that_are_gone() -> None:
    store, _clock, _rec = _setup(_spec())
    store.join("job", "a")
    times = LeaderClock()
    first = times.view(store.read_job("job"), 5.0)
    assert first.members[0].joined_at == 5.0 and first.status.since == 5.0
    again = times.view(store.read_job("job"), 9.0)
    assert again.members[0].joined_at == 5.0
    store.members_of("job").clear()
    store.join("job", "a")  # re-joined: a new record
    assert times.view(store.read_job("job"), 12.0).members[0].joined_at == 12.0


def test_etcd_down_ends_the_pass_without_writing() -> None:
    store, _clock, rec = _setup(_spec())
    store.join("job", "a")
    store.down = True
    with pytest.raises(Exception, match="down"):
        rec.pass_once(store.fence)
    assert store.published == []


def test_a_report_from_the_smaller_side_evicts_the_silent_named_nodes_after_the_grace() -> None:
    """a's agent names b and c unreachable (it is the smaller side: nothing at once). b and c never report and their
    leases say they are silent (dead): the leader waits REPORT_GRACE_S, evicts them, and a trains on alone, with no
    restart spent."""
    store, clock, rec = _setup(_spec())
    for node in ("a", "b", "c"):
        store.join("job", node)
    rec.pass_once(store.fence)
    world = store.jobs["job"].generation
    assert world is not None and world.node_ids == ("a", "b", "c")
    clock.now += 6.0  # the leader heard every heartbeat for more than half a TTL ...
    store.ages[("job", "b")] = store.ages[("job", "c")] = 6.0  # ... and none from b and c for that long
    store.jobs["job"].failures.append(
        FailureReport("a", world.number, 0, "a peer failed", clock.now, ("b", "c"), cause=FailureCause.WAITING)
    )
    assert rec.reconcile("job", store.fence) == clock.now + REPORT_GRACE_S  # waiting for their reports
    assert store.evicted == []
    clock.now += REPORT_GRACE_S
    rec.pass_once(store.fence)
    rec.pass_once(store.fence)
    assert store.evicted == [("job", ("b", "c"))]
    last = store.jobs["job"].generation
    assert last is not None and (last.node_ids, last.reason, last.restarts_used) == (("a",), "failure", 0)


def test_a_named_node_is_evicted_once_its_lease_falls_silent_and_never_on_the_word_alone() -> None:
    """a names b, which still heartbeats: nobody is evicted, and the leader looks at b's lease every SILENCE_POLL_S.
    Once b misses two heartbeats (it died after all), b is evicted at no restart. Had b kept beating, a's report
    would have become a restart charged to a."""
    store, clock, rec = _setup(_spec())
    for node in ("a", "b"):
        store.join("job", node)
    rec.pass_once(store.fence)
    world = store.jobs["job"].generation
    assert world is not None and world.node_ids == ("a", "b")
    clock.now += 6.0
    store.jobs["job"].failures.append(FailureReport("a", world.number, 1, "gloo: connection reset", clock.now, ("b",)))
    assert rec.reconcile("job", store.fence) == clock.now + SILENCE_POLL_S
    assert store.evicted == []
    clock.now += SILENCE_POLL_S
    store.ages[("job", "b")] = 6.0
    rec.pass_once(store.fence)
    rec.pass_once(store.fence)
    assert store.evicted == [("job", ("b",))]
    last = store.jobs["job"].generation
    assert last is not None and (last.node_ids, last.reason, last.restarts_used) == (("a",), "failure", 0)


def test_a_pass_reads_only_the_jobs_that_changed_or_came_due_and_all_of_them_every_resync() -> None:
    """A leader of many jobs that wait and change nothing reads none of them between full passes: the watch (or an
    API call's poke) names a job that changed, and each job's own deadline brings it back."""
    store, clock = FakeStore(), Clock()
    for i in range(50):
        store.add_job(_spec(f"idle-{i}", min_nodes_timeout_s=3600.0))
    store.add_job(_spec("busy", join_grace_s=2.0))
    rec = Reconciler(store, None, clock=clock, wall=lambda: 1.7e9, resync_s=30.0)
    rec.lead()
    reads = _count_reads(store)
    rec._pass(store.fence)
    assert len(reads) == 51, "a new term reads every job"
    reads.clear()
    clock.now += 1
    rec._pass(store.fence)
    assert reads == [], "nothing changed, nothing is due: nothing is read"
    store.join("busy", "a")  # the watch (or the Join's poke) names the job
    rec.poke("busy")
    rec._pass(store.fence)
    assert reads == ["busy"]
    reads.clear()
    clock.now += 2.5  # the join grace ends: the job is due
    rec._pass(store.fence)
    assert reads == ["busy"] and store.published[-1].node_ids == ("a",)
    reads.clear()
    clock.now += 30  # the full resync
    rec._pass(store.fence)
    assert len(reads) == 51


def test_arrivals_below_what_the_plan_waits_for_are_counted_not_read() -> None:
    """A burst of Joins into a job that waits for its minimum (or batches joins up to its maximum) is read once the
    members that came could change the plan, or at the plan's deadline: not once per arrival."""
    store, clock = FakeStore(), Clock()
    store.add_job(JobSpec("burst", 4, 4, join_grace_s=0.0, heartbeat_ttl_s=10.0, min_nodes_timeout_s=600.0))
    rec = Reconciler(store, None, clock=clock, wall=lambda: 1.7e9, resync_s=30.0)
    rec.lead()
    reads = _count_reads(store)
    rec._pass(store.fence)
    assert reads == ["burst"]
    for node in ("a", "b", "c"):
        reads.clear()
        store.join("burst", node)
        rec._keys_changed([f"burst/members/{node}"])
        rec._pass(store.fence)
        assert reads == [], f"{node}: fewer than the 4 the job waits for: nothing to plan"
    store.join("burst", "d")
    rec._keys_changed(["burst/members/d"])
    rec._pass(store.fence)
    assert reads == ["burst"] and store.published[-1].node_ids == ("a", "b", "c", "d")


def test_arrivals_while_joins_are_batched_are_read_at_the_deadline_or_when_the_job_is_full() -> None:
    store, clock, rec = _setup(_spec("grow", join_grace_s=5.0))
    reads = _count_reads(store)
    store.join("grow", "a")
    rec.poke("grow")
    rec._pass(store.fence)  # batching a's join until +5 s
    reads.clear()
    clock.now += 1
    store.join("grow", "b")
    rec._keys_changed(["grow/members/b"])
    rec._pass(store.fence)
    assert reads == [] and not store.published, "b only moves the deadline later: read at the old one"
    clock.now += 4
    rec._pass(store.fence)
    assert reads == ["grow"] and not store.published, "at a's deadline, b's (+6 s) is the one that counts"
    reads.clear()
    for node in ("c", "d"):
        store.join("grow", node)
        rec._keys_changed([f"grow/members/{node}"])
    rec._pass(store.fence)
    assert reads == ["grow"] and store.published[-1].node_ids == ("a", "b", "c", "d"), "full: published at once"


def test_any_other_change_is_read_at_once() -> None:
    store, clock = FakeStore(), Clock()
    store.add_job(JobSpec("w", 4, 4, heartbeat_ttl_s=10.0, min_nodes_timeout_s=600.0))
    rec = Reconciler(store, None, clock=clock, wall=lambda: 1.7e9)
    rec.lead()
    rec._pass(store.fence)
    reads = _count_reads(store)
    rec._keys_changed(["w/members/a", "w/state"])
    rec._pass(store.fence)
    assert reads == ["w"]
    assert needs_read(None, 1) and needs_read((3, 4), 1) and not needs_read((2, 4), 1)
