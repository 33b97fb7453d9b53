"""The coordinator's contract: job specs, members, generations, planner decisions, and the coordinator's errors.

Everything here is plain data (frozen dataclasses) with no I/O. The table that maps domain errors to gRPC status codes
(and back) lives here too, so servicer and client translate in exactly one place.
"""

from __future__ import annotations

import enum
import ipaddress
import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

import grpc

from pliant.errors import ConfigError, PliantError

__all__ = [
    "JOIN_TOKEN_RULE",
    "MAX_ADDRESS_BYTES",
    "MAX_ERROR_BYTES",
    "MAX_NPROC",
    "MAX_REASON_BYTES",
    "MAX_WORLD_SIZE",
    "Admission",
    "AlreadyExists",
    "CoordinatorError",
    "CorruptRecord",
    "Decision",
    "FailJob",
    "FailedPrecondition",
    "FailureCause",
    "FailureReport",
    "FencingError",
    "Generation",
    "GenerationMember",
    "InvalidArgument",
    "JobFinished",
    "JobInfo",
    "JobSnapshot",
    "JobSpec",
    "JobState",
    "JobStatus",
    "JobStore",
    "Keep",
    "Member",
    "MemberProgress",
    "NewGeneration",
    "NotFound",
    "Outcome",
    "PermissionDenied",
    "ResourceExhausted",
    "Revocation",
    "Strike",
    "Unauthenticated",
    "Unavailable",
    "WaitUntil",
    "WatchEvent",
    "error_for_status",
    "is_join_token",
    "job_namespace",
    "parse_node_range",
    "quote",
    "status_for_error",
    "truncate_reason",
    "validate_address",
    "validate_id",
    "validate_namespace",
    "validate_slots",
]

_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_HOST_LABEL_RE = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")
MAX_ADDRESS_BYTES = 255  # host:port a node advertises
MAX_REASON_BYTES = 4096  # FinishJob reasons and failure messages; longer ones are truncated with a note
MAX_ERROR_BYTES = 1024  # a failure's error (it travels in every generation that refuses a world or excludes a node)
MAX_NPROC = 1024  # processes per node (nproc_per_node, a Join's slots)
MAX_WORLD_SIZE = 65_536  # processes in one generation


# ----------------------------------------------------------------------------------------------------------------------
# Errors


class CoordinatorError(PliantError):
    """Base of the coordinator's errors."""


class InvalidArgument(CoordinatorError, ValueError):
    """A request or spec carries a bad value (gRPC INVALID_ARGUMENT)."""


class NotFound(CoordinatorError, LookupError):
    """The job, member or lease named does not exist (gRPC NOT_FOUND)."""


class AlreadyExists(CoordinatorError):
    """The job or node id is already taken (gRPC ALREADY_EXISTS)."""


class FailedPrecondition(CoordinatorError):
    """The request is valid but the job's state forbids it, e.g. joining a finished job (FAILED_PRECONDITION)."""


class JobFinished(FailedPrecondition):
    """The job has finished (``state``: succeeded or failed), so it takes no join: a node that comes late ends as the
    job did (FAILED_PRECONDITION on the wire, its message in the one form :meth:`parse` reads back)."""

    _FORM = re.compile(
        r"job '(?P<job>[^']*)' already (?P<state>succeeded|failed) \((?P<reason>.*)\); start a new job id", re.DOTALL
    )

    def __init__(self, job: str, state: JobState, reason: str = "") -> None:
        super().__init__(
            f"job {job!r} already {state.value} ({reason or 'no reason given'}); start a new job id to train again"
        )
        self.job, self.state = job, state

    @classmethod
    def parse(cls, message: str) -> JobFinished | None:
        """The error ``message`` (a FAILED_PRECONDITION's, possibly quoted inside another message) carries, if any."""
        found = cls._FORM.search(message)
        return cls(found["job"], JobState(found["state"]), found["reason"]) if found else None


class Unavailable(CoordinatorError, ConnectionError):
    """etcd or the coordinator cannot be reached; nothing was written and the call is safe to retry (UNAVAILABLE)."""


class CorruptRecord(CoordinatorError):
    """A record in etcd cannot be decoded (not JSON, or a field missing or of the wrong type): the job it belongs to is
    skipped until an operator fixes or deletes the record; the message names the key (gRPC DATA_LOSS)."""


class FencingError(CoordinatorError):
    """A generation write was rejected because the writer is no longer leader or its view of the job is stale."""


class Unauthenticated(CoordinatorError):
    """The caller did not prove who it is: a missing or wrong join token (gRPC UNAUTHENTICATED)."""


class PermissionDenied(CoordinatorError, PermissionError):
    """The caller is known but may not do this: another node's lease, a non-member, a call that needs the admin
    role (gRPC PERMISSION_DENIED). Nothing was changed."""


class ResourceExhausted(CoordinatorError):
    """A limit was reached: the job quota, watch streams, etcd's request size or space quota. Retrying the same call
    does not help until something is freed (gRPC RESOURCE_EXHAUSTED)."""


_STATUS_BY_ERROR: tuple[tuple[type[CoordinatorError], grpc.StatusCode], ...] = (
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (FencingError, grpc.StatusCode.ABORTED),
    (CorruptRecord, grpc.StatusCode.DATA_LOSS),
)


def status_for_error(exc: CoordinatorError) -> grpc.StatusCode:
    """Return the gRPC status code that carries ``exc`` over the wire."""
    for cls, code in _STATUS_BY_ERROR:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def error_for_status(code: grpc.StatusCode, message: str) -> CoordinatorError:
    """Return the domain error for a gRPC status received by a client (INTERNAL and unknown codes -> base class)."""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return Unavailable(message or "the coordinator did not answer in time")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        finished = JobFinished.parse(message)
        if finished is not None:
            return finished
    for cls, known in _STATUS_BY_ERROR:
        if known == code:
            return cls(message)
    return CoordinatorError(f"{code.name}: {message}")


# ----------------------------------------------------------------------------------------------------------------------
# Validation helpers


def quote(value: object, limit: int = 100) -> str:
    """``repr`` of a bad value for an error message, cut to about ``limit`` characters (with its full length)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = len(value) if isinstance(value, str | bytes) else len(text)
    return f"{text[:limit]}... ({size} characters)"


JOIN_TOKEN_RULE = (
    "22-256 printable ASCII characters without spaces, at least 128 random bits (`openssl rand -base64 24` makes one)"
)
"""What a join token is (one the coordinator generates is 43 URL-safe characters)."""


def is_join_token(value: str) -> bool:
    """Whether ``value`` has the form of a join token (:data:`JOIN_TOKEN_RULE`)."""
    return 22 <= len(value) <= 256 and value.isascii() and value.isprintable() and " " not in value


def parse_node_range(text: str) -> tuple[int, int]:
    """``--nnodes``, torchrun's way: ``N`` or ``MIN:MAX`` (every command that takes a job's node range).

    Raises:
        ConfigError: not that form, or not 1 <= MIN <= MAX; the message names the value and the fix.
    """
    low_text, _, high_text = text.partition(":")
    try:
        low, high = int(low_text), int(high_text or low_text)
    except ValueError:
        raise ConfigError(f"--nnodes {text!r} must be N or MIN:MAX, e.g. 2 or 1:4") from None
    if low < 1 or high < low:
        raise ConfigError(f"--nnodes {text!r} must have 1 <= MIN <= MAX, e.g. 1:4")
    return low, high


_NAMESPACE_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def job_namespace(job_id: str) -> str:
    """The namespace a job id is scoped to: what precedes its first '.' when that is a DNS label ("": none).

    A namespace's join token (``SetNamespaceToken``) creates and joins only jobs of its namespace.
    """
    head, dot, _rest = job_id.partition(".")
    return head if dot and _NAMESPACE_RE.fullmatch(head) else ""


def validate_namespace(value: str) -> str:
    """Check a namespace's name: a DNS label (a Kubernetes namespace's form)."""
    if not isinstance(value, str) or not _NAMESPACE_RE.fullmatch(value):
        raise InvalidArgument(
            f"namespace {quote(value)} is invalid: use a DNS label (1-63 lowercase letters, digits and '-', starting "
            f"and ending with a letter or digit), e.g. team-a"
        )
    return value


def validate_id(value: str, what: str) -> str:
    """Check a job or node id: 1-128 characters of letters, digits, '.', '_' and '-', starting with a letter/digit."""
    if not isinstance(value, str) or not _ID_RE.fullmatch(value):
        raise InvalidArgument(
            f"{what} {quote(value)} is invalid: use 1-128 letters, digits, '.', '_' or '-', starting with a letter "
            f"or digit"
        )
    return value


def _valid_host(host: str) -> bool:
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            return isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
        except ValueError:
            return False
    try:
        ipaddress.IPv4Address(host)
        return True
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    return bool(host) and all(_HOST_LABEL_RE.fullmatch(label) for label in labels) and not labels[-1].isdigit()


def validate_address(value: str, what: str = "address") -> str:
    """Check a ``host:port`` address a node advertises: a hostname or IP (IPv6 in brackets) and a port in 1..65535,
    at most 255 bytes."""
    text = value or ""
    host, sep, port = text.rpartition(":")
    if (
        len(text.encode()) > MAX_ADDRESS_BYTES
        or not sep
        or not _valid_host(host)
        or not port.isascii()
        or not port.isdigit()
        or not 0 < int(port) < 65536
    ):
        raise InvalidArgument(
            f"{what} {quote(value)} is not HOST:PORT (a hostname or IP address, a port in 1..65535, at most "
            f"{MAX_ADDRESS_BYTES} bytes), e.g. 10.0.0.5:29500 or node-3.pool.svc:29500"
        )
    return value


def validate_slots(value: int, what: str = "slots") -> int:
    """Check a process count per node: 0 (the job's default, for a Join's slots) up to MAX_NPROC."""
    if not isinstance(value, int) or not 0 <= value <= MAX_NPROC:
        raise InvalidArgument(f"{what}={quote(value)} must be between 1 and {MAX_NPROC} processes per node")
    return value


def truncate_reason(text: str, limit: int = MAX_REASON_BYTES) -> str:
    """Cut a reason or failure message to ``limit`` UTF-8 bytes, saying how much was dropped."""
    data = text.encode()
    if len(data) <= limit:
        return text
    note = f" ... [truncated: {len(data)} bytes, kept {limit}]"
    return data[: limit - len(note.encode())].decode(errors="ignore") + note


def _from_mapping(cls: type, data: Mapping[str, Any]) -> Any:
    """Build a dataclass from a mapping, ignoring unknown keys (forward compatibility of stored JSON)."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


# ----------------------------------------------------------------------------------------------------------------------
# Jobs


class JobState(enum.Enum):
    """A job's lifecycle.

    Allowed transitions: WAITING -> RUNNING (a generation with members is published), RUNNING -> WAITING (below min
    nodes), WAITING|RUNNING -> SUCCEEDED|FAILED (FinishJob, min-nodes timeout, restart budget spent). SUCCEEDED and
    FAILED are terminal.
    """

    WAITING = "waiting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED)


@dataclass(frozen=True)
class JobSpec:
    """What a user asks of a job. Durations are seconds.

    Attributes:
        job_id: unique id; every etcd key of the job lives under it.
        min_nodes: fewest nodes the job trains with.
        max_nodes: most nodes the job trains with; later joiners wait as spares.
        nproc_per_node: worker processes per node (a node's Join may override it with its slots).
        heartbeat_ttl_s: membership lease TTL; a node silent this long is dropped.
        join_grace_s: scale-ups arriving within this window of each other are batched into one generation.
        max_restarts: worker failures the job survives (scaling events never count).
        min_nodes_timeout_s: how long the job may wait below min_nodes before it fails.
        node_group: nodes that train only together (an hsdp replica cut over several nodes): a world holds whole
            groups of this many nodes, a group keeps its nodes in order while they live, and a node whose group lost
            a node waits as a spare until a newcomer completes a group with it.
    """

    job_id: str
    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    heartbeat_ttl_s: float = 5.0
    join_grace_s: float = 1.0
    max_restarts: int = 3
    min_nodes_timeout_s: float = 600.0
    node_group: int = 1

    def __post_init__(self) -> None:
        validate_id(self.job_id, "job_id")
        for name in ("min_nodes", "max_nodes", "nproc_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"{name}={quote(value)} must be an integer >= 1")
        if self.nproc_per_node > MAX_NPROC:
            raise InvalidArgument(f"nproc_per_node={self.nproc_per_node} must be at most {MAX_NPROC}")
        if self.min_nodes * self.nproc_per_node > MAX_WORLD_SIZE:
            raise InvalidArgument(
                f"min_nodes={self.min_nodes} x nproc_per_node={self.nproc_per_node} exceeds the largest world size, "
                f"{MAX_WORLD_SIZE} processes; lower min_nodes"
            )
        if self.max_nodes > MAX_WORLD_SIZE:
            raise InvalidArgument(f"max_nodes={self.max_nodes} must be at most {MAX_WORLD_SIZE}")
        if self.min_nodes > self.max_nodes:
            raise InvalidArgument(
                f"min_nodes={self.min_nodes} is greater than max_nodes={self.max_nodes}; "
                f"use --nnodes {self.min_nodes}:{max(self.min_nodes, self.max_nodes)} or lower min_nodes"
            )
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise InvalidArgument(f"max_restarts={self.max_restarts!r} must be an integer >= 0")
        # etcd leases are granted in whole seconds, at least 2 with etcd's default timings.
        if not 2 <= self.heartbeat_ttl_s <= 3600:
            raise InvalidArgument(f"heartbeat_ttl_s={self.heartbeat_ttl_s!r} must be between 2 and 3600 seconds")
        if not 0 <= self.join_grace_s <= 600:
            raise InvalidArgument(f"join_grace_s={self.join_grace_s!r} must be between 0 and 600 seconds")
        if not 0 < self.min_nodes_timeout_s <= 7 * 24 * 3600:
            raise InvalidArgument(f"min_nodes_timeout_s={self.min_nodes_timeout_s!r} must be > 0 and at most a week")
        if not isinstance(self.node_group, int) or self.node_group < 1:
            raise InvalidArgument(f"node_group={quote(self.node_group)} must be an integer >= 1")
        if self.min_nodes % self.node_group or self.max_nodes % self.node_group:
            raise InvalidArgument(
                f"--nnodes {self.min_nodes}:{self.max_nodes} must be multiples of --node-group {self.node_group}: a "
                f"world holds whole groups of {self.node_group} nodes"
            )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> JobSpec:
        return _from_mapping(cls, json.loads(text))

    def differences(self, other: JobSpec) -> list[str]:
        """Names and values of the fields where ``other`` differs from this spec."""
        return [
            f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


class Outcome(enum.Enum):
    """How a finished job ended (:func:`pliant.coordinator.outcome.outcome_of`); the state record carries it once the
    job is terminal."""

    FULL = "full"
    """Succeeded at its full size, with no world size refused and no node excluded."""
    REDUCED = "reduced"
    """Succeeded, with world sizes refused or nodes excluded (the reason names them)."""
    FAILED = "failed"
    """Failed (the reason says why)."""


@dataclass(frozen=True)
class JobStatus:
    """A job's state record: stored at ``.../jobs/<job>/state``. ``outcome``: how it ended, once terminal."""

    state: JobState
    since: float
    reason: str = ""
    outcome: Outcome | None = None

    def to_json(self) -> str:
        data = {"state": self.state.value, "since": self.since, "reason": self.reason}
        if self.outcome is not None:
            data["outcome"] = self.outcome.value
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str | bytes) -> JobStatus:
        data = json.loads(text)
        state = JobState(data["state"])
        outcome = data.get("outcome")
        return cls(
            state=state,
            since=float(data["since"]),
            reason=data.get("reason", ""),
            outcome=Outcome(outcome) if outcome else None,
        )


# ----------------------------------------------------------------------------------------------------------------------
# Members and generations


@dataclass(frozen=True)
class Member:
    """A node holding a live membership lease.

    Attributes:
        node_id: the node's id, unique in the job while its lease lives.
        address: host:port of the node's agent store.
        slots: processes the node runs (0: the job's nproc_per_node).
        joined_at: wall-clock seconds when the serving replica accepted the Join.
        order: etcd create revision of the member key; orders joiners deterministically.
        lease_id: the etcd lease holding the membership.
    """

    node_id: str
    address: str
    slots: int = 0
    joined_at: float = 0.0
    order: int = 0
    lease_id: int = 0

    def to_json(self) -> str:
        data = asdict(self)
        del data["order"]  # known only once etcd stored the key
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, *, order: int = 0, lease_id: int = 0) -> Member:
        member = _from_mapping(cls, json.loads(text))
        return Member(**{**asdict(member), "order": order, "lease_id": lease_id or member.lease_id})


@dataclass(frozen=True)
class MemberProgress:
    """How a member is doing, as GetJob / ListJobs report it (``pliant status``).

    Attributes:
        heartbeat_age_s: seconds since the node's last heartbeat, from its lease's remaining TTL (1 s granularity);
            -1 when unknown.
        step: the latest training step the node's workers reported through heartbeats (0: none yet).
        step_at: wall-clock seconds when a coordinator recorded that step (0: none yet).
        strikes: the node's failed readmissions (its peers could not reach it) since its strikes last lapsed
            (:class:`Strike`; it is held back as a spare between tries).
        goodput: the node's seconds in the job as its agent last reported them, by what they went to: ``productive``
            and the badput causes (:mod:`pliant.agent.goodput`); empty when none was reported.
    """

    heartbeat_age_s: float = -1.0
    step: int = 0
    step_at: float = 0.0
    strikes: int = 0
    goodput: Mapping[str, float] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"step": self.step, "step_at": self.step_at, "goodput": dict(self.goodput)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> MemberProgress:
        data = json.loads(text)
        goodput = data.get("goodput") or {}
        return MemberProgress(
            step=int(data.get("step", 0)),
            step_at=float(data.get("step_at", 0.0)),
            goodput={str(k): float(v) for k, v in goodput.items()} if isinstance(goodput, dict) else {},
        )


@dataclass(frozen=True)
class GenerationMember:
    """One node's place in a generation: node rank, first global rank, process count, and ``since``: the generation
    from which the node has trained in this world without a break (kept in etcd, not sent to agents)."""

    node_id: str
    node_rank: int
    rank_offset: int
    nproc: int
    address: str
    since: int = 0


@dataclass(frozen=True)
class Generation:
    """A world: the ordered nodes that train together, published by the leader with a fenced write. A generation with
    no members tells every agent to stop its workers (the job is waiting below min nodes or done)."""

    job_id: str
    number: int
    members: tuple[GenerationMember, ...]
    reason: str
    restarts_used: int = 0
    created_at: float = 0.0
    incarnation: str = ""  # the job's incarnation: a UUID the control plane wrote once, when it created the job
    # Worker failures charged to each node so far, (node id, count), sorted: kept in etcd, not sent to agents.
    charged: tuple[tuple[str, int], ...] = ()
    warrant: str = (
        ""  # the control plane's signature of this world (pliant.security.warrant), made as the leader publishes it
    )
    # World sizes the job no longer takes, (world size, error), sorted: every node of a world of that size failed
    # with the same error (the world's failure, not a node's; see pliant.coordinator.planner).
    refused: tuple[tuple[int, str], ...] = ()
    # Nodes left out for good for their own failures, (node id, failures charged, last error), sorted.
    excluded: tuple[tuple[str, int, str], ...] = ()

    @property
    def world_size(self) -> int:
        return sum(m.nproc for m in self.members)

    @property
    def store_address(self) -> str:
        return self.members[0].address if self.members else ""

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(m.node_id for m in self.members)

    @property
    def after_failure(self) -> bool:
        """Whether this world replaces one that failed: a worker died (``restart``) or a node was lost
        (``failure``). The world before can complete no collective, so its workers can save nothing."""
        return self.reason in ("restart", "failure")

    def to_json(self) -> str:
        data = asdict(self)
        data["members"] = [asdict(m) for m in self.members]
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Generation:
        data = json.loads(text)
        members = tuple(_from_mapping(GenerationMember, m) for m in data.pop("members", []))
        charged = tuple((str(n), int(c)) for n, c in data.pop("charged", []))
        refused = tuple((int(w), str(e)) for w, e in data.pop("refused", []))
        excluded = tuple((str(n), int(c), str(e)) for n, c, e in data.pop("excluded", []))
        return _from_mapping(
            cls, {**data, "members": members, "charged": charged, "refused": refused, "excluded": excluded}
        )


@dataclass(frozen=True)
class Revocation:
    """A certificate the coordinator refuses from ``effective_at`` on (seconds since the epoch): its serial, whose it
    was (the subject), why, and when it expires anyway (``not_after``; 0: unknown)."""

    serial: int
    subject: str = ""
    reason: str = ""
    revoked_at: float = 0.0
    effective_at: float = 0.0
    not_after: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Revocation:
        return _from_mapping(cls, json.loads(text))


@dataclass(frozen=True)
class Admission:
    """What a Join grants: the membership lease, the current generation number (0: none yet), the heartbeat TTL, the
    job's checkpoint key and agent key (:mod:`pliant.security.seal`), and its control public key
    (:mod:`pliant.security.warrant`)."""

    lease_id: int
    generation: int
    heartbeat_ttl_s: float
    checkpoint_key: bytes = b""
    agent_key: bytes = b""
    control_key: bytes = b""


class FailureCause(enum.Enum):
    """What a failure report says happened on the reporting node (``pb.FailureCause`` on the wire)."""

    EXITED = "exited"
    """A worker exited with a non-zero code, or was killed by a signal (the report's ``exit_code``)."""
    HUNG = "hung"
    """No step within the hang timeout: the agent stopped its workers."""
    WAITING = "waiting"
    """No worker of the node failed: they wait in place after a peer failed; the planner gives the failure's cause a
    moment to be reported (:data:`pliant.coordinator.planner.REPORT_GRACE_S`)."""
    NOT_ARRIVED = "not-arrived"
    """A hand-over in place gave up on newcomers that never arrived."""
    START_FAILED = "start-failed"
    """The node could not start its workers."""
    FENCED = "fenced"
    """Another incarnation of the job took the checkpoint directory over; this world stopped."""

    @classmethod
    def of_legacy_code(cls, exit_code: int) -> FailureCause:
        """The cause an agent that sends none meant by ``exit_code`` (-1 hung, -2 waiting, -3 fenced; any other
        code a worker's exit)."""
        return {-1: cls.HUNG, -2: cls.WAITING, -3: cls.FENCED}.get(exit_code, cls.EXITED)


@dataclass(frozen=True)
class FailureReport:
    """An agent's report that ``generation`` failed on ``node_id`` (``cause``, with a worker's ``exit_code`` when it
    is :attr:`FailureCause.EXITED`), the members whose agents it could not reach (``unreachable``; see
    :func:`pliant.coordinator.policy.evictions`), and whether its workers trained a step in ``generation``
    (``arrived``: every member arrived). ``error``: the exception a worker died of, as the failure's identity: the
    same error on every node of a world makes the failure the world's (:mod:`pliant.coordinator.planner`)."""

    node_id: str
    generation: int
    exit_code: int = 1
    message: str = ""
    reported_at: float = 0.0
    unreachable: tuple[str, ...] = ()
    arrived: bool = False
    cause: FailureCause = FailureCause.EXITED
    error: str = ""  # with EXITED: the exception the worker died of, "Type: message" ("": a signal, or no exception)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "cause": self.cause.value}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> FailureReport:
        data = json.loads(text)
        cause = data.get("cause")
        return _from_mapping(
            cls,
            {
                **data,
                "unreachable": tuple(data.get("unreachable", ())),
                "cause": FailureCause(cause) if cause else FailureCause.of_legacy_code(data.get("exit_code", 1)),
            },
        )


@dataclass(frozen=True)
class Strike:
    """A node's failed readmissions (:func:`pliant.coordinator.policy.struck`): ``count`` at ``address`` since they
    lapsed; ``seen_at``: when the leader saw the latest (its clock); ``lifted``: no hold; ``missed``: its agent, a
    spare, could not reach every member of the current generation since (the hold lasts)."""

    node_id: str
    address: str
    count: int
    seen_at: float = 0.0
    lifted: bool = False
    missed: bool = False


@dataclass(frozen=True)
class JobSnapshot:
    """Everything the planner needs about one job, read from etcd at a single revision.

    Attributes:
        spec: the job's spec.
        status: the job's state record.
        members: live members, in join order.
        generation: the current generation, or None before the first.
        failures: failure reports for the current generation, in the order etcd recorded them.
        departed: node ids that left gracefully (Leave) recently.
        generation_mod_revision: mod revision of the current-generation key (0 if absent): the fence of the next write.
        status_mod_revision: mod revision of the state key (0 if absent).
        incarnation: the job's incarnation, a UUID written once when the job was created (a job created again under
            its id, or in a rebuilt etcd, has another one).
        strikes: nodes evicted as unreachable by their peers, recently (held back from rejoining for a while).
        silent: members the leader hears no heartbeat from (:func:`pliant.coordinator.policy.silent_members`), known
            only while a failure report names them: the leader reads their leases and fills this in its view; a
            snapshot read from etcd has none.
    """

    spec: JobSpec
    status: JobStatus
    members: tuple[Member, ...] = ()
    generation: Generation | None = None
    failures: tuple[FailureReport, ...] = ()
    departed: frozenset[str] = field(default_factory=frozenset)
    generation_mod_revision: int = 0
    status_mod_revision: int = 0
    incarnation: str = ""
    strikes: tuple[Strike, ...] = ()
    silent: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class JobInfo:
    """What GetJob / ListJobs return: the spec, state, current generation, live members and their progress."""

    spec: JobSpec
    status: JobStatus
    generation: Generation | None = None
    members: tuple[Member, ...] = ()
    progress: Mapping[str, MemberProgress] = field(default_factory=dict)


@dataclass(frozen=True)
class WatchEvent:
    """One WatchGenerations message: the latest generation sent (None before the first) and the job's state."""

    generation: Generation | None
    status: JobStatus


# ----------------------------------------------------------------------------------------------------------------------
# Planner decisions


@dataclass(frozen=True)
class Keep:
    """Nothing to do."""


@dataclass(frozen=True)
class NewGeneration:
    """Publish ``generation`` and move the job to ``state``."""

    generation: Generation
    state: JobState


@dataclass(frozen=True)
class WaitUntil:
    """Re-plan at ``deadline`` (the planner's clock: the leader's) unless something changes first; record ``state``
    if it changed. ``replan_at_members``: while the job has fewer member keys than this, a member's arrival alone
    changes nothing before the deadline (0: any change may), so the reconciler need not read the job for it."""

    deadline: float
    why: str
    state: JobState
    replan_at_members: int = 0


@dataclass(frozen=True)
class FailJob:
    """Fail the job with a reason a user understands."""

    reason: str


Decision = Keep | NewGeneration | WaitUntil | FailJob


# ----------------------------------------------------------------------------------------------------------------------
# The store, as the reconciler sees it (etcd in coordinator/store.py; an in-memory fake in the unit tests)


class JobStore(Protocol):
    """What the reconciler reads and writes. Every write is fenced by leadership (``fence``, opaque here) and by the
    mod revision of the record it replaces, read in ``snap``; a failed fence raises :class:`FencingError` and writes
    nothing. Every call may raise :class:`Unavailable`; a read may raise :class:`CorruptRecord`."""

    def list_job_ids(self) -> list[str]: ...
    def read_job(self, job: str) -> JobSnapshot: ...
    def lease_ages(self, job: str, members: tuple[Member, ...]) -> dict[str, float]: ...
    def warrant(self, generation: Generation) -> str: ...
    def publish(self, snap: JobSnapshot, generation: Generation, status: JobStatus, fence: Any) -> None: ...
    def set_status(self, snap: JobSnapshot, status: JobStatus, fence: Any) -> None: ...
    def evict(self, snap: JobSnapshot, nodes: tuple[str, ...], fence: Any, keep: tuple[str, ...] = ()) -> None: ...
    def delete_job(self, job: str) -> None: ...
