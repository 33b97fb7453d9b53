"""The agent's decisions as one state machine: ``decide(state, event, now) -> (state, actions)``.

No I/O and no clock: :mod:`pliant.agent.agent` (the executor) turns what happens (a generation from the watch, a
worker exit, a heartbeat's outcome, a signal, a store port read, the workers' progress on each tick) into events
(:mod:`pliant.agent.events`), calls :func:`decide`, and performs the actions it returns (:mod:`pliant.agent.actions`),
in order. Everything here is unit-tested with a fake clock and no processes.

The agent is in one phase at a time, and each phase carries its own data (:data:`Phase`): :class:`Joining`,
:class:`Waiting` (not in the world), :class:`Starting` (a group of a generation waits for its store port),
:class:`Running` (a worker group runs), :class:`HandingOver` (the running group waits for a generation's store port or
its newcomers before it is handed that generation in place), :class:`Leaving` (the node left; its workers run until
the world without it is published), :class:`pliant.agent.stopping.Stopping` (a group is being stopped; what follows
waits for it) and :class:`Ended`. Around them, :class:`CoreState` keeps what holds across phases: the newest
generation seen, the membership's renewals, the step times and the newest generation a step completed in. The
lifecycle a phase reports (:class:`pliant.agent.contract.AgentState`) and the transitions allowed between lifecycles
are in :mod:`pliant.agent.contract`.

The rules:

- **Generations**: with ``--rescale in-place`` and a group whose workers all announced that they re-form in place
  (pliant.worker; see :mod:`pliant.worker.inplace.protocol`), a newer generation that keeps this node *reconfigures* the
  running group: each live worker gets its new env as a directive, and a local rank whose worker died gets a fresh
  worker, which takes its state from the survivors. Otherwise the newer generation stops the running group (asking
  workers to checkpoint first: the restart path) and starts this node's workers if it is a member. As node rank 0 it
  opens the generation's store before stopping or reconfiguring its old group, so joining nodes never wait for it to
  learn the port.
- **Hand-over to newcomers**: a generation that admits new nodes is handed to the running group only once the
  newcomers' workers counted themselves in at the generation's store, so the survivors train on while the newcomers
  start; meanwhile their agents are probed, and a newcomer this node cannot reach is reported instead
  (:mod:`pliant.agent.handover`'s rules). On each tick while a hand-over waits, the executor is asked to read the
  arrivals (:class:`ReadArrivals`); when a probe is due it probes (:class:`ProbeNewcomers`), and the verdict hands the
  generation over (:class:`Reconfigure`) or reports the newcomers it cannot reach.
- **Failures in place**: when a worker of such a group dies, the failure is reported and the other local workers
  keep their processes (they wait for the next generation). A worker that writes the ``wait`` phase saw a peer fail
  mid-step: its agent reports a failure for that generation at once, naming peers whose agents do not answer, so the
  coordinator evicts a dead node without waiting for its lease.
- **Static stability**: the coordinator being away changes nothing by itself. Workers keep training; reports are
  queued and sent when it answers again (the executor retries them in the background); the agent never exits because
  of it.
- **Self-fencing**: when this agent cannot renew its membership for ``FENCE_AFTER`` heartbeat TTLs, it asks its
  peers' agents how long they have been renewing theirs without a break, and the newest generation they have seen;
  if one has renewed for ``FENCE_AFTER`` TTLs, the control plane has answered others for longer than the grace it
  gives everyone after an outage, so this node may have been evicted; once a peer has seen a generation newer than
  this node's group, it was: it stops its workers, so no zombie world trains on. While the peers still see this
  group's generation, nobody evicted it (a leader that took over, or got etcd back, waits a TTL first), and its
  workers are still the world's: they keep going. Otherwise the control plane is down (or just back) for everyone,
  and the workers keep going. A world with no peer to ask (one node) is
  fenced by the checkpoint directory instead: once a newer generation opened it (its fence file), the old group is
  stopped (and reported), and its commits are refused anyway. A new incarnation of the job (started again after every
  node was lost) takes the directory over; the fence then stops any world of the older one.
- **Store ports**: a group starts, or is handed a generation in place, once the generation's store port is known:
  node rank 0 opens the store itself (:class:`Prepare`), any other node reads the port from node rank 0's agent store
  in the background (:class:`ReadStorePort`), so the loop never waits for a node rank 0 that is slow to stop its old
  group, or dead. Both are answered with :class:`StorePortRead`; a port that could not be read fails the start.
- **Stopping is a phase**: a group is stopped in stages with deadlines (:mod:`pliant.agent.stopping`): the executor
  starts each stage when told (:class:`Stop`, then :class:`Escalate` once a tick finds the stage's deadline passed)
  and never waits; it reports the group gone (:class:`GroupStopped`). What needs the old workers gone (the next
  group's :class:`Start`, :class:`Leave`, :class:`Exit`, and whatever was decided after them) waits in the
  :class:`pliant.agent.stopping.Stopping` phase until then.
- **Hangs**: workers write their step and phase (start, step, save, done) to a progress file. A rank in the step
  phase that makes no progress for the hang timeout (by default ``HANG_MULTIPLE`` x the median step time, at least
  ``HANG_FLOOR_S``), or that stays in the start or save phase for the start timeout, is hung: the agent dumps every
  worker's stacks, stops the group and reports a failure, so the job recovers as from any failure. Workers that never
  write progress (scripts without pliant.worker) are not watched.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import ClassVar

from pliant.agent.actions import (
    Action,
    Dump,
    Escalate,
    Exit,
    Leave,
    Prepare,
    ProbeNewcomers,
    ProbePeers,
    ReadArrivals,
    ReadStorePort,
    Reconfigure,
    Report,
    Send,
    Start,
    Stop,
)
from pliant.agent.contract import AgentState, ExitCode, left_on
from pliant.agent.events import (
    ArrivalsRead,
    Event,
    GenerationSeen,
    GroupExited,
    GroupStopped,
    HeartbeatFailed,
    HeartbeatOk,
    JobFinished,
    Joined,
    LeaseLost,
    NewcomersProbed,
    PeersProbed,
    SignalReceived,
    StartFailed,
    StopStarted,
    StorePortRead,
    Tick,
)
from pliant.agent.handover import HandOver, probe_due, probed
from pliant.agent.stopping import Graces, Stopping, StopStage, begin, defer, escalated, first_stage
from pliant.coordinator.contract import FailureCause, Generation, GenerationMember, JobState
from pliant.fence import Fence

__all__ = [
    "FENCE_AFTER",
    "HANG_FLOOR_S",
    "HANG_MULTIPLE",
    "LEAVE_WAIT_S",
    "CoreConfig",
    "CoreState",
    "Ended",
    "Group",
    "HandingOver",
    "Joining",
    "Leaving",
    "Phase",
    "RankProgress",
    "Running",
    "Starting",
    "Stopping",
    "Waiting",
    "decide",
    "hang_timeout",
    "left_out",
    "renewal_streak",
    "ticks_quickly",
    "wants_port",
]

HANG_FLOOR_S = 60.0
HANG_MULTIPLE = 10.0
# Peers are asked after this many TTLs without a renewal, and a peer's unbroken renewals must have lasted as long: a
# returning coordinator gives every member one TTL before it evicts anyone, and nodes reconnect at different moments,
# so a shorter streak does not yet show that this node alone is cut off.
FENCE_AFTER = 1.5
DONE_UNHEARD_S = 15.0  # workers done and the control plane unreachable this long (and 3 TTLs): the agent exits 0
LEAVE_WAIT_S = 5.0  # a leaving node's workers wait at most this long for the world without it to be published
_STEP_SAMPLES = 64  # recent step intervals the median is taken over


@dataclass(frozen=True)
class CoreConfig:
    """The timings the decisions use (from :class:`pliant.agent.contract.AgentConfig`).

    Attributes:
        hang_timeout_s: no step progress for this long is a hang (None: automatic, see :func:`hang_timeout`).
        start_timeout_s: no first step (or a checkpoint save, or a wait for the next generation) for this long is a
            hang; 0 disables it.
        rescale_in_place: ``--rescale in-place``: reconfigure groups that can (False: always the restart path).
        graces: how long each stage of a stop may last; the rescale grace is also how long a hand-over in place
            waits for its newcomers before a last probe decides.
        max_nodes: the job's maximum node count as this node was told it (0: unknown): a node left out of a world
            that has this many is a spare.
    """

    hang_timeout_s: float | None = None
    start_timeout_s: float = 600.0
    rescale_in_place: bool = False
    graces: Graces = field(default_factory=Graces)
    max_nodes: int = 0


@dataclass(frozen=True)
class RankProgress:
    """A local rank's progress as last read: ``step`` and ``phase``, first seen at ``since``; the generation a
    "wait" or a "transfer" names (a new wait at the same step is a new record)."""

    step: int
    phase: str
    since: float
    generation: int = 0


@dataclass(frozen=True)
class Group:
    """This node's worker group of one generation.

    Attributes:
        number: the generation the workers run, or were last handed in place.
        members: the node ids of the generation the workers last formed (or were handed).
        progress: the local ranks' progress, as last read.
        ready: every live worker announced that it re-forms in place.
        handed: the generation last handed to these workers in place (None: none).
    """

    number: int
    members: tuple[str, ...] = ()
    progress: tuple[tuple[int, RankProgress], ...] = ()
    ready: bool = False
    handed: int | None = None


# -- phases ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Joining:
    """Joining the job (first, or again after the membership was lost). ``done``: this node's workers completed the
    job's work before the membership was lost."""

    done: bool = False
    lifecycle: ClassVar[AgentState] = AgentState.JOINING


@dataclass(frozen=True)
class Waiting:
    """A member with no workers: not in the world (spare, left out, excluded), or between worlds. ``done``: every
    worker of this node exited 0, and the job's end is not seen yet."""

    done: bool = False
    lifecycle: ClassVar[AgentState] = AgentState.WAITING


@dataclass(frozen=True)
class Starting:
    """``generation`` includes this node: its ``group`` starts once the generation's store port is read."""

    generation: Generation
    group: Group
    lifecycle: ClassVar[AgentState] = AgentState.RUNNING


@dataclass(frozen=True)
class Running:
    """This node's worker ``group`` runs."""

    group: Group
    lifecycle: ClassVar[AgentState] = AgentState.RUNNING


@dataclass(frozen=True)
class HandingOver:
    """The running ``group`` is handed ``generation`` in place once its store ``port`` is known and, when it admits
    newcomers, once they counted themselves in (``handover``: their wait, its deadline and probes; None: no
    newcomers). The workers train on in their generation meanwhile.

    ``restart``: a join by the restart path. The group runs its own generation (``group.number``) until the
    newcomers are warm (their agents count their workers in once their zygote's imports are done), then is stopped
    for the rescale and ``generation``'s group started: the survivors pause for the save and the restart only, not
    for the newcomers' imports."""

    group: Group
    generation: Generation
    port: int | None = None
    handover: HandOver | None = None
    restart: bool = False
    lifecycle: ClassVar[AgentState] = AgentState.RUNNING


@dataclass(frozen=True)
class Leaving:
    """The node left the job on signal ``signum``; its ``group`` runs until the world without it is published, or
    until ``deadline``."""

    group: Group
    signum: int
    deadline: float
    lifecycle: ClassVar[AgentState] = AgentState.LEAVING


@dataclass(frozen=True)
class Ended:
    """The agent is done: the job ``SUCCEEDED`` or ``FAILED``, or the node ``LEFT``. Terminal."""

    outcome: AgentState

    @property
    def lifecycle(self) -> AgentState:
        return self.outcome


Phase = Joining | Waiting | Starting | Running | HandingOver | Leaving | Stopping | Ended
"""The agent's phase; :class:`pliant.agent.stopping.Stopping` wraps the phase that follows the stop."""


@dataclass(frozen=True)
class CoreState:
    """What the agent knows: its ``phase`` and what holds across phases.

    Attributes:
        node_id: this node's id.
        phase: the phase the agent is in (:data:`Phase`).
        generation: the newest generation seen.
        ttl_s: the membership's heartbeat TTL.
        renewed_at: when the membership was last renewed.
        renewing_since: start of the current unbroken run of renewals (None: failing).
        probed_at: when the peers were last asked how long they renew (self-fencing).
        step_intervals: recent step intervals, for the automatic hang timeout.
        trained_in: the newest generation a worker of this node was seen to complete a step in.
        reason: why the agent is in its phase, in a person's words.
        config: the timings.
    """

    node_id: str
    phase: Phase = field(default_factory=Joining)
    generation: Generation | None = None
    ttl_s: float = 10.0
    renewed_at: float = 0.0
    renewing_since: float | None = None
    probed_at: float = -1e18
    step_intervals: tuple[float, ...] = ()
    trained_in: int = 0
    reason: str = ""
    config: CoreConfig = field(default_factory=CoreConfig)

    @property
    def lifecycle(self) -> AgentState:
        """The lifecycle state the agent reports (:class:`pliant.agent.contract.AgentState`)."""
        return self.phase.lifecycle

    @property
    def current(self) -> Phase:
        """The phase decisions are made in: the phase that follows a stop while a group stops."""
        return self.phase.after if isinstance(self.phase, Stopping) else self.phase

    @property
    def group(self) -> Group | None:
        """This node's worker group (one only planned, while it starts, included)."""
        phase = self.current
        return phase.group if isinstance(phase, (Starting, Running, HandingOver, Leaving)) else None

    @property
    def stopping(self) -> Stopping | None:
        """The stop in progress, if a group is being stopped."""
        return self.phase if isinstance(self.phase, Stopping) else None

    @property
    def handing(self) -> HandingOver | None:
        """The hand-over in place that waits, if any."""
        phase = self.current
        return phase if isinstance(phase, HandingOver) else None


# -- decisions ---------------------------------------------------------------------------------------------------------


def decide(state: CoreState, event: Event, now: float) -> tuple[CoreState, list[Action]]:
    """The agent's next state and the actions to perform, in order, for ``event`` at agent-clock time ``now``."""
    phase = state.phase
    if isinstance(phase, Stopping):
        return _while_stopping(state, phase, event, now)
    if isinstance(event, (GroupStopped, StopStarted)) or isinstance(phase, Ended):
        return state, []
    state, actions = _decide(state, event, now, stopping=False)
    at = next((i for i, action in enumerate(actions) if isinstance(action, Stop)), None)
    if at is None:
        return state, actions
    stop = actions[at]
    assert isinstance(stop, Stop)
    stage = first_stage(stop.rescale, stop.finish, stop.hung, stop.failed)
    # What follows the stop waits for the group to be gone (:mod:`pliant.agent.stopping`).
    stopping = begin(stage, state.config.graces, now, tuple(actions[at + 1 :]), after=state.phase)
    return replace(state, phase=stopping), actions[: at + 1]


def _while_stopping(state: CoreState, phase: Stopping, event: Event, now: float) -> tuple[CoreState, list[Action]]:
    """:func:`decide` while a group stops: the stop's own events and deadlines, and every other event decided in the
    phase that follows, with what must wait for the group to be gone queued."""
    if isinstance(event, GroupStopped):  # what waited for the group to be gone
        return replace(state, phase=phase.after), list(phase.then)
    if isinstance(event, StopStarted):
        return replace(state, phase=begin(event.stage, state.config.graces, now, phase.then, phase.after)), []
    escalate: list[Action] = []
    if isinstance(event, Tick):  # a stage's deadline passed: the next stage
        following = escalated(phase, state.config.graces, now)
        if following is not None and following.stage is StopStage.GONE:
            return replace(state, phase=phase.after), [Escalate(StopStage.GONE), *phase.then]
        if following is not None:
            phase, escalate = following, [Escalate(following.stage)]
    if isinstance(phase.after, Ended):
        return replace(state, phase=phase), escalate
    state, actions = _decide(replace(state, phase=phase.after), event, now, stopping=True)
    actions, then = defer(phase.then, actions)
    return replace(state, phase=replace(phase, then=then, after=state.phase)), [*escalate, *actions]


def _decide(state: CoreState, event: Event, now: float, stopping: bool) -> tuple[CoreState, list[Action]]:
    """The decision for ``event`` in the current phase (``stopping``: an earlier group is still being stopped)."""
    if isinstance(state.phase, Leaving):
        return _leaving(state, state.phase, event, now)
    if isinstance(event, SignalReceived):
        return _on_signal(state, event, now, stopping)
    handler = _HANDLERS.get(type(event))
    if handler is None:
        raise TypeError(f"unknown agent event {event!r}")
    return handler(state, event, now)


def _enter(state: CoreState, phase: Phase, reason: str = "") -> CoreState:
    return replace(state, phase=phase, reason=reason or state.reason)


def _with_group(state: CoreState, group: Group) -> CoreState:
    """``state`` with its phase's group replaced by ``group``."""
    return replace(state, phase=replace(state.phase, group=group))  # type: ignore[type-var]


def hang_timeout(state: CoreState) -> float:
    """The step-phase hang timeout: the configured one, else ``HANG_MULTIPLE`` x the median step interval seen,
    at least ``HANG_FLOOR_S``."""
    if state.config.hang_timeout_s is not None:
        return state.config.hang_timeout_s
    median = statistics.median(state.step_intervals) if state.step_intervals else 0.0
    return max(HANG_FLOOR_S, HANG_MULTIPLE * median)


def renewal_streak(state: CoreState, now: float) -> float:
    """How long this agent has renewed its membership without a break (-1: it is not renewing now). Peers read it."""
    if state.renewing_since is None or now - state.renewed_at > state.ttl_s:
        return -1.0
    return now - state.renewing_since


def ticks_quickly(state: CoreState) -> bool:
    """Whether the agent wants its ticks often: a hand-over waits for its newcomers, or a group stops (each tick may
    hand over, or enter the next stage)."""
    return state.handing is not None or state.stopping is not None


def wants_port(state: CoreState, generation: int) -> bool:
    """Whether the agent still waits for ``generation``'s store port (a background reader stops once not)."""
    phase = state.current
    if isinstance(phase, Starting):
        return phase.generation.number == generation
    return isinstance(phase, HandingOver) and phase.port is None and phase.generation.number == generation


def _renewed(state: CoreState, now: float) -> CoreState:
    unbroken = state.renewing_since is not None and now - state.renewed_at <= state.ttl_s
    return replace(state, renewed_at=now, renewing_since=state.renewing_since if unbroken else now)


def _moves_in_place(state: CoreState) -> bool:
    """Whether this node's running group takes the next generation in its processes: ``--rescale in-place``, and
    every worker announced that it takes directives."""
    phase = state.current
    return state.config.rescale_in_place and isinstance(phase, (Running, HandingOver)) and phase.group.ready


def _port_of(gen: Generation, mine: GenerationMember) -> Action:
    """How this node learns ``gen``'s store port: node rank 0 opens the store, any other node reads its port."""
    return Prepare(gen) if mine.node_rank == 0 else ReadStorePort(gen)


def _on_joined(state: CoreState, event: Joined, now: float) -> tuple[CoreState, list[Action]]:
    state = _renewed(replace(state, ttl_s=event.ttl_s, renewing_since=None), now)
    phase = state.phase
    if isinstance(phase, Joining):
        phase = Waiting(done=phase.done)
    return _enter(state, phase, "joined"), []


def _on_generation(state: CoreState, event: GenerationSeen, now: float) -> tuple[CoreState, list[Action]]:
    gen = event.generation
    prior = state.generation
    if prior is not None and gen.number <= prior.number:
        return state, []
    state = replace(state, generation=gen)
    mine = next((m for m in gen.members if m.node_id == state.node_id), None)
    actions: list[Action] = [_port_of(gen, mine)] if mine is not None else []
    ids = tuple(m.node_id for m in gen.members)
    group = state.group
    if mine is not None and group is not None and _moves_in_place(state):
        ranks = f"ranks {mine.rank_offset}..{mine.rank_offset + mine.nproc - 1}"
        # The same processes: their progress carries on (a rank still in "wait" waits for this very generation).
        group = replace(group, number=gen.number, handed=gen.number)
        why = f"generation {gen.number} in place, {ranks}"
        known = set(group.members) or set(ids)  # an unknown group's world: no newcomers
        newcomers = tuple(node for node in ids if node not in known)
        needed = sum(m.nproc for m in gen.members if m.node_id in newcomers)
        if needed:  # handed over once the newcomers counted themselves in (the survivors train on meanwhile)
            handing = HandingOver(group, gen, None, HandOver(newcomers, needed, now + state.config.graces.rescale_s))
            return _enter(state, handing, f"{why}, once {', '.join(newcomers)} arrive"), actions
        return _enter(state, HandingOver(replace(group, members=ids), gen), why), actions
    current = state.current
    training = (
        current if isinstance(current, Running) or (isinstance(current, HandingOver) and current.restart) else None
    )
    if mine is not None and training is not None and gen.reason == "join" and training.group.members:
        # A join by the restart path (or another while one waits): the workers train on until the newcomers to their
        # world are warm.
        newcomers = tuple(node for node in ids if node not in set(training.group.members))
        needed = sum(m.nproc for m in gen.members if m.node_id in newcomers)
        if needed:
            wait = HandOver(newcomers, needed, now + state.config.graces.rescale_s)
            handing = HandingOver(training.group, gen, None, wait, restart=True)
            why = f"generation {gen.number} by the restart path once {', '.join(newcomers)} warmed up"
            return _enter(state, handing, why), actions
    stranded = False
    if group is not None:
        # Dropped from a world that goes on in place (evicted, or a spare again): the workers hand over and leave at
        # the step boundary, as in a graceful leave, so the others re-form without a restart. Workers that all wait
        # after a failed step have no boundary left to hand over at (their world broke; the next goes on without
        # them), and may sit in a meeting with a peer they cannot reach: they are stopped at once.
        # A world the job replaced because it failed (a worker died, a node was lost) can save nothing: its workers
        # are aborted, and the next world restores from the last checkpoint. A node lost from a world this group
        # never ran (a newcomer that never arrived while the group waited for it) broke nothing of its own: it saves.
        leave = mine is None and bool(gen.members) and _moves_in_place(state)
        stranded = leave and bool(group.progress) and all(p.phase == "wait" for _, p in group.progress)
        unjoined = prior is not None and group.number < prior.number and bool(group.members)
        intact = gen.reason == "failure" and unjoined and set(group.members) <= set(ids)
        if stranded:
            actions.append(Stop())
        elif not leave and gen.after_failure and not intact:
            actions.append(Stop(failed=True))
        else:
            actions.append(Stop(rescale=True, leave=leave))
    if mine is None:
        why = left_out(state, gen)
        why += "; workers that waited after a failed step stopped" if stranded else ""
        return _enter(state, Waiting(), why), actions
    ranks = f"ranks {mine.rank_offset}..{mine.rank_offset + mine.nproc - 1}"
    return _enter(state, Starting(gen, Group(gen.number, ids)), f"generation {gen.number}, {ranks}"), actions


def left_out(state: CoreState, gen: Generation) -> str:
    """Why this node is not in ``gen``'s world, in a person's words: excluded for its own failures, left out of a
    world size the job refuses, a spare at the job's maximum, or waiting to be admitted."""
    if not gen.members:
        return "the job waits for more nodes"
    mine = next(((count, error) for node, count, error in gen.excluded if node == state.node_id), None)
    if mine is not None:
        count, error = mine
        return f"excluded after {count} worker failures on this node: {error or 'no error given'}"
    full = state.config.max_nodes and len(gen.members) >= state.config.max_nodes
    if gen.refused and not full:
        sizes = ", ".join(str(size) for size, _error in gen.refused)
        return (
            f"left out: the job no longer takes world size {sizes} (it fails on every node); it trains at world "
            f"{gen.world_size} without this node"
        )
    if full:
        return "spare: the job is at max nodes"
    return "waiting to be admitted to the job's next world"


def _on_port(state: CoreState, event: StorePortRead, now: float) -> tuple[CoreState, list[Action]]:
    """A generation's store port: the group that waited for it starts, or is handed the generation in place."""
    if not wants_port(state, event.generation):
        return state, []
    phase = state.current
    if not event.port and isinstance(phase, HandingOver) and phase.restart:  # the old world trains: saved first
        report = _failure(state, event.generation, FailureCause.START_FAILED, event.error or "no store port")
        why = f"cannot start generation {event.generation}: {event.error or 'no store port'}"
        return _enter(state, Waiting(), why), [Stop(rescale=True), Send(report)]
    if not event.port:
        return _on_start_failed(state, StartFailed(event.generation, event.error or "no store port"), now)
    if isinstance(phase, Starting):
        return _enter(state, Running(phase.group)), [Start(phase.generation, event.port)]
    assert isinstance(phase, HandingOver)
    if phase.handover is None:
        return _enter(state, Running(phase.group)), [Reconfigure(phase.generation, event.port)]
    return _enter(state, replace(phase, port=event.port)), []


def _on_start_failed(state: CoreState, event: StartFailed, now: float) -> tuple[CoreState, list[Action]]:
    group = state.group
    if group is None or group.number != event.generation:
        return state, []
    report = _failure(state, event.generation, FailureCause.START_FAILED, event.message)
    return _enter(state, Waiting(), f"cannot start: {event.message}"), [Stop(), Send(report)]


def _on_exit(state: CoreState, event: GroupExited, now: float) -> tuple[CoreState, list[Action]]:
    result = event.result
    group = state.group
    if group is None or result.stopped:
        return state, [Stop()]  # not the group this state runs: just reap it
    handing = state.handing
    if handing is not None and handing.restart and result.generation == group.number:
        return _exit_while_warming(state, handing, event)
    if result.generation != group.number:
        if group.handed != group.number:
            return state, [Stop()]  # a group of an earlier generation: just reap it
        # The running group, handed generation ``group.number`` in place and not re-formed there yet (the executor
        # waits for newcomers): its exit is that generation's, or the failure report would be stale and lost.
        result = replace(result, generation=group.number)
    failure = result.first_failure
    if failure is not None and event.alive and _moves_in_place(state):
        # The other local workers keep their processes and state; the next generation replaces the dead one.
        message = event.message or f"exit code {failure[1]}"
        report = _failure(state, result.generation, FailureCause.EXITED, message, failure[1], event.error)
        return _enter(state, state.phase, f"worker failure reported; {event.alive} workers wait in place"), [
            Send(report)
        ]
    if result.succeeded:
        # Workers handed a generation in place that ran the job's last steps in the world before it, while its
        # newcomers' workers started, complete it untrained: the coordinator then does not wait for the newcomers,
        # whose workers can never train in it.
        untrained = group.handed == result.generation and 0 < state.trained_in < result.generation
        report = Report("success", result.generation, untrained=untrained)
        return _enter(state, Waiting(done=True), "workers done; waiting for the job to finish"), [Stop(), Send(report)]
    if result.saved_for_rescale:
        gen = state.generation
        mine = next((m for m in gen.members if m.node_id == state.node_id), None) if gen is not None else None
        if gen is not None and mine is not None and group.handed == result.generation == gen.number:
            # Handed this generation in place, the world took the restart path instead (an engine that cannot move
            # in place, or another node's group could not): fresh workers restore from the checkpoint.
            restarted = Starting(gen, Group(gen.number, handed=group.handed))
            why = f"generation {gen.number} restarted from the checkpoint"
            return _enter(state, restarted, why), [_port_of(gen, mine), Stop()]
        return _enter(state, Waiting(), f"workers of generation {result.generation} saved for a rescale"), [Stop()]
    return _group_failed(state, result.generation, event)


def _exit_while_warming(state: CoreState, handing: HandingOver, event: GroupExited) -> tuple[CoreState, list[Action]]:
    """The running group ended while a join by the restart path waited for its newcomers: saved for a rescale (another
    node's request reached every rank), the change goes ahead; its end or its failure is the new generation's, the
    one the coordinator runs (the newcomers never trained in it)."""
    result, gen = event.result, handing.generation
    if result.saved_for_rescale:
        return _restart_into(state, handing, f"the workers of generation {result.generation} saved for a rescale")
    if result.succeeded:
        report = Report("success", gen.number, untrained=True)
        return _enter(state, Waiting(done=True), "workers done; waiting for the job to finish"), [Stop(), Send(report)]
    return _group_failed(state, gen.number, event)


def _group_failed(state: CoreState, generation: int, event: GroupExited) -> tuple[CoreState, list[Action]]:
    """A worker of the group failed: ``generation``'s failure is reported, and the group's world aborted."""
    failure = event.result.first_failure
    code = failure[1] if failure else 1
    message = event.message or f"a worker exited with code {code}"
    report = _failure(state, generation, FailureCause.EXITED, message, code, event.error)
    # Reported before the abort ends: the other nodes abort their workers of the lost world meanwhile.
    return _enter(state, Waiting(), "worker failure reported"), [Send(report), Stop(failed=True)]


def _fenced_by(state: CoreState, fence: Fence | None) -> str:
    """Why the checkpoint directory's ``fence`` says that this node's running world was superseded ("" if not)."""
    gen, group = state.generation, state.group
    if fence is None or group is None or gen is None or fence.job != gen.job_id:
        return ""
    if not fence.supersedes(gen.incarnation, group.number):
        return ""
    if fence.owner.incarnation == gen.incarnation:
        return (
            f"fenced: generation {fence.owner.generation} owns the checkpoint directory, this group runs {group.number}"
        )
    return (
        f"fenced: another incarnation of job {gen.job_id} (started again) took the checkpoint directory over; "
        f"this world (generation {group.number}) stops"
    )


def _failure(
    state: CoreState, generation: int, cause: FailureCause, message: str, exit_code: int = 0, error: str = ""
) -> Report:
    """A failure report of ``generation`` (``exit_code``: a worker's, when it exited; ``error``: the exception it
    died of), saying whether this node's workers trained a step in it."""
    return Report("failure", generation, exit_code, message, state.trained_in >= generation, cause, error=error)


def _watch_progress(state: CoreState, tick: Tick, now: float) -> tuple[CoreState, list[Action]]:
    """Track each rank's progress (and the newest generation a step completed in); a hung rank fails the group."""
    group = state.group
    if group is None:
        return state, []
    before = dict(group.progress)
    progress: dict[int, RankProgress] = {}
    intervals = list(state.step_intervals)
    waiting: list[int] = []  # ranks that entered the "wait" phase since the last tick
    trained_in = state.trained_in
    for rank, record in tick.progress.items():
        step, phase, generation = record if len(record) == 3 else (*record, 0)
        if phase == "step":
            trained_in = max(trained_in, generation)
        old = before.get(rank)
        if old is not None and (old.step, old.phase, old.generation) == (step, phase, generation):
            progress[rank] = old
            continue
        if phase == "wait":
            waiting.append(rank)
        if old is not None and old.phase == "step" and phase == "step" and step > old.step:
            intervals.append((now - old.since) / (step - old.step))
        progress[rank] = RankProgress(step, phase, now, generation)
    group = replace(group, progress=tuple(sorted(progress.items())), ready=tick.ready)
    state = replace(_with_group(state, group), step_intervals=tuple(intervals[-_STEP_SAMPLES:]), trained_in=trained_in)
    limit = hang_timeout(state)
    start_limit = state.config.start_timeout_s
    for rank, p in sorted(progress.items()):
        idle = now - p.since
        if p.phase == "step" and idle > limit:
            why = f"local rank {rank} made no progress for {idle:.0f}s after step {p.step} (hang timeout {limit:g}s)"
        elif p.phase in ("start", "save", "wait", "transfer") and start_limit and idle > start_limit:
            what = {
                "start": "its first step",
                "save": f"the checkpoint save after step {p.step}",
                "wait": f"waiting for the next generation after step {p.step}",
                "transfer": f"moving the state into generation {p.generation} after step {p.step}",
            }[p.phase]
            why = f"local rank {rank} spent {idle:.0f}s on {what} (start timeout {start_limit:g}s)"
        else:
            continue
        report = _failure(state, group.number, FailureCause.HUNG, f"hang: {why}")
        return _enter(state, Waiting(), f"hang detected: {why}"), [Dump(why), Stop(hung=True), Send(report)]
    if waiting:
        message = f"local rank {min(waiting)} saw a peer fail mid-step and waits in place for the next generation"
        state = _enter(state, state.phase, "a peer failed; waiting in place")
        return state, [Send(_failure(state, group.number, FailureCause.WAITING, message))]  # no worker of ours failed
    return state, []


def _done_unheard(state: CoreState, now: float) -> bool:
    """Every worker of this node exited 0, and nothing has been heard from the control plane for DONE_UNHEARD_S (and
    three TTLs): nothing is left to do here, and no one may ever say that the job finished."""
    if not isinstance(state.phase, Waiting) or not state.phase.done or state.renewing_since is not None:
        return False
    return now - state.renewed_at > max(DONE_UNHEARD_S, 3 * state.ttl_s)


def _watch_membership(state: CoreState, now: float) -> tuple[CoreState, list[Action]]:
    """Ask the peers once per half TTL while this agent cannot renew and its workers run."""
    silent = now - state.renewed_at > FENCE_AFTER * state.ttl_s
    if state.group is None or not silent or now - state.probed_at < state.ttl_s / 2:
        return state, []
    if state.generation is None or len(state.generation.members) < 2:
        return state, []  # no peer to ask: assume the control plane is down for everyone
    return replace(state, probed_at=now), [ProbePeers()]


def _on_tick(state: CoreState, event: Tick, now: float) -> tuple[CoreState, list[Action]]:
    if _done_unheard(state, now):
        why = (
            f"this node's workers finished, and the control plane has not been reached for "
            f"{now - state.renewed_at:.0f}s, so the job's end cannot be recorded; exiting"
        )
        return _enter(state, Ended(AgentState.SUCCEEDED), why), [Exit(ExitCode.SUCCEEDED)]
    fenced = _fenced_by(state, event.fence)
    if fenced:
        # Reported, so that the control plane that runs this world learns why it stopped.
        group = state.group
        report = _failure(state, group.number if group is not None else 0, FailureCause.FENCED, fenced)
        return _enter(state, Waiting(), fenced), [Stop(), Send(report)]
    state, actions = _watch_progress(state, event, now)
    if not actions:
        state, actions = _watch_membership(state, now)
    handing = state.handing
    if handing is not None and handing.handover is not None:  # a hand-over waits: read its arrivals on every tick
        if handing.port is None:  # none can have counted in where nobody knows the store yet
            state, probe = _on_arrivals(state, ArrivalsRead(handing.generation.number, 0), now)
            actions = [*actions, *probe]
        else:
            actions = [*actions, ReadArrivals(handing.generation, handing.port, warm=handing.restart)]
    return state, actions


def _on_arrivals(state: CoreState, event: ArrivalsRead, now: float) -> tuple[CoreState, list[Action]]:
    """Probe the newcomers of a waiting hand-over when a probe is due (all arrived, the grace ran out, or the last
    probe is old)."""
    handing = state.handing
    if handing is None or handing.handover is None or handing.generation.number != event.generation:
        return state, []  # handed over, reported or superseded since
    pending = handing.handover
    if not probe_due(pending, event.arrived, now):
        return state, []
    state = _enter(state, replace(handing, handover=replace(pending, probing=True)))  # answered by NewcomersProbed
    return state, [ProbeNewcomers(handing.generation, pending.newcomers, event.arrived)]


def _on_probed(state: CoreState, event: NewcomersProbed, now: float) -> tuple[CoreState, list[Action]]:
    """Hand the waiting generation over, report the newcomers this node cannot reach, or wait on."""
    handing = state.handing
    if handing is None or handing.handover is None or handing.generation.number != event.generation:
        return state, []
    gen = handing.generation
    pending, verdict = probed(handing.handover, event.arrived, event.unreachable, now, state.config.graces.rescale_s)
    if verdict.cut:  # the workers train on in their generation; the report brings the next one
        report = _failure(state, gen.number, FailureCause.NOT_ARRIVED, verdict.message)
        why = f"generation {gen.number} not handed over: {verdict.message}"
        return _enter(state, Running(handing.group), why), [Send(report)]
    if verdict.hand and handing.restart:
        return _restart_into(state, handing, "the newcomers warmed up")
    if verdict.hand and handing.port is not None:
        group = replace(handing.group, members=tuple(m.node_id for m in gen.members))
        why = f"generation {gen.number} handed over in place"
        return _enter(state, Running(group), why), [Reconfigure(gen, handing.port)]
    return _enter(state, replace(handing, handover=pending)), []


def _restart_into(state: CoreState, handing: HandingOver, why: str) -> tuple[CoreState, list[Action]]:
    """A join by the restart path goes ahead: the running group saves and exits, then ``handing.generation``'s group
    starts (once its store port is read, if it is not yet)."""
    gen = handing.generation
    group = Group(gen.number, tuple(m.node_id for m in gen.members))
    why = f"generation {gen.number} by the restart path: {why}"
    if handing.port is None:
        return _enter(state, Starting(gen, group), why), [Stop(rescale=True)]
    return _enter(state, Running(group), why), [Stop(rescale=True), Start(gen, handing.port)]


def _on_job(state: CoreState, event: JobFinished, now: float) -> tuple[CoreState, list[Action]]:
    if not event.state.terminal:
        return state, []
    finish = event.state is JobState.SUCCEEDED
    stop: list[Action] = [Stop(finish=finish)] if state.group is not None else []
    if finish:
        return _enter(state, Ended(AgentState.SUCCEEDED), event.reason), [*stop, Exit(ExitCode.SUCCEEDED, event.reason)]
    return _enter(state, Ended(AgentState.FAILED), event.reason), [*stop, Exit(ExitCode.JOB_FAILED, event.reason)]


def _on_heartbeat_ok(state: CoreState, event: HeartbeatOk, now: float) -> tuple[CoreState, list[Action]]:
    return _renewed(state, now), []


def _on_heartbeat_failed(state: CoreState, event: HeartbeatFailed, now: float) -> tuple[CoreState, list[Action]]:
    return _watch_membership(replace(state, renewing_since=None), now)


def _on_lease_lost(state: CoreState, event: LeaseLost, now: float) -> tuple[CoreState, list[Action]]:
    actions: list[Action] = [Stop()] if state.group is not None else []
    done = isinstance(state.phase, (Waiting, Joining)) and state.phase.done
    return _enter(replace(state, renewing_since=None), Joining(done), f"membership lost: {event.why}"), actions


def _on_peers(state: CoreState, event: PeersProbed, now: float) -> tuple[CoreState, list[Action]]:
    limit = FENCE_AFTER * state.ttl_s
    group = state.group
    if event.streak_s < limit or group is None or now - state.renewed_at <= limit:
        return state, []
    if 0 < event.newest <= group.number:  # the peers' world is still this group's: not evicted (yet)
        return state, []
    why = (
        f"fenced: no membership renewal for {now - state.renewed_at:.0f}s while a peer has renewed for "
        f"{event.streak_s:.0f}s" + (f" and seen generation {event.newest}" if event.newest > 0 else "")
    )
    return _enter(state, Waiting(), why), [Stop()]


def _on_signal(state: CoreState, event: SignalReceived, now: float, stopping: bool) -> tuple[CoreState, list[Action]]:
    """SIGTERM or SIGINT: leave gracefully (``stopping``: an earlier group is still being stopped, and this node's
    group, if any, is only planned)."""
    code = left_on(event.signum)
    if _moves_in_place(state):
        # Leave first: the others' next generation (without this node) is on its way while this node's ranks
        # reach the step boundary, so they find their directives there and re-form without waiting.
        return _enter(state, Ended(AgentState.LEFT), "graceful leave"), [
            Leave(),
            Stop(rescale=True, leave=True),
            Exit(code),
        ]
    phase = state.current
    if isinstance(phase, (Running, HandingOver)) and not stopping and state.renewing_since is not None:
        # Leave first, and stop the workers once the world without this node is published: every node's agent
        # then stops its workers at the same moment, so no peer's exit breaks the others' collectives before
        # their SIGTERM handlers run. (A control plane that does not answer publishes nothing: no wait then.)
        leaving = Leaving(phase.group, event.signum, now + LEAVE_WAIT_S)
        return _enter(state, leaving, "graceful leave: waiting for the world without this node"), [Leave()]
    stop: list[Action] = [Stop(rescale=True)] if state.group is not None else []  # a group only planned
    return _enter(state, Ended(AgentState.LEFT), "graceful leave"), [*stop, Leave(), Exit(code)]


def _leaving(state: CoreState, phase: Leaving, event: Event, now: float) -> tuple[CoreState, list[Action]]:
    """LEAVING: the node left; its workers stop (the restart path: SIGTERM for a plain script) once the world without
    it is published, or at the deadline, or at once on a second signal or when they exited by themselves."""
    if isinstance(event, JobFinished) and event.state.terminal:
        return _on_job(_enter(state, Running(phase.group)), event, now)
    published = isinstance(event, GenerationSeen) and state.node_id not in event.generation.node_ids
    due = isinstance(event, Tick) and now >= phase.deadline
    if not (published or due or isinstance(event, (SignalReceived, GroupExited))):
        return state, []
    why = "graceful leave" if published else "graceful leave (the world without this node was not seen in time)"
    return _enter(state, Ended(AgentState.LEFT), why), [Stop(rescale=True), Exit(left_on(phase.signum))]


_HANDLERS: dict[type, Callable[[CoreState, object, float], tuple[CoreState, list[Action]]]] = {
    Joined: _on_joined,  # type: ignore[dict-item]
    GenerationSeen: _on_generation,  # type: ignore[dict-item]
    StorePortRead: _on_port,  # type: ignore[dict-item]
    StartFailed: _on_start_failed,  # type: ignore[dict-item]
    JobFinished: _on_job,  # type: ignore[dict-item]
    GroupExited: _on_exit,  # type: ignore[dict-item]
    HeartbeatOk: _on_heartbeat_ok,  # type: ignore[dict-item]
    HeartbeatFailed: _on_heartbeat_failed,  # type: ignore[dict-item]
    LeaseLost: _on_lease_lost,  # type: ignore[dict-item]
    PeersProbed: _on_peers,  # type: ignore[dict-item]
    ArrivalsRead: _on_arrivals,  # type: ignore[dict-item]
    NewcomersProbed: _on_probed,  # type: ignore[dict-item]
    Tick: _on_tick,  # type: ignore[dict-item]
}
"""Each event's decision, outside the stop's own events and the leaving phase."""
