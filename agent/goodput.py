"""Goodput: how much of a node's time in a job trained, and where the rest went (badput, by cause and, for a
recovery, by phase).

The convention is Google's ML goodput: goodput time is time spent on steps that count towards the final model;
everything else is badput, by cause. A node's time is charged tick by tick (the agent's loop, every 0.25 s): what the
node is doing at a tick (:func:`classify`) is what the time until the next tick is charged to, so a charge is right
to a tick.

What the node is doing, from what its agent knows (the workers' progress records, :mod:`pliant.progress`, its
lifecycle, the job's state and the generations it sees):

- ``productive``: the workers compute a step beyond the highest this node completed so far (after step ``s``
  completed, step ``s + 1`` is in progress; it is new when ``s`` is the highest completed). A script whose workers
  have reported no progress in this job (one without ``pliant.worker``) counts its workers' whole running time here:
  an upper bound; so does a ``pliant.worker`` script's first start until its session opens (its imports, under a
  second from the zygote).
- ``redone``: the workers compute a step this node completed before (after a restore from an older checkpoint, or a
  sharded engine's roll back).
- ``checkpoint``: a worker is blocked in a checkpoint save (the ``save`` phase).
- ``waiting``: the job waits for nodes (below its minimum), or this node is held out of the world (a spare, left out,
  excluded).
- ``start``, ``rescale``, ``failure``: no step in progress, charged to the last interruption: the job's start
  (before this node's first step), a join or a leave, or a failure (a worker's exit, a lost node: a generation after
  a failure). A rescale's and a failure's time is split by phase (:data:`PHASES`): ``decide`` until the generation
  that follows is seen (the agents' reports and the coordinator's plan; workers waiting for their agent after a
  collective failed, the ``wait`` phase, are a failure's), ``restart`` while the node has no workers of it (stopping
  the old ones, forking the new), ``restore`` while its workers start or move their state into the new world (their
  imports, a checkpoint's load, the state from peers).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["CAUSES", "PHASES", "PRODUCTIVE", "RECOVERIES", "Activity", "Goodput", "classify"]

PRODUCTIVE = "productive"
CAUSES = ("start", "rescale", "failure", "redone", "checkpoint", "waiting")
"""The badput causes, as the metrics label them."""
PHASES = ("decide", "restart", "restore")
"""The phases of a rescale's or a failure's badput; the other causes have none ("")."""
RECOVERIES = ("rescale", "failure")
"""The causes whose badput is split by phase."""

_BETWEEN_PHASES = ("start", "transfer")


@dataclass(frozen=True)
class Activity:
    """What the node does at a tick.

    Attributes:
        workers: a worker group of this node runs.
        progress: its workers' progress records (local rank -> (step, phase) or (step, phase, generation)).
        held_out: the job waits for nodes, or this node waits outside the world (spare, left out, excluded).
    """

    workers: bool
    progress: Mapping[int, tuple] = field(default_factory=dict)
    held_out: bool = False


def classify(activity: Activity, interruption: str, decided: bool, highest: int, reported: bool) -> tuple[str, str]:
    """(:data:`PRODUCTIVE` or the badput cause, the recovery phase or "") of ``activity``.

    Args:
        activity: what the node does.
        interruption: the cause of the last interruption: ``start``, ``rescale`` or ``failure``.
        decided: the generation that follows the interruption was seen.
        highest: the highest step this node's workers completed so far, this activity's included (-1: none).
        reported: this node's workers have written progress in this job (a script that reports its steps).
    """
    between = interruption if interruption not in RECOVERIES else None
    if not activity.workers:
        if activity.held_out:
            return "waiting", ""
        return (between, "") if between else (interruption, "restart" if decided else "decide")
    records = list(activity.progress.values())
    if not records:
        if not reported:
            return PRODUCTIVE, ""  # no steps reported: the running time counts as training
        return (between, "") if between else (interruption, "restore")
    phases = {record[1] for record in records}
    if "save" in phases:
        return "checkpoint", ""
    if "wait" in phases:
        return "failure", "decide"
    if phases & set(_BETWEEN_PHASES):
        return (between, "") if between else (interruption, "restore")
    step = min(record[0] for record in records)
    return (PRODUCTIVE, "") if step >= highest else ("redone", "")


class Goodput:
    """One node's goodput and badput seconds, charged tick by tick (see the module docstring).

    Threads: the agent's loop thread only.

    Attributes:
        seconds: seconds charged so far, by category (:data:`PRODUCTIVE` and each of :data:`CAUSES`).
        phases: a rescale's and a failure's seconds by (cause, phase).
    """

    def __init__(self, now: float) -> None:
        self.seconds: dict[str, float] = dict.fromkeys((PRODUCTIVE, *CAUSES), 0.0)
        self.phases: dict[tuple[str, str], float] = {(c, p): 0.0 for c in RECOVERIES for p in PHASES}
        self._at = now
        self._doing = ("start", "")  # what the time since the last charge goes to
        self._interruption = "start"
        self._decided = True
        self._highest = -1  # the highest step completed (-1: none yet)
        self._reported = False

    def interrupted(self, cause: str, decided: bool) -> None:
        """The node's training was interrupted (``rescale`` or ``failure``): by a generation it sees (``decided``), or
        by a failure its next generation will answer. Before its first step, the job's start stays the cause."""
        if self._highest < 0:
            return
        if decided and self._interruption == "failure" and not self._decided:
            cause = "failure"  # the generation that answers a failure this node saw, whatever it says
        self._interruption, self._decided = cause, decided

    def charge(self, now: float, activity: Activity) -> tuple[str, str, float]:
        """Charge the time since the last charge to what the node was doing then, and note what it does now; returns
        (the category charged, its phase or "", seconds)."""
        (category, phase), spent = self._doing, max(0.0, now - self._at)
        self.seconds[category] += spent
        if phase:
            self.phases[category, phase] += spent
        self._at = now
        self._reported = self._reported or bool(activity.progress)
        steps = [record[0] for record in activity.progress.values() if record[1] == "step"]
        if steps:
            self._highest = max(self._highest, min(steps))
        self._doing = classify(activity, self._interruption, self._decided, self._highest, self._reported)
        return category, phase, spent

    def total(self) -> float:
        return sum(self.seconds.values())

    def line(self) -> str:
        """``goodput 91.2% (badput: failure 2.2s, start 1.9s)``: the share of the time charged that trained, and the
        causes charged at least 0.05 s, largest first ("" before any time was charged)."""
        total = self.total()
        if total <= 0:
            return ""
        causes = sorted(((s, c) for c, s in self.seconds.items() if c != PRODUCTIVE and s >= 0.05), reverse=True)
        badput = ", ".join(f"{cause} {spent:.1f}s" for spent, cause in causes) or "none"
        return f"goodput {100 * self.seconds[PRODUCTIVE] / total:.1f}% (badput: {badput})"
