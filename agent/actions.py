"""What the agent's core tells its executor to do: the closed set of actions :func:`pliant.agent.core.decide`
returns, performed in order by :mod:`pliant.agent.agent`. Those that read or probe something are answered with an
event (:mod:`pliant.agent.events`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pliant.coordinator.contract import FailureCause, Generation

if TYPE_CHECKING:
    from pliant.agent.stopping import StopStage

__all__ = [
    "Action",
    "Dump",
    "Escalate",
    "Exit",
    "Leave",
    "Prepare",
    "ProbeNewcomers",
    "ProbePeers",
    "ReadArrivals",
    "ReadStorePort",
    "Reconfigure",
    "Report",
    "Send",
    "Start",
    "Stop",
]


@dataclass(frozen=True)
class Report:
    """A report the coordinator must receive: a worker failure or the group's success, for ``generation``.

    Attributes:
        kind: ``"failure"`` or ``"success"``.
        generation: the generation reported on.
        exit_code: of a failure whose cause is EXITED: the worker's (negative: the signal that killed it).
        message: what failed, in words.
        arrived: a worker of this node completed a step in ``generation``: every member arrived.
        cause: why the generation failed on this node.
        untrained: of a success: no worker of this node completed a step in ``generation``.
        error: of an EXITED failure: the exception the worker died of ("Type: message"; "" for none).
    """

    kind: str
    generation: int
    exit_code: int = 0
    message: str = ""
    arrived: bool = False
    cause: FailureCause = FailureCause.EXITED
    untrained: bool = False
    error: str = ""


@dataclass(frozen=True)
class Prepare:
    """Open ``generation``'s store (this node is its rank 0) so joiners can meet there while the old group saves;
    answered with :class:`pliant.agent.events.StorePortRead`."""

    generation: Generation


@dataclass(frozen=True)
class ReadStorePort:
    """Read ``generation``'s store port from node rank 0's agent store, in the background (node rank 0 may still be
    stopping its old group); answered with :class:`pliant.agent.events.StorePortRead`."""

    generation: Generation


@dataclass(frozen=True)
class Stop:
    """Begin stopping the running group (:mod:`pliant.agent.stopping`): ``rescale`` asks the workers to checkpoint and
    exit (``leave``: to hand over and exit, the others re-forming in place); ``finish`` lets them end by themselves;
    neither: SIGTERM. ``hung``: the workers' stacks are being dumped (:class:`Dump`), SIGTERM follows once they had
    time to reach the logs. ``failed``: the group's world failed; SIGTERM, and SIGKILL after the abort grace. The
    executor answers :class:`pliant.agent.events.GroupStopped` once no worker is left (at once when it has no
    group)."""

    rescale: bool = False
    finish: bool = False
    leave: bool = False
    hung: bool = False
    failed: bool = False


@dataclass(frozen=True)
class Escalate:
    """The stopping group's stage ran out: enter ``stage`` (``DUMP``: the late workers' stacks to their logs;
    ``TERM``: SIGTERM; ``KILL``: SIGKILL; ``GONE``: give up on what outlived SIGKILL)."""

    stage: StopStage


@dataclass(frozen=True)
class Reconfigure:
    """Hand the running group ``generation`` in place, its store on ``port``: live workers get their new env, dead
    local ranks fresh workers."""

    generation: Generation
    port: int


@dataclass(frozen=True)
class ReadArrivals:
    """Count the workers that counted themselves in at ``generation``'s store (on ``port``); answered with
    :class:`pliant.agent.events.ArrivalsRead`. ``warm``: count instead the workers the nodes' agents are about to
    fork, their imports done (:data:`pliant.agent.stores.WARM_KEY`), for a join by the restart path."""

    generation: Generation
    port: int
    warm: bool = False


@dataclass(frozen=True)
class ProbeNewcomers:
    """Probe the agents of ``generation``'s ``newcomers``; answered with :class:`pliant.agent.events.NewcomersProbed`
    (``arrived`` passed on)."""

    generation: Generation
    newcomers: tuple[str, ...]
    arrived: int


@dataclass(frozen=True)
class Start:
    """Start this node's workers of ``generation``, whose store listens on ``port``; a failure is answered with
    :class:`pliant.agent.events.StartFailed`."""

    generation: Generation
    port: int


@dataclass(frozen=True)
class Send:
    """Send ``report`` to the coordinator (retried in the background while it does not answer)."""

    report: Report


@dataclass(frozen=True)
class Dump:
    """Ask every worker for its Python stacks, into its log (a hang; the :class:`Stop` that follows gives them the
    time to get there)."""

    why: str


@dataclass(frozen=True)
class ProbePeers:
    """Ask the peers' agents how long they have renewed their memberships; answered with
    :class:`pliant.agent.events.PeersProbed`."""


@dataclass(frozen=True)
class Leave:
    """Leave the job (the membership's Leave call)."""


@dataclass(frozen=True)
class Exit:
    """End the agent with ``code`` (:class:`pliant.agent.contract.ExitCode`, or :func:`pliant.agent.contract.left_on`
    a signal); a finished job's ``message`` (how it ended, and why) is printed."""

    code: int
    message: str = ""


Action = (
    Prepare
    | ReadStorePort
    | Stop
    | Escalate
    | Reconfigure
    | ReadArrivals
    | ProbeNewcomers
    | Start
    | Send
    | Dump
    | ProbePeers
    | Leave
    | Exit
)
