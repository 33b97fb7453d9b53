"""Recovery and ordering: an etcd restart mid-run loses nothing, and watches resume in order from any replica."""

from __future__ import annotations

import threading
import time

import pytest

from pliant.coordinator.contract import JobSpec, JobState, JobStatus, Member
from pliant.coordinator.election import LeaderElection
from pliant.coordinator.etcd_server import EtcdServer
from pliant.coordinator.planner import plan
from pliant.coordinator.store import EtcdStore
from pliant.coordinator.watch_hub import WatchHub
from tests.conftest import wait_for

pytestmark = pytest.mark.timeout(90)

TOKEN = "test-join-token-0123456789"


def _generation(client, number: int):
    return wait_for(
        lambda: (g := client.get_job("job").generation) and g.number >= number and g, 15, f"generation {number}"
    )


def test_etcd_restart_mid_run_loses_no_generation(make_coordinator, tmp_path, fleet) -> None:
    etcd = EtcdServer(data_dir=str(tmp_path / "etcd")).start()
    try:
        server = make_coordinator("solo", endpoints=(etcd.endpoint,))
        with fleet(server.address, retry_for_s=30) as client:
            client.create_job(JobSpec("job", 1, 4, heartbeat_ttl_s=30, join_grace_s=0.1))
            grant = client.join("job", "a", "127.0.0.1:1")
            _generation(client, 1)
            assert client.heartbeat("job", "a", grant.lease_id) > 0  # opens the replica's keepalive stream
            client.join("job", "b", "127.0.0.1:2")
            assert _generation(client, 2).node_ids == ("a", "b")

            etcd.kill()  # a crash, not a clean stop
            etcd.start()  # same data dir, same ports

            # The client retries UNAVAILABLE while etcd comes back; the leader re-arms its watches.
            client.join("job", "c", "127.0.0.1:3")
            # The keepalive stream broke with etcd; the retried heartbeat reopens it and the lease survived.
            assert client.heartbeat("job", "a", grant.lease_id) > 0
            third = _generation(client, 3)
            assert third.number == 3 and third.node_ids == ("a", "b", "c")
            gens, status = server.store.generations_since("job", 1)
            assert [g.number for g in gens] == [1, 2, 3]
            assert status.state is JobState.RUNNING
    finally:
        etcd.stop()


def test_a_watch_resumed_from_n_receives_n_plus_1_onwards_in_order(make_coordinator, fleet) -> None:
    server = make_coordinator()
    with fleet(server.address) as client:
        client.create_job(JobSpec("job", 1, 8, join_grace_s=0))
        for i in range(1, 5):
            client.join("job", f"n{i}", f"127.0.0.1:{i}")
            _generation(client, i)
        # Resume from 3: receive 3, 4, then what is published after, in order.
        received: list[int] = []
        done = threading.Event()

        def follow() -> None:
            for event in client.watch("job", 3):
                if event.generation is not None:
                    received.append(event.generation.number)
                if len(received) >= 4:
                    done.set()
                    return

        thread = threading.Thread(target=follow, daemon=True)
        thread.start()
        wait_for(lambda: len(received) >= 2, 10, "the backlog")
        for i in range(5, 7):
            client.join("job", f"n{i}", f"127.0.0.1:{i}")
            _generation(client, i)
        assert done.wait(10), received
        assert received == [3, 4, 5, 6]


def test_a_watch_moves_to_another_replica_and_misses_nothing(make_coordinator, fleet) -> None:
    first = make_coordinator("first")
    second = make_coordinator("second")
    with fleet([first.address, second.address]) as client:
        client.create_job(JobSpec("job", 1, 8, join_grace_s=0))
        client.join("job", "n1", "127.0.0.1:1")
        _generation(client, 1)
        events = client.watch("job", 1)
        assert next(e for e in events if e.generation).generation.number == 1
        serving = first if client.admin._current == 0 else second
        other = second if serving is first else first
        serving.stop(grace_s=0)  # the replica serving the stream goes away
        with fleet(other.address) as admin:
            admin.tokens.update(client.tokens)
            for i in range(2, 4):
                admin.join("job", f"n{i}", f"127.0.0.1:{i}")
                _generation(admin, i)
        numbers = []
        for event in events:
            if event.generation is not None:
                numbers.append(event.generation.number)
            if numbers and numbers[-1] == 3:
                break
        events.close()
        assert numbers == [2, 3]


class _FeedReadsStale(EtcdStore):
    """A real store whose watch feed, once ``armed``, holds what it read from etcd until ``release`` is set: the
    feed thread of a loaded replica, descheduled between its read and its offers."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.armed, self.holding, self.release = threading.Event(), threading.Event(), threading.Event()

    def generations_since(self, job, first):
        answer = super().generations_since(job, first)
        if threading.current_thread().name.startswith("feed ") and self.armed.is_set():
            self.armed.clear()
            self.holding.set()
            self.release.wait(10)
        return answer


def test_a_subscriber_never_receives_an_older_state_after_a_newer_one(etcd, prefix) -> None:
    """A stream that subscribes while the feed holds an older read of etcd receives the newer state once, and the
    older one never after it."""
    store = _FeedReadsStale([etcd.endpoint], prefix)
    election = LeaderElection(store, "leader", ttl_s=5).start()
    hub = WatchHub(store)
    try:
        assert election.wait_for(True, 10)
        store.create_job(JobSpec("job", 1, 1, join_grace_s=0), time.time(), TOKEN)
        store.join("job", Member("a", "127.0.0.1:1", 0, time.time()), TOKEN)
        early = hub.subscribe("job", 1)  # the feed exists, serving one stream
        store.armed.set()
        assert store.holding.wait(5), "the feed read etcd"  # it read the job before any generation
        snap = store.read_job("job")
        store.publish(
            snap, plan(snap, time.time()).generation, JobStatus(JobState.RUNNING, time.time()), election.fence
        )

        subscribed: list = []
        late = threading.Thread(target=lambda: subscribed.append(hub.subscribe("job", 1)), daemon=True)
        late.start()
        time.sleep(0.3)  # the late stream subscribes while the feed still holds its older read
        store.release.set()
        late.join(10)
        (sub,) = subscribed
        store.finish_job("job", True, "trained", time.time())

        def states(s, count: int) -> list[tuple[int | None, JobState]]:
            got = []
            while len(got) < count and (event := s.get(5)) is not None:
                got.append((event.generation and event.generation.number, event.status.state))
            return got

        assert states(sub, 2) == [(1, JobState.RUNNING), (1, JobState.SUCCEEDED)]
        # The early stream saw the job before any generation; a feed read after the finish may give it the newest
        # state without RUNNING, never an older one after a newer.
        seen = states(early, 3)
        assert seen[0] == (None, JobState.WAITING) and seen[-1] == (1, JobState.SUCCEEDED), seen
        assert seen[1:-1] in ([], [(1, JobState.RUNNING)]), seen
        sub.close()
        early.close()
    finally:
        hub.close()
        election.stop()
        store.close()
