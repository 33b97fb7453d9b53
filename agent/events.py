"""What happens to an agent, as the events :func:`pliant.agent.core.decide` takes.

The executor (:mod:`pliant.agent.agent`) and the threads that feed its queue (:mod:`pliant.agent.membership`: the
watch and the heartbeat; signals; the background readers and probes) turn what they see into these; the core never
sees anything else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pliant.agent.contract import GroupResult
from pliant.agent.stopping import StopStage
from pliant.coordinator.contract import Generation, JobState
from pliant.fence import Fence

__all__ = [
    "ArrivalsRead",
    "Event",
    "GenerationSeen",
    "GroupExited",
    "GroupStopped",
    "HeartbeatFailed",
    "HeartbeatOk",
    "JobFinished",
    "Joined",
    "LeaseLost",
    "NewcomersProbed",
    "PeersProbed",
    "SignalReceived",
    "StartFailed",
    "StopStarted",
    "StorePortRead",
    "Tick",
]


@dataclass(frozen=True)
class Joined:
    """The membership joined (or joined again), with a heartbeat TTL of ``ttl_s``."""

    ttl_s: float


@dataclass(frozen=True)
class GenerationSeen:
    """The watch delivered ``generation``."""

    generation: Generation


@dataclass(frozen=True)
class JobFinished:
    """The watch delivered the job's state (the core acts on terminal ones)."""

    state: JobState
    reason: str


@dataclass(frozen=True)
class GroupExited:
    """Workers of the running group exited.

    Attributes:
        result: the group's exit codes so far.
        message: the executor's description of the failure the node reports (``result.first_failure``: rank, code,
            error).
        alive: workers of the group still running.
        error: the exception that worker died of ("Type: message"; "" for none).
    """

    result: GroupResult
    message: str = ""
    alive: int = 0
    error: str = ""


@dataclass(frozen=True)
class GroupStopped:
    """The group being stopped has no live worker left (the executor reaped it, or gave up on it: ``GONE``)."""

    generation: int


@dataclass(frozen=True)
class StopStarted:
    """The first stage the executor could enter for a :class:`pliant.agent.actions.Stop` when it differs from the one
    asked: a rescale none of whose workers takes the request is stopped with SIGTERM at once (``TERM``)."""

    stage: StopStage


@dataclass(frozen=True)
class StartFailed:
    """The workers of ``generation`` could not be started (``message`` says why)."""

    generation: int
    message: str


@dataclass(frozen=True)
class StorePortRead:
    """The answer to :class:`pliant.agent.actions.Prepare` or :class:`pliant.agent.actions.ReadStorePort`: the port
    ``generation``'s store listens on at node rank 0 (0: not read, and ``error`` says why)."""

    generation: int
    port: int
    error: str = ""


@dataclass(frozen=True)
class HeartbeatOk:
    """A heartbeat renewed the membership."""


@dataclass(frozen=True)
class HeartbeatFailed:
    """A heartbeat found no coordinator (the membership may still be held)."""


@dataclass(frozen=True)
class LeaseLost:
    """The control plane says this node is no longer a member (``why``); the membership joins again."""

    why: str


@dataclass(frozen=True)
class PeersProbed:
    """The answer to :class:`pliant.agent.actions.ProbePeers`.

    Attributes:
        streak_s: the longest unbroken run of membership renewals among the peers' agents (-1: none answered).
        newest: the newest generation any of them has seen (-1: none says; 0: none seen).
    """

    streak_s: float
    newest: int = -1


@dataclass(frozen=True)
class SignalReceived:
    """SIGTERM or SIGINT: leave the job gracefully, and exit with :func:`pliant.agent.contract.left_on` it."""

    signum: int


@dataclass(frozen=True)
class ArrivalsRead:
    """The answer to :class:`pliant.agent.actions.ReadArrivals`: ``arrived`` workers counted in at ``generation``'s
    store (0: unreadable)."""

    generation: int
    arrived: int


@dataclass(frozen=True)
class NewcomersProbed:
    """The answer to :class:`pliant.agent.actions.ProbeNewcomers`: the newcomers of ``generation`` whose agents did
    not answer."""

    generation: int
    arrived: int
    unreachable: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Tick:
    """Periodic, with the workers' progress as read now (local rank -> (step, phase) or (step, phase, generation), for
    ranks that write one; the generation a "wait" names) and the checkpoint directory's fence, checked against the
    job's key (:mod:`pliant.fence`; None: none, or one that is not sealed with the key)."""

    progress: Mapping[int, tuple[int, str] | tuple[int, str, int]] = field(default_factory=dict)
    fence: Fence | None = None
    ready: bool = False  # every live worker announced that it re-forms in place


Event = (
    Joined
    | GenerationSeen
    | JobFinished
    | GroupExited
    | GroupStopped
    | StopStarted
    | StartFailed
    | StorePortRead
    | HeartbeatOk
    | HeartbeatFailed
    | LeaseLost
    | PeersProbed
    | SignalReceived
    | ArrivalsRead
    | NewcomersProbed
    | Tick
)
