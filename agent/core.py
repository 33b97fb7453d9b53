"""The agent's decisions as one pure function: ``decide(state, event, now) -> (state, actions)``.

No I/O and no clock: :mod:`pliant.agent.agent` (the executor) turns what happens (a generation from the watch, a
worker exit, a heartbeat's outcome, a signal, the workers' progress on each tick) into events, calls :func:`decide`,
and performs the actions it returns, in order. Everything here is unit-tested with a fake clock and no processes.

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
- **Stopping is a state**: a group is stopped in stages with deadlines (:mod:`pliant.agent.stopping`): the executor
  starts each stage when told (:class:`Stop`, then :class:`Escalate` once a tick finds the stage's deadline passed)
  and never waits; it reports the group gone (:class:`GroupStopped`). What needs the old workers gone (the next
  group's :class:`Start`, :class:`Leave`, :class:`Exit`, and whatever was decided after them) waits in
  ``CoreState.stopping`` until then.
- **Hangs**: workers write their step and phase (start, step, save, done) to a progress file. A rank in the step
  phase that makes no progress for the hang timeout (by default ``HANG_MULTIPLE`` x the median step time, at least
  ``HANG_FLOOR_S``), or that stays in the start or save phase for the start timeout, is hung: the agent dumps every
  worker's stacks, stops the group and reports a failure, so the job recovers as from any failure. Workers that never
  write progress (scripts without pliant.worker) are not watched.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from pliant.agent.contract import AgentState, ExitCode, GroupResult, left_on
from pliant.agent.handover import HandOver, probe_due, probed
from pliant.agent.stopping import Graces, Stopping, StopStage, begin, defer, escalated, first_stage
from pliant.coordinator.contract import FailureCause, Generation, JobState
from pliant.fence import Fence

__all__ = [
    "FENCE_AFTER",
    "HANG_FLOOR_S",
    "HANG_MULTIPLE",
    "LEAVE_WAIT_S",
    "Action",
    "ArrivalsRead",
    "CoreConfig",
    "CoreState",
    "Dump",
    "Escalate",
    "Event",
    "Exit",
    "GenerationSeen",
    "GroupExited",
    "GroupStopped",
    "HeartbeatFailed",
    "HeartbeatOk",
    "JobFinished",
    "Joined",
    "LeaseLost",
    "Leave",
    "NewcomersProbed",
    "PeersProbed",
    "Prepare",
    "ProbeNewcomers",
    "ProbePeers",
    "ReadArrivals",
    "Reconfigure",
    "Report",
    "Send",
    "SignalReceived",
    "Start",
    "StartFailed",
    "Stop",
    "StopStarted",
    "Tick",
    "decide",
    "hang_timeout",
    "left_out",
    "renewal_streak",
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
        rescale_grace_s: how long a hand-over in place waits for its newcomers before a last probe decides, and how
            long workers asked to save or hand over for a rescale may take to exit.
        stop_grace_s: SIGTERM -> SIGKILL.
        finish_grace_s: how long workers may take to exit by themselves after the job succeeded elsewhere.
        max_nodes: the job's maximum node count as this node was told it (0: unknown): a node left out of a world
            that has this many is a spare.
    """

    hang_timeout_s: float | None = None
    start_timeout_s: float = 600.0
    rescale_in_place: bool = False
    rescale_grace_s: float = 30.0
    stop_grace_s: float = 5.0
    finish_grace_s: float = 10.0
    max_nodes: int = 0

    @property
    def graces(self) -> Graces:
        return Graces(finish_s=self.finish_grace_s, rescale_s=self.rescale_grace_s, stop_s=self.stop_grace_s)


@dataclass(frozen=True)
class Report:
    """A report the coordinator must receive: a worker failure or the group's success, for ``generation``."""

    kind: str  # "failure" | "success"
    generation: int
    exit_code: int = 0  # of a failure whose cause is EXITED: the worker's (negative: the signal that killed it)
    message: str = ""
    arrived: bool = False  # a worker of this node completed a step in ``generation``: every member arrived
    cause: FailureCause = FailureCause.EXITED
    untrained: bool = False  # of a success: no worker of this node completed a step in ``generation``
    error: str = ""  # of an EXITED failure: the exception the worker died of ("Type: message"; "" for none)


@dataclass(frozen=True)
class RankProgress:
    step: int
    phase: str
    since: float  # when this (step, phase, generation) was first seen
    generation: int = 0  # of a "wait" or a "transfer": its generation (a new wait at the same step is a new record)


@dataclass(frozen=True)
class CoreState:
    """What the agent knows. ``group`` is the generation number of the running worker group (None: none)."""

    node_id: str
    phase: AgentState = AgentState.JOINING
    generation: Generation | None = None
    group: int | None = None
    started_at: float = 0.0
    progress: tuple[tuple[int, RankProgress], ...] = ()
    step_intervals: tuple[float, ...] = ()
    ttl_s: float = 10.0
    renewed_at: float = 0.0
    renewing_since: float | None = None  # start of the current unbroken run of renewals (None: failing)
    probed_at: float = -1e18
    ready: bool = False  # every live worker of the group announced that it re-forms in place
    handed: int | None = None  # the generation last handed to the running group in place
    members: tuple[str, ...] = ()  # the node ids of the generation the running group last formed (or was handed)
    handing: Generation | None = None  # a generation waiting for its newcomers before it is handed over in place
    handover: HandOver | None = None  # that wait: its newcomers, deadline and probes
    stopping: Stopping | None = None  # a group being stopped, and what waits for it to be gone
    leaving: tuple[int, float] | None = None  # LEAVING: (the signal, when the workers stop at the latest)
    trained_in: int = 0  # the newest generation a worker of this node was seen to complete a step in
    done: bool = False  # every worker of this node exited 0 (the job's end not yet seen)
    reason: str = ""
    config: CoreConfig = field(default_factory=CoreConfig)


# -- events ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Joined:
    ttl_s: float


@dataclass(frozen=True)
class GenerationSeen:
    generation: Generation


@dataclass(frozen=True)
class JobFinished:
    state: JobState
    reason: str


@dataclass(frozen=True)
class GroupExited:
    result: GroupResult
    message: str = ""  # the executor's description of the first failure (rank, code, error)
    alive: int = 0  # workers of the group still running
    error: str = ""  # the exception the first failed worker died of ("Type: message"; "" for none)


@dataclass(frozen=True)
class GroupStopped:
    """The group being stopped has no live worker left (the executor reaped it, or gave up on it: ``GONE``)."""

    generation: int


@dataclass(frozen=True)
class StopStarted:
    """The first stage the executor could enter for a :class:`Stop` when it differs from the one asked: a rescale
    none of whose workers takes the request is stopped with SIGTERM at once (``TERM``)."""

    stage: StopStage


@dataclass(frozen=True)
class StartFailed:
    generation: int
    message: str


@dataclass(frozen=True)
class HeartbeatOk:
    pass


@dataclass(frozen=True)
class HeartbeatFailed:
    pass


@dataclass(frozen=True)
class LeaseLost:
    why: str


@dataclass(frozen=True)
class PeersProbed:
    streak_s: float  # the longest unbroken run of membership renewals among the peers' agents (-1: none answered)
    newest: int = -1  # the newest generation any of them has seen (-1: none says; 0: none seen)


@dataclass(frozen=True)
class SignalReceived:
    """SIGTERM or SIGINT: leave the job gracefully, and exit with :func:`pliant.agent.contract.left_on` it."""

    signum: int


@dataclass(frozen=True)
class ArrivalsRead:
    """What :class:`ReadArrivals` found: ``arrived`` workers counted in at ``generation``'s store (0: unreadable)."""

    generation: int
    arrived: int


@dataclass(frozen=True)
class NewcomersProbed:
    """What :class:`ProbeNewcomers` found: the newcomers of ``generation`` whose agents did not answer."""

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
    | HeartbeatOk
    | HeartbeatFailed
    | LeaseLost
    | PeersProbed
    | SignalReceived
    | ArrivalsRead
    | NewcomersProbed
    | Tick
)


# -- actions -----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prepare:
    """Open ``generation``'s store (this node is its rank 0) so joiners can meet there while the old group saves."""

    generation: Generation


@dataclass(frozen=True)
class Stop:
    """Begin stopping the running group (:mod:`pliant.agent.stopping`): ``rescale`` asks the workers to checkpoint and
    exit (``leave``: to hand over and exit, the others re-forming in place); ``finish`` lets them end by themselves;
    neither: SIGTERM. ``hung``: the workers' stacks are being dumped (:class:`Dump`), SIGTERM follows once they had
    time to reach the logs. The executor answers :class:`GroupStopped` once no worker is left (at once when it has no
    group)."""

    rescale: bool = False
    finish: bool = False
    leave: bool = False
    hung: bool = False


@dataclass(frozen=True)
class Escalate:
    """The stopping group's stage ran out: enter ``stage`` (``DUMP``: the late workers' stacks to their logs;
    ``TERM``: SIGTERM; ``KILL``: SIGKILL; ``GONE``: give up on what outlived SIGKILL)."""

    stage: StopStage


@dataclass(frozen=True)
class Reconfigure:
    """Hand the running group ``generation`` in place: live workers get their new env, dead local ranks fresh
    workers."""

    generation: Generation


@dataclass(frozen=True)
class ReadArrivals:
    """Count the workers that counted themselves in at ``generation``'s store; answer with :class:`ArrivalsRead`."""

    generation: Generation


@dataclass(frozen=True)
class ProbeNewcomers:
    """Probe the agents of ``generation``'s ``newcomers``; answer with :class:`NewcomersProbed` (``arrived`` passed
    on)."""

    generation: Generation
    newcomers: tuple[str, ...]
    arrived: int


@dataclass(frozen=True)
class Start:
    generation: Generation


@dataclass(frozen=True)
class Send:
    report: Report


@dataclass(frozen=True)
class Dump:
    """Ask every worker for its Python stacks, into its log (a hang; the :class:`Stop` that follows gives them the
    time to get there)."""

    why: str


@dataclass(frozen=True)
class ProbePeers:
    pass


@dataclass(frozen=True)
class Leave:
    pass


@dataclass(frozen=True)
class Exit:
    """End the agent with ``code`` (:class:`pliant.agent.contract.ExitCode`, or :func:`left_on` a signal); a finished
    job's ``message`` (how it ended, and why) is printed."""

    code: int
    message: str = ""


Action = (
    Prepare
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


# -- decisions ---------------------------------------------------------------------------------------------------------


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


def _renewed(state: CoreState, now: float) -> CoreState:
    unbroken = state.renewing_since is not None and now - state.renewed_at <= state.ttl_s
    return replace(state, renewed_at=now, renewing_since=state.renewing_since if unbroken else now)


def _set(state: CoreState, phase: AgentState, reason: str = "", **changes: object) -> CoreState:
    return replace(state, phase=phase, reason=reason or state.reason, **changes)  # type: ignore[arg-type]


def _no_group(state: CoreState) -> CoreState:
    return replace(state, group=None, progress=(), started_at=0.0, ready=False, members=(), handing=None, handover=None)


def _moves_in_place(state: CoreState) -> bool:
    """Whether this node's running group takes the next generation in its processes: ``--rescale in-place``, and
    every worker announced that it takes directives."""
    return state.config.rescale_in_place and state.ready and state.group is not None


def _on_generation(state: CoreState, gen: Generation, now: float) -> tuple[CoreState, list[Action]]:
    if state.generation is not None and gen.number <= state.generation.number:
        return state, []
    state = replace(state, generation=gen, done=False)
    actions: list[Action] = []
    mine = next((m for m in gen.members if m.node_id == state.node_id), None)
    if mine is not None and mine.node_rank == 0:
        actions.append(Prepare(gen))
    if mine is not None and _moves_in_place(state):
        ranks = f"ranks {mine.rank_offset}..{mine.rank_offset + mine.nproc - 1}"
        # The same processes: their progress carries on (a rank still in "wait" waits for this very generation).
        state = replace(state, group=gen.number, started_at=now, handed=gen.number, handing=None, handover=None)
        why = f"generation {gen.number} in place, {ranks}"
        known = set(state.members) or {m.node_id for m in gen.members}  # an unknown group's world: no newcomers
        newcomers = tuple(m.node_id for m in gen.members if m.node_id not in known)
        needed = sum(m.nproc for m in gen.members if m.node_id in newcomers)
        if needed:  # handed over once the newcomers counted themselves in (the survivors train on meanwhile)
            pending = HandOver(newcomers, needed, now + state.config.rescale_grace_s)
            state = replace(state, handing=gen, handover=pending)
            return _set(state, AgentState.RUNNING, f"{why}, once {', '.join(newcomers)} arrive"), actions
        state = replace(state, members=tuple(m.node_id for m in gen.members))
        return _set(state, AgentState.RUNNING, why), [*actions, Reconfigure(gen)]
    stranded = False
    if state.group is not None:
        # Dropped from a world that goes on in place (evicted, or a spare again): the workers hand over and leave at
        # the step boundary, as in a graceful leave, so the others re-form without a restart. Workers that all wait
        # after a failed step have no boundary left to hand over at (their world broke; the next goes on without
        # them), and may sit in a meeting with a peer they cannot reach: they are stopped at once.
        leave = mine is None and bool(gen.members) and _moves_in_place(state)
        stranded = leave and bool(state.progress) and all(p.phase == "wait" for _, p in state.progress)
        actions.append(Stop() if stranded else Stop(rescale=True, leave=leave))
        state = _no_group(state)
    if mine is None:
        why = left_out(state, gen)
        why += "; workers that waited after a failed step stopped" if stranded else ""
        return _set(state, AgentState.WAITING, why), actions
    actions.append(Start(gen))
    ranks = f"ranks {mine.rank_offset}..{mine.rank_offset + mine.nproc - 1}"
    state = replace(state, group=gen.number, started_at=now, progress=(), members=tuple(m.node_id for m in gen.members))
    return _set(state, AgentState.RUNNING, f"generation {gen.number}, {ranks}"), actions


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


def _on_exit(state: CoreState, event: GroupExited, now: float) -> tuple[CoreState, list[Action]]:
    result = event.result
    if state.group is None or result.stopped:
        return state, [Stop()]  # not the group this state runs: just reap it
    if result.generation != state.group:
        if state.handed != state.group:
            return state, [Stop()]  # a group of an earlier generation: just reap it
        # The running group, handed generation ``state.group`` in place and not re-formed there yet (the executor
        # waits for newcomers): its exit is that generation's, or the failure report would be stale and lost.
        result = replace(result, generation=state.group)
    failure = result.first_failure
    if failure is not None and event.alive and _moves_in_place(state):
        # The other local workers keep their processes and state; the next generation replaces the dead one.
        report = _failure(
            state,
            result.generation,
            FailureCause.EXITED,
            event.message or f"exit code {failure[1]}",
            failure[1],
            event.error,
        )
        return _set(state, AgentState.RUNNING, f"worker failure reported; {event.alive} workers wait in place"), [
            Send(report)
        ]
    state = _no_group(state)
    if result.succeeded:
        # Workers handed a generation in place that ran the job's last steps in the world before it, while its
        # newcomers' workers started, complete it untrained: the coordinator then does not wait for the newcomers,
        # whose workers can never train in it.
        untrained = state.handed == result.generation and 0 < state.trained_in < result.generation
        report = Report("success", result.generation, untrained=untrained)
        state = replace(state, done=True)
        return _set(state, AgentState.WAITING, "workers done; waiting for the job to finish"), [Stop(), Send(report)]
    if result.saved_for_rescale:
        gen = state.generation
        if gen is not None and state.handed == result.generation == gen.number:
            # Handed this generation in place, the world took the restart path instead (an engine that cannot move
            # in place, or another node's group could not): fresh workers restore from the checkpoint.
            state = replace(state, group=gen.number, started_at=now)
            return _set(state, AgentState.RUNNING, f"generation {gen.number} restarted from the checkpoint"), [
                Stop(),
                Start(gen),
            ]
        return _set(state, AgentState.WAITING, f"workers of generation {result.generation} saved for a rescale"), [
            Stop()
        ]
    failure = result.first_failure
    code = failure[1] if failure else 1
    report = _failure(
        state,
        result.generation,
        FailureCause.EXITED,
        event.message or f"a worker exited with code {code}",
        code,
        event.error,
    )
    return _set(state, AgentState.WAITING, "worker failure reported"), [Stop(), Send(report)]


def _fenced_by(state: CoreState, fence: Fence | None) -> str:
    """Why the checkpoint directory's ``fence`` says that this node's running world was superseded ("" if not)."""
    gen = state.generation
    if fence is None or state.group is None or gen is None or fence.job != gen.job_id:
        return ""
    if not fence.supersedes(gen.incarnation, state.group):
        return ""
    if fence.owner.incarnation == gen.incarnation:
        return (
            f"fenced: generation {fence.owner.generation} owns the checkpoint directory, this group runs {state.group}"
        )
    return (
        f"fenced: another incarnation of job {gen.job_id} (started again) took the checkpoint directory over; "
        f"this world (generation {state.group}) stops"
    )


def _failure(
    state: CoreState, generation: int, cause: FailureCause, message: str, exit_code: int = 0, error: str = ""
) -> Report:
    """A failure report of ``generation`` (``exit_code``: a worker's, when it exited; ``error``: the exception it
    died of), saying whether this node's workers trained a step in it."""
    return Report("failure", generation, exit_code, message, state.trained_in >= generation, cause, error=error)


def _watch_progress(state: CoreState, tick: Tick, now: float) -> tuple[CoreState, list[Action]]:
    """Track each rank's progress (and the newest generation a step completed in); a hung rank fails the group."""
    if state.group is None:
        return state, []
    before = dict(state.progress)
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
    state = replace(
        state,
        progress=tuple(sorted(progress.items())),
        step_intervals=tuple(intervals[-_STEP_SAMPLES:]),
        ready=tick.ready,
        trained_in=trained_in,
    )
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
        generation = state.group
        assert generation is not None
        report = _failure(state, generation, FailureCause.HUNG, f"hang: {why}")
        state = _set(_no_group(state), AgentState.WAITING, f"hang detected: {why}")
        return state, [Dump(why), Stop(hung=True), Send(report)]
    if waiting:
        message = f"local rank {min(waiting)} saw a peer fail mid-step and waits in place for the next generation"
        state = _set(state, state.phase, "a peer failed; waiting in place")
        return state, [Send(_failure(state, state.group, FailureCause.WAITING, message))]  # no worker of ours failed
    return state, []


def _done_unheard(state: CoreState, now: float) -> bool:
    """Every worker of this node exited 0, and nothing has been heard from the control plane for DONE_UNHEARD_S (and
    three TTLs): nothing is left to do here, and no one may ever say that the job finished."""
    if not state.done or state.group is not None or state.renewing_since is not None:
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


def _on_arrivals(state: CoreState, event: ArrivalsRead, now: float) -> tuple[CoreState, list[Action]]:
    """Probe the newcomers of a waiting hand-over when a probe is due (all arrived, the grace ran out, or the last
    probe is old)."""
    pending, gen = state.handover, state.handing
    if pending is None or gen is None or gen.number != event.generation:
        return state, []  # handed over, reported or superseded since
    if not probe_due(pending, event.arrived, now):
        return state, []
    state = replace(state, handover=replace(pending, probing=True))  # answered by NewcomersProbed
    return state, [ProbeNewcomers(gen, pending.newcomers, event.arrived)]


def _on_probed(state: CoreState, event: NewcomersProbed, now: float) -> tuple[CoreState, list[Action]]:
    """Hand the waiting generation over, report the newcomers this node cannot reach, or wait on."""
    pending, gen = state.handover, state.handing
    if pending is None or gen is None or gen.number != event.generation:
        return state, []
    pending, verdict = probed(pending, event.arrived, event.unreachable, now, state.config.rescale_grace_s)
    if verdict.cut:  # the workers train on in their generation; the report brings the next one
        report = _failure(state, gen.number, FailureCause.NOT_ARRIVED, verdict.message)
        state = replace(state, handing=None, handover=None)
        return _set(state, AgentState.RUNNING, f"generation {gen.number} not handed over: {verdict.message}"), [
            Send(report)
        ]
    if verdict.hand:
        state = replace(state, handing=None, handover=None, members=tuple(m.node_id for m in gen.members))
        return _set(state, AgentState.RUNNING, f"generation {gen.number} handed over in place"), [Reconfigure(gen)]
    return replace(state, handover=pending), []


def decide(state: CoreState, event: Event, now: float) -> tuple[CoreState, list[Action]]:
    """The agent's next state and the actions to perform, in order, for ``event`` at agent-clock time ``now``."""
    stopping = state.stopping
    if isinstance(event, GroupStopped):  # what waited for the group to be gone
        return (replace(state, stopping=None), list(stopping.then)) if stopping is not None else (state, [])
    if isinstance(event, StopStarted):
        if stopping is None:
            return state, []
        return replace(state, stopping=begin(event.stage, state.config.graces, now, stopping.then)), []
    escalate: list[Action] = []
    if isinstance(event, Tick) and stopping is not None:  # a stage's deadline passed: the next stage
        following = escalated(stopping, state.config.graces, now)
        if following is not None and following.stage is StopStage.GONE:
            return replace(state, stopping=None), [Escalate(StopStage.GONE), *stopping.then]
        if following is not None:
            state, escalate = replace(state, stopping=following), [Escalate(following.stage)]
    if state.phase in (AgentState.SUCCEEDED, AgentState.FAILED, AgentState.LEFT):
        return state, escalate
    state, actions = _decide(state, event, now)
    state, actions = _sequenced(state, actions, now)
    return state, [*escalate, *actions]


def _sequenced(state: CoreState, actions: list[Action], now: float) -> tuple[CoreState, list[Action]]:
    """Queue what must wait for a group to be gone (:mod:`pliant.agent.stopping`): everything after a :class:`Stop`
    that begins one, and, while a group stops, every start, leave or exit and what was decided after it."""
    if state.stopping is not None:
        actions, then = defer(state.stopping.then, actions, (Start, Leave, Exit), Stop, Start)
        return replace(state, stopping=replace(state.stopping, then=then)), actions
    at = next((i for i, action in enumerate(actions) if isinstance(action, Stop)), None)
    if at is None:
        return state, actions
    stop = actions[at]
    assert isinstance(stop, Stop)
    stage = first_stage(stop.rescale, stop.finish, stop.hung)
    stopping = begin(stage, state.config.graces, now, tuple(actions[at + 1 :]))
    return replace(state, stopping=stopping), actions[: at + 1]


def _leaving(state: CoreState, event: Event, now: float) -> tuple[CoreState, list[Action]]:
    """LEAVING: the node left; its workers stop (the restart path: SIGTERM for a plain script) once the world without
    it is published, or at the deadline, or at once on a second signal or when they exited by themselves."""
    assert state.leaving is not None
    signum, deadline = state.leaving
    if isinstance(event, JobFinished) and event.state.terminal:
        return _decide(replace(state, phase=AgentState.RUNNING, leaving=None), event, now)
    published = isinstance(event, GenerationSeen) and state.node_id not in event.generation.node_ids
    due = isinstance(event, Tick) and now >= deadline
    if not (published or due or isinstance(event, (SignalReceived, GroupExited))):
        return state, []
    why = "graceful leave" if published else "graceful leave (the world without this node was not seen in time)"
    state = replace(_no_group(state), leaving=None)
    return _set(state, AgentState.LEFT, why), [Stop(rescale=True), Exit(left_on(signum))]


def _decide(state: CoreState, event: Event, now: float) -> tuple[CoreState, list[Action]]:
    """:func:`decide` for every event but a stop's own, before what must wait for a stop is queued."""
    if state.phase is AgentState.LEAVING:
        return _leaving(state, event, now)
    if isinstance(event, Joined):
        state = replace(state, ttl_s=event.ttl_s, renewing_since=None)
        return _set(_renewed(state, now), AgentState.WAITING if state.group is None else state.phase, "joined"), []
    if isinstance(event, GenerationSeen):
        return _on_generation(state, event.generation, now)
    if isinstance(event, JobFinished):
        if not event.state.terminal:
            return state, []
        finish = event.state is JobState.SUCCEEDED
        stop: list[Action] = [Stop(finish=finish)] if state.group is not None else []
        if finish:
            return _set(_no_group(state), AgentState.SUCCEEDED, event.reason), [
                *stop,
                Exit(ExitCode.SUCCEEDED, event.reason),
            ]
        return _set(_no_group(state), AgentState.FAILED, event.reason), [*stop, Exit(ExitCode.JOB_FAILED, event.reason)]
    if isinstance(event, GroupExited):
        return _on_exit(state, event, now)
    if isinstance(event, StartFailed):
        if state.group != event.generation:
            return state, []
        report = _failure(state, event.generation, FailureCause.START_FAILED, event.message)
        return _set(_no_group(state), AgentState.WAITING, f"cannot start: {event.message}"), [Stop(), Send(report)]
    if isinstance(event, HeartbeatOk):
        return _renewed(state, now), []
    if isinstance(event, HeartbeatFailed):
        return _watch_membership(replace(state, renewing_since=None), now)
    if isinstance(event, LeaseLost):
        actions: list[Action] = [Stop()] if state.group is not None else []
        state = replace(state, renewing_since=None)
        return _set(_no_group(state), AgentState.JOINING, f"membership lost: {event.why}"), actions
    if isinstance(event, PeersProbed):
        limit = FENCE_AFTER * state.ttl_s
        if event.streak_s < limit or state.group is None or now - state.renewed_at <= limit:
            return state, []
        if 0 < event.newest <= state.group:  # the peers' world is still this group's: not evicted (yet)
            return state, []
        why = (
            f"fenced: no membership renewal for {now - state.renewed_at:.0f}s while a peer has renewed for "
            f"{event.streak_s:.0f}s" + (f" and seen generation {event.newest}" if event.newest > 0 else "")
        )
        return _set(_no_group(state), AgentState.WAITING, why), [Stop()]
    if isinstance(event, SignalReceived):
        if _moves_in_place(state):
            # Leave first: the others' next generation (without this node) is on its way while this node's ranks
            # reach the step boundary, so they find their directives there and re-form without waiting.
            return _set(_no_group(state), AgentState.LEFT, "graceful leave"), [
                Leave(),
                Stop(rescale=True, leave=True),
                Exit(left_on(event.signum)),
            ]
        if state.group is not None and state.stopping is None and state.renewing_since is not None:
            # Leave first, and stop the workers once the world without this node is published: every node's agent
            # then stops its workers at the same moment, so no peer's exit breaks the others' collectives before
            # their SIGTERM handlers run. (A control plane that does not answer publishes nothing: no wait then.)
            state = replace(state, leaving=(event.signum, now + LEAVE_WAIT_S))
            return _set(state, AgentState.LEAVING, "graceful leave: waiting for the world without this node"), [Leave()]
        stop: list[Action] = [Stop(rescale=True)] if state.group is not None else []  # a group only planned
        return _set(_no_group(state), AgentState.LEFT, "graceful leave"), [*stop, Leave(), Exit(left_on(event.signum))]
    if isinstance(event, ArrivalsRead):
        return _on_arrivals(state, event, now)
    if isinstance(event, NewcomersProbed):
        return _on_probed(state, event, now)
    if isinstance(event, Tick):
        if _done_unheard(state, now):
            why = (
                f"this node's workers finished, and the control plane has not been reached for "
                f"{now - state.renewed_at:.0f}s, so the job's end cannot be recorded; exiting"
            )
            return _set(state, AgentState.SUCCEEDED, why), [Exit(ExitCode.SUCCEEDED)]
        fenced = _fenced_by(state, event.fence)
        if fenced:
            # Reported, so that the control plane that runs this world learns why it stopped.
            report = _failure(state, state.group or 0, FailureCause.FENCED, fenced)
            return _set(_no_group(state), AgentState.WAITING, fenced), [Stop(), Send(report)]
        state, actions = _watch_progress(state, event, now)
        if not actions:
            state, actions = _watch_membership(state, now)
        if state.handing is not None:  # a hand-over waits: read its arrivals on every tick
            actions = [*actions, ReadArrivals(state.handing)]
        return state, actions
    raise TypeError(f"unknown agent event {event!r}")
