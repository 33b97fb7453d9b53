"""Static stability against a real etcd: control-plane outages evict nobody who keeps trying, bad records stay local,
state writes are fenced, and health tells the truth."""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time

import pytest

from pliant.coordinator import election
from pliant.coordinator.contract import (
    CorruptRecord,
    FencingError,
    JobSpec,
    JobState,
    JobStatus,
)
from pliant.coordinator.etcd_server import EtcdServer
from tests.conftest import health_serving, wait_for

pytestmark = pytest.mark.timeout(120)


def _gen(client, job: str, number: int, timeout_s: float = 15):
    return wait_for(
        lambda: (g := client.get_job(job).generation) and g.number >= number and g,
        timeout_s,
        f"{job} generation {number}",
    )


class _Heartbeats:
    """Nodes that keep heartbeating through failures, as agents do."""

    def __init__(self, client, job: str, nodes: list[str]) -> None:
        self.client, self.job, self.nodes = client, job, nodes
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.3):
            for node in self.nodes:
                with contextlib.suppress(Exception):
                    self.client.heartbeat(self.job, node, self.client.leases[(self.job, node)])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(15)


def test_every_replica_down_longer_than_the_ttl_evicts_no_one(make_coordinator, fleet) -> None:
    ttl = 2.0
    first = make_coordinator("first")
    with fleet(first.address, retry_for_s=0.5) as client:
        client.create_job(JobSpec("job", 1, 4, heartbeat_ttl_s=ttl, join_grace_s=0.1))
        client.join("job", "a", "127.0.0.1:1")
        client.join("job", "b", "127.0.0.1:2")
        assert _gen(client, "job", 1).node_ids == ("a", "b")
        first.stop(grace_s=0)  # the whole control plane: etcd keeps running, every lease ages
        time.sleep(3 * ttl)
    second = make_coordinator("second")
    with fleet(second.address, retry_for_s=5) as client2:
        client2.tokens.update(client.tokens)
        client2.leases.update(client.leases)
        beats = _Heartbeats(client2, "job", ["a"])  # "b" died during the outage; "a" kept trying
        try:
            wait_for(lambda: second.election.is_leader, 10, "the new leader")
            time.sleep(ttl * 0.8)
            # Within the first TTL nobody is evicted, even "b", whose lease is 6 s old.
            assert [m.node_id for m in client2.get_job("job").members] == ["a", "b"]
            third = _gen(client2, "job", 2, timeout_s=3 * ttl)
            assert third.node_ids == ("a",) and third.reason == "failure"
            assert second.metrics.evictions.labels("job")._value.get() == 1
        finally:
            beats.close()


def test_an_etcd_outage_evicts_no_one_and_health_comes_back(
    make_coordinator, fleet, tmp_path, pki, monkeypatch, caplog
) -> None:
    """...and the replica says so while it lasts (every UNREACHABLE_SAID_EVERY_S), and when etcd is back."""
    monkeypatch.setattr(election, "UNREACHABLE_SAID_EVERY_S", 1.0)
    caplog.set_level(logging.WARNING, logger="pliant.coordinator.election")
    ttl = 2.0
    etcd = EtcdServer(data_dir=str(tmp_path / "etcd")).start()
    try:
        server = make_coordinator("solo", endpoints=(etcd.endpoint,), health_listen="127.0.0.1:0")
        health = f"127.0.0.1:{server.health_port}"
        with fleet(server.address, retry_for_s=0.5) as client:
            client.create_job(JobSpec("job", 1, 4, heartbeat_ttl_s=ttl, join_grace_s=0.1))
            client.join("job", "a", "127.0.0.1:1")
            client.join("job", "b", "127.0.0.1:2")
            assert _gen(client, "job", 1).node_ids == ("a", "b")
            beats = _Heartbeats(client, "job", ["a", "b"])
            try:
                etcd.kill()
                wait_for(lambda: not health_serving(health), 15, "NOT_SERVING while etcd is down")
                time.sleep(3 * ttl)
                etcd.start()
                # SERVING as soon as etcd answers: leader or not (this replica wins again after its lease expired).
                wait_for(lambda: health_serving(health), 15, "SERVING once etcd is back")
                wait_for(lambda: server.election.is_leader, 15, "leadership")
                time.sleep(2 * ttl)
                info = client.get_job("job")
                assert [m.node_id for m in info.members] == ["a", "b"]
                assert info.generation.number == 1 and info.status.state is JobState.RUNNING
                said = [r.getMessage() for r in caplog.records if r.name == "pliant.coordinator.election"]
                assert [m for m in said if "election paused, etcd unreachable" in m], said
                assert len([m for m in said if "etcd still unreachable after" in m]) >= 3, said
                assert [m for m in said if re.search(r"reaches etcd again after \d+s", m)], said
            finally:
                beats.close()
    finally:
        etcd.stop()


def test_a_malformed_record_is_skipped_and_reported(make_coordinator, fleet) -> None:
    server = make_coordinator(health_listen="127.0.0.1:0")
    with fleet(server.address) as client:
        client.create_job(JobSpec("bad", 1, 2, join_grace_s=0.1))
        client.join("bad", "a", "127.0.0.1:1")
        _gen(client, "bad", 1)
        store = server.store
        store.client.put(store.job_key("bad", "state"), '{"since": 1.0}')  # valid JSON, no "state"
        client.create_job(JobSpec("good", 1, 2, join_grace_s=0.1))
        client.join("good", "b", "127.0.0.1:2")
        assert _gen(client, "good", 1).node_ids == ("b",)
        wait_for(lambda: "bad" in server.reconciler.unreadable, 10, "the bad job to be marked")
        assert "KeyError" in server.reconciler.unreadable["bad"]
        assert server.metrics.unreadable_jobs._value.get() == 1
        assert server.election.is_leader and health_serving(f"127.0.0.1:{server.health_port}")
        jobs, unreadable = client.admin.list_jobs_and_errors()
        assert [j.spec.job_id for j in jobs] == ["good"]
        assert "jobs/bad/state" in unreadable["bad"] and "etcdctl del" in unreadable["bad"]
        with pytest.raises(CorruptRecord, match="jobs/bad/state"):
            client.get_job("bad")


def test_state_writes_are_fenced_by_the_record_read(make_coordinator, fleet) -> None:
    server = make_coordinator()
    with fleet(server.address) as client:
        client.create_job(JobSpec("job", 1, 2, join_grace_s=0.1))
        client.join("job", "a", "127.0.0.1:1")
        _gen(client, "job", 1)
        store, fence = server.store, server.election.fence
        snap = store.read_job("job")
        client.finish_job("job", True, "done")
        with pytest.raises(FencingError):
            store.set_status(snap, JobStatus(JobState.FAILED, 0.0, "late"), fence)
        with pytest.raises(FencingError):
            store.set_status(store.read_job("job"), JobStatus(JobState.FAILED, 0.0, "over a terminal state"), fence)
        assert client.get_job("job").status.state is JobState.SUCCEEDED


def test_a_reconciler_fault_resigns_and_reports_not_serving_until_it_recovers(make_coordinator, monkeypatch) -> None:
    server = make_coordinator("faulty", health_listen="127.0.0.1:0")
    health = f"127.0.0.1:{server.health_port}"
    wait_for(lambda: server.election.is_leader, 10, "leadership")
    original, calls = server.store.list_job_ids, []

    def broken() -> list[str]:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug outside any one job")
        return original()

    monkeypatch.setattr(server.store, "list_job_ids", broken)
    server.reconciler.poke()
    wait_for(lambda: not health_serving(health), 10, "NOT_SERVING after the fault")
    assert not server.election.is_leader
    # It reports NOT_SERVING first, then deletes its leader key (an etcd round trip) before its next campaign.
    wait_for(lambda: server.store.leader()[0] != "faulty", 5, "the leader key resigned")
    assert server.metrics.faults._value.get() == 1
    # After one leader TTL it campaigns again; etcd answers, so it serves (and leads: it is the only replica).
    wait_for(lambda: health_serving(health) and server.election.is_leader, 15, "recovery")
