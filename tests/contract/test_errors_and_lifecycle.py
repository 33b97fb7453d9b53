"""Bad input gets the right status code and a message naming the value; job lifecycle rules hold end to end."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import grpc
import pytest

from pliant.coordinator import etcd_server
from pliant.coordinator.contract import FailureCause, FailureReport, JobSpec, JobState, NotFound, Unavailable
from pliant.coordinator.etcd_server import EtcdServer, EtcdServerError
from pliant.coordinator.policy import BACKOFF_BASE_S, REPORT_GRACE_S, corroboration_s
from pliant.coordinator.store import EtcdStore
from pliant.v1 import coordinator_pb2 as pb
from pliant.v1 import coordinator_pb2_grpc as pb_grpc
from tests.conftest import wait_for
from tests.fleet import secure_channel

pytestmark = pytest.mark.timeout(60)

Code = grpc.StatusCode


def _spec(**kw: object) -> pb.JobSpec:
    return pb.JobSpec(**{"job_id": "job", "min_nodes": 1, "max_nodes": 2, "nproc_per_node": 1, **kw})


def _expect(call, request, code: grpc.StatusCode, needle: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=10)
    assert info.value.code() == code, info.value.details()
    assert needle in info.value.details(), info.value.details()


def test_every_bad_input_gets_its_status_code(make_coordinator, pki) -> None:
    server = make_coordinator()
    with secure_channel(pki, server.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        _expect(
            stub.CreateJob,
            pb.CreateJobRequest(spec=_spec(min_nodes=3, max_nodes=2)),
            Code.INVALID_ARGUMENT,
            "min_nodes=3 is greater than max_nodes=2",
        )
        _expect(
            stub.CreateJob,
            pb.CreateJobRequest(spec=_spec(min_nodes=0)),
            Code.INVALID_ARGUMENT,
            "min_nodes=0 must be an integer >= 1",
        )
        _expect(
            stub.CreateJob,
            pb.CreateJobRequest(spec=_spec(job_id="no/slashes")),
            Code.INVALID_ARGUMENT,
            "job_id 'no/slashes'",
        )
        _expect(stub.GetJob, pb.GetJobRequest(job_id="ghost"), Code.NOT_FOUND, "job 'ghost' does not exist")
        _expect(stub.Join, pb.JoinRequest(job_id="ghost", node_id="a", address="h:1"), Code.NOT_FOUND, "'ghost'")
        first_event = lambda req, timeout: next(stub.WatchGenerations(req, timeout=timeout))  # noqa: E731
        _expect(first_event, pb.WatchGenerationsRequest(job_id="ghost"), Code.NOT_FOUND, "'ghost'")

        token = stub.CreateJob(pb.CreateJobRequest(spec=_spec()), timeout=10).join_token
        again = stub.CreateJob(pb.CreateJobRequest(spec=_spec()), timeout=10)
        assert not again.created  # identical spec: idempotent
        _expect(stub.CreateJob, pb.CreateJobRequest(spec=_spec(max_nodes=5)), Code.ALREADY_EXISTS, "max_nodes: 2 != 5")

        _expect(
            stub.Join,
            pb.JoinRequest(job_id="job", node_id="", address="h:1", join_token=token),
            Code.INVALID_ARGUMENT,
            "node_id ''",
        )
        _expect(
            stub.Join,
            pb.JoinRequest(job_id="job", node_id="a", address="nohost", join_token=token),
            Code.INVALID_ARGUMENT,
            "address 'nohost' is not HOST:PORT",
        )
        grant = stub.Join(pb.JoinRequest(job_id="job", node_id="a", address="h:1", join_token=token), timeout=10)
        _expect(
            stub.Join,
            pb.JoinRequest(job_id="job", node_id="a", address="h:2", join_token=token),
            Code.ALREADY_EXISTS,
            "node id 'a' already holds a live membership",
        )
        _expect(
            stub.Heartbeat,
            pb.HeartbeatRequest(job_id="job", node_id="a", lease_id=0),
            Code.INVALID_ARGUMENT,
            "lease_id for node 'a' is 0",
        )
        _expect(
            stub.Heartbeat,
            pb.HeartbeatRequest(job_id="job", node_id="a", lease_id=12345),
            Code.PERMISSION_DENIED,
            "the lease sent is not the one node 'a''s membership",
        )
        _expect(
            stub.Heartbeat,
            pb.HeartbeatRequest(job_id="job", node_id="z", lease_id=12345),
            Code.NOT_FOUND,
            "node 'z' has no live membership",
        )
        _expect(
            stub.ReportFailure,
            pb.ReportFailureRequest(job_id="job", node_id="a", generation=0, lease_id=grant.lease_id),
            Code.INVALID_ARGUMENT,
            "generation 0",
        )
        assert stub.Heartbeat(pb.HeartbeatRequest(job_id="job", node_id="a", lease_id=grant.lease_id), timeout=10)

        stub.FinishJob(pb.FinishJobRequest(job_id="job", succeeded=False, reason="user stopped it"), timeout=10)
        _expect(
            stub.FinishJob,
            pb.FinishJobRequest(job_id="job", succeeded=True),
            Code.FAILED_PRECONDITION,
            "already failed (user stopped it)",
        )
        _expect(
            stub.Join,
            pb.JoinRequest(job_id="job", node_id="b", address="h:3", join_token=token),
            Code.FAILED_PRECONDITION,
            "start a new job id",
        )


def test_etcd_unreachable_is_unavailable_and_writes_nothing(make_coordinator, tmp_path, fleet, pki) -> None:
    etcd = EtcdServer(data_dir=str(tmp_path / "etcd")).start()
    try:
        server = make_coordinator("solo", endpoints=(etcd.endpoint,), etcd_timeout_s=1.0)
        etcd.kill()
        with secure_channel(pki, server.address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            _expect(
                stub.CreateJob,
                pb.CreateJobRequest(spec=_spec(job_id="lost")),
                Code.UNAVAILABLE,
                f"etcd at {etcd.endpoint} did not answer",
            )
        with (
            fleet(server.address, retry_for_s=1.5) as client,
            pytest.raises(Unavailable, match="no coordinator answered"),
        ):
            client.get_job("lost")
        etcd.start()
        with fleet(server.address, retry_for_s=20) as client:
            assert [j.spec.job_id for j in client.list_jobs()] == [], "nothing may be written while etcd is down"
            etcd.kill()
            # A client call made while etcd is down succeeds once etcd is back: UNAVAILABLE is retried.
            restart = threading.Timer(1.0, etcd.start)
            restart.start()
            _info, created, _token = client.create_job(JobSpec("late", 1, 1))
            assert created
            assert client.get_job("late").status.state is JobState.WAITING
            restart.join()  # its start() may still be checking etcd's health: the stop below would fail it
    finally:
        etcd.stop()


def test_an_etcd_whose_picked_port_was_taken_meanwhile_starts_on_other_ports(tmp_path, monkeypatch) -> None:
    """A free port is bound by etcd only later: another process may take it in between. A fresh etcd then starts on
    ports picked again; one given the taken port reports it."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        picks = iter([taken])
        real = etcd_server.free_port
        monkeypatch.setattr(etcd_server, "free_port", lambda host: next(picks, None) or real(host))
        etcd = EtcdServer(data_dir=str(tmp_path / "picked"))
        assert etcd.client_port == taken
        try:
            etcd.start()
            assert etcd.client_port != taken and etcd.proc is not None and etcd.proc.poll() is None
        finally:
            etcd.stop()
        given = EtcdServer(data_dir=str(tmp_path / "given"), client_port=taken)
        with pytest.raises(EtcdServerError, match=rf"exited with code \d+ on http://127\.0\.0\.1:{taken}; .*taken"):
            given.start()


def test_below_min_nodes_the_job_waits_then_fails_with_a_clear_reason(make_coordinator, fleet) -> None:
    server = make_coordinator()
    with fleet(server.address) as client:
        client.create_job(JobSpec("job", 2, 2, heartbeat_ttl_s=2, join_grace_s=0, min_nodes_timeout_s=1.5))
        grant = client.join("job", "a", "127.0.0.1:1")
        started = time.monotonic()
        client.heartbeat("job", "a", grant.lease_id)
        info = wait_for(lambda: (j := client.get_job("job")).status.state is JobState.FAILED and j, 10, "failure")
        assert time.monotonic() - started >= 1.0
        assert "1 of the 2 nodes it needs (live: a)" in info.status.reason
        assert "--nnodes" in info.status.reason


def test_restarts_are_charged_to_the_failing_node_on_failures_only(make_coordinator, fleet) -> None:
    server = make_coordinator()
    with fleet(server.address) as client:
        client.create_job(JobSpec("job", 1, 3, join_grace_s=0, max_restarts=1))
        client.join("job", "a", "127.0.0.1:1")
        gen = wait_for(lambda: client.get_job("job").generation, 10, "generation 1")
        client.join("job", "b", "127.0.0.1:2")  # a scaling event
        gen = wait_for(lambda: (g := client.get_job("job").generation) and g.number == 2 and g, 10, "generation 2")
        assert gen.restarts_used == 0
        assert client.report_failure("job", "b", 1, 1) == (False, 2)  # stale generation: ignored
        assert client.report_failure("job", "b", 2, 137, "worker 1 killed") == (True, 2)
        gen = wait_for(lambda: (g := client.get_job("job").generation) and g.number == 3 and g, 10, "generation 3")
        assert (gen.reason, gen.restarts_used, gen.node_ids) == ("restart", 1, ("a", "b"))
        assert client.report_failure("job", "a", 3, 1)[0]  # a's first: within its own budget
        gen = wait_for(lambda: (g := client.get_job("job").generation) and g.number == 4 and g, 10, "generation 4")
        assert (gen.reason, gen.restarts_used, gen.node_ids) == ("restart", 2, ("a", "b"))
        assert client.report_failure("job", "a", 4, 1)[0]  # a's second: past its budget, excluded; b trains on
        gen = wait_for(lambda: (g := client.get_job("job").generation) and g.number == 5 and g, 10, "generation 5")
        assert gen.node_ids == ("b",)
        assert client.report_failure("job", "b", 5, 1)[0]  # b's second: no node within its budget remains
        info = wait_for(lambda: (j := client.get_job("job")).status.state is JobState.FAILED and j, 10, "failure")
        assert "max_restarts=1" in info.status.reason and "failed again on b" in info.status.reason


def test_unreachable_peers_are_evicted_with_the_failure_and_cost_no_restart(make_coordinator, fleet) -> None:
    server = make_coordinator()
    with fleet(server.address) as client:
        client.create_job(JobSpec("job", 1, 3, heartbeat_ttl_s=30, join_grace_s=0, max_restarts=0))
        a = client.join("job", "a", "127.0.0.1:1")
        # b comes after a's world: a newcomer that never arrived, whom a's word evicts at once (two nodes of the
        # first world would wait for b to fall silent, half the 30 s TTL).
        wait_for(lambda: (g := client.get_job("job").generation) and g.node_ids == ("a",), 10, "world a")
        b = client.join("job", "b", "127.0.0.1:2")
        wait_for(lambda: (g := client.get_job("job").generation) and g.node_ids == ("a", "b"), 10, "world a,b")
        number = client.get_job("job").generation.number
        assert client.report_failure("job", "a", number, 1, "gloo: connection reset", ["b"]) == (True, number)
        gen = wait_for(lambda: (g := client.get_job("job").generation) and g.number == number + 1 and g, 10, "next")
        assert (gen.node_ids, gen.reason, gen.restarts_used) == (("a",), "failure", 0)
        assert client.get_job("job").status.state is JobState.RUNNING  # max_restarts=0 and still running
        with pytest.raises(NotFound, match="expired or was revoked"):  # b learns at its next heartbeat
            client.heartbeat("job", "b", b.lease_id)
        client.heartbeat("job", "a", a.lease_id)


def test_a_cut_between_two_members_evicts_one_side_and_holds_it_back_when_it_keeps_failing(
    make_coordinator, fleet
) -> None:
    """Both sides of a cut report each other: one is evicted, not both. The evicted node rejoins at once (an
    established member's eviction earns no strike); when its readmission fails (an older member reports it), it gets
    a strike and is held back BACKOFF_BASE_S before the next try, then twice that, unless it comes back at another
    address, or its agent reaches every member of the current generation (the cut healed: the hold is lifted, at
    most once per two strikes)."""
    server = make_coordinator()
    with fleet(server.address) as client:
        client.create_job(JobSpec("job", 1, 3, heartbeat_ttl_s=30, join_grace_s=0, max_restarts=0))
        a = client.join("job", "a", "127.0.0.1:1")
        client.join("job", "b", "127.0.0.1:2")
        wait_for(lambda: (g := client.get_job("job").generation) and g.node_ids == ("a", "b"), 10, "world a,b")
        c = client.join("job", "c", "127.0.0.1:9")  # a generation after the one that admitted b: b is established
        wait_for(lambda: len(client.get_job("job").generation.node_ids) == 3, 10, "world a,b,c")
        client.leave("job", "c", c.lease_id)
        number = wait_for(
            lambda: (g := client.get_job("job").generation) and g.node_ids == ("a", "b") and g.number,
            10,
            "world a,b again",
        )
        assert client.report_failure("job", "a", number, 1, "gloo: timed out", ["b"]) == (True, number)
        accepted, _ = client.report_failure("job", "b", number, 1, "gloo: timed out", ["a"])  # b is no member now
        gen = wait_for(lambda: (g := client.get_job("job").generation) and g.number > number and g, 10, "next")
        assert gen.node_ids == ("a",) and gen.reason == "failure", (gen, accepted)
        client.heartbeat("job", "a", a.lease_id)  # a was not evicted

        def readmission_fails(address: str) -> float:
            """b joins at ``address``; once admitted, a reports it; returns how long b waited to be admitted."""
            client.join("job", "b", address)
            joined = time.monotonic()
            gen = wait_for(
                lambda: (g := client.get_job("job").generation) and g.node_ids == ("a", "b") and g, 60, "b admitted"
            )
            waited = time.monotonic() - joined
            assert client.report_failure(
                "job", "a", gen.number, 0, "b never arrived", ["b"], cause=FailureCause.NOT_ARRIVED
            ) == (True, gen.number)
            wait_for(lambda: client.get_job("job").generation.node_ids == ("a",), 10, "b evicted")
            return waited

        assert readmission_fails("127.0.0.1:2") < BACKOFF_BASE_S  # no strike yet: at once
        assert client.get_job("job", progress=True).progress["a"].strikes == 0
        held = readmission_fails("127.0.0.1:2")  # strike 1: held back
        assert BACKOFF_BASE_S - 1 <= held <= BACKOFF_BASE_S + 5, held
        grant = client.join("job", "b", "127.0.0.1:2")  # strike 2: held back twice as long
        assert client.get_job("job", progress=True).progress["b"].strikes == 2  # pliant status: "held back"
        time.sleep(BACKOFF_BASE_S + 2)
        number = client.get_job("job").generation.number
        assert client.get_job("job").generation.node_ids == ("a",)
        client.heartbeat("job", "b", grant.lease_id, reaches_generation=number - 1)  # a world gone: nothing
        time.sleep(1.0)
        assert client.get_job("job").generation.node_ids == ("a",)
        lifted = time.monotonic()
        client.heartbeat("job", "b", grant.lease_id, reaches_generation=number)  # b's agent reaches a's again
        wait_for(lambda: client.get_job("job").generation.node_ids == ("a", "b"), 10, "b admitted, its hold lifted")
        assert time.monotonic() - lifted < BACKOFF_BASE_S / 2
        assert client.get_job("job", progress=True).progress["b"].strikes == 2  # the count stays
        client.leave("job", "b", grant.lease_id)
        wait_for(lambda: client.get_job("job").generation.node_ids == ("a",), 10, "b left")
        held = readmission_fails("127.0.0.1:2")  # lifted until the next strike: admitted at once, then strike 3 ...
        assert held < BACKOFF_BASE_S, held
        grant = client.join("job", "b", "127.0.0.1:2")  # ... and held back again
        time.sleep(2.0)
        number = client.get_job("job").generation.number
        assert client.get_job("job").generation.node_ids == ("a",), "held back again"
        client.heartbeat("job", "b", grant.lease_id, reaches_generation=number)  # a second lift, with 3 strikes: ok
        gen = wait_for(
            lambda: (g := client.get_job("job").generation) and g.node_ids == ("a", "b") and g,
            10,
            "b admitted, lifted again",
        )
        assert client.report_failure(
            "job", "a", gen.number, 0, "b never arrived", ["b"], cause=FailureCause.NOT_ARRIVED
        ) == (True, gen.number)
        wait_for(lambda: client.get_job("job").generation.node_ids == ("a",), 10, "b evicted: strike 4")
        grant = client.join("job", "b", "127.0.0.1:2")
        time.sleep(1.0)
        number = client.get_job("job").generation.number
        client.heartbeat("job", "b", grant.lease_id, reaches_generation=number)  # a third lift with 4 strikes: no
        time.sleep(1.5)
        assert client.get_job("job").generation.node_ids == ("a",), "a cut only b's connects cross still backs off"
        client.leave("job", "b", grant.lease_id)
        assert readmission_fails("127.0.0.1:3") < BACKOFF_BASE_S  # another address (a restarted agent): at once


def test_a_spare_that_cannot_reach_the_members_is_held_until_it_does(make_coordinator, fleet, caplog) -> None:
    """b's readmission failed (strike 1: held back BACKOFF_BASE_S). While b's agent, a spare, says it cannot reach
    every member of the current generation, the hold lasts past that; once it reaches them, b is admitted at once. After
    strike 2 (no lift: one per two strikes), reaching them again still ends what its misses added."""
    caplog.set_level(logging.INFO, logger="pliant.coordinator")
    server = make_coordinator()
    with fleet(server.address) as client:
        client.create_job(JobSpec("job", 1, 3, heartbeat_ttl_s=30, join_grace_s=0, max_restarts=0))
        client.join("job", "a", "127.0.0.1:1")
        wait_for(lambda: (g := client.get_job("job").generation) and g.node_ids == ("a",), 10, "world a")

        def readmission_fails() -> tuple[int, int]:
            """b joins; a reports it once admitted; b joins again: (b's lease, the generation b is held from)."""
            client.join("job", "b", "127.0.0.1:2")
            gen = wait_for(
                lambda: (g := client.get_job("job").generation) and g.node_ids == ("a", "b") and g, 60, "b admitted"
            )
            assert client.report_failure(
                "job", "a", gen.number, 0, "b never arrived", ["b"], cause=FailureCause.NOT_ARRIVED
            ) == (True, gen.number)
            number = wait_for(
                lambda: (g := client.get_job("job").generation) and g.node_ids == ("a",) and g.number, 10, "b evicted"
            )
            return client.join("job", "b", "127.0.0.1:2").lease_id, number

        lease, number = readmission_fails()  # b had no strike: admitted at once; now strike 1
        struck = time.monotonic()
        client.heartbeat("job", "b", lease, misses_generation=number)  # b's agent cannot reach a's
        time.sleep(BACKOFF_BASE_S + 2)
        assert client.get_job("job").generation.node_ids == ("a",), "held past its backoff: a try would fail again"
        assert "cannot reach every member" in caplog.text
        client.heartbeat("job", "b", lease, reaches_generation=number)  # the cut healed
        wait_for(lambda: client.get_job("job").generation.node_ids == ("a", "b"), 10, "b admitted, its hold lifted")
        assert time.monotonic() - struck < BACKOFF_BASE_S + 5
        assert client.report_failure(
            "job",
            "a",
            client.get_job("job").generation.number,
            0,
            "b never arrived",
            ["b"],
            cause=FailureCause.NOT_ARRIVED,
        )[0]  # strike 2: lifts=1 of count 2, no lift this time
        number = wait_for(
            lambda: (g := client.get_job("job").generation) and g.node_ids == ("a",) and g.number,
            10,
            "b evicted: strike 2",
        )
        lease = client.join("job", "b", "127.0.0.1:2").lease_id
        client.heartbeat("job", "b", lease, misses_generation=number)
        client.heartbeat("job", "b", lease, reaches_generation=number)
        wait_for(lambda: "held back for the rest of its backoff" in caplog.text, 10, "the miss cleared, no lift")
        assert client.get_job("job").generation.node_ids == ("a",)


def test_a_newcomer_that_arrived_earns_no_strike_when_a_cut_drops_it(make_coordinator, fleet) -> None:
    """b was admitted by the current generation, arrived and trained in it; then a cut drops it, and both sides
    report it. a's report, the first, says that a's workers trained a step in the generation (``arrived``): b is
    evicted without a strike and readmitted at once, however often that happens, and b's own word against a counts
    as an older member's would. The same report without ``arrived`` (b never arrived: a failed readmission) strikes
    b, on a's word alone (the world never trained with b)."""
    server = make_coordinator()
    with fleet(server.address) as client:
        client.create_job(JobSpec("job", 1, 3, heartbeat_ttl_s=30, join_grace_s=0, max_restarts=0))
        client.join("job", "a", "127.0.0.1:1")
        wait_for(lambda: (g := client.get_job("job").generation) and g.node_ids == ("a",), 10, "world a")

        def admitted(node: str, port: int) -> tuple[int, float]:
            client.join("job", node, f"127.0.0.1:{port}")
            joined = time.monotonic()
            number = wait_for(
                lambda: (g := client.get_job("job").generation) and node in g.node_ids and g.number,
                30,
                f"{node} admitted",
            )
            return number, time.monotonic() - joined

        for _ in range(3):
            number, waited = admitted("b", 2)
            assert waited < BACKOFF_BASE_S / 2, waited  # never held back
            assert client.get_job("job", progress=True).progress["b"].strikes == 0
            report = client.report_failure("job", "a", number, 1, "gloo: connection reset", ["b"], arrived=True)
            assert report == (True, number)
            client.report_failure("job", "b", number, 1, "gloo: connection reset", ["a"], arrived=True)
            wait_for(lambda: client.get_job("job").generation.node_ids == ("a",), 10, "b evicted")
        # c, then b: once b's generation trained, b's word against a counts at once, as older c's would (before, it
        # waited REPORT_GRACE_S for c to say so).
        admitted("c", 3)
        number, _ = admitted("b", 2)
        reported = time.monotonic()
        assert client.report_failure("job", "b", number, -2, "a peer failed", ["a"], arrived=True) == (True, number)
        client.report_failure("job", "a", number, -2, "a peer failed", ["b"], arrived=True)  # the other side of the cut
        gen = wait_for(lambda: (g := client.get_job("job").generation) and g.number > number and g, 10, "a evicted")
        assert time.monotonic() - reported < REPORT_GRACE_S, "b's report waited for c's"
        assert gen.node_ids == ("c", "b") and gen.reason == "failure", gen
        number, _ = admitted("a", 1)
        assert client.report_failure("job", "c", number, -1, "a never arrived", ["a"]) == (True, number)
        wait_for(lambda: client.get_job("job").generation.node_ids == ("c", "b"), 10, "a evicted again")
        assert client.get_job("job", progress=True).progress["b"].strikes == 0
        client.join("job", "a", "127.0.0.1:1")
        assert client.get_job("job", progress=True).progress["a"].strikes == 1  # a failed readmission


def test_a_node_cut_off_from_its_peers_is_the_one_evicted_whoever_reports_first(
    make_coordinator, fleet, caplog
) -> None:
    """a reaches the control plane but none of its peers, and reports first, naming b, c and d: that evicts nobody
    (a is the smaller side, and nobody bears its word out yet). c's report naming a evicts a. Then c and d die, and
    b's report names them: they never report and fall silent on their leases, so they are evicted REPORT_GRACE_S
    later (before their TTL), at no restart."""
    caplog.set_level(logging.INFO, logger="pliant.coordinator")
    server = make_coordinator()
    with fleet(server.address) as client:
        client.create_job(JobSpec("job", 1, 5, heartbeat_ttl_s=8, join_grace_s=0, max_restarts=0))
        for node, port in (("a", 1), ("b", 2), ("c", 3), ("d", 4)):
            client.join("job", node, f"127.0.0.1:{port}")
        with client.beating("job", ["a", "b", "c", "d"]) as beats:
            wait_for(lambda: (g := client.get_job("job").generation) and len(g.node_ids) == 4, 10, "world a,b,c,d")
            e = client.join("job", "e", "127.0.0.1:5")  # a generation after the one that admitted the last of a..d
            wait_for(lambda: (g := client.get_job("job").generation) and len(g.node_ids) == 5, 10, "world a..e")
            client.leave("job", "e", e.lease_id)  # ... so that all four are established, whatever the batching was
            number = wait_for(
                lambda: (g := client.get_job("job").generation) and len(g.node_ids) == 4 and g.number,
                10,
                "world a,b,c,d again",
            )
            assert client.report_failure("job", "a", number, -2, "a peer failed", ["b", "c", "d"]) == (True, number)
            time.sleep(REPORT_GRACE_S / 2)
            assert client.get_job("job").generation.number == number  # nobody evicted, no restart: waiting
            assert client.report_failure("job", "c", number, -2, "a peer failed", ["a"]) == (True, number)
            gen = wait_for(lambda: (g := client.get_job("job").generation) and g.number > number and g, 10, "next")
            assert (gen.node_ids, gen.reason, gen.restarts_used) == (("b", "c", "d"), "failure", 0)

            beats.stop("c", "d")  # c and d die: b names them, and they never answer
            reported = time.monotonic()
            assert client.report_failure("job", "b", gen.number, -2, "a peer failed", ["c", "d"]) == (True, gen.number)
            last = wait_for(lambda: (g := client.get_job("job").generation) and g.number > gen.number and g, 15, "last")
            assert (last.node_ids, last.reason, last.restarts_used) == (("b",), "failure", 0)
            assert time.monotonic() - reported >= REPORT_GRACE_S - 0.5
            assert "evicted c, d: named unreachable by b, silent on their leases too" in caplog.text
            assert client.get_job("job").status.state is JobState.RUNNING


def test_one_members_word_never_evicts_a_healthy_peer(make_coordinator, fleet) -> None:
    """a names b unreachable (after the world trained: b is no newcomer), again and again, while b heartbeats and
    trains: b is never evicted. Each of a's reports
    waits for b to fall silent, then restarts the world charged to a, and past max_restarts a is excluded while b
    trains on. (Two members naming a third, or both sides of a cut, do evict: the tests above.)"""
    server = make_coordinator()
    with fleet(server.address) as client:
        client.create_job(JobSpec("job", 1, 3, heartbeat_ttl_s=4, join_grace_s=0, max_restarts=1))
        client.join("job", "a", "127.0.0.1:1")
        client.join("job", "b", "127.0.0.1:2")
        with client.beating("job", ["a", "b"]):
            number = wait_for(
                lambda: (g := client.get_job("job").generation) and g.node_ids == ("a", "b") and g.number,
                10,
                "world a,b",
            )
            for restarts in (1, 2):
                reported = time.monotonic()
                lie = client.report_failure("job", "a", number, 1, "gloo: connection reset", ["b"], arrived=True)
                assert lie == (True, number)
                gen = wait_for(
                    lambda n=number: (g := client.get_job("job").generation) and g.number > n and g, 15, "next"
                )
                assert time.monotonic() - reported >= corroboration_s(4) - 0.5  # it waited for b's silence
                assert "b" in gen.node_ids, gen
                number = gen.number
                assert (gen.reason, gen.restarts_used) == ("restart", restarts), gen
            assert gen.node_ids == ("b",) and gen.reason == "restart", gen  # a excluded (max_restarts=1); b trains on
            assert client.get_job("job").status.state is JobState.RUNNING


def test_two_reports_at_once_evict_a_newcomer_once_and_strike_it_once(make_coordinator, fleet, etcd, prefix) -> None:
    """a and b both report newcomer c, and b's report is written while a's is between its read and its write (a
    real etcd; the race forced by running b's report inside a's). a's transaction must then fail and read again: c is
    evicted once, with one strike. Before, a's went through too: in the lone-cut soak two reports at once counted two
    strikes (a hold twice as long), and here the strike record was lost."""
    server = make_coordinator()
    store = EtcdStore([etcd.endpoint], prefix)
    try:
        with fleet(server.address) as client:
            client.create_job(JobSpec("job", 1, 3, heartbeat_ttl_s=30, join_grace_s=0, max_restarts=0))
            client.join("job", "a", "127.0.0.1:1")
            client.join("job", "b", "127.0.0.1:2")
            wait_for(lambda: (g := client.get_job("job").generation) and g.node_ids == ("a", "b"), 10, "world a,b")
            client.join("job", "c", "127.0.0.1:3")
            gen = wait_for(lambda: (g := client.get_job("job").generation) and len(g.node_ids) == 3 and g, 10, "c in")
            txn, raced = store._txn, []

            def racing(compare, success, failure=None):  # type: ignore[no-untyped-def]
                store._txn = txn  # once: b's report runs, and a's goes on, with etcd's own transactions
                raced.append(store.report_failure("job", FailureReport("b", gen.number, -1, unreachable=("c",))))
                return txn(compare, success, failure)

            store._txn = racing  # type: ignore[method-assign]
            late = store.report_failure("job", FailureReport("a", gen.number, -1, unreachable=("c",)))
            value, _ = store.client.get(store.job_key("job", "strikes", "c"))
            assert raced == [(True, gen.number)] and value is not None and json.loads(value)["count"] == 1
            assert late in ((True, gen.number), (False, gen.number + 1))  # recorded, or stale once c's loss was
            wait_for(lambda: (g := client.get_job("job").generation) and g.node_ids == ("a", "b"), 10, "c evicted")
    finally:
        store.close()


def test_the_job_succeeds_once_every_member_reported_success(make_coordinator, fleet) -> None:
    """One member's success report never ends the job while another member trains: every member of the current
    generation must report it."""
    server = make_coordinator()
    with fleet(server.address) as client:
        client.create_job(JobSpec("job", 2, 2, join_grace_s=0))
        client.join("job", "a", "127.0.0.1:1")
        client.join("job", "b", "127.0.0.1:2")
        gen = wait_for(lambda: (g := client.get_job("job").generation) and len(g.node_ids) == 2 and g, 10, "gen 1")
        assert client.report_success("job", "a", gen.number + 5) == (False, gen.number)
        for _ in range(3):  # repeated by one member: still that member's one report
            assert client.report_success("job", "a", gen.number) == (True, gen.number)
        info = client.get_job("job")
        assert info.status.state is JobState.RUNNING, "one member's success ended the job"
        assert client.report_success("job", "b", gen.number) == (True, gen.number)
        info = client.get_job("job")
        assert (
            info.status.state is JobState.SUCCEEDED
            and "every node's workers completed generation 1" in info.status.reason
        )


def test_a_job_that_ends_as_a_node_joins_does_not_wait_for_the_newcomer(make_coordinator, fleet) -> None:
    """Members whose workers ran the job's last steps in the world before a join (untrained in the new generation)
    end the job without the newcomer, which never trained; members that were no newcomers still need every one."""
    server = make_coordinator()
    with fleet(server.address) as client:
        client.create_job(JobSpec("job", 1, 3, join_grace_s=0))
        client.join("job", "a", "127.0.0.1:1")
        client.join("job", "b", "127.0.0.1:2")
        two = wait_for(lambda: (g := client.get_job("job").generation) and len(g.node_ids) == 2 and g, 10, "a, b")
        client.join("job", "c", "127.0.0.1:3")
        three = wait_for(lambda: (g := client.get_job("job").generation) and len(g.node_ids) == 3 and g, 10, "c in")
        assert three.number > two.number
        assert client.report_success("job", "a", three.number) == (True, three.number)
        assert client.report_success("job", "b", three.number, untrained=True) == (True, three.number)
        info = client.get_job("job")
        assert info.status.state is JobState.SUCCEEDED, info.status
        assert "c joined generation" in info.status.reason and "never trained in it" in info.status.reason

        client.create_job(JobSpec("job2", 2, 2, join_grace_s=0))  # its first generation: a and b, no newcomer
        client.join("job2", "a", "127.0.0.1:1")
        client.join("job2", "b", "127.0.0.1:2")
        both = wait_for(lambda: (g := client.get_job("job2").generation) and len(g.node_ids) == 2 and g, 10, "job2")
        client.report_success("job2", "a", both.number, untrained=True)
        assert client.get_job("job2").status.state is JobState.RUNNING, "b was no newcomer of this generation"


def test_under_etcds_nospace_alarm_jobs_are_read_and_deleted_to_free_space(make_coordinator, fleet) -> None:
    """etcd out of space refuses every write and every transaction: the coordinator still reads jobs (one range
    read), says what to do when a write is refused, and deletes a job that cannot be finished (--force: plain
    deletes, which etcd still serves); once etcd is compacted, defragmented and disarmed, jobs are created again."""
    import etcd3

    from pliant.coordinator.etcd_server import EtcdServer

    with EtcdServer(quota_bytes=4 << 20) as etcd:
        server = make_coordinator(endpoints=(etcd.endpoint,))
        raw = etcd3.client(host=etcd.host, port=etcd.client_port)
        with fleet(server.address) as client:
            client.create_job(JobSpec("job", 1, 2, heartbeat_ttl_s=30, join_grace_s=0))
            client.join("job", "a", "127.0.0.1:1")
            wait_for(lambda: client.get_job("job").generation, 10, "generation 1")
            with pytest.raises(Exception, match="space exceeded"):
                for i in range(1000):
                    raw.put(f"/junk/{i % 20}", "x" * 100_000)
            assert client.get_job("job").generation.node_ids == ("a",), "reads are served"
            with pytest.raises(Exception, match=r"out of space \(its NOSPACE alarm.*pliant job delete JOB --force"):
                client.finish_job("job", False, "no space")
            with pytest.raises(Exception, match="or delete it unfinished with --force"):
                client.delete_job("job")
            client.admin.delete_job("job", force=True)
            with pytest.raises(NotFound):
                client.get_job("job")
            # An operator frees space: etcdctl del, compact --physical (a defrag while a compaction is still under
            # way keeps what it had not removed yet), defrag, alarm disarm.
            freed = raw.delete_prefix("/junk/")
            raw.compact(freed.header.revision, physical=True)
            raw.defragment()
            for alarm in raw.list_alarms():
                raw.disarm_alarm(alarm.member_id)
            client.create_job(JobSpec("again", 1, 1))
            assert client.get_job("again").spec.job_id == "again"
        raw.close()
