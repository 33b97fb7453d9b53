"""A replica's threads, its bootstrap port, join tokens, renewals and watch streams, each used as its worst holder
would, against a real coordinator (mutual TLS) on a real etcd: one certificate or one address holds no more than its
share, a token is never guessed fast, a renewal leaves bounded state, and a revoked certificate's stream ends; the job's
members are served throughout."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from pliant.bootstrap import BootstrapError, pinned_ca, request_certificate
from pliant.coordinator.client import CoordinatorClient
from pliant.coordinator.contract import JobSpec, ResourceExhausted
from pliant.coordinator.signer import WRONG_TOKENS_PER_ADDRESS, Signer
from pliant.coordinator.store import EtcdStore
from pliant.security.identity import Role, ca_fingerprint
from pliant.v1 import bootstrap_pb2 as bpb
from pliant.v1 import coordinator_pb2 as pb
from tests.conftest import wait_for
from tests.fleet import secure_channel

pytestmark = pytest.mark.timeout(120)

Code = grpc.StatusCode


class HeldCalls:
    """Calls opened on ``channel`` whose request message never comes (the client's request iterator waits), until
    :meth:`release` (each then ends with no message sent)."""

    def __init__(self, channel: grpc.Channel, method: str, response: Callable[[bytes], object]) -> None:
        self._never = threading.Event()
        self._call = channel.stream_unary(method, request_serializer=bytes, response_deserializer=response)
        self.futures: list[grpc.Future] = []

    def _requests(self) -> Iterator[bytes]:
        self._never.wait(120)
        yield from ()

    def open(self, n: int) -> HeldCalls:
        self.futures += [self._call.future(self._requests()) for _ in range(n)]
        return self

    def refused(self) -> list[grpc.Future]:
        """The calls answered already (each refused: nothing was sent)."""
        return [f for f in self.futures if f.done()]

    def release(self) -> None:
        self._never.set()
        for future in self.futures:
            with contextlib.suppress(grpc.RpcError):
                future.result(timeout=10)


def test_one_certificate_holds_no_more_than_its_calls_and_every_member_is_served(make_coordinator, fleet, pki):
    """A member's certificate opening many calls and never sending their requests (once every thread of the replica)
    holds its 4 calls; the others are RESOURCE_EXHAUSTED at once; another member heartbeats, joins and watches
    meanwhile; once its calls end, the certificate is served again."""
    server = make_coordinator(max_workers=16, calls_per_caller=4)
    with fleet(server) as client:
        client.create_job(JobSpec("job", 1, 3, heartbeat_ttl_s=30, join_grace_s=0))
        client.join("job", "mallory", "127.0.0.1:1")
        grant = client.join("job", "b", "127.0.0.1:2")
        channel = secure_channel(pki, server.address, "mallory")
        held = HeldCalls(channel, "/pliant.v1.Coordinator/Heartbeat", pb.HeartbeatResponse.FromString).open(24)
        try:
            refused = wait_for(lambda: len(held.refused()) == 20 and held.refused(), 10, "20 calls refused")
            for future in refused:
                assert future.exception().code() == Code.RESOURCE_EXHAUSTED
                assert "this certificate (agent 'mallory') has 4 calls in flight" in future.exception().details()
            time.sleep(1.0)
            assert len(held.refused()) == 20, "its 4 calls are held: only they wait for their requests"
            served = [client.heartbeat("job", "b", grant.lease_id) for _ in range(20)]
            assert served == [30.0] * 20, "another member is served while they wait"
            client.join("job", "c", "127.0.0.1:3")
            assert next(client.node("c").watch("job")).generation.number >= 1
        finally:
            held.release()
            channel.close()
        assert client.node("mallory").get_job("job").spec.job_id == "job", "its slots came back"


def test_one_address_holds_two_bootstrap_calls_and_a_token_is_never_guessed_fast(make_coordinator, fleet, pki):
    """The bootstrap port takes callers without a certificate: an address holds at most two calls waiting for their
    requests, and after 5 wrong join tokens every call from it, the right token's too, is RESOURCE_EXHAUSTED until
    its bucket refills."""
    server = make_coordinator(signer=Signer(pki.ca, 60.0))
    admin = fleet(server)
    _info, _created, token = admin.create_job(JobSpec("job", 1, 4, heartbeat_ttl_s=30, join_grace_s=0))
    pin = ca_fingerprint(pki.ca.cert_pem)
    ca_pem = pinned_ca(server.bootstrap_address, pin)
    channel = grpc.secure_channel(server.bootstrap_address, grpc.ssl_channel_credentials(ca_pem))
    held = HeldCalls(channel, "/pliant.v1.Bootstrap/IssueAgentCertificate", bpb.AgentCertificate.FromString)
    try:
        held.open(3)
        [third] = wait_for(lambda: held.refused(), 10, "the third call refused")
        assert third.exception().code() == Code.RESOURCE_EXHAUSTED
        assert "this address (127.0.0.1) has 2 calls in flight" in third.exception().details()
    finally:
        held.release()
        channel.close()
    assert request_certificate(server.bootstrap_address, pin, "job", "n1", token).identity.name == "n1"

    for attempt in range(int(WRONG_TOKENS_PER_ADDRESS[0])):
        with pytest.raises(BootstrapError) as wrong:
            request_certificate(server.bootstrap_address, pin, "job", "n2", f"guess-number-{attempt:04d}-abcdefgh")
        assert wrong.value.code == "UNAUTHENTICATED", wrong.value
    with pytest.raises(BootstrapError) as throttled:
        request_certificate(server.bootstrap_address, pin, "job", "n2", token)  # the right one, too soon
    assert throttled.value.code == "RESOURCE_EXHAUSTED" and "wrong join tokens, from 127.0.0.1" in str(throttled.value)
    assert admin.get_job("job").spec.job_id == "job", "the API port serves on"


def test_renewals_are_rate_limited_and_leave_bounded_state(make_coordinator, fleet, pki, etcd, prefix):
    """A member renewing in a loop gets 3 certificates, then RESOURCE_EXHAUSTED (3 more per certificate lifetime):
    it writes no more revocations than that, and heartbeats on."""
    server = make_coordinator(signer=Signer(pki.ca, 3600.0))
    admin = fleet(server)
    _info, _created, token = admin.create_job(JobSpec("job", 1, 4, heartbeat_ttl_s=30, join_grace_s=0))
    tls = request_certificate(server.bootstrap_address, ca_fingerprint(pki.ca.cert_pem), "job", "n1", token)
    store = EtcdStore((etcd.endpoint,), prefix)
    with CoordinatorClient(server.address, tls, retry_for_s=0) as node:
        grant = node.join("job", "n1", "127.0.0.1:1", 1, token)
        revoked_before = len(store.revoked())
        for _ in range(3):
            node.renew_certificate("job")
        with pytest.raises(ResourceExhausted, match="renewed its certificate 3 times lately"):
            for _ in range(100):
                node.renew_certificate("job")
        assert len(store.revoked()) - revoked_before == 3, "one revocation per renewal granted, no more"
        assert node.heartbeat("job", "n1", grant.lease_id) == 30.0


def test_a_revoked_certificates_open_watch_stream_ends(make_coordinator, fleet, pki):
    """Revoking a certificate ends the WatchGenerations streams already open with it (UNAUTHENTICATED), within the
    stream's poll; other members' streams go on."""
    server = make_coordinator()
    with fleet(server) as client:
        client.create_job(JobSpec("job", 1, 3, heartbeat_ttl_s=30, join_grace_s=0))
        client.join("job", "x", "127.0.0.1:1")
        client.join("job", "b", "127.0.0.1:2")
        stolen = pki.issue("agent-x", Role.AGENT, "x")
        with CoordinatorClient(server.address, stolen.load()) as thief:
            stream = thief.watch("job")
            next(stream)
            client.admin.revoke_certificate(Path(stolen.cert).read_bytes())
            started = time.monotonic()
            with pytest.raises(Exception) as ended:
                for _ in stream:
                    pass
            assert type(ended.value).__name__ == "Unauthenticated" and "was revoked" in str(ended.value)
            assert time.monotonic() - started < 5
        assert next(client.node("b").watch("job")).generation is not None, "another member's stream is served"


def test_a_join_token_shorter_than_128_bits_is_refused_whoever_chose_it(make_coordinator, fleet) -> None:
    """An admin's own token (``pliant job create --join-token-file``, RotateJoinToken) is held to what a generated one
    is: 22 characters or more (128 bits of URL-safe base64), else INVALID_ARGUMENT, naming its length, not its value."""
    from pliant.coordinator.contract import InvalidArgument

    server = make_coordinator()
    with fleet(server) as client:
        weak = "0123456789abcdefghij0"  # 21 characters
        for call in (
            lambda: client.admin.create_job(JobSpec("job", 1, 2), weak),
            lambda: client.admin.rotate_join_token("job", weak),
        ):
            with pytest.raises(InvalidArgument, match="join_token of 21 characters is invalid") as refused:
                call()
            assert weak not in str(refused.value)
            if "job" not in [j.spec.job_id for j in client.list_jobs()]:
                client.admin.create_job(JobSpec("job", 1, 2), weak + "1")  # 22: accepted
