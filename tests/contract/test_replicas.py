"""High availability: any replica serves the API, a killed leader is replaced, and a deposed leader cannot publish."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from pliant.coordinator.client import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS
from pliant.coordinator.contract import CoordinatorError, FencingError, JobSpec, JobState, JobStatus, Member
from pliant.coordinator.election import LeaderElection
from pliant.coordinator.planner import plan
from pliant.coordinator.store import EtcdStore
from tests.conftest import wait_for

TOKEN = "test-join-token-0123456789"

pytestmark = pytest.mark.timeout(90)


def test_the_api_works_through_a_non_leader_replica(make_coordinator, fleet) -> None:
    leader = make_coordinator("leader")
    assert leader.election.wait_for(True, 10)
    follower = make_coordinator("follower")
    time.sleep(0.3)
    assert not follower.election.is_leader
    with fleet(follower.address) as client:
        _info, created, _token = client.create_job(JobSpec("job", 2, 2, join_grace_s=0.1))
        assert created
        events = client.watch("job", 1)
        client.join("job", "a", "127.0.0.1:1")
        client.join("job", "b", "127.0.0.1:2")
        first = next(e for e in events if e.generation is not None)
        assert first.generation.number == 1 and first.generation.node_ids == ("a", "b")
        assert first.status.state is JobState.RUNNING
        assert [j.spec.job_id for j in client.list_jobs()] == ["job"]
        done = client.finish_job("job", True, "trained")
        assert done.status.state is JobState.SUCCEEDED
        finished = next(events)
        assert finished.status.state is JobState.SUCCEEDED and finished.status.reason == "trained"
        events.close()


def test_kill_9_of_the_leader_and_the_other_replica_publishes(spawn_coordinator, etcd, prefix, fleet) -> None:
    proc_a, addr_a = spawn_coordinator("a")
    store = EtcdStore([etcd.endpoint], prefix)
    try:
        wait_for(lambda: store.leader()[0] == "a", 10, "replica a to lead")
        proc_b, addr_b = spawn_coordinator("b")
        with fleet([addr_b, addr_a]) as client:
            client.create_job(JobSpec("job", 1, 3, heartbeat_ttl_s=10, join_grace_s=0.1))
            client.join("job", "n1", "127.0.0.1:1")
            wait_for(lambda: client.get_job("job").generation, 10, "generation 1")

            proc_a.kill()  # SIGKILL: no resignation, its leader lease must expire
            killed_at = time.monotonic()
            client.join("job", "n2", "127.0.0.1:2")
            gen = wait_for(
                lambda: (g := client.get_job("job").generation) and g.number == 2 and g, 15, "generation 2 from b"
            )
            took = time.monotonic() - killed_at
            assert gen.node_ids == ("n1", "n2")
            assert store.leader()[0] == "b"
            assert took < 2.0 + 2.5, f"replica b took {took:.1f}s to publish after the leader's kill"
        assert proc_b.proc.poll() is None
    finally:
        store.close()


def test_a_watch_on_a_replica_that_goes_silent_resumes_on_the_next(spawn_coordinator, fleet) -> None:
    """A replica that stops answering without closing anything (SIGSTOP: its kernel still acknowledges TCP, nothing
    answers HTTP/2; as a host that lost power, or a cut that resets nothing) must not leave a watch on it deaf to new
    generations: keepalive pings break the call within KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS, and the watch
    resumes on the next replica. Before the pings it waited for as long as the replica was silent."""
    proc_a, addr_a = spawn_coordinator("a")
    _, addr_b = spawn_coordinator("b")
    with fleet([addr_b]) as control, fleet([addr_a, addr_b]) as watcher:
        control.create_job(JobSpec("job", 1, 3, heartbeat_ttl_s=30, join_grace_s=0.1))
        control.join("job", "n1", "127.0.0.1:1")
        wait_for(lambda: control.get_job("job").generation, 10, "generation 1")
        seen: list[tuple[float, int]] = []

        def follow() -> None:
            try:
                for event in watcher.watch("job"):
                    if event.generation is not None:
                        seen.append((time.monotonic(), event.generation.number))
            except CoordinatorError:  # the watcher's channels closed at the end of the test
                pass

        threading.Thread(target=follow, daemon=True).start()
        wait_for(lambda: [n for _, n in seen] == [1], 10, "the watch, on replica a")
        os.kill(proc_a.pid, signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            control.join("job", "n2", "127.0.0.1:2")
            wait_for(lambda: any(n == 2 for _, n in seen), 30, "generation 2, through replica b")
        finally:
            os.kill(proc_a.pid, signal.SIGCONT)
        took = next(t for t, n in seen if n == 2) - stopped
        print(f"a watch on a silent replica saw the next generation {took:.2f}s after the replica stopped")
        assert took < (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000 + 5.0


def test_a_deposed_leader_cannot_publish(etcd, prefix) -> None:
    store = EtcdStore([etcd.endpoint], prefix)
    first = LeaderElection(store, "first", ttl_s=2).start()
    second = LeaderElection(store, "second", ttl_s=2)
    try:
        assert first.wait_for(True, 10)
        old_fence = first.fence
        assert old_fence is not None
        store.create_job(JobSpec("job", 1, 1, join_grace_s=0), time.time(), TOKEN)
        store.join("job", Member("a", "127.0.0.1:1", 0, time.time()), TOKEN)

        # Depose the first leader: its key goes away (as when its lease expires), the second wins.
        first.stop(resign=True)
        second.start()
        assert second.wait_for(True, 10)
        assert second.fence is not None and second.fence.revision != old_fence.revision

        snap = store.read_job("job")
        decision = plan(snap, time.time())
        status = JobStatus(JobState.RUNNING, time.time())
        with pytest.raises(FencingError):
            store.publish(snap, decision.generation, status, old_fence)
        assert store.read_job("job").generation is None, "the deposed leader's write must not land"
        store.publish(snap, decision.generation, status, second.fence)
        assert store.read_job("job").generation.number == 1
    finally:
        second.stop()
        store.close()


def test_no_generation_number_is_published_twice(etcd, prefix) -> None:
    """Writers racing from the same snapshot: exactly one wins each number."""
    store = EtcdStore([etcd.endpoint], prefix)
    election = LeaderElection(store, "leader", ttl_s=2).start()
    try:
        assert election.wait_for(True, 10)
        fence = election.fence
        store.create_job(JobSpec("job", 1, 8, join_grace_s=0), time.time(), TOKEN)
        for number in range(1, 6):
            store.join("job", Member(f"n{number}", f"127.0.0.1:{number}", 0, time.time()), TOKEN)
            snap = store.read_job("job")
            decision = plan(snap, time.time())
            wins, losses = [], []
            barrier = threading.Barrier(4)

            def race(snap=snap, decision=decision, wins=wins, losses=losses, barrier=barrier) -> None:
                barrier.wait()
                try:
                    store.publish(snap, decision.generation, JobStatus(decision.state, time.time()), fence)
                    wins.append(1)
                except FencingError:
                    losses.append(1)

            threads = [threading.Thread(target=race) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert (len(wins), len(losses)) == (1, 3), f"generation {number}: {len(wins)} writers won"
        gens, _ = store.generations_since("job", 1)
        assert [g.number for g in gens] == [1, 2, 3, 4, 5]
    finally:
        election.stop()
        store.close()
