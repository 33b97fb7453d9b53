"""Membership on a real etcd and a real coordinator: Join grants a lease, heartbeats keep it, silence expires it."""

from __future__ import annotations

import threading
import time

import pytest

from pliant.coordinator.contract import JobSpec, JobState, NotFound
from tests.conftest import wait_for
from tests.integration.proxy import Proxy

pytestmark = pytest.mark.timeout(60)


def test_join_grants_a_lease_and_the_member_is_visible(make_coordinator, fleet) -> None:
    server = make_coordinator()
    with fleet(server.address) as client:
        client.create_job(JobSpec("job", 1, 2, nproc_per_node=2, heartbeat_ttl_s=3))
        grant = client.join("job", "node-a", "127.0.0.1:29500", slots=2)
        assert grant.lease_id != 0
        assert grant.heartbeat_ttl_s == 3
        assert 0 < grant.heartbeat_interval_s < grant.heartbeat_ttl_s

        members = client.get_job("job").members
        assert [(m.node_id, m.address, m.slots) for m in members] == [("node-a", "127.0.0.1:29500", 2)]

        # The member key in etcd is attached to exactly that lease. The lease is long (the outage tolerance): the
        # leader, not etcd, evicts a member silent for the job's TTL, so a control-plane outage evicts nobody.
        store = server.store
        value, meta = store.client.get(store.job_key("job", "members", "node-a"))
        assert value is not None and meta.lease_id == grant.lease_id
        info = store.client.get_lease_info(grant.lease_id)
        assert info.grantedTTL == 3600 and 3595 < info.TTL <= 3600
        assert client.heartbeat("job", "node-a", grant.lease_id) == pytest.approx(3, abs=1)


def test_silent_member_expires_and_a_new_generation_follows_within_ttl_plus_1s(make_coordinator, fleet) -> None:
    server = make_coordinator()
    ttl = 2.0
    with fleet(server.address) as client:
        client.create_job(JobSpec("job", 1, 2, heartbeat_ttl_s=ttl, join_grace_s=0.2))
        a = client.join("job", "a", "127.0.0.1:1")
        b = client.join("job", "b", "127.0.0.1:2")
        first = wait_for(lambda: client.get_job("job").generation, 10, "the first generation")
        assert first.node_ids == ("a", "b")

        stop = threading.Event()
        last_heartbeat_of_b = time.monotonic()

        def keep_a_alive() -> None:
            while not stop.wait(0.3):
                client.heartbeat("job", "a", a.lease_id)

        keeper = threading.Thread(target=keep_a_alive, daemon=True)
        keeper.start()
        try:
            client.heartbeat("job", "b", b.lease_id)
            last_heartbeat_of_b = time.monotonic()
            second = wait_for(
                lambda: (g := client.get_job("job").generation) and g.number == 2 and g, ttl + 3, "generation 2"
            )
            elapsed = time.monotonic() - last_heartbeat_of_b
        finally:
            stop.set()
            keeper.join()
        assert second.node_ids == ("a",)
        assert second.reason == "failure"
        assert elapsed <= ttl + 1.0, f"new generation {elapsed:.2f}s after b's last heartbeat (TTL {ttl}s)"
        assert [m.node_id for m in client.get_job("job").members] == ["a"]
        with pytest.raises(NotFound, match="expired or was revoked"):
            client.heartbeat("job", "b", b.lease_id)


def test_leave_is_graceful_and_frees_the_node_id(make_coordinator, fleet) -> None:
    server = make_coordinator()
    with fleet(server.address) as client:
        client.create_job(JobSpec("job", 1, 2, join_grace_s=0.1))
        a = client.join("job", "a", "127.0.0.1:1")
        b = client.join("job", "b", "127.0.0.1:2")
        wait_for(lambda: client.get_job("job").generation, 10, "the first generation")
        client.leave("job", "b", b.lease_id)
        gen = wait_for(lambda: (g := client.get_job("job").generation) and g.number == 2 and g, 5, "generation 2")
        assert gen.reason == "leave" and gen.node_ids == ("a",)
        # Leaving never finishes the job; only the coordinator does.
        assert client.get_job("job").status.state is JobState.RUNNING
        b2 = client.join("job", "b", "127.0.0.1:2")  # the id is free again at once
        assert b2.lease_id != b.lease_id
        client.heartbeat("job", "a", a.lease_id)


def test_concurrent_heartbeats_share_one_keepalive_stream(make_coordinator, fleet) -> None:
    from concurrent.futures import ThreadPoolExecutor

    server = make_coordinator()
    with fleet(server.address) as client:
        client.create_job(JobSpec("job", 1, 40, heartbeat_ttl_s=3))
        grants = [client.join("job", f"n{i}", f"127.0.0.1:{i + 1}") for i in range(20)]
        calls = [(f"n{i % 20}", grants[i % 20].lease_id) for i in range(200)]  # 10 heartbeats per lease, in parallel
        with ThreadPoolExecutor(32) as pool:
            ttls = list(pool.map(lambda c: client.heartbeat("job", c[0], c[1]), calls))
        assert all(2 <= ttl <= 3 for ttl in ttls)
        server.store.client.revoke_lease(grants[0].lease_id)
        time.sleep(0.5)  # the replica's member watch sees the delete
        with pytest.raises(NotFound, match=r"expired or was revoked|no live membership"):
            client.heartbeat("job", "n0", grants[0].lease_id)
        assert client.heartbeat("job", "n1", grants[1].lease_id) > 0  # the stream is still fine


def test_a_replica_cut_off_from_etcd_costs_a_heartbeat_only_its_deadline(etcd, make_coordinator, fleet) -> None:
    """A replica that still takes calls but cannot reach etcd (a partition between them: its etcd requests hang for
    their 5 s deadline) must cost a heartbeat less than the TTL: each attempt has the deadline the agent passes (a
    third of the TTL), then the next replica answers. With the client's default deadline (5 s) the TTL (3 s) ran out
    first: the chaos soak's minority fault once evicted every node that way."""
    good = make_coordinator("r1")
    proxy = Proxy(etcd.endpoint.removeprefix("http://"))
    try:
        cut_off = make_coordinator("r2", endpoints=(f"http://{proxy.address}",))
        with fleet(good.address) as admin:
            admin.create_job(JobSpec("job", 1, 2, heartbeat_ttl_s=3))
            token = admin.tokens["job"]
        with fleet([cut_off.address, good.address]) as nodes:
            nodes.tokens["job"] = token
            grant = nodes.join("job", "a", "127.0.0.1:29500")  # through r2, while it reaches etcd
            client = nodes.node("a")
            assert client._current == 0
            proxy.mute()
            started = time.monotonic()
            assert client.heartbeat("job", "a", grant.lease_id, timeout_s=grant.heartbeat_ttl_s / 3) == 3
            took = time.monotonic() - started
            assert took < grant.heartbeat_ttl_s, f"the heartbeat took {took:.2f}s, past the TTL"
    finally:
        proxy.close()
