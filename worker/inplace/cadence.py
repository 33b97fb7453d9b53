"""How often the rescale protocol votes and a sharded engine takes its buddy snapshots: pure decisions.

Nothing here does I/O or reads a clock: :class:`Cadence` is given each committed step's duration and the commit
vote's all-reduced integers, and every rank derives the same steps from the same integers.

**Votes** (:mod:`pliant.rescale_vote`, the schedule the framework integrations vote on too). The commit vote that
carries "my agent asked for a rescale" comes about every :data:`~pliant.rescale_vote.VOTE_WITHIN_S`, from the slowest
rank's last step time, which the vote itself carries. The first step of a job or of a new world votes.

**Buddy snapshots** (:mod:`pliant.worker.inplace.buddy`; ``pliant run --snapshot-every auto``, the default). A snapshot
costs the training the copy of the rank's shard, its send to the buddy and the receipt of the wards' copies, all while
the step after it computes. What that costs depends on the machine: on a GPU the copy is a DMA on its own engine; on two
busy CPU cores, a memcpy and loopback TCP take the cores from the step. So K, the committed steps between snapshots
(and the most steps a peer's death makes the survivors run again), is chosen from the cost measured here, as CheckFreq
(FAST '21) chooses its checkpoints' frequency:

1. every rank measures its *snapshot cost*: by how much the step that took a snapshot and the next one (each from
   its start to the next step's start: the script's work between steps is in the steps' time) exceed an unaffected
   step (the median of this world's last :data:`_BASE_STEPS`, once it has :data:`_MIN_BASE`), in wall-clock time and
   in the process's CPU time, each the median of the last :data:`_SAMPLES` snapshots, once there are
   :data:`_MIN_SAMPLES` (a step held up by another process or by the kernel counts once, not as a trend); the
   smaller of the two, as a fraction of an unaffected step's wall-clock time. A snapshot cannot cost the training
   more time than it adds to the steps, nor, where the cores are what the training waits for, more than the CPU its
   copy, send and receive use; the CPU time is the steadier measure where other processes share the cores (the
   wall-clock time then swings by tens of percent from step to step), and the wall-clock time is the truer one where
   the copies use cores that would be idle (a GPU's host). Snapshots at a
   re-formation are not measured (the new world's first step has other costs), nor those that allocate their
   buffers (the first two of a world: the first touch of fresh pages costs several times a copy into a reused
   buffer);
2. from it, the rank asks for a K (:meth:`Cadence.wanted`): the smallest in [:data:`MIN_SNAPSHOT_EVERY`,
   :data:`MAX_SNAPSHOT_EVERY`] with cost / K <= :data:`SNAPSHOT_BUDGET` (:func:`snapshots_apart`), or K as it is
   while that is enough and at most half again as many steps; 0 before it has measured;
3. the vote carries it, all-reduced with max, and every rank takes the largest as K (:data:`FIRST_SNAPSHOT_EVERY`
   while no rank has measured: far enough apart that the steps between two snapshots give a clean base, past a
   job's first steps, which are slower). A fixed ``--snapshot-every K`` asks for K, so ranks started with different
   settings still agree.

K is a function of the all-reduced integer alone, so a newcomer (which has measured nothing) agrees with the
survivors from its first vote, the new world's first step, before that step's snapshot is due. A snapshot is due K
steps after the last one, which every rank of a world took at the same step.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque

from pliant.rescale_vote import VoteSchedule, ballot_us

__all__ = [
    "FIRST_SNAPSHOT_EVERY",
    "MAX_SNAPSHOT_EVERY",
    "MIN_SNAPSHOT_EVERY",
    "SNAPSHOT_BUDGET",
    "Cadence",
    "snapshots_apart",
]

logger = logging.getLogger(__name__)

SNAPSHOT_BUDGET = 0.015  # automatic K: the snapshots may take this fraction of the training's time ...
MIN_SNAPSHOT_EVERY = 4  # ... with K at least this (the steps between snapshots give the cost's base) ...
MAX_SNAPSHOT_EVERY = 64  # ... and at most this many steps (run again, at most, after a peer's death) ...
FIRST_SNAPSHOT_EVERY = 16  # ... and this many until some rank has measured the cost
_BASE_STEPS = 9  # an unaffected step's time: the median of this world's last this many
_MIN_BASE = 4  # ... once it has at least this many
_KEEP_WITHIN = 1.5  # K stays while it is at least what the cost needs and at most this many times it
_SAMPLES = 5  # a rank's snapshot cost: the median of its last this many snapshots' ...
_MIN_SAMPLES = 3  # ... once it has measured this many (one held-up step among them is then outvoted)


def snapshots_apart(cost: float | None, budget: float = SNAPSHOT_BUDGET) -> int:
    """Automatic K for a snapshot that costs ``cost`` of a step's time (None: no rank has measured it yet): the
    smallest K within [MIN_SNAPSHOT_EVERY, MAX_SNAPSHOT_EVERY] that keeps ``cost / K`` within ``budget``."""
    if cost is None:
        return FIRST_SNAPSHOT_EVERY
    return min(MAX_SNAPSHOT_EVERY, max(MIN_SNAPSHOT_EVERY, math.ceil(cost / budget - 1e-9)))


class Cadence:
    """One rank's votes and snapshots (see the module docstring). Owned by the rescale protocol.

    Args:
        snapshot_every: a fixed K (``--snapshot-every K``), or None for the automatic one.

    Attributes:
        every: K now (the same on every rank of a world).
        next_vote: the step of the next vote (the same on every rank).
        last_snapshot: the committed steps at this world's last snapshot (None: none yet).
        cost: this rank's measured snapshot cost, a fraction of a step (None: not measured yet).
    """

    def __init__(self, snapshot_every: int | None = None) -> None:
        self.fixed = snapshot_every
        self.every = snapshot_every or FIRST_SNAPSHOT_EVERY
        self.votes = VoteSchedule()
        self.last_snapshot: int | None = None
        self.last_step_s = 0.0
        self._measured = False  # the last snapshot was taken by a step (not at a re-formation)
        self._base: deque[tuple[float, float]] = deque(maxlen=_BASE_STEPS)  # this world's last unaffected steps'
        self._excess = (0.0, 0.0)  # the affected steps' (wall, CPU) seconds over the base, since the last snapshot
        self._costs: deque[tuple[float, float]] = deque(maxlen=_SAMPLES)  # the last snapshots' (wall, CPU) costs
        self._tick: tuple[int, float, float] | None = None  # the last step's start: (step, wall, CPU)

    @property
    def next_vote(self) -> int:
        """The step of the next vote (the same on every rank)."""
        return self.votes.next_vote

    @property
    def cost(self) -> float | None:
        """This rank's measured snapshot cost, a fraction of an unaffected step (None: not measured yet)."""
        return max(0.0, min(_medians(self._costs))) if len(self._costs) >= _MIN_SAMPLES else None

    def snapshot_due(self, steps_done: int) -> bool:
        """Whether the step that brought the committed steps to ``steps_done`` takes a snapshot."""
        return self.last_snapshot is None or steps_done - self.last_snapshot >= self.every

    def save_may_snapshot(self, steps_done: int) -> bool:
        """Whether a checkpoint of ``steps_done`` may take a snapshot the cadence did not (to write from it): at
        least half an interval after the last one, so it stands in for the next, which then comes an interval after
        it. The saves then add few exchanges with the buddies (a save sooner takes DCP's own copy)."""
        return self.last_snapshot is None or 2 * (steps_done - self.last_snapshot) >= self.every

    def took(self, steps_done: int, by_step: bool = True) -> None:
        """A snapshot was taken at ``steps_done``: by a step (``by_step``: its cost is measured), or at a
        re-formation or into new buffers (False)."""
        self.last_snapshot, self._measured, self._excess = steps_done, by_step, (0.0, 0.0)

    def reformed(self, steps_done: int) -> None:
        """A new world starts at ``steps_done``: it votes in its first step, and its steps have a new base."""
        self.votes.restart(steps_done)
        self._measured, self._tick = False, None
        self._base.clear()

    def tick(self, step: int, wall_s: float, cpu_s: float) -> None:
        """Step ``step`` (0-based) starts at ``wall_s`` on a monotonic clock, when the process (every thread) had used
        ``cpu_s`` of CPU time. The time from the previous step's start, when that was step ``step - 1`` of this world,
        is that step's: its snapshot, if it took one, and the script's own work between steps included."""
        last, self._tick = self._tick, (step, wall_s, cpu_s)
        if last is None or last[0] != step - 1:
            return
        seconds, cpu_seconds = wall_s - last[1], cpu_s - last[2]
        self.last_step_s = seconds
        if self.last_snapshot is None:
            return
        place = step - self.last_snapshot  # of step - 1: 0 took the snapshot; 1 is the next one (the copy ran)
        sample = (seconds, cpu_seconds)
        if place >= 2:
            self._base.append(sample)
        elif place >= 0 and self._measured and len(self._base) >= _MIN_BASE:
            base = _medians(self._base)
            self._excess = (self._excess[0] + seconds - base[0], self._excess[1] + cpu_seconds - base[1])
            if place == 1:  # noise either way: the cost is clamped only when it is used
                self._costs.append((self._excess[0] / base[0], self._excess[1] / base[0]))

    def wanted(self) -> int:
        """The K this rank asks for: the fixed one; 0 (no opinion) before it measured; else what its cost needs,
        or K as it is while that is enough and not more than :data:`_KEEP_WITHIN` times as many steps (a cost that
        wavers around a boundary does not move K back and forth)."""
        if self.fixed is not None:
            return self.fixed
        cost = self.cost
        if cost is None:
            return 0
        needed = snapshots_apart(cost)
        return self.every if needed <= self.every <= max(needed * _KEEP_WITHIN, MIN_SNAPSHOT_EVERY) else needed

    def ballot(self) -> tuple[int, int]:
        """This rank's two integers for the vote: its last step time (µs) and the K it asks for (:meth:`wanted`)."""
        return ballot_us(self.last_step_s), self.wanted()

    def agreed(self, step: int, slowest_us: int, every: int) -> None:
        """The vote of ``step`` gave the slowest rank's last step time and the largest K asked for (0: no rank has
        measured): set the next vote's step and K."""
        self.votes.agreed(step, slowest_us)
        every = every or FIRST_SNAPSHOT_EVERY
        if every != self.every:
            cost = self.cost
            logger.info(
                "buddy snapshots every %d steps from step %d (here a snapshot costs %s of a step; budget %.1f%%)",
                every,
                step,
                "?" if cost is None else f"{100 * cost:.1f}%",
                100 * SNAPSHOT_BUDGET,
            )
        self.every = every


def _medians(samples: deque[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)
