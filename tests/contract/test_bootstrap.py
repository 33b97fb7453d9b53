"""The bootstrap join against a real coordinator on a real etcd: a node with only the join command's token and CA
fingerprint gets an agent certificate for its own node id (and nothing else), renews it over mutual TLS, and every
refusal says why in one line; a server whose CA does not match the pin never receives the token."""

from __future__ import annotations

import datetime
import tempfile
import time

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pliant.bootstrap import BootstrapError, pinned_ca, request_certificate
from pliant.coordinator.client import CoordinatorClient
from pliant.coordinator.contract import JobSpec, PermissionDenied
from pliant.coordinator.signer import Signer
from pliant.security.identity import Role, ca_fingerprint
from pliant.security.issuance import LocalCA, new_csr
from pliant.v1 import bootstrap_pb2, bootstrap_pb2_grpc
from pliant.v1 import coordinator_pb2 as pb
from tests.fleet import COORDINATOR_HOSTS, coordinator_tls

pytestmark = pytest.mark.timeout(90)

LIFETIME_S = 30.0


@pytest.fixture
def signing(make_coordinator, pki, fleet):  # type: ignore[no-untyped-def]
    """A coordinator that signs agent certificates (the tests' CA), a job on it and its token."""
    server = make_coordinator(signer=Signer(pki.ca, LIFETIME_S))
    admin = fleet(server)
    _info, _created, token = admin.create_job(JobSpec("job", 1, 4, heartbeat_ttl_s=30, join_grace_s=0))
    return server, admin, token, ca_fingerprint(pki.ca.cert_pem)


def _refusal(server, pin: str, node: str, token: str, job: str = "job") -> BootstrapError:  # type: ignore[no-untyped-def]
    with pytest.raises(BootstrapError) as caught:
        request_certificate(server.bootstrap_address, pin, job, node, token)
    return caught.value


def _calls(server, code: str = "") -> float:  # type: ignore[no-untyped-def]
    """IssueAgentCertificate calls the server's metrics counted (with status ``code``; "": any)."""
    total = 0.0
    for metric in server.registry.collect():
        for sample in metric.samples:
            labels = sample.labels
            if sample.name == "pliant_coordinator_rpcs_total" and labels.get("method") == "IssueAgentCertificate":
                total += sample.value if not code or labels.get("code") == code else 0
    return total


def test_a_node_gets_a_short_lived_agent_certificate_for_its_own_id_and_joins_with_it(signing) -> None:
    server, _admin, token, pin = signing
    assert server.bootstrap_port == server.port + 1
    tls = request_certificate(server.bootstrap_address, pin, "job", "node-1", token)
    cert = x509.load_pem_x509_certificate(tls.cert_pem)
    subject = {a.oid: a.value for a in cert.subject}
    assert subject == {
        NameOID.ORGANIZATION_NAME: "pliant",
        NameOID.ORGANIZATIONAL_UNIT_NAME: "agent",
        NameOID.COMMON_NAME: "node-1",
    }
    usages = list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert usages == [ExtendedKeyUsageOID.CLIENT_AUTH], "client use only"
    left = (cert.not_valid_after_utc - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
    assert LIFETIME_S - 5 < left <= LIFETIME_S, left
    with CoordinatorClient(server.address, tls) as node:
        grant = node.join("job", "node-1", "127.0.0.1:1001", 1, token)
        assert node.heartbeat("job", "node-1", grant.lease_id) > 0
        with pytest.raises(PermissionDenied, match="acts only for node 'node-1'"):
            node.join("job", "node-2", "127.0.0.1:1002", 1, token)
    assert _calls(server, "OK") == 1


def test_a_certificate_is_renewed_over_mutual_tls_with_a_fresh_key_and_only_for_the_callers_own_id(signing) -> None:
    server, _admin, token, pin = signing
    tls = request_certificate(server.bootstrap_address, pin, "job", "node-1", token)
    with CoordinatorClient(server.address, tls) as node:
        grant = node.join("job", "node-1", "127.0.0.1:1001", 1, token)
        time.sleep(1.1)  # a later expiry, to the second
        fresh, expiry = node.renew_certificate("job")
        assert fresh.identity == tls.identity and fresh.key_pem != tls.key_pem
        old = x509.load_pem_x509_certificate(tls.cert_pem).not_valid_after_utc.timestamp()
        assert expiry > old and x509.load_pem_x509_certificate(fresh.cert_pem).not_valid_after_utc.timestamp() == expiry
        assert node.tls is fresh
        assert node.heartbeat("job", "node-1", grant.lease_id) > 0, "calls go on with the renewed certificate"
        # A request for another node's id, or another role, over the node's own channel: refused.
        for role, name in ((Role.AGENT, "node-2"), (Role.ADMIN, "node-1")):
            _key, csr = new_csr(role, name)
            with pytest.raises(PermissionDenied, match="refused"):
                node._call("RenewAgentCertificate", pb.RenewAgentCertificateRequest(job_id="job", csr_pem=csr))
    # A node that is not a live member of the job renews nothing.
    other = request_certificate(server.bootstrap_address, pin, "job", "node-3", token)
    with CoordinatorClient(server.address, other) as stranger, pytest.raises(PermissionDenied, match="not a member"):
        stranger.renew_certificate("job")


def test_each_refusal_says_why_in_one_line(signing, fleet) -> None:
    server, admin, token, pin = signing
    wrong = _refusal(server, pin, "node-1", "not-the-token-0123456789")
    assert wrong.code == "UNAUTHENTICATED" and "a wrong join token for job 'job'" in str(wrong)
    missing = _refusal(server, pin, "node-1", "")
    assert missing.code == "UNAUTHENTICATED" and "no join token" in str(missing)
    # A job that does not exist gets the answer a wrong token gets: a stranger learns no job's name.
    nojob = _refusal(server, pin, "node-1", "not-the-token-0123456789", job="no-such-job")
    assert nojob.code == "UNAUTHENTICATED" and "a wrong join token for job 'no-such-job'" in str(nojob)
    # A rotated token: the old one no longer bootstraps.
    fresh_token = admin.admin.rotate_join_token("job")
    rotated = _refusal(server, pin, "node-1", token)
    assert rotated.code == "UNAUTHENTICATED", rotated
    # A node id that a live member holds.
    tls = request_certificate(server.bootstrap_address, pin, "job", "node-1", fresh_token)
    with CoordinatorClient(server.address, tls) as node:
        node.join("job", "node-1", "127.0.0.1:1001", 1, fresh_token)
        held = _refusal(server, pin, "node-1", fresh_token)
    assert held.code == "ALREADY_EXISTS" and "held by a live member of job 'job'" in str(held)
    # A request for another role, or for another id than the call names (a raw call after pinning the CA).
    ca_pem = pinned_ca(server.bootstrap_address, pin)
    with grpc.secure_channel(server.bootstrap_address, grpc.ssl_channel_credentials(ca_pem)) as channel:
        stub = bootstrap_pb2_grpc.BootstrapStub(channel)
        for role, name, needle in (
            (Role.ADMIN, "node-9", "agent certificates only"),
            (Role.COORDINATOR, "node-9", "agent certificates only"),
            (Role.AGENT, "node-8", "for its own id only"),
        ):
            _key, csr = new_csr(role, name)
            request = bootstrap_pb2.IssueAgentCertificateRequest(
                job_id="job", node_id="node-9", join_token=fresh_token, csr_pem=csr
            )
            with pytest.raises(grpc.RpcError) as caught:
                stub.IssueAgentCertificate(request, timeout=5)
            assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, caught.value
            assert needle in caught.value.details() and "\n" not in caught.value.details()
        garbage = bootstrap_pb2.IssueAgentCertificateRequest(
            job_id="job", node_id="node-9", join_token=fresh_token, csr_pem=b"not a request"
        )
        with pytest.raises(grpc.RpcError) as caught:
            stub.IssueAgentCertificate(garbage, timeout=5)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_the_token_is_never_sent_to_a_server_whose_ca_does_not_match_the_pin(signing, make_coordinator) -> None:
    server, _admin, token, pin = signing
    impostor_ca = LocalCA(tempfile.mkdtemp(prefix="impostor-"))
    impostor = make_coordinator(
        "impostor",
        tls=impostor_ca.issue("coordinator", Role.COORDINATOR, "impostor", COORDINATOR_HOSTS),
        signer=Signer(impostor_ca.ca, LIFETIME_S),
    )
    refused = _refusal(impostor, pin, "node-1", token)
    assert refused.code == "PIN" and "not sending the join token" in str(refused)
    assert ca_fingerprint(impostor_ca.ca.cert_pem) in str(refused) and pin in str(refused)
    assert _calls(impostor) == 0, "the impostor received no request at all"
    # The real server, pinned right, signs.
    assert request_certificate(server.bootstrap_address, pin, "job", "node-1", token).identity.name == "node-1"


def test_a_replica_without_the_signing_key_serves_no_bootstrap_and_renews_nothing(make_coordinator, pki, fleet) -> None:
    server = make_coordinator()
    assert server.bootstrap_port == 0 and server.bootstrap_address == ""
    admin = fleet(server)
    _info, _created, token = admin.create_job(JobSpec("job", 1, 4, heartbeat_ttl_s=30, join_grace_s=0))
    node = admin.node("n1")
    node.join("job", "n1", "127.0.0.1:1001", 1, token)
    with pytest.raises(Exception, match="holds no signing key"):
        node.renew_certificate("job")
    assert coordinator_tls(pki)  # the replica's own certificate is the tests' as ever


def test_a_node_id_holds_one_certificate_the_one_it_replaces_is_revoked(signing) -> None:
    """Signing a node id another certificate (a bootstrap join again, once its earlier agent is gone) revokes the one
    before at once: a copy of the old key authenticates nothing."""
    server, _admin, token, pin = signing
    first = request_certificate(server.bootstrap_address, pin, "job", "node-1", token)
    with CoordinatorClient(server.address, first) as node:
        grant = node.join("job", "node-1", "127.0.0.1:1001", 1, token)
        node.leave("job", "node-1", grant.lease_id)  # the node goes; it comes back with a fresh key
    second = request_certificate(server.bootstrap_address, pin, "job", "node-1", token)
    with CoordinatorClient(server.address, first, retry_for_s=0) as old, pytest.raises(Exception) as info:
        old.join("job", "node-1", "127.0.0.1:1001", 1, token)
    assert type(info.value).__name__ == "Unauthenticated" and "is revoked (replaced" in str(info.value)
    with CoordinatorClient(server.address, second) as node:
        assert node.join("job", "node-1", "127.0.0.1:1001", 1, token).lease_id


def test_a_node_id_of_another_job_is_never_signed_and_a_certificate_acts_in_its_own_job_only(signing) -> None:
    """Job A's join token, used as a squatter would: a certificate for a node id that is a live member of job B, or
    that holds a certificate of job B, is refused (ALREADY_EXISTS), and B's member keeps its certificate and its
    membership; a certificate signed for job A is refused in job B whatever node id it names."""
    server, admin, token, pin = signing
    _info, _created, other_token = admin.admin.create_job(JobSpec("other", 1, 4, heartbeat_ttl_s=30, join_grace_s=0))
    victim_tls = request_certificate(server.bootstrap_address, pin, "other", "victim", other_token)
    assert victim_tls.identity is not None and victim_tls.identity.job == "other"
    with CoordinatorClient(server.address, victim_tls) as victim:
        grant = victim.join("other", "victim", "127.0.0.1:1001", 1, other_token)
        live = _refusal(server, pin, "victim", token)  # job's token, for the live member of "other"
        assert live.code == "ALREADY_EXISTS" and "live member of another job" in str(live), live
        assert "'other'" not in str(live), "the refusal names no other job"
        assert victim.heartbeat("other", "victim", grant.lease_id) > 0, "the victim's certificate still works"
        victim.leave("other", "victim", grant.lease_id)
    held = _refusal(server, pin, "victim", token)  # gone from "other", its certificate of "other" still valid
    assert held.code == "ALREADY_EXISTS" and "holds a certificate of another job" in str(held), held

    mine = request_certificate(server.bootstrap_address, pin, "job", "n2", token)
    with CoordinatorClient(server.address, mine, retry_for_s=0) as squatter:
        squatter.join("job", "n2", "127.0.0.1:1002", 1, token)
        for call in (
            lambda: squatter.join("other", "n2", "127.0.0.1:1002", 1, other_token),
            lambda: squatter.get_job("other"),
        ):
            with pytest.raises(PermissionDenied, match="of job 'job' acts only in its own job"):
                call()
    with CoordinatorClient(server.address, victim_tls) as victim:  # not revoked by any of it
        assert victim.join("other", "victim", "127.0.0.1:1001", 1, other_token).lease_id
