"""Stopping a worker group, as a phase of the agent with deadlines (pure; applied by :func:`pliant.agent.core.decide`).

A group is stopped in stages, each with a grace after which the next begins; the executor never waits for one. It
starts a stage when told to (:class:`pliant.agent.actions.Stop`, then :class:`pliant.agent.actions.Escalate`), tells
which first stage it could enter (``StopStarted``), and reports the group gone once every worker exited
(``GroupStopped``); the core checks the deadline on its ticks. The stages:

- ``FINISH`` (the job succeeded elsewhere): the workers end by themselves, within the finish grace.
- ``RESCALE`` (a rescale): the workers that run the rescale protocol were told to save and exit (``restart``) or to
  hand over and exit (``leave``), within the rescale grace. A group none of whose workers takes the request enters
  ``TERM`` at once instead (a plain script: torchrun's SIGTERM).
- ``DUMP``, after a ``RESCALE`` that ran out, or first when the workers hung: the (late or hung) workers' stacks
  are dumped to their logs, for :data:`DUMP_S`, so they are there before the workers are stopped.
- ``TERM``: SIGTERM to every worker's process group (a script's own handler runs: save on preemption), within the
  stop grace.
- ``ABORT``, first when the group's world failed (one of its workers died, or the job restarted without this world):
  SIGTERM, within the abort grace. Its collectives can never complete, so a script that waits in one never runs its
  handler, and a handler that runs can save nothing its peers agree on: the world's state is lost either way, and the
  next world restores from the last checkpoint as soon as these workers are gone.
- ``KILL``: SIGKILL, within :data:`KILL_REAP_S`.
- ``GONE``: a worker that outlived SIGKILL (a process stuck in the kernel) is given up on, with an error.

What the core decided to do once the group is gone (start the next group, exit, leave) waits in
:attr:`Stopping.then`, and the phase the agent is in once it is gone in :attr:`Stopping.after`: nothing that needs
the old workers gone (their checkpoint saved, their ports, their GPU) runs before. While a group stops, the core
decides in ``after`` as if the group were gone, anything of that kind decided meanwhile joins the queue, and a group
that was only planned (its start still queued) is dropped from it when a newer decision stops it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any

from pliant import settings
from pliant.agent.actions import Action, Exit, Leave, Start, Stop

__all__ = ["DUMP_S", "KILL_REAP_S", "Graces", "StopStage", "Stopping", "begin", "defer", "escalated", "first_stage"]

DUMP_S = 0.5  # the late workers' stack dumps reach their logs through the output pumps within this
KILL_REAP_S = 10.0  # a worker SIGKILLed is reaped within this, or given up on


class StopStage(enum.Enum):
    """A stage of stopping a group (see the module docstring)."""

    FINISH = "finish"
    RESCALE = "rescale"
    DUMP = "dump"
    TERM = "term"
    ABORT = "abort"
    KILL = "kill"
    GONE = "gone"


@dataclass(frozen=True)
class Graces:
    """How long each stage may last (from :class:`pliant.agent.contract.AgentConfig`)."""

    finish_s: float = settings.FINISH_GRACE_S
    rescale_s: float = settings.RESCALE_GRACE_S
    stop_s: float = settings.STOP_GRACE_S
    abort_s: float = settings.ABORT_GRACE_S

    def of(self, stage: StopStage) -> float:
        return {
            StopStage.FINISH: self.finish_s,
            StopStage.RESCALE: self.rescale_s,
            StopStage.DUMP: DUMP_S,
            StopStage.TERM: self.stop_s,
            StopStage.ABORT: self.abort_s,
            StopStage.KILL: KILL_REAP_S,
            StopStage.GONE: 0.0,
        }[stage]


@dataclass(frozen=True)
class Stopping:
    """The agent's phase while a group is being stopped.

    Attributes:
        stage: the stage the stop is in, until ``deadline`` (agent clock).
        deadline: when the stage runs out and the next begins.
        then: the actions that wait for the group to be gone, in order.
        after: the phase the agent is in once the group is gone (:data:`pliant.agent.core.Phase`; never a
            ``Stopping``); the core decides in it meanwhile.
    """

    stage: StopStage
    deadline: float
    then: tuple[Action, ...] = ()
    after: Any = None

    @property
    def lifecycle(self) -> Any:
        """The lifecycle state the agent reports: the one of the phase it is in once the group is gone."""
        return self.after.lifecycle


def first_stage(rescale: bool, finish: bool, hung: bool = False, failed: bool = False) -> StopStage:
    """The stage a stop begins with: the job's end lets the workers finish; a rescale asks them to save or hand over;
    hung workers' stacks are dumped first; a world that failed is aborted; anything else is SIGTERM."""
    if finish:
        return StopStage.FINISH
    if hung:
        return StopStage.DUMP
    if failed:
        return StopStage.ABORT
    return StopStage.RESCALE if rescale else StopStage.TERM


def begin(stage: StopStage, graces: Graces, now: float, then: tuple[Action, ...] = (), after: Any = None) -> Stopping:
    """A stop entering ``stage`` at ``now``."""
    return Stopping(stage, now + graces.of(stage), then, after)


def escalated(stopping: Stopping, graces: Graces, now: float) -> Stopping | None:
    """The next stage once ``stopping``'s deadline passed at ``now``; None while it has not."""
    if now < stopping.deadline:
        return None
    following = {
        StopStage.FINISH: StopStage.TERM,
        StopStage.RESCALE: StopStage.DUMP,
        StopStage.DUMP: StopStage.TERM,
        StopStage.TERM: StopStage.KILL,
        StopStage.ABORT: StopStage.KILL,
        StopStage.KILL: StopStage.GONE,
        StopStage.GONE: StopStage.GONE,
    }[stopping.stage]
    return replace(stopping, stage=following, deadline=now + graces.of(following))


def defer(then: tuple[Action, ...], actions: list[Action]) -> tuple[list[Action], tuple[Action, ...]]:
    """While a group stops: split ``actions`` into those to perform now and the queue ``then`` extended. From the first
    start, leave or exit on, actions queue, in order. A stop among them stops the group that was only planned: the
    starts queued so far are dropped, and the stop itself is not performed (the group already stopping is the only
    one the executor has)."""
    now_actions: list[Action] = []
    queued = list(then)
    waiting = False
    for action in actions:
        if isinstance(action, Stop):
            queued = [a for a in queued if not isinstance(a, Start)]
            waiting = True
        elif waiting or isinstance(action, (Start, Leave, Exit)):
            waiting = True
            queued.append(action)
        else:
            now_actions.append(action)
    return now_actions, tuple(queued)
