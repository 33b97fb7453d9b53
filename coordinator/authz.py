"""Who may call what: the coordinator's authorization rules as pure functions of the caller's identity (no I/O).

The caller's identity comes from its verified client certificate (:func:`pliant.security.credentials.peer_identity`).
The rules:

============================  =======================================================================================
call                          who may make it
============================  =======================================================================================
CreateJob, FinishJob,         admin
DeleteJob, RotateJoinToken,
ListJobs, CreateSeatKey,
SetNamespaceToken
GetJob                        admin (everything); an agent that is a member of the job (node addresses removed)
Join                          the agent whose certificate names the node id joined (with the job's token); admin
Heartbeat, Leave,             the agent of that node, with the lease its Join returned (checked against etcd by the
ReportFailure, ReportSuccess  servicer); reports only from members of the generation named; admin with the lease
WatchGenerations              admin; an agent that is a member of the job
RenewAgentCertificate         an agent that is a live member of the job, for its own node id (the signer checks the
                              request names it); not admin
ClaimSeat                     an agent that is a live member of the job, for its own node id, with a seat key or
                              the proof of the seat it held (a seat in an embedded control plane receives the CA keys
                              and the sealing root; the seat keeper checks the key or proof); not admin
RevokeCertificate             admin
============================  =======================================================================================

The Bootstrap service (:mod:`pliant.coordinator.signer`) is served on a port of its own, to callers without a
certificate; the job's join token is its credential. A namespace's join token (SetNamespaceToken) also creates jobs
of that namespace there (``<namespace>.<name>``), which then join with it: it acts in its namespace's jobs only.

An agent certificate signed by the bootstrap join names its job (:data:`pliant.security.identity.JOB_URI`): it acts in
that job
only, whatever node ids other jobs have. One an operator made (``pliant certs create-agent``) names none, and acts in
any job whose member its node id is.

A certificate on the denylist (:mod:`pliant.coordinator.revocation`) may make no call at all. A coordinator
certificate serves; it may not call. On a plaintext channel (``--insecure``) there is no identity: every
caller may do what an admin may, and only the lease and token checks remain.
"""

from __future__ import annotations

from dataclasses import dataclass

from pliant.coordinator.contract import PermissionDenied
from pliant.security.identity import Identity, Role

__all__ = ["ADMIN_METHODS", "Caller", "require_admin", "require_job", "require_node"]

ADMIN_METHODS = frozenset(
    {
        "CreateJob",
        "FinishJob",
        "DeleteJob",
        "RotateJoinToken",
        "SetNamespaceToken",
        "ListJobs",
        "RevokeCertificate",
        "CreateSeatKey",
    }
)


@dataclass(frozen=True)
class Caller:
    """The peer of one call: its certificate's identity and serial number (None and 0 on a plaintext channel)."""

    identity: Identity | None
    serial: int = 0

    @property
    def is_admin(self) -> bool:
        return self.identity is None or self.identity.role is Role.ADMIN

    @property
    def node_id(self) -> str | None:
        """The node id an agent certificate names (None for other callers)."""
        return self.identity.name if self.identity and self.identity.role is Role.AGENT else None

    @property
    def job(self) -> str:
        """The one job an agent certificate acts in ("": any job it is a member of, or not an agent)."""
        return self.identity.job if self.identity and self.identity.role is Role.AGENT else ""

    def __str__(self) -> str:
        return "a plaintext caller" if self.identity is None else f"the {self.identity}"


def require_admin(caller: Caller, method: str) -> None:
    """Raise PermissionDenied unless ``caller`` may make admin call ``method``."""
    if not caller.is_admin:
        raise PermissionDenied(
            f"{method} needs an admin certificate, and {caller} is not one; run it with the --tls-dir of an admin "
            f"(pliant certs create-admin)"
        )


def require_job(caller: Caller, job_id: str, method: str) -> None:
    """Raise PermissionDenied when ``caller``'s certificate is bound to a job other than ``job_id``."""
    if caller.job and caller.job != job_id:
        raise PermissionDenied(
            f"{method} for job {job_id[:100]!r} refused: {caller} acts only in its own job; a node joins each job "
            f"with that job's join line"
        )


def require_node(caller: Caller, node_id: str, method: str, job_id: str) -> None:
    """Raise PermissionDenied unless ``caller`` may act for node ``node_id`` of job ``job_id`` (its own agent, in the
    job its certificate names if it names one, or an admin)."""
    if caller.is_admin:
        return
    require_job(caller, job_id, method)
    if caller.node_id is None:
        raise PermissionDenied(
            f"{method} is for agents, and {caller} is not one; use an agent certificate "
            f"(pliant certs create-agent NODE_ID)"
        )
    if caller.node_id != node_id:
        raise PermissionDenied(
            f"{method} for node {node_id[:100]!r} refused: {caller} acts only for node {caller.node_id!r}; run each "
            f"agent with its own certificate, whose name is its --node-id"
        )
