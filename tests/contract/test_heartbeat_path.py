"""The heartbeat path on a real etcd and a real coordinator: a heartbeat makes no etcd round trip of its own; what
etcd must learn (the lease's keepalive, the node's step) follows in batches; and nothing is answered from memory for
longer than half a TTL, nor after the membership is gone."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from pliant.coordinator.contract import CoordinatorError, JobSpec, NotFound
from pliant.coordinator.etcd_server import EtcdServer
from tests.conftest import wait_for

pytestmark = pytest.mark.timeout(60)


@pytest.fixture()
def own_etcd(tmp_path) -> Iterator[EtcdServer]:
    """An etcd of this test's own, which it may pause (SIGSTOP) without touching the session's."""
    server = EtcdServer(log_path=str(tmp_path / "etcd.log")).start()
    yield server
    if server.proc is not None and server.proc.poll() is None:
        os.killpg(server.proc.pid, signal.SIGCONT)
    server.stop()


class Paused:
    """etcd stopped (SIGSTOP) for the ``with`` block: it answers nothing, and everything it was sent waits."""

    def __init__(self, etcd: EtcdServer) -> None:
        assert etcd.proc is not None
        self.pid = etcd.proc.pid

    def __enter__(self) -> Paused:
        os.killpg(self.pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc: object) -> None:
        os.killpg(self.pid, signal.SIGCONT)


def test_heartbeats_are_answered_while_etcd_answers_nothing(own_etcd, make_coordinator, fleet) -> None:
    """Once etcd has confirmed a member's lease on a replica, its heartbeats are answered from the replica's memory:
    with etcd paused, every member's heartbeats still return at once, each within a deadline far below etcd's own
    timeout, and the keepalives they owe reach etcd once it runs again."""
    server = make_coordinator(endpoints=(own_etcd.endpoint,))
    with fleet(server.address) as client:
        client.create_job(JobSpec("job", 1, 20, heartbeat_ttl_s=10))
        grants = {f"n{i}": client.join("job", f"n{i}", f"127.0.0.1:{i + 1}") for i in range(10)}
        for node, grant in grants.items():  # the first heartbeat of a lease on a replica goes to etcd
            client.heartbeat("job", node, grant.lease_id)
        store = server.store
        before = {node: store.client.get_lease_info(g.lease_id).TTL for node, g in grants.items()}
        time.sleep(1.2)  # etcd's lease TTLs are whole seconds: let them drop by one
        with Paused(own_etcd):
            for _round in range(5):
                for node, grant in grants.items():
                    assert client.heartbeat("job", node, grant.lease_id, step=7, timeout_s=0.5) == 10
        # etcd learns the keepalives (the leases are young again) and the steps, in batches
        wait_for(
            lambda: all(before[n] <= store.client.get_lease_info(g.lease_id).TTL for n, g in grants.items()),
            5,
            "the batched keepalives",
        )
        wait_for(
            lambda: all(p.step == 7 for p in store.progress("job", client.get_job("job").members).values()),
            5,
            "the batched progress writes",
        )


def test_no_heartbeat_is_answered_from_memory_half_a_ttl_after_etcds_last_confirmation(
    own_etcd, make_coordinator, fleet
) -> None:
    """A replica cut off from etcd stops vouching for its members once their leases' last confirmation is half a TTL
    old: their heartbeats then fail, so each agent sees the outage itself (and tries another replica)."""
    server = make_coordinator(endpoints=(own_etcd.endpoint,))
    with fleet(server.address, retry_for_s=0) as client:
        client.create_job(JobSpec("job", 1, 2, heartbeat_ttl_s=2))
        grant = client.join("job", "a", "127.0.0.1:1")
        client.heartbeat("job", "a", grant.lease_id)
        with Paused(own_etcd):
            assert client.heartbeat("job", "a", grant.lease_id, timeout_s=0.5) == 2
            time.sleep(1.1)  # half the TTL since the last confirmation
            with pytest.raises(CoordinatorError):
                client.heartbeat("job", "a", grant.lease_id, timeout_s=0.5)
        wait_for(lambda: client.heartbeat("job", "a", grant.lease_id) == 2, 10, "heartbeats once etcd is back")


def test_a_membership_deleted_elsewhere_fails_the_next_heartbeats_from_memory(
    make_coordinator, fleet, etcd, prefix
) -> None:
    """A member key deleted by another replica (an eviction, a leave) or behind the coordinators' back (its lease
    revoked in etcd) ends the heartbeats answered from memory: the replica's watch sees the delete, the very next
    heartbeat fails NotFound, and the node's peers' go on."""
    first, second = make_coordinator("r1"), make_coordinator("r2")
    with fleet(first.address) as a, fleet(second.address) as b:
        a.create_job(JobSpec("job", 1, 4, heartbeat_ttl_s=10))
        grants = {n: a.join("job", n, f"127.0.0.1:{i + 1}") for i, n in enumerate(("x", "y", "z"))}
        for node, grant in grants.items():
            for _ in range(3):  # confirmed on r2: answered from its memory from now on
                b.heartbeat("job", node, grant.lease_id)
        time.sleep(0.3)  # the batch those heartbeats queued is sent: no keepalive of r2's is due now
        a.leave("job", "x", grants["x"].lease_id)  # deleted through r1
        first.store.client.revoke_lease(grants["y"].lease_id)  # deleted in etcd itself
        time.sleep(0.5)  # the watch's delay; no heartbeat meanwhile (a batch's keepalive would find the lease gone)
        for node in ("x", "y"):
            with pytest.raises(NotFound, match=r"expired or was revoked|no live membership"):
                b.heartbeat("job", node, grants[node].lease_id)
        assert b.heartbeat("job", "z", grants["z"].lease_id) == 10


def test_the_leader_bounds_the_ages_of_leases_it_confirmed_and_looks_up_the_rest(own_etcd, make_coordinator, fleet):
    """The ages of leases whose keepalives this replica sent lately come from its memory, each at least the age etcd
    would give: with etcd paused they are known at once. A lease this replica has not confirmed within half a TTL (its
    node beats on another replica, or not at all) is looked up: etcd's own age, which grows while the node is
    silent."""
    server = make_coordinator(endpoints=(own_etcd.endpoint,))
    with fleet(server.address) as client:
        client.create_job(JobSpec("job", 1, 4, heartbeat_ttl_s=4))
        grants = {n: client.join("job", n, f"127.0.0.1:{i + 1}") for i, n in enumerate(("a", "b"))}
        client.heartbeat("job", "a", grants["a"].lease_id)  # confirmed here; b never beats
        store = server.store
        members = store.read_job("job").members  # with their lease ids
        time.sleep(1.2)
        client.heartbeat("job", "a", grants["a"].lease_id)
        time.sleep(0.3)  # the batch's keepalive is confirmed
        with Paused(own_etcd):
            started = time.monotonic()
            ages = store.lease_ages("job", [m for m in members if m.node_id == "a"])
            assert time.monotonic() - started < 0.5, "no lookup: etcd answers nothing"
            assert 0.1 <= ages["a"] < 1.0, "since the batch's keepalive, sent within 0.3 s"
        ages = store.lease_ages("job", members)
        assert 0.1 <= ages["a"] < 1.0
        assert ages["b"] >= 1.0, "b's age is etcd's (whole seconds, rounded up): never confirmed here"
        time.sleep(2.0)  # half the TTL since a's last keepalive: a is looked up too
        assert store.lease_ages("job", members)["a"] >= 2.0
