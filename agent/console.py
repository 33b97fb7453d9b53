"""What the agent says on its console (:data:`pliant.logsetup.CONSOLE`): a line per world this node takes part in,
the last line when it exits, the status line of a long wait (:mod:`pliant.statusline`), and the line of a control
plane gone.

A world's line names the generation and why it came, the world size (before and after, in place), which nodes joined
and left since this node's last world, this node's ranks, and how long the change took from when this agent saw the
generation. A wait shows once it has lasted :data:`SHOW_WAIT_AFTER_S`: nodes below the job's minimum, a spare held at
the job's maximum, a hand-over in place waiting for its newcomers' workers, a state moving into a new world (its ranks
in the ``transfer`` phase, :mod:`pliant.progress`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pliant.agent.contract import AgentState
from pliant.agent.core import CoreState
from pliant.coordinator.contract import Generation, GenerationMember, JobState
from pliant.statusline import StatusLine

__all__ = ["SHOW_WAIT_AFTER_S", "Summary", "WaitLine", "awaited", "refused_lines", "unreachable"]

SHOW_WAIT_AFTER_S = 5.0
"""A wait shorter than this is not shown."""


def _count(number: int, noun: str, plural: str = "") -> str:
    return f"{number} {noun if number == 1 else plural or noun + 's'}"


@dataclass
class Summary:
    """This node's part in the job, for its console: a line per world it takes part in, and the last line (loop
    thread)."""

    started_at: float = field(default_factory=time.monotonic)
    steps: int = 0  # the highest step this node's workers completed
    worlds: list[int] = field(default_factory=list)  # the world sizes this node trained in, in order
    groups: int = 0  # worker groups started
    in_place: int = 0  # generations handed to running workers
    rescales: int = 0  # worlds this node went on in after its first, for a join or a leave
    recoveries: int = 0  # worlds this node went on in after its first, for a failure (a worker's or a lost node's)
    nodes: tuple[str, ...] = ()  # the nodes of the last world this node trained in
    seen_at: dict[int, float] = field(default_factory=dict)  # when this agent first saw each recent generation

    def seen(self, gen: Generation, now: float) -> None:
        """The agent saw ``gen`` (what a world line's time counts from)."""
        self.seen_at.setdefault(gen.number, now)
        for old in sorted(self.seen_at)[:-8]:
            del self.seen_at[old]

    def _world(self, gen: Generation) -> tuple[int, str]:
        """Record ``gen``'s world; returns the size before (0: none) and which nodes joined and left since."""
        if self.groups + self.in_place > 1:  # not this node's first world: a change, by its cause
            if gen.after_failure:
                self.recoveries += 1
            else:
                self.rescales += 1
        before = self.worlds[-1] if self.worlds else 0
        if before != gen.world_size:
            self.worlds.append(gen.world_size)
        joined = [node for node in gen.node_ids if self.nodes and node not in self.nodes]
        left = [node for node in self.nodes if node not in gen.node_ids]
        self.nodes = gen.node_ids
        changes = [f"{', '.join(joined)} joined"] * bool(joined) + [f"{', '.join(left)} left"] * bool(left)
        return before, f" ({'; '.join(changes)})" if changes else ""

    def _took(self, gen: Generation, now: float) -> str:
        return f"{max(0.0, now - self.seen_at.get(gen.number, now)):.1f}s"

    def started(self, gen: Generation, me: GenerationMember, now: float) -> str:
        """A worker group started for ``gen``: its console line."""
        self.groups += 1
        _, changes = self._world(gen)
        last = me.rank_offset + me.nproc - 1
        return (
            f"generation {gen.number} ({gen.reason}): world {gen.world_size}{changes}, ranks {me.rank_offset}..{last} "
            f"on this node, {_count(me.nproc, 'worker')} started in {self._took(gen, now)}"
        )

    def handed(self, gen: Generation, kept: int, started: int, now: float) -> str:
        """``gen`` handed to the running group in place: its console line."""
        self.in_place += 1
        before, changes = self._world(gen)
        return (
            f"generation {gen.number} ({gen.reason}): world {before} -> {gen.world_size}{changes} in place in "
            f"{self._took(gen, now)}, {_count(kept, 'worker')} kept, {started} started"
        )

    def line(self, job: str, outcome: str, now: float, goodput: str = "") -> str:
        """The last line: how the job ended for this node, and what it went through: its world sizes, the changes of
        world it went on through, by cause (rescales, for joins and leaves; recoveries, from failures), and its
        ``goodput`` (:meth:`pliant.agent.goodput.Goodput.line`; "": none)."""
        worlds = " -> ".join(map(str, self.worlds)) or "none"
        steps = f"{self.steps} steps in " if self.steps else ""  # a script without pliant.worker reports none
        return (
            f"job {job} {outcome}: {steps}{now - self.started_at:.1f}s on this node; world sizes {worlds}; "
            f"{_count(self.rescales, 'rescale')} and {_count(self.recoveries, 'recovery', 'recoveries')} from "
            f"failures, {self.in_place} of them in place" + (f"; {goodput}" if goodput else "")
        )


def awaited(state: CoreState, job: JobState | None, job_reason: str, min_nodes: int, now: float) -> tuple[str, str]:
    """What this node waits for, in a person's words, and a note that may change as it waits (("", "") when it waits
    for nothing worth a status line).

    Args:
        state: the agent's decision state.
        job: the job's state as last watched (None: not seen yet); ``job_reason`` its reason.
        min_nodes: the job's minimum as this node was told it (the job's own may differ).
        now: the executor's monotonic clock (a hand-over's grace is counted on it).
    """
    handing = state.handing
    if handing is not None and handing.handover is not None:
        left = max(0.0, handing.handover.deadline - now)
        newcomers = ", ".join(handing.handover.newcomers)
        what = f"generation {handing.generation.number}: waiting for {newcomers} to start their workers"
        return what, f"{left:.0f}s to go"
    group = state.group
    moving = [p for _, p in group.progress if p.phase == "transfer"] if group is not None else []
    if moving:
        return f"generation {moving[0].generation}: moving the state into the new world", f"{len(moving)} rank(s) here"
    if group is not None or state.lifecycle is not AgentState.WAITING:
        return "", ""
    if job is JobState.WAITING:
        return f"waiting for nodes: {job_reason or f'the job needs {min_nodes}'}", ""
    if state.reason.startswith("spare"):
        return f"waiting as a {state.reason}", "this node joins when a node leaves"
    if state.reason.startswith(("excluded", "left out")):
        return f"waiting: {state.reason}", "this node joins if the job can take it"
    return "", ""


def refused_lines(before: Generation | None, gen: Generation) -> list[str]:
    """The lines for the world sizes ``gen`` refuses that ``before`` (the generation this node saw last) did not:
    which size fails, with the script's error, and the size the job trains at instead."""
    known = {size for size, _error in before.refused} if before is not None else set()
    where = f"it trains at world {gen.world_size}" if gen.members else "it waits for nodes"
    return [
        f"world size {size} fails on every node with {error}; the job no longer takes that size ({where}). That is "
        f"the script's error at world {size}: see any node's worker log"
        for size, error in gen.refused
        if size not in known
    ]


@dataclass
class WaitLine:
    """The status line of what this node waits for (loop thread)."""

    line: StatusLine
    after_s: float = SHOW_WAIT_AFTER_S  # a shorter wait is not shown
    what: str = ""
    since: float = 0.0

    def update(self, what: str, note: str, now: float) -> None:
        """Show ``what`` (once awaited for ``after_s``), the time so far and ``note``; "" clears the line."""
        if what != self.what:
            if self.what:
                self.line.clear()
            self.what, self.since = what, now
        if what and now - self.since >= self.after_s:
            self.line.show(what, f"{now - self.since:.0f}s so far" + (f"; {note}" if note else ""), now)


def unreachable(node: str, targets: Sequence[str], seated: Sequence[str], down_s: float) -> str:
    """The one line an agent says once per control-plane outage: where the control plane was, what still works, and
    what brings it back.

    Args:
        node: this node's id.
        targets: the coordinators the agent calls.
        seated: the nodes that held the embedded control plane's seats, as the control plane last listed them (empty:
            a standalone deployment, or none listed).
        down_s: how long it has been unreachable.
    """
    if len(seated) > 1:
        where = (
            f"an embedded control plane on {len(seated)} nodes ({', '.join(seated)}): its etcd needs "
            f"{len(seated) // 2 + 1} of them"
        )
        fix = (
            "Start `pliant run` again (the join line) on the seats' nodes that are gone: each takes its seat back "
            "from its saved state, and the control plane is back once a majority of the seats runs"
        )
    elif seated:
        where = f"embedded in node {seated[0]}'s `pliant run`"
        fix = (
            f"Restart `pliant run` on node {seated[0]} with the same flags and --listen; a control plane that "
            f"outlives any node takes 3 seats (--nnodes with 3 nodes or more) or standalone replicas (README: "
            f"Guarantees and limits)"
        )
    else:
        where, fix = "its replicas", "Check that a coordinator replica runs and reaches etcd (pliant status)"
    return (
        f"agent {node}: the control plane at {','.join(targets)} ({where}) has been unreachable for {down_s:.0f}s; "
        f"the workers keep training, but no node can join or leave and the job's end cannot be recorded until it "
        f"is back. {fix}"
    )
