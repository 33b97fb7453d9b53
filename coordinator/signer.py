"""Agent certificates signed by the coordinator: the bootstrap join's Bootstrap service, and the renewal that
``RenewAgentCertificate`` serves over mutual TLS.

A replica signs when it holds the CA's key (:class:`Signer`): ``pliant run``'s embedded coordinator holds its
ephemeral CA in memory; a standalone replica reads ``ca.crt`` and ``ca.key`` from ``--signing-ca-dir`` (a file, or a
Kubernetes Secret mounted there), the way kube-controller-manager gets ``--cluster-signing-key-file``. Every replica
given the key can sign; one without it refuses renewals with FAILED_PRECONDITION and serves no Bootstrap port.

What is signed is decided by :meth:`Signer.sign`: only the agent role, only the node id the request is for, bound to
the one job it was asked for (a URI SAN, :data:`pliant.security.identity.JOB_URI`). Who may ask: a node that holds the
job's join token, for a node id that no live member of any job holds and whose certificate of another job has expired
(:class:`BootstrapServicer`; with a namespace's join token, the call may first create a job of that namespace, as
the agents a Kubernetes namespace runs do); or the agent itself, a live member, over mutual TLS (the servicer's
``RenewAgentCertificate``, authorized where every call is). Certificates are short-lived (``lifetime_s``) and for
client use only; a node id holds one, in one job: signing it another in that job revokes the one before
(:mod:`pliant.coordinator.revocation`), and never touches another job's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from pliant.coordinator.contract import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    validate_id,
)
from pliant.coordinator.convert import spec_from_pb
from pliant.coordinator.limits import RateLimit, address_key
from pliant.coordinator.revocation import Denylist, replaced_certificate
from pliant.coordinator.rpc import serve_unary
from pliant.coordinator.store import EtcdStore
from pliant.errors import ConfigError
from pliant.security.identity import Role, not_after
from pliant.security.issuance import IssuedCert, csr_identity, sign_csr
from pliant.v1 import bootstrap_pb2 as bpb
from pliant.v1 import bootstrap_pb2_grpc as bpb_grpc

__all__ = ["DEFAULT_AGENT_CERT_LIFETIME_S", "MAX_CSR_BYTES", "BootstrapServicer", "Signer"]

logger = logging.getLogger(__name__)

DEFAULT_AGENT_CERT_LIFETIME_S = 24 * 3600.0
MAX_CSR_BYTES = 16 * 1024


@dataclass(frozen=True)
class Signer:
    """The CA key a replica signs agent certificates with.

    Attributes:
        ca: the CA certificate and its private key.
        lifetime_s: validity of each agent certificate it signs (agents renew at two thirds of it).
    """

    ca: IssuedCert
    lifetime_s: float = DEFAULT_AGENT_CERT_LIFETIME_S

    def __post_init__(self) -> None:
        if not 10 <= self.lifetime_s <= 366 * 24 * 3600:
            raise ConfigError(f"--agent-cert-lifetime {self.lifetime_s:g} must be between 10 seconds and a year")

    def sign(self, csr_pem: bytes, node_id: str, job_id: str) -> bpb.AgentCertificate:
        """Sign ``csr_pem`` as the agent certificate of ``node_id``, acting in job ``job_id`` only.

        Raises:
            InvalidArgument: the request is too large, does not parse or is not signed by its key.
            PermissionDenied: it asks for another role or another node id.
        """
        if len(csr_pem) > MAX_CSR_BYTES:
            raise InvalidArgument(f"certificate request of {len(csr_pem)} bytes; the limit is {MAX_CSR_BYTES}")
        try:
            asked = csr_identity(csr_pem)
        except ValueError as exc:
            raise InvalidArgument(f"{exc}; make it with `pliant run --ca-cert-hash ...` (the agent does)") from None
        if asked is None or asked.role is not Role.AGENT:
            raise PermissionDenied(
                f"refused: the request asks for {asked or 'a certificate with no pliant role'}; a join token gets "
                f"agent certificates only (admin and coordinator certificates come from `pliant certs`)"
            )
        if asked.name != node_id:
            raise PermissionDenied(
                f"refused: the request is for node {asked.name[:100]!r}, the call for node {node_id[:100]!r}; a node "
                f"gets a certificate for its own id only"
            )
        cert_pem = sign_csr(self.ca, csr_pem, Role.AGENT, node_id, self.lifetime_s, job=job_id)
        expires = not_after(cert_pem).timestamp()
        return bpb.AgentCertificate(cert_pem=cert_pem, ca_pem=self.ca.cert_pem, not_after=expires)


def _held_by_live_member(store: EtcdStore, job: str, node: str) -> None:
    """Raise AlreadyExists when node id ``node`` is a live member of job ``job`` or of any other job."""
    for holder in (job, *(j for j in store.list_job_ids() if j != job)):
        if store.is_member(holder, node):
            where = f"job {job!r}" if holder == job else "another job"
            raise AlreadyExists(
                f"node id {node!r} is held by a live member of {where}; "
                f"give this node another --node-id (the default, HOSTNAME-PID, is unique), or wait until that member "
                f"is gone"
            )


BOOTSTRAPS_PER_ADDRESS = (32.0, 4.0)  # bootstrap calls one source address may make: a burst, then per second
WRONG_TOKENS_PER_ADDRESS = (5.0, 1 / 12)  # wrong join tokens one source address may send: 5, then 5 a minute


class BootstrapServicer(bpb_grpc.BootstrapServicer):
    """The Bootstrap service (served on the replica's bootstrap port, TLS that checks the server only).

    Each source address may make :data:`BOOTSTRAPS_PER_ADDRESS` calls, and send :data:`WRONG_TOKENS_PER_ADDRESS`
    wrong join tokens (past them, every call from it is RESOURCE_EXHAUSTED until its bucket refills: a token is never
    guessed faster); the port's server also holds at most two calls in flight per address
    (:mod:`pliant.coordinator.limits`).

    Args:
        store: the etcd store (join tokens, live members).
        signer: the CA key.
        observe: called with (method, status code, seconds) after each call.
        denylist: where the agent certificate a node id held before is revoked when it is signed another.
        max_jobs: jobs the deployment holds at most (a namespace's token creates none past it; 0: no limit).
    """

    def __init__(
        self,
        store: EtcdStore,
        signer: Signer,
        observe: Callable[[str, grpc.StatusCode, float], None] | None = None,
        denylist: Denylist | None = None,
        max_jobs: int = 0,
    ) -> None:
        self._store = store
        self._max_jobs = max_jobs
        self._signer = signer
        self._observe = observe or (lambda method, code, seconds: None)
        self._denylist = denylist
        self._calls = RateLimit(*BOOTSTRAPS_PER_ADDRESS)
        self._wrong = RateLimit(*WRONG_TOKENS_PER_ADDRESS)

    def IssueAgentCertificate(
        self, request: bpb.IssueAgentCertificateRequest, context: grpc.ServicerContext
    ) -> bpb.AgentCertificate:
        return serve_unary(
            "IssueAgentCertificate", context, self._observe, lambda: self._issue(request, context), logging.INFO
        )

    def _issue(self, request: bpb.IssueAgentCertificateRequest, context: grpc.ServicerContext) -> bpb.AgentCertificate:
        """Sign the node's certificate once the caller's address is within its budget and its join token is the
        job's."""
        source = address_key(context)
        wait = max(self._calls.take(source), self._wrong.peek(source))
        if wait:
            raise ResourceExhausted(
                f"too many bootstrap calls, or wrong join tokens, from {source}; retry in {wait:.0f}s"
            )
        job = validate_id(request.job_id, "job_id")
        node = validate_id(request.node_id, "node_id")
        try:
            if request.HasField("create"):
                self._create(job, request)
            self._store.check_token(job, request.join_token)
        except Unauthenticated:
            self._wrong.take(source)
            raise
        _held_by_live_member(self._store, job, node)
        issued = self._signer.sign(request.csr_pem, node, job)
        # The node id's earlier agent in this job is gone (no live member holds the id): its certificate goes at
        # once. A node id whose certificate of another job is still valid is refused (AlreadyExists), unsigned.
        replaced_certificate(self._store, self._denylist, job, node, issued.cert_pem, "signed again", 0.0, time.time())
        logger.info(
            "bootstrap: agent certificate for node %s of job %s signed (valid %.0fs)",
            node,
            job,
            self._signer.lifetime_s,
        )
        return issued

    def _create(self, job: str, request: bpb.IssueAgentCertificateRequest) -> None:
        """Create the job the request carries unless it exists, with the namespace's join token the request holds."""
        spec = spec_from_pb(request.create)
        if spec.job_id != job:
            raise InvalidArgument(
                f"the job to create is {spec.job_id[:100]!r} and the certificate's job {job!r}; they must be the same"
            )
        try:
            _spec, created = self._store.create_namespaced_job(spec, time.time(), request.join_token, self._max_jobs)
        except AlreadyExists as exc:  # not a node id in use (which a joining node waits out): the job's own terms
            raise FailedPrecondition(str(exc)) from None
        if created:
            logger.info("bootstrap: job %s created with its namespace's join token", job)
