"""A namespace's join token against a real coordinator on a real etcd, used as its worst holder would use it: the
credential a Kubernetes job namespace holds (pliant k8s namespace) creates its namespace's jobs at the bootstrap join
and joins them, and can do nothing to another namespace's jobs, to jobs an admin created, or to the control plane.
"""

from __future__ import annotations

import pytest

from pliant.bootstrap import BootstrapError, request_certificate
from pliant.coordinator.client import CoordinatorClient
from pliant.coordinator.contract import (
    AlreadyExists,
    InvalidArgument,
    JobSpec,
    PermissionDenied,
)
from pliant.coordinator.convert import spec_to_pb
from pliant.coordinator.signer import Signer
from pliant.security.identity import ca_fingerprint

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def plane(make_coordinator, pki, fleet):  # type: ignore[no-untyped-def]
    """A signing coordinator, its admin, and team-a's and team-b's namespace tokens."""
    server = make_coordinator(signer=Signer(pki.ca, 60.0))
    admin = fleet(server).admin
    tokens = {ns: admin.set_namespace_token(ns)[0] for ns in ("team-a", "team-b")}
    return server, admin, tokens, ca_fingerprint(pki.ca.cert_pem)


def _spec(job: str, high: int = 2) -> JobSpec:
    return JobSpec(job, 1, high, nproc_per_node=2, heartbeat_ttl_s=30, join_grace_s=0, max_restarts=1)


def _bootstrap(server, pin: str, job: str, node: str, token: str, spec: JobSpec | None = None):  # type: ignore[no-untyped-def]
    create = spec_to_pb(spec) if spec is not None else None
    return request_certificate(server.bootstrap_address, pin, job, node, token, create=create)


def _refused(server, pin: str, job: str, node: str, token: str, spec: JobSpec | None = None) -> BootstrapError:  # type: ignore[no-untyped-def]
    with pytest.raises(BootstrapError) as caught:
        _bootstrap(server, pin, job, node, token, spec)
    return caught.value


def test_a_namespace_token_creates_its_namespaces_job_once_and_its_nodes_join_it(plane) -> None:
    server, admin, tokens, pin = plane
    spec = _spec("team-a.alpha")
    first = _bootstrap(server, pin, "team-a.alpha", "team-a.pod-0", tokens["team-a"], spec)
    second = _bootstrap(server, pin, "team-a.alpha", "team-a.pod-1", tokens["team-a"], spec)  # identical: a no-op
    info = admin.get_job("team-a.alpha")
    assert info.spec == spec and len(admin.list_jobs()) == 1
    for tls, node in ((first, "team-a.pod-0"), (second, "team-a.pod-1")):
        with CoordinatorClient(server.address, tls) as member:
            grant = member.join("team-a.alpha", node, "127.0.0.1:1001", 2, tokens["team-a"])
            assert member.heartbeat("team-a.alpha", node, grant.lease_id) > 0
    # Another spec for the same job is the job's own terms, refused at once (not a node id to wait for).
    other = _refused(server, pin, "team-a.alpha", "team-a.pod-2", tokens["team-a"], _spec("team-a.alpha", 4))
    assert other.code == "FAILED_PRECONDITION" and "different spec" in str(other)


def test_a_namespace_token_touches_no_other_namespace_no_admin_job_and_no_admin_call(plane) -> None:
    server, admin, tokens, pin = plane
    team_a = tokens["team-a"]
    # Another namespace's job: neither created nor joined with team-a's token.
    refused = _refused(server, pin, "team-b.beta", "x", team_a, _spec("team-b.beta"))
    assert refused.code == "UNAUTHENTICATED" and "not namespace 'team-b'" in str(refused)
    _bootstrap(server, pin, "team-b.beta", "team-b.pod-0", tokens["team-b"], _spec("team-b.beta"))
    assert _refused(server, pin, "team-b.beta", "team-a.pod-9", team_a).code == "UNAUTHENTICATED"
    # A job of no namespace, or one an admin created in the namespace with its own token.
    assert _refused(server, pin, "gamma", "x", team_a, _spec("gamma")).code == "PERMISSION_DENIED"
    admin.create_job(_spec("team-a.admins"))
    held = _refused(server, pin, "team-a.admins", "x", team_a, _spec("team-a.admins"))
    assert held.code == "FAILED_PRECONDITION" and "another join token" in str(held)
    assert _refused(server, pin, "team-a.admins", "x", team_a).code == "UNAUTHENTICATED"
    # The job named in the request is the one created: no creating one job for a certificate of another.
    mismatch = _refused(server, pin, "team-a.one", "x", team_a, _spec("team-a.two"))
    assert mismatch.code == "INVALID_ARGUMENT"
    # A node of team-a's job may not make admin calls with the certificate the token got it.
    tls = _bootstrap(server, pin, "team-a.alpha", "team-a.pod-0", team_a, _spec("team-a.alpha"))
    with CoordinatorClient(server.address, tls) as member:
        for call in (lambda: member.set_namespace_token("team-a", rotate=True), lambda: member.list_jobs()):
            with pytest.raises(PermissionDenied, match="needs an admin certificate"):
                call()
    assert sorted(j.spec.job_id for j in admin.list_jobs()) == ["team-a.admins", "team-a.alpha", "team-b.beta"]


def test_registering_is_idempotent_and_rotation_moves_the_namespaces_jobs_to_the_new_token(plane) -> None:
    server, admin, tokens, pin = plane
    assert admin.set_namespace_token("team-a", join_token=tokens["team-a"]) == (tokens["team-a"], False)
    with pytest.raises(AlreadyExists, match="pass --rotate"):
        admin.set_namespace_token("team-a")
    with pytest.raises(InvalidArgument, match="namespace 'Team_A' is invalid"):
        admin.set_namespace_token("Team_A")
    _bootstrap(server, pin, "team-a.alpha", "team-a.pod-0", tokens["team-a"], _spec("team-a.alpha"))
    new, changed = admin.set_namespace_token("team-a", rotate=True)
    assert changed and new != tokens["team-a"]
    assert _refused(server, pin, "team-a.alpha", "team-a.pod-1", tokens["team-a"]).code == "UNAUTHENTICATED"
    tls = _bootstrap(server, pin, "team-a.alpha", "team-a.pod-1", new, _spec("team-a.alpha"))
    with CoordinatorClient(server.address, tls) as member:
        member.join("team-a.alpha", "team-a.pod-1", "127.0.0.1:1002", 2, new)
