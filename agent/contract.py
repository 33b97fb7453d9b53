"""The agent's contract: its configuration, its state machine, the outcome of a worker group, and its errors."""

from __future__ import annotations

import enum
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from pliant import settings
from pliant.agent.stopping import Graces
from pliant.coordinator.contract import JobSpec
from pliant.env import RESCALE_EXIT_CODE, RESCALE_MODES
from pliant.errorfile import peer_gone
from pliant.errors import ConfigError, PliantError
from pliant.home import state_home
from pliant.net import parse_host_port
from pliant.security.tlsdir import TlsConfig

__all__ = [
    "COORDINATORS",
    "TRANSITIONS",
    "AgentConfig",
    "AgentError",
    "AgentState",
    "ExitCode",
    "GroupResult",
    "default_node_id",
    "left_on",
    "state_home",
]


class AgentError(PliantError):
    """Base of the agent's errors."""


class ExitCode(enum.IntEnum):
    """What an agent's (``pliant agent``, ``pliant run``) exit code says about the job, for whatever restarts it: a
    Kubernetes Job's pod failure policy acts on it (``pliant k8s job``), a shell script may too.

    Besides these, ``128 + N`` (:func:`left_on`): this node left gracefully on signal N (143: SIGTERM, 130: SIGINT)
    and the job goes on without it, so a supervisor should start the node again (a Kubernetes index is replaced)."""

    SUCCEEDED = 0
    """The job succeeded (or had already when this agent came)."""
    JOB_FAILED = 1
    """The job failed (its restarts spent, below its minimum nodes for too long, failed by an admin)."""
    ERROR = 2
    """This agent could not take part (a bad flag, a refused join, its store host died); the job goes on."""


def left_on(signum: int) -> int:
    """The exit code of an agent that left the job gracefully on signal ``signum``: the shell's ``128 + N``."""
    return 128 + signum


class AgentState(enum.Enum):
    """An agent's lifecycle, as it reports it (metrics, logs); the transitions allowed are :data:`TRANSITIONS`.

    JOINING: joining the job (first, or again after its membership was lost). WAITING: a member without workers
    (spare, left out, below min, between worlds, or done and waiting for the job's end). RUNNING: workers of a
    generation that includes this node start or run. LEAVING: the node left the job on SIGTERM, and its workers run
    until the world without it is published, so every node's workers are stopped together. SUCCEEDED, FAILED (the job
    finished) and LEFT (graceful leave) are terminal.
    """

    JOINING = "joining"
    WAITING = "waiting"
    RUNNING = "running"
    LEAVING = "leaving"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    LEFT = "left"


def _transitions(
    *pairs: tuple[tuple[AgentState, ...], tuple[AgentState, ...]],
) -> frozenset[tuple[AgentState, AgentState]]:
    return frozenset((a, b) for sources, targets in pairs for a in sources for b in targets)


_S = AgentState
TRANSITIONS = _transitions(
    ((_S.JOINING,), (_S.WAITING, _S.RUNNING)),  # joined; or a generation with or without this node came first
    ((_S.WAITING,), (_S.RUNNING, _S.JOINING)),  # a generation includes this node; the membership was lost
    ((_S.RUNNING,), (_S.WAITING, _S.LEAVING, _S.JOINING)),  # a world without it, failure, done; SIGTERM; lost
    ((_S.JOINING, _S.WAITING, _S.RUNNING, _S.LEAVING), (_S.SUCCEEDED, _S.FAILED, _S.LEFT)),  # the job ended; left
)
"""The lifecycle changes the agent's core may make, (from, to), besides staying: the states it reports follow only
these (a test drives the core through random events and checks both ways)."""

COORDINATORS = "@COORDINATORS@"
"""The coordinators' place in :attr:`AgentConfig.join_line` (a word the shell takes as it is, unquoted)."""


def default_node_id() -> str:
    """A node id unique on this host: ``<hostname>-<pid>`` (like torchrun's)."""
    return f"{socket.gethostname().split('.')[0]}-{os.getpid()}"


@dataclass(frozen=True)
class AgentConfig:
    """What one agent runs.

    Attributes:
        coordinator: coordinator replica addresses (HOST:PORT).
        spec: the job's spec; used to create the job if it does not exist yet.
        command: the worker command after the interpreter, e.g. ``("train.py", "--lr", "0.1")`` or
            ``("-m", "pkg.train")``; with ``no_python`` the full command.
        nproc_per_node: workers this node runs.
        node_id: this node's id (unique in the job).
        host: address other nodes reach this node's agent store (and the per-generation store) on.
        store_port: port of the agent store (0: a free one).
        log_dir: per-worker log files go under it ("" : console only).
        checkpoint_dir: exported to workers as PLIANT_CHECKPOINT_DIR.
        stop_grace_s: SIGTERM -> SIGKILL grace when stopping workers.
        abort_grace_s: SIGTERM -> SIGKILL grace when stopping the workers of a world that failed.
        rescale_grace_s: how long workers may take to checkpoint and exit when a new generation comes (or the agent
            leaves) before they are stopped; 0 stops them at once.
        finish_grace_s: how long workers may take to exit after the job succeeded elsewhere.
        hang_timeout_s: a worker that completes no step for this long is hung (None: automatic, see
            :func:`pliant.agent.core.hang_timeout`).
        start_timeout_s: a worker that reaches no first step, or spends longer in one checkpoint save, is hung
            (0: never).
        allow_fresh_start: exported to workers: when checkpoints exist but none loads, train from step 0 instead of
            failing.
        rescale: ``in-place`` (groups that can re-form keep their processes and state across generations) or
            ``restart`` (every new generation stops the group after a checkpoint).
        snapshot_every: committed steps between a sharded engine's buddy copies, or None (``auto``) to choose them
            from their measured cost (exported to workers; :mod:`pliant.worker.inplace.cadence`).
        snapshot_dir: the folder in node-local memory where the agent makes the directory its workers keep their
            buddy copies in, so that a dead worker's outlive it (:mod:`pliant.agent.snapshots`); None: ``/dev/shm``
            where it is writable; "": none (the copies live in the workers' memory only).
        no_python: run ``command`` as is instead of with the Python interpreter.
        preload: the modules the worker zygote imports after torch (``--preload``); ``()`` for none
            (``--no-preload``); None: what the training script imports at its top level (:mod:`pliant.agent.preload`).
        heartbeat_retry_s: how long the agent's coordinator calls retry UNAVAILABLE.
        metrics_port: serve the node's Prometheus metrics (the agent's and its workers') on ``host:metrics_port``
            (0: a free port); None serves none.
        tls: the agent's TLS files (an agent certificate naming ``node_id``); None: plaintext (``--insecure``).
        join_token: the job's join token; "" lets the agent create the job (admin or plaintext only) and join with
            the token it chose.
        admin_tls: an admin certificate the agent creates the job with when it does not exist (``pliant run``'s
            embedded control plane); None: the agent's own certificate.
        ca_cert_hash: ``sha256:<hex>`` of the coordinator CA's public key: without ``tls`` the agent joins by
            bootstrap (:mod:`pliant.bootstrap`), pinning that CA; "": no bootstrap.
        bootstrap: the Bootstrap services' HOST:PORT, tried in order (with ``ca_cert_hash``).
        create_job: the bootstrap join creates the job (``spec``) first unless it exists: ``join_token`` is a
            namespace's, and the job id ``<namespace>.<name>`` (a Kubernetes namespace's agents).
        seat: a node of an embedded control plane (``pliant run``'s): it comes back to a seat it held, and with
            ``seat_key`` asks for a new one: an etcd member and a coordinator replica on this node
            (:mod:`pliant.agent.seat`).
        seat_key: the control plane's seat key ("": this node takes no new seat).
        join_line: the line other nodes join with, :data:`COORDINATORS` in the place of the coordinators; said again
            when the control plane's coordinators change ("": never said).
    """

    coordinator: tuple[str, ...]
    spec: JobSpec
    command: tuple[str, ...]
    nproc_per_node: int = 1
    node_id: str = field(default_factory=default_node_id)
    host: str = "127.0.0.1"
    store_port: int = 0
    log_dir: str = ""
    checkpoint_dir: str = ""
    stop_grace_s: float = settings.STOP_GRACE_S
    abort_grace_s: float = settings.ABORT_GRACE_S
    rescale_grace_s: float = settings.RESCALE_GRACE_S
    finish_grace_s: float = settings.FINISH_GRACE_S
    hang_timeout_s: float | None = None
    start_timeout_s: float = 600.0
    allow_fresh_start: bool = False
    rescale: str = "in-place"
    snapshot_every: int | None = None
    snapshot_dir: str | None = None
    no_python: bool = False
    preload: tuple[str, ...] | None = None
    heartbeat_retry_s: float = 10.0
    metrics_port: int | None = None
    tls: TlsConfig | None = None
    join_token: str = field(default="", repr=False)
    admin_tls: TlsConfig | None = None
    ca_cert_hash: str = ""
    bootstrap: tuple[str, ...] = ()
    create_job: bool = False
    seat: bool = False
    seat_key: str = field(default="", repr=False)
    join_line: str = ""

    @property
    def graces(self) -> Graces:
        """How long each stage of stopping a worker group may last."""
        return Graces(
            finish_s=self.finish_grace_s,
            rescale_s=self.rescale_grace_s,
            stop_s=self.stop_grace_s,
            abort_s=self.abort_grace_s,
        )

    @property
    def held_membership_wait_s(self) -> float:
        """How long a restarted node waits for its earlier agent's membership (same node id) to be dropped before it
        gives up: the leader drops a silent member within a heartbeat TTL or two."""
        return 2 * self.spec.heartbeat_ttl_s + 10

    def __post_init__(self) -> None:
        if not self.coordinator:
            raise ConfigError("no coordinator address: pass --coordinator HOST:PORT")
        for address in self.coordinator:
            parse_host_port(address, what="--coordinator")
        if not self.command:
            raise ConfigError("no training script given: pliant run [flags] SCRIPT [ARGS...]")
        if self.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node {self.nproc_per_node} must be >= 1")
        if not 0 <= self.store_port < 65536:
            raise ConfigError(f"store port {self.store_port} must be in 0..65535")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"--metrics-port {self.metrics_port} must be in 0..65535 (0: a free port)")
        graces = {"--stop-grace": self.stop_grace_s, "--abort-grace": self.abort_grace_s}
        graces["--finish-grace"] = self.finish_grace_s
        for flag, seconds in graces.items():
            if seconds < 0:
                raise ConfigError(f"{flag} {seconds:g} must be >= 0 seconds")
        if self.hang_timeout_s is not None and self.hang_timeout_s <= 0:
            raise ConfigError(
                f"--hang-timeout {self.hang_timeout_s:g} must be > 0 seconds (omit it for the automatic timeout)"
            )
        if self.rescale not in RESCALE_MODES:
            raise ConfigError(f"--rescale {self.rescale!r} must be one of: {', '.join(RESCALE_MODES)}")
        if self.snapshot_every is not None and self.snapshot_every < 1:
            raise ConfigError(
                f"--snapshot-every {self.snapshot_every} must be 'auto' or at least 1 (committed steps "
                f"between a sharded engine's buddy copies)"
            )
        if self.ca_cert_hash and (self.tls is not None or not self.bootstrap or not self.join_token):
            raise ConfigError(
                "a bootstrap join (--ca-cert-hash) needs the job's --join-token and a coordinator, and no --tls-dir "
                "(which names a certificate made beforehand)"
            )
        if self.create_job and not self.ca_cert_hash:
            raise ConfigError(
                "--create-job creates the job at the bootstrap join: add --ca-cert-hash and the namespace's "
                "--join-token (pliant k8s namespace)"
            )
        for address in self.bootstrap:
            parse_host_port(address, what="--bootstrap")
        if self.start_timeout_s < 0:
            raise ConfigError(f"--start-timeout {self.start_timeout_s:g} must be >= 0 seconds (0: never)")


@dataclass(frozen=True)
class GroupResult:
    """How a node's worker group of one generation ended.

    Attributes:
        generation: the generation the workers ran.
        exit_codes: local rank -> exit code (negative: killed by that signal).
        stopped: the agent stopped the group itself (a new generation, shutdown), so exits are not failures.
        blamed: the failed worker the node's report describes, when :meth:`blame` chose one (local rank).
    """

    generation: int
    exit_codes: dict[int, int]
    stopped: bool = False
    blamed: int | None = None

    @property
    def succeeded(self) -> bool:
        return not self.stopped and all(code == 0 for code in self.exit_codes.values())

    @property
    def saved_for_rescale(self) -> bool:
        """Every worker exited 0 or with the rescale code, and at least one with the rescale code."""
        codes = set(self.exit_codes.values())
        return RESCALE_EXIT_CODE in codes and codes <= {0, RESCALE_EXIT_CODE}

    @property
    def failed(self) -> list[tuple[int, int]]:
        """(local rank, exit code) of every failed worker, by local rank."""
        return [(rank, code) for rank, code in sorted(self.exit_codes.items()) if code not in (0, RESCALE_EXIT_CODE)]

    @property
    def first_failure(self) -> tuple[int, int] | None:
        """(local rank, exit code) of the failed worker the node reports, if any: the :attr:`blamed` one, else the
        failed worker of the lowest local rank."""
        failed = self.failed
        chosen = [f for f in failed if f[0] == self.blamed]
        return (chosen or failed or [None])[0]

    def blame(self, errors: Mapping[int, str]) -> GroupResult:
        """This result with :attr:`blamed` set to the failed worker the node's report describes, given the
        ``errors`` failed workers died of (local rank -> ``Type: message``; none for a signal or ``sys.exit``): the
        first whose error is not a peer's going away (:func:`pliant.errorfile.peer_gone`; such a worker died of the
        collective its local peer's own failure broke), else the first."""
        failed = [rank for rank, _code in self.failed]
        own = [rank for rank in failed if not peer_gone(errors.get(rank, ""))]
        return replace(self, blamed=(own or failed or [None])[0])
