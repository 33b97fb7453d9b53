"""Probes of a real coordinator (mutual TLS) on a real etcd, one per way in which anyone who reached the coordinator
could once fail, finish or read any job: each is now refused with the right status code and a clear message, and the
refused call leaves etcd's contents exactly as they were."""

from __future__ import annotations

import datetime
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from pliant.coordinator.client import CoordinatorClient
from pliant.coordinator.contract import JobSpec, JobState, Unavailable
from pliant.coordinator.store import EtcdStore
from pliant.security.credentials import channel_credentials
from pliant.security.identity import Role
from pliant.security.issuance import LocalCA, issue_cert, write_tls_dir
from pliant.security.tlsdir import TlsConfig
from pliant.v1 import coordinator_pb2 as pb
from pliant.v1 import coordinator_pb2_grpc as pb_grpc
from tests.conftest import health_serving, wait_for
from tests.fleet import agent_tls, secure_channel

pytestmark = pytest.mark.timeout(90)

Code = grpc.StatusCode


class Probe:
    """A running coordinator with one job (nodes a and b in generation 1 or 2), stubs as admin, as a, as b and as a
    stranger node, and a view of etcd to prove that refused calls change nothing."""

    def __init__(self, server: object, pki: LocalCA, etcd_endpoint: str, prefix: str, fleet: object) -> None:
        self.server, self.pki, self.prefix = server, pki, prefix
        self.store = EtcdStore((etcd_endpoint,), prefix)
        self.fleet = fleet
        self.channels: list[grpc.Channel] = []
        _info, _created, self.token = fleet.create_job(JobSpec("job", 1, 4, heartbeat_ttl_s=30, join_grace_s=0))
        self.a = fleet.join("job", "a", "127.0.0.1:1001")
        self.b = fleet.join("job", "b", "127.0.0.1:1002")
        self.gen = wait_for(
            lambda: (g := fleet.get_job("job").generation) and g.node_ids == ("a", "b") and g,
            10,
            "generation with a and b",
        )

    def stub(self, who: str) -> pb_grpc.CoordinatorStub:
        channel = secure_channel(self.pki, self.server.address, who)
        self.channels.append(channel)
        return pb_grpc.CoordinatorStub(channel)

    def etcd(self) -> dict[bytes, bytes]:
        return {meta.key: value for value, meta in self.store.client.get_prefix(self.prefix)}

    def refused(self, call: Callable, request: object, code: grpc.StatusCode, needle: str) -> str:
        """Make ``call``; assert it fails with ``code`` and ``needle`` in the message, and that etcd is unchanged."""
        before = self.etcd()
        with pytest.raises(grpc.RpcError) as info:
            result = call(request, timeout=10)
            if hasattr(result, "__next__"):
                next(result)
        details = info.value.details() or ""
        assert info.value.code() == code, details
        assert needle in details, details
        for secret in (
            str(self.a.lease_id),
            f"{self.a.lease_id:x}",
            str(self.b.lease_id),
            f"{self.b.lease_id:x}",
            self.token,
        ):
            assert secret not in details, f"the message leaks a lease id or the token: {details}"
        assert self.etcd() == before, f"a refused {type(request).__name__} changed etcd"
        return details

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
        self.store.close()


@pytest.fixture
def probe(make_coordinator, pki, etcd, prefix, fleet) -> Iterator[Probe]:
    server = make_coordinator()
    item = Probe(server, pki, etcd.endpoint, prefix, fleet(server))
    yield item
    item.close()


def test_failure_and_success_reports_only_from_members_of_the_generation(probe: Probe) -> None:
    stranger, a = probe.stub("mallory"), probe.stub("a")
    number = probe.gen.number
    report = pb.ReportFailureRequest(job_id="job", node_id="mallory", generation=number, exit_code=1, lease_id=12345)
    for _ in range(3):  # three of them once spent the restart budget and failed the job
        probe.refused(stranger.ReportFailure, report, Code.NOT_FOUND, "node 'mallory' has no live membership")
    # Posing as a member: another node's certificate, or a's identity without a's lease.
    probe.refused(
        stranger.ReportFailure,
        pb.ReportFailureRequest(job_id="job", node_id="a", generation=number, lease_id=probe.a.lease_id),
        Code.PERMISSION_DENIED,
        "acts only for node 'mallory'",
    )
    probe.refused(
        a.ReportFailure,
        pb.ReportFailureRequest(job_id="job", node_id="a", generation=number, lease_id=probe.b.lease_id),
        Code.PERMISSION_DENIED,
        "not the one node 'a''s membership",
    )
    # unreachable_nodes names only members of the generation reported.
    probe.refused(
        a.ReportFailure,
        pb.ReportFailureRequest(
            job_id="job", node_id="a", generation=number, lease_id=probe.a.lease_id, unreachable_nodes=["ghost"]
        ),
        Code.INVALID_ARGUMENT,
        "not members of job 'job'",
    )
    probe.refused(
        stranger.ReportSuccess,
        pb.ReportSuccessRequest(job_id="job", node_id="mallory", generation=number, lease_id=12345),
        Code.NOT_FOUND,
        "no live membership",
    )
    info = probe.fleet.get_job("job")
    assert info.status.state is JobState.RUNNING and info.generation.restarts_used == 0


def test_a_spare_is_no_member_of_the_generation(make_coordinator, fleet) -> None:
    server = make_coordinator()
    with fleet(server) as client:
        client.create_job(JobSpec("job", 1, 1, heartbeat_ttl_s=30, join_grace_s=0))
        client.join("job", "a", "127.0.0.1:1")
        client.join("job", "spare", "127.0.0.1:2")  # max_nodes=1: it waits as a spare
        gen = wait_for(lambda: client.get_job("job").generation, 10, "generation 1")
        for report in (
            lambda: client.report_failure("job", "spare", gen.number, 1),
            lambda: client.report_success("job", "spare", gen.number),
        ):
            with pytest.raises(Exception, match="node 'spare' is not a member of job 'job''s generation 1") as info:
                report()
            assert type(info.value).__name__ == "PermissionDenied"
        assert client.get_job("job").status.state is JobState.RUNNING


def test_admin_calls_need_the_admin_role(probe: Probe) -> None:
    a = probe.stub("a")
    probe.refused(
        a.FinishJob,
        pb.FinishJobRequest(job_id="job", succeeded=True),
        Code.PERMISSION_DENIED,
        "FinishJob needs an admin certificate",
    )
    probe.refused(
        a.CreateJob,
        pb.CreateJobRequest(spec=pb.JobSpec(job_id="x", min_nodes=1, max_nodes=1, nproc_per_node=1)),
        Code.PERMISSION_DENIED,
        "CreateJob needs an admin",
    )
    probe.refused(a.ListJobs, pb.ListJobsRequest(), Code.PERMISSION_DENIED, "ListJobs needs an admin")
    probe.refused(a.DeleteJob, pb.DeleteJobRequest(job_id="job"), Code.PERMISSION_DENIED, "DeleteJob needs an admin")
    probe.refused(
        a.RotateJoinToken,
        pb.RotateJoinTokenRequest(job_id="job"),
        Code.PERMISSION_DENIED,
        "RotateJoinToken needs an admin",
    )
    # A member reads its job without any node's address; a stranger not at all; an admin everything.
    seen = a.GetJob(pb.GetJobRequest(job_id="job"), timeout=10)
    assert [m.address for m in seen.members] == ["", ""] and seen.generation.store_address == ""
    probe.refused(
        probe.stub("mallory").GetJob, pb.GetJobRequest(job_id="job"), Code.PERMISSION_DENIED, "not a member of it"
    )
    full = probe.stub("admin").GetJob(pb.GetJobRequest(job_id="job"), timeout=10)
    assert full.generation.store_address == "127.0.0.1:1001"


def test_leases_are_bound_to_their_node(probe: Probe) -> None:
    a, b = probe.stub("a"), probe.stub("b")
    leader_lease = probe.store.client.get(probe.store.leader_key)[1].lease_id
    # Leave with the leader's lease (any lease) once revoked it: the coordinator stepped down.
    probe.refused(
        a.Leave,
        pb.LeaveRequest(job_id="job", node_id="a", lease_id=leader_lease),
        Code.PERMISSION_DENIED,
        "a node leaves only with the lease_id its own Join returned",
    )
    probe.refused(
        a.Leave,
        pb.LeaveRequest(job_id="job", node_id="b", lease_id=probe.b.lease_id),
        Code.PERMISSION_DENIED,
        "acts only for node 'a'",
    )
    assert probe.server.election.is_leader
    # Heartbeat is no oracle of lease ids: a's certificate may only ask about a, and with any lease not its own the
    # answer is the same refusal, whether the id exists (b's, the leader's) or not.
    for lease in (probe.b.lease_id, leader_lease, 12345, 2**62):
        probe.refused(
            a.Heartbeat,
            pb.HeartbeatRequest(job_id="job", node_id="a", lease_id=lease),
            Code.PERMISSION_DENIED,
            "not the one node 'a''s membership",
        )
    probe.refused(
        b.Heartbeat,
        pb.HeartbeatRequest(job_id="job", node_id="a", lease_id=probe.a.lease_id),
        Code.PERMISSION_DENIED,
        "acts only for node 'b'",
    )
    assert a.Heartbeat(pb.HeartbeatRequest(job_id="job", node_id="a", lease_id=probe.a.lease_id), timeout=10).ttl_s
    # ALREADY_EXISTS names the holder's address, never its lease.
    probe.refused(
        a.Join,
        pb.JoinRequest(job_id="job", node_id="a", address="127.0.0.1:9", join_token=probe.token),
        Code.ALREADY_EXISTS,
        "already holds a live membership",
    )


def test_join_needs_the_token_and_the_node_own_certificate(probe: Probe) -> None:
    d = probe.stub("d")
    join = pb.JoinRequest(job_id="job", node_id="d", address="127.0.0.1:1004")
    probe.refused(d.Join, join, Code.UNAUTHENTICATED, "no join token for job 'job'; pass the token")
    join.join_token = "wrong-" + probe.token[6:]
    probe.refused(d.Join, join, Code.UNAUTHENTICATED, "a wrong join token")
    join.join_token, join.node_id = probe.token, "e"
    probe.refused(d.Join, join, Code.PERMISSION_DENIED, "acts only for node 'd'")
    # A rotated token replaces the old one at once, on every replica.
    new = probe.fleet.admin.rotate_join_token("job")
    join.node_id = "d"
    probe.refused(d.Join, join, Code.UNAUTHENTICATED, "a wrong join token")
    join.join_token = new
    assert d.Join(join, timeout=10).lease_id


def test_watch_only_for_members_and_admins(probe: Probe) -> None:
    probe.refused(
        probe.stub("mallory").WatchGenerations,
        pb.WatchGenerationsRequest(job_id="job"),
        Code.PERMISSION_DENIED,
        "not a member of it",
    )
    for who in ("a", "admin"):
        first = next(probe.stub(who).WatchGenerations(pb.WatchGenerationsRequest(job_id="job"), timeout=10))
        assert first.generation.number == probe.gen.number


def test_bounded_inputs(probe: Probe) -> None:
    admin, a = probe.stub("admin"), probe.stub("a")
    spec = dict(min_nodes=1, max_nodes=2, nproc_per_node=1)
    probe.refused(
        admin.CreateJob,
        pb.CreateJobRequest(spec=pb.JobSpec(job_id="abc\n", **spec)),
        Code.INVALID_ARGUMENT,
        "job_id 'abc\\n' is invalid",
    )
    probe.refused(
        admin.CreateJob,
        pb.CreateJobRequest(spec=pb.JobSpec(job_id="big", min_nodes=1, max_nodes=1, nproc_per_node=2**32 - 1)),
        Code.INVALID_ARGUMENT,
        "must be at most 1024",
    )
    join = pb.JoinRequest(job_id="job", node_id="a", join_token=probe.token)
    for address in ("evil host\n:80", "h" * 1_000_000 + ":80", "-bad-.example:80", "host:0", "[::1:80"):
        join.address = address
        details = probe.refused(a.Join, join, Code.INVALID_ARGUMENT, "is not HOST:PORT")
        assert len(details) < 400, "a bad value is quoted in at most ~100 characters"
    join.address, join.slots = "127.0.0.1:80", 2**32 - 1
    probe.refused(a.Join, join, Code.INVALID_ARGUMENT, "slots=4294967295 must be between 1 and 1024")
    join.slots = 2  # more than the admin's nproc_per_node: a member cannot take the world's ranks for itself
    probe.refused(a.Join, join, Code.INVALID_ARGUMENT, "slots=2 exceeds job 'job''s nproc_per_node=1")
    # A long reason is kept, truncated to 4 KiB with a note; one over the message limit is RESOURCE_EXHAUSTED, which
    # the client does not retry.
    admin.FinishJob(pb.FinishJobRequest(job_id="job", succeeded=False, reason="r" * 1_000_000), timeout=10)
    reason = probe.fleet.get_job("job").status.reason
    assert len(reason.encode()) <= 4096 and "[truncated: 1000000 bytes, kept 4096]" in reason
    probe.refused(
        admin.FinishJob, pb.FinishJobRequest(job_id="job", reason="r" * 2_000_000), Code.RESOURCE_EXHAUSTED, ""
    )
    started = time.monotonic()
    with pytest.raises(Exception, match=r"RESOURCE_EXHAUSTED|larger than max"):
        probe.fleet.admin.finish_job("job", False, "r" * 2_000_000)
    assert time.monotonic() - started < 2, "RESOURCE_EXHAUSTED is not 'safe to retry'"


def test_job_quota_delete_and_ttl(make_coordinator, fleet) -> None:
    server = make_coordinator(max_jobs=2, finished_job_ttl_s=1.0)
    with fleet(server) as client:
        client.create_job(JobSpec("one"))
        client.create_job(JobSpec("two"))
        with pytest.raises(Exception, match="holds 2 jobs, its limit \\(--max-jobs 2\\)") as info:
            client.create_job(JobSpec("three"))
        assert type(info.value).__name__ == "ResourceExhausted"
        with pytest.raises(Exception, match="finish it first") as info:
            client.delete_job("one")
        assert type(info.value).__name__ == "FailedPrecondition"
        client.finish_job("one", True, "done")
        client.delete_job("one")
        client.create_job(JobSpec("three"))
        client.finish_job("two", False, "stopped")
        wait_for(lambda: [j.spec.job_id for j in client.list_jobs()] == ["three"], 10, "the TTL to delete job two")


def test_watch_streams_are_capped_and_never_starve_heartbeats(make_coordinator, fleet) -> None:
    server = make_coordinator(max_workers=8, max_watch_streams=3)
    with fleet(server) as client:
        client.create_job(JobSpec("job", 1, 3, join_grace_s=0))
        client.join("job", "a", "127.0.0.1:1")
        grants = {node: client.join("job", node, f"127.0.0.1:{port}") for node, port in (("b", 2), ("c", 3))}
        streams = [client.node("a").watch("job") for _ in range(3)]
        for stream in streams:
            next(stream)
        with pytest.raises(Exception, match="serves 3 WatchGenerations streams, its limit") as info:
            next(client.watch("job"))
        assert type(info.value).__name__ == "ResourceExhausted"
        results: list[float] = []
        threads = [  # four at once per node: what one caller may have in flight here (half the 8 threads)
            threading.Thread(target=lambda n=node: results.append(client.heartbeat("job", n, grants[n].lease_id)))
            for node in ("b", "c")
            for _ in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(results) == 8, "heartbeats are served while the stream cap is reached"
        for stream in streams:
            stream.close()


def test_one_members_repeated_failure_reports_exclude_it_not_the_job(make_coordinator, fleet) -> None:
    """Failures are charged to the node that reports them: past max_restarts it is excluded (a spare for good), and
    the job goes on with the others."""
    server = make_coordinator()
    with fleet(server) as client:
        client.create_job(JobSpec("job", 1, 2, heartbeat_ttl_s=30, join_grace_s=0, max_restarts=1))
        client.join("job", "a", "127.0.0.1:1")
        client.join("job", "b", "127.0.0.1:2")
        gen = wait_for(lambda: (g := client.get_job("job").generation) and len(g.node_ids) == 2 and g, 10, "a, b")
        for _ in range(2):
            assert client.report_failure("job", "a", gen.number, 1, "boom") == (True, gen.number)
            gen = wait_for(
                lambda n=gen.number: (g := client.get_job("job").generation) and g.number > n and g,
                10,
                "the next generation",
            )
        assert gen.node_ids == ("b",), "a, past its own budget, is excluded"
        assert client.get_job("job").status.state is JobState.RUNNING, "b's budget is untouched"
        with pytest.raises(Exception, match="'a' is not a member of job 'job''s generation"):
            client.report_success("job", "a", gen.number)  # an excluded node speaks for no generation
        assert client.get_job("job").status.state is JobState.RUNNING


def test_one_member_opening_watch_streams_locks_out_only_itself(make_coordinator, fleet) -> None:
    from pliant.coordinator.servicer import STREAMS_PER_CALLER

    server = make_coordinator(max_workers=16, max_watch_streams=STREAMS_PER_CALLER + 2)
    with fleet(server) as client:
        client.create_job(JobSpec("job", 1, 2, join_grace_s=0))
        client.join("job", "a", "127.0.0.1:1")
        client.join("job", "b", "127.0.0.1:2")
        streams = [client.node("a").watch("job") for _ in range(STREAMS_PER_CALLER)]
        for stream in streams:
            next(stream)
        with pytest.raises(Exception, match=f"holds {STREAMS_PER_CALLER} WatchGenerations streams on this replica"):
            next(client.node("a").watch("job"))
        honest = client.node("b").watch("job")
        assert next(honest) is not None, "another node still watches its job"
        streams[0].close()

        def reopened() -> object:
            stream = client.node("a").watch("job")
            try:
                next(stream)
            except Exception:
                stream.close()
                return None
            return stream

        again = wait_for(reopened, 10, "a closed stream to free its caller's place", interval_s=0.2)
        for stream in [*streams[1:], honest, again]:
            stream.close()


def test_connections_without_a_valid_certificate_are_refused(make_coordinator, pki, tmp_path: Path) -> None:
    server = make_coordinator()
    request = pb.ListJobsRequest()

    def refused(channel: grpc.Channel) -> None:
        with channel, pytest.raises(grpc.RpcError) as info:
            pb_grpc.CoordinatorStub(channel).ListJobs(request, timeout=5)
        assert info.value.code() == Code.UNAVAILABLE

    refused(grpc.insecure_channel(server.address))  # no TLS at all
    other = LocalCA(tmp_path / "other")  # a certificate from another CA, for the right name and role
    refused(grpc.secure_channel(server.address, channel_credentials(other.issue("admin", Role.ADMIN, "x").load())))
    expired_dir = tmp_path / "expired"  # an expired admin certificate from the right CA
    past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=10)
    write_tls_dir(expired_dir, pki.ca.cert_pem, issue_cert(pki.ca, Role.ADMIN, "old", lifetime_days=1, not_before=past))
    files = TlsConfig.from_dir(expired_dir)
    with pytest.raises(Exception, match="expired on"):
        files.load()  # our own clients refuse to use it, naming the file
    from pliant.security.tlsdir import TlsMaterial

    material = TlsMaterial(
        Path(files.ca).read_bytes(), Path(files.cert).read_bytes(), Path(files.key).read_bytes(), None
    )
    refused(grpc.secure_channel(server.address, channel_credentials(material)))  # and the server refuses it
    # A client that does not trust the server's CA does not talk to it either.
    refused(grpc.secure_channel(server.address, grpc.ssl_channel_credentials(other.ca.cert_pem)))
    agent_tls(pki, "ok").load()  # the right CA still works (sanity)
    # Our client says so at once, naming the fix, instead of retrying as if no replica ran.
    started = time.monotonic()
    foreign = other.issue("admin2", Role.ADMIN, "x").load()
    with CoordinatorClient(server.address, foreign, retry_for_s=10) as client, pytest.raises(Unavailable) as info:
        client.list_jobs()
    assert re.search(r"TLS handshake with \S+ failed .* must come from the same CA", str(info.value)), info.value
    assert time.monotonic() - started < 3, "a certificate from another CA is not retried"


def test_etcd_over_tls_with_client_certificates(make_coordinator, fleet, pki, tmp_path: Path) -> None:
    from pliant.coordinator.etcd_server import EtcdServer

    etcd_tls = pki.issue("etcd-server", Role.COORDINATOR, "etcd", ["127.0.0.1"])
    client_tls = pki.issue("etcd-client", Role.COORDINATOR, "coordinator-etcd-client")
    with EtcdServer(data_dir=str(tmp_path / "etcd"), tls=etcd_tls) as etcd:
        assert etcd.endpoint.startswith("https://")
        server = make_coordinator("tls-etcd", endpoints=(etcd.endpoint,), etcd_tls=client_tls)
        with fleet(server) as client:
            client.create_job(JobSpec("job", 1, 1, join_grace_s=0))
            client.join("job", "a", "127.0.0.1:1")
            assert wait_for(lambda: client.get_job("job").generation, 10, "a generation over etcd TLS").node_ids == (
                "a",
            )
        # Without a client certificate etcd refuses the connection; without TLS files an https endpoint is an error.
        with pytest.raises(Exception, match="is https but no etcd TLS files"):
            EtcdStore((etcd.endpoint,), "/x")
        other = LocalCA(tmp_path / "other").issue("c", Role.COORDINATOR, "intruder")
        files = other.load()
        store = EtcdStore(
            (etcd.endpoint,),
            "/x",
            timeout_s=2,
            credentials=grpc.ssl_channel_credentials(pki.ca.cert_pem, files.key_pem, files.cert_pem),
        )
        with pytest.raises(Exception, match="did not answer"):
            store.list_job_ids()
        store.close()


def test_etcd_size_errors_are_resource_exhausted_not_unavailable(etcd, prefix) -> None:
    store = EtcdStore((etcd.endpoint,), prefix)
    try:
        store.create_job(JobSpec("job"), time.time(), "token-0123456789abcdef")
        with pytest.raises(Exception, match="retrying will not help") as info:
            store.finish_job("job", True, "x" * 3_000_000, time.time())  # past the servicer's 4 KiB cut
        assert type(info.value).__name__ == "ResourceExhausted"
        assert store.read_job("job").status.state is JobState.WAITING, "nothing was written"
    finally:
        store.close()


def test_a_revoked_certificate_is_refused_on_every_replica(make_coordinator, fleet, pki) -> None:
    """``pliant certs revoke`` (RevokeCertificate): from then on every call made with the certificate is refused with
    UNAUTHENTICATED naming its serial, on the replica that revoked it at once and on the others within moments; the
    node's other certificates, and other nodes, are untouched."""
    first, second = make_coordinator("r1"), make_coordinator("r2")
    stolen = pki.issue("agent-x-stolen", Role.AGENT, "x")
    with fleet(first) as client:
        client.create_job(JobSpec("job", 1, 2, heartbeat_ttl_s=30, join_grace_s=0))
        client.join("job", "b", "127.0.0.1:2")

        def get_job(server: object) -> grpc.RpcError | None:
            channel = grpc.secure_channel(server.address, channel_credentials(stolen.load()))
            with channel:
                try:
                    pb_grpc.CoordinatorStub(channel).ListJobs(pb.ListJobsRequest(), timeout=5)
                except grpc.RpcError as exc:
                    return exc
            return None

        assert get_job(first).code() == Code.PERMISSION_DENIED, "an agent may not list jobs: reached authorization"
        serial, subject = client.admin.revoke_certificate(Path(stolen.cert).read_bytes(), reason="laptop stolen")
        assert subject == "CN=x,OU=agent,O=pliant" and int(serial, 16) > 0
        for server in (first, second):
            refused = wait_for(
                lambda s=server: (e := get_job(s)) and e.code() == Code.UNAUTHENTICATED and e,
                10,
                "the revocation on every replica",
            )
            assert f"certificate (serial {serial}) is revoked (revoked by the admin 'test-admin': laptop stolen)" in (
                refused.details()
            )
        assert client.get_job("job").members[0].node_id == "b", "other callers are served"
        with pytest.raises(Exception, match="is not a certificate serial in hex"):
            client.admin.revoke_certificate(serial="not-hex")


def test_pliant_certs_revoke_revokes_a_certificate_file(make_coordinator, pki) -> None:
    import subprocess
    import sys

    from tests.fleet import admin_tls

    server = make_coordinator()
    lost = pki.issue("agent-lost-node", Role.AGENT, "lost-node")
    admin_dir = str(Path(admin_tls(pki).cert).parent)
    argv = [sys.executable, "-m", "pliant", "certs", "revoke", "--coordinator", server.address, "--tls-dir", admin_dir]
    done = subprocess.run([*argv, lost.cert, "--reason", "node retired"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "revoked certificate serial" in done.stdout and "lost-node" in done.stdout, done
    both = subprocess.run([*argv, lost.cert, "--serial", "ab"], capture_output=True, text=True, timeout=60)
    assert both.returncode != 0 and "its file (pliant certs revoke PATH/tls.crt) or --serial HEX" in both.stderr


def test_a_member_that_leaves_and_joins_again_and_again_is_held_back(make_coordinator, fleet) -> None:
    """Join/leave churn by one member: its second leave within a minute earns a strike, so it waits as a spare for
    the backoff before it is admitted again; the generations it can cause are few."""
    from pliant.coordinator.policy import BACKOFF_BASE_S

    server = make_coordinator()
    with fleet(server) as client:
        client.create_job(JobSpec("job", 1, 2, heartbeat_ttl_s=30, join_grace_s=0))
        client.join("job", "a", "127.0.0.1:1")
        wait_for(lambda: (g := client.get_job("job").generation) and g.node_ids == ("a",), 10, "a's world")
        started = client.get_job("job").generation.number
        admitted_after: list[float] = []
        for _ in range(3):
            grant = client.join("job", "b", "127.0.0.1:2")
            joined = time.monotonic()
            wait_for(lambda: client.get_job("job").generation.node_ids == ("a", "b"), 30, "b admitted")
            admitted_after.append(time.monotonic() - joined)
            client.leave("job", "b", grant.lease_id)
            wait_for(lambda: client.get_job("job").generation.node_ids == ("a",), 10, "b gone")
        assert admitted_after[0] < 2 and admitted_after[1] < 2, "a first leave and rejoin costs nothing"
        assert admitted_after[2] >= BACKOFF_BASE_S - 1, admitted_after
        assert client.get_job("job", progress=True).progress["a"].strikes == 0
        assert client.get_job("job").generation.number - started <= 6


def test_connections_that_never_finish_their_handshake_are_closed(make_coordinator, pki) -> None:
    """Idle connections opened without a TLS handshake hold nothing for long: each is closed after HANDSHAKE_TIMEOUT_S
    (gRPC's own default is 120 s), and clients are served meanwhile."""
    import socket

    from pliant.coordinator.server import HANDSHAKE_TIMEOUT_S

    server = make_coordinator()
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(200)]
    started = time.monotonic()
    try:
        assert health_serving(server.address, pki), "a client is served while they hang"
        for sock in idle:
            sock.settimeout(HANDSHAKE_TIMEOUT_S + 10)
            assert sock.recv(16) == b"", "the server closed it"
        assert time.monotonic() - started < HANDSHAKE_TIMEOUT_S + 5
    finally:
        for sock in idle:
            sock.close()


def test_a_member_gets_what_checks_worlds_and_nothing_that_makes_them(probe: Probe) -> None:
    """A join gives a member the key its workers seal checkpoint markers with, the agent key its agent seals store
    records with, and the public half of the control key; every published world carries the control plane's warrant,
    which that public key checks and neither secret key can make."""
    from pliant.security import warrant
    from pliant.security.seal import tag

    grant, gen = probe.a, probe.gen
    assert len(grant.checkpoint_key) == len(grant.agent_key) == len(grant.control_key) == 32
    assert grant.checkpoint_key != grant.agent_key
    world = warrant.World("job", gen.incarnation, gen.number, gen.created_at)
    assert gen.warrant and warrant.verify(grant.control_key, world, gen.warrant)
    later = warrant.World("job", gen.incarnation, gen.number + 1, gen.created_at + 1)
    assert not warrant.verify(grant.control_key, later, gen.warrant), "a warrant names one world"
    for key in (grant.checkpoint_key, grant.agent_key):
        assert not warrant.verify(grant.control_key, later, tag(key, *later.message()) * 4)
