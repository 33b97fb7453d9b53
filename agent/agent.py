"""The node agent's executor: it joins the job, turns what happens into events (:mod:`pliant.agent.events`) for
:func:`pliant.agent.core.decide`, and performs the actions it returns (:mod:`pliant.agent.actions`: start and stop
workers, open or read a store port, send reports, dump stacks, leave, exit). It keeps processes, threads and queues,
and no decision of its own.

Threads feed one event queue: the membership's (:mod:`pliant.agent.membership`: the generation watch, the heartbeat,
which also re-joins after an eviction), signals, and the short-lived threads that read a store port from node rank 0
or probe peers' and newcomers' agents (each answers with an event); the main thread reads the workers' exits and
progress files on each tick and owns every process, so workers are always spawned from the thread that outlives them.
Reports go to the membership's reporter, which retries while the coordinator is away, so nothing the main loop does
ever waits on the control plane or a peer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from pliant import scratch
from pliant.agent import core, snapshots
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
    Send,
    Start,
    Stop,
)
from pliant.agent.console import Summary, WaitLine, awaited, refused_lines
from pliant.agent.contract import AgentConfig, AgentError, ExitCode, GroupResult
from pliant.agent.events import (
    ArrivalsRead,
    Event,
    GenerationSeen,
    GroupExited,
    GroupStopped,
    NewcomersProbed,
    PeersProbed,
    SignalReceived,
    StartFailed,
    StopStarted,
    StorePortRead,
    Tick,
)
from pliant.agent.events import JobFinished as JobEnded
from pliant.agent.goodput import Activity, Goodput
from pliant.agent.membership import JoinRefused, Membership
from pliant.agent.metrics import AgentMetrics
from pliant.agent.preload import plan_preload
from pliant.agent.stopping import StopStage
from pliant.agent.storehost import StoreHost, StoreHostError
from pliant.agent.stores import ARRIVED_KEY, RESTARTING_KEY, WARM_KEY, NodeStore, reachable, reserve
from pliant.agent.workers import WorkerCommand, WorkerGroup, Zygote, worker_base_env
from pliant.bootstrap import BootstrapError
from pliant.coordinator.contract import (
    MAX_ERROR_BYTES,
    CoordinatorError,
    Generation,
    GenerationMember,
    JobFinished,
    JobState,
    Outcome,
    WatchEvent,
    truncate_reason,
)
from pliant.env import WorkerEnv
from pliant.errorfile import read_error
from pliant.fence import Fence, read_fence
from pliant.logsetup import CONSOLE
from pliant.metrics import MetricsServer, serve_metrics
from pliant.net import interface_of, is_loopback
from pliant.progress import read_record
from pliant.security.seal import SealError
from pliant.statusline import status_line

if TYPE_CHECKING:
    from pliant.agent.seat import SeatHolder

__all__ = ["Agent"]

logger = logging.getLogger(__name__)
console = logging.getLogger(CONSOLE)  # the job's own lines (pliant.logsetup)

TICK_S = 0.25
QUICK_TICK_S = 0.02  # while a hand-over waits or a group stops (core.ticks_quickly)
ZYGOTE_READY_S = 120.0  # the longest a start waits for the zygote's imports (its spawn's own limit)
WARM_POLL_S = 0.02  # a newcomer waiting for the others to restart into its generation reads their count this often
JOIN_WAIT_SHOWN_AFTER_S = 1.0  # a join that waits longer (no coordinator answers yet) says what it waits for
HEALTHY_WITHIN_S = 30.0  # /healthz fails once the loop has not ticked for this long (a wedged executor)
PROGRESS_PREFIX = "pliant-progress-"  # the workers' progress records: a scratch directory (pliant.scratch) per agent
FENCE_READ_S = 2.0  # the checkpoint directory's fence file (maybe on a shared filesystem) is read at most this often


class Agent:
    """One node's supervisor. ``run()`` returns the process exit code (:class:`ExitCode`): 0 when the job succeeded, 1
    when it failed (never because the coordinator was away), 2 when this agent could not take part, 128 + N when it
    left gracefully on signal N.

    What it holds, besides ``state`` (the core's: every decision is :func:`pliant.agent.core.decide`'s; the loop thread
    replaces it, a store port's reader reads it) and its configuration; the main (loop) thread owns every field unless
    said otherwise:

    - processes: ``zygote`` (the worker fork server), ``_stores`` (the store host) and ``store`` (this node's agent
      store in it), ``group`` (the running workers), ``_stopping`` (the workers being stopped), ``_tracked`` (groups
      whose exits are still counted);
    - threads and servers: ``membership`` (join, heartbeat, watch, reports: threads of its own), ``_seat`` (this
      node's control-plane seat: a thread of its own), ``metrics_server``, and the short-lived readers and probes of
      :meth:`_in_background`;
    - queues and events: ``_events`` (every thread puts, the loop takes), ``_stop`` (set once, at exit);
    - what it read, for the events it makes: ``_generations`` (the newest generations seen; the membership's threads
      read it), ``_fence`` (the checkpoint directory's fence, read every :data:`FENCE_READ_S`), ``_renewing`` (what
      it last told its peers), ``_restarting`` (the generations this node restarts into once their newcomers warmed
      up, as it told their stores);
    - what it says: ``_summary`` and ``_wait`` (the console's lines), ``_goodput`` (this node's time by what it did,
      charged at each tick), ``_job`` and ``_outcome`` (the job's state as last watched), ``_ticked_at`` (the loop's
      last tick; the metrics thread reads it for ``/healthz``).

    Args:
        config: the agent's configuration.
        zygote: the worker fork server to use (default: the agent starts its own; none with ``no_python``).
        registry: where the agent's metrics go (default: a new one); the metrics endpoint serves it.
    """

    def __init__(
        self, config: AgentConfig, zygote: Zygote | None = None, registry: CollectorRegistry | None = None
    ) -> None:
        self.config = config
        self.command = WorkerCommand.from_launch(config.command, config.no_python)
        self.base_env = worker_base_env(config.nproc_per_node)
        ifname = "" if is_loopback(config.host) else interface_of(config.host)
        if ifname:  # gloo binds the interface of the address peers reach this node on, unless the user chose one
            self.base_env.setdefault("GLOO_SOCKET_IFNAME", ifname)
        self.zygote = zygote
        self.address = ""
        self.state = core.CoreState(
            config.node_id,
            config=core.CoreConfig(
                config.hang_timeout_s,
                config.start_timeout_s,
                rescale_in_place=config.rescale == "in-place",
                graces=config.graces,
                max_nodes=config.spec.max_nodes,
            ),
        )
        self.group: WorkerGroup | None = None
        self._stopping: WorkerGroup | None = None  # the group being stopped (the core's Stopping phase has its stage)
        self._restarting: set[int] = set()  # generations this node restarts into once their newcomers warmed up
        self.store: NodeStore | None = None
        self._stores: StoreHost | None = None
        self._generations: dict[int, Generation] = {}
        self._events: queue.Queue[object] = queue.Queue()
        self._stop = threading.Event()
        registry = CollectorRegistry(auto_describe=True) if registry is None else registry
        self.metrics = AgentMetrics(registry, config.spec.job_id, config.node_id)
        self.metrics.set_state(self.state.lifecycle)
        self.membership = Membership(
            config, self._events, self.metrics, self._stop, lambda: self.state.generation, self._generations.get
        )
        self.metrics_server: MetricsServer | None = None
        self.progress_dir = scratch.make(PROGRESS_PREFIX, config.node_id)
        self.snapshot_dir = snapshots.make(snapshots.usable(config.snapshot_dir), config.node_id)  # buddy copies
        self._tracked: list[WorkerGroup] = []  # groups whose workers may not all have been seen exiting
        self._renewing: tuple[int, int] | None = None
        self._ticked_at: float | None = None  # the loop's last tick (loop thread; read by the metrics thread)
        self._summary = Summary()  # the last line's figures (loop thread)
        self._goodput = Goodput(time.monotonic())  # this node's goodput and badput seconds (loop thread)
        self._seat: SeatHolder | None = None  # this node's seat in an embedded control plane (main thread)
        self._wait = WaitLine(status_line())  # the console's line for a long wait (loop thread)
        self._job: tuple[JobState | None, str] = (None, "")  # the job's state and reason, as last watched (loop thread)
        self._outcome: Outcome | None = None  # how the job ended, once watched (loop thread)
        self._fence: Fence | None = None  # the checkpoint directory's sealed fence, read every FENCE_READ_S
        self._fence_read_at, self._fence_problem = -FENCE_READ_S, ""

    def health(self) -> str:
        """For ``/healthz`` (any thread): "" while the loop ticks, else why not: it has not started yet (a startup
        probe's wait: the join, the zygote's imports) or has not ticked for :data:`HEALTHY_WITHIN_S` (a wedged
        executor; the heartbeat and metrics threads may still run). An agent whose control plane is away is healthy:
        its workers train on."""
        ticked = self._ticked_at
        if ticked is None:
            return "starting: joining the job"
        idle = time.monotonic() - ticked
        return f"the agent's loop has not ticked for {idle:.0f}s" if idle > HEALTHY_WITHIN_S else ""

    # -- lifecycle -----------------------------------------------------------------------------------------------------

    def run(self) -> int:
        """Join, supervise until the job ends or SIGTERM, clean up, and return the exit code."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda signum, _frame: self._events.put(SignalReceived(signum)))
        try:
            if self.zygote is None and not self.config.no_python:
                self.zygote = Zygote(self.base_env, plan_preload(self.config))  # imports torch while the agent joins
            # The stores run in the store host (the zygote forks it once torch is imported): never torch in here.
            self._stores = self.zygote.stores if self.zygote is not None else StoreHost.standalone()
            listening = reserve(self.config.host, self.config.store_port)  # the address joined with stays ours
            port = int(listening.getsockname()[1])
            self.address = f"{self.config.host}:{port}"
            if self.config.metrics_port is not None:
                self.metrics_server = serve_metrics(
                    self.metrics.registry, f"{self.config.host}:{self.config.metrics_port}", health=self.health
                )
            if not self.config.checkpoint_dir:
                logger.warning(
                    "agent %s: no --checkpoint-dir: unless the script saves its own checkpoints, every "
                    "rescale or worker failure restarts training from step 0; pass --checkpoint-dir DIR "
                    "(shared by the nodes) to keep progress",
                    self.config.node_id,
                )
            if self.config.seat:  # a node of an embedded control plane: its seat, if it held one, comes back first
                from pliant.agent.seat import RESUME_WAIT_S, SeatHolder  # the coordinator's code: where it may run

                self._seat = SeatHolder(
                    self.config.spec.job_id,
                    self.config.node_id,
                    self.config.host,
                    self.config.ca_cert_hash,
                    self.config.seat_key,
                    self.membership.client,
                    self.metrics.registry,
                    lambda line: console.info("%s", line),
                    self.membership.seat_handed,
                ).start()
                self._seat.resumed.wait(RESUME_WAIT_S + 5)
            joining = WaitLine(status_line(), after_s=JOIN_WAIT_SHOWN_AFTER_S)
            self.membership.enter(self.address, lambda what, note: joining.update(what, note, time.monotonic()))
            joining.update("", "", time.monotonic())
            if self._seat is not None:
                self._seat.joined.set()  # it asks for a seat (or its own back) from now on
            self.membership.start()
            # The join grace runs while the store host starts (the zygote's torch import); heartbeats already go.
            self.store = NodeStore(self._stores, self.config.host, listening, self.config.store_port)
            self.store.key = self.membership.agent_key  # seals its records (its workers hold no such key)
            return self._loop()
        except JobFinished as exc:  # a node that comes late ends as the job did
            console.info("job %s already %s; nothing to do", exc.job, exc.state.value)
            return ExitCode.SUCCEEDED if exc.state is JobState.SUCCEEDED else ExitCode.JOB_FAILED
        except (CoordinatorError, AgentError, BootstrapError) as exc:
            console.error("error: %s", exc)
            return ExitCode.ERROR
        finally:
            self._wait.update("", "", time.monotonic())
            self._stop.set()
            if self._seat is not None:
                self._seat.close()
            for group in (self._stopping, self.group):
                if group is not None:
                    group.stop(self.config.stop_grace_s)
            if self.store is not None:
                self.store.close()
            if self.zygote is not None:
                self.zygote.close()  # and its store host
            elif self._stores is not None:
                self._stores.close()
            self.membership.close()
            if self.metrics_server is not None:
                self.metrics_server.close()
            self.metrics.close()
            scratch.remove(self.progress_dir, self.snapshot_dir)

    def _publish_renewing(self) -> None:
        """Tell peers (through the agent store) for how long this agent has renewed its membership without a break,
        and the newest generation it has seen."""
        gen = self.state.generation
        renewing = (int(core.renewal_streak(self.state, time.monotonic())), gen.number if gen is not None else 0)
        if renewing != self._renewing and self.store is not None:
            with contextlib.suppress(Exception):
                self.store.set_renewing(*renewing)
                self._renewing = renewing

    # -- the main loop -------------------------------------------------------------------------------------------------

    def _next_event(self, deadline: float) -> object:
        try:
            return self._events.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            pass
        if self._stopping is not None and not self._stopping.late():  # every worker of the stopped group exited
            stopped, self._stopping = self._stopping, None
            stopped.reap()
            return GroupStopped(stopped.generation)
        if self.group is not None:
            result = self.group.poll()
            if result is not None and not result.stopped:
                errors = self._errors_of(result)
                result = result.blame(errors)
                error = errors.get(result.blamed, "") if result.blamed is not None else ""
                return GroupExited(result, self._describe(result, error), self.group.alive, error)
        now = time.monotonic()
        if (
            self.config.checkpoint_dir
            and self.membership.grant is not None
            and now - self._fence_read_at >= FENCE_READ_S
        ):
            self._fence, self._fence_read_at = self._read_fence(), now
        ready = self.group is not None and self.group.ready()
        progress = self.group.progress() if self.group is not None else {}
        self._summary.steps = max([self._summary.steps, *(step for step, _phase, _gen in progress.values())])
        return Tick(progress, self._fence, ready)

    def _read_fence(self) -> Fence | None:
        """The checkpoint directory's fence if the control plane's warrants bear it out; one that they do not (forged,
        or from a deployment with another sealing secret) is ignored, and said once, since the next world replaces
        it."""
        try:
            fence = read_fence(self.config.checkpoint_dir, self.membership.control_key)
        except SealError as exc:
            problem = str(exc)
            if problem != self._fence_problem:
                logger.warning(
                    "agent %s: ignoring the fence file in %s: %s; the next world that opens the directory replaces it",
                    self.config.node_id,
                    self.config.checkpoint_dir,
                    problem,
                )
            self._fence_problem = problem
            return None
        self._fence_problem = ""
        return fence

    def _loop(self) -> int:
        next_tick = time.monotonic()
        while True:
            event = self._next_event(next_tick)
            if isinstance(event, Tick):
                self._ticked_at = time.monotonic()
                self._charge(event)
                next_tick = time.monotonic() + (QUICK_TICK_S if core.ticks_quickly(self.state) else TICK_S)
                if self._stores is not None and self._stores.closed:  # no store: no rendezvous, no hand-over
                    self.membership.leave()
                    raise AgentError(
                        "the node's store host (pliant-stores) exited; this agent left the job and exits "
                        "so that its supervisor restarts the node"
                    )
                self._publish_renewing()
                waiting = awaited(self.state, *self._job, self.config.spec.min_nodes, self._ticked_at)
                self._wait.update(*waiting, self._ticked_at)
            elif isinstance(event, WatchEvent):
                self._job = (event.status.state, event.status.reason)
                self._outcome = event.status.outcome
                if event.generation is not None:
                    cause = "failure" if event.generation.after_failure else "rescale"
                    self._goodput.interrupted(cause, decided=True)
                    for line in refused_lines(self.state.generation, event.generation):
                        console.warning("%s", line)
                    self._generations[event.generation.number] = event.generation
                    self._summary.seen(event.generation, time.monotonic())
                    for old in sorted(self._generations)[:-8]:
                        del self._generations[old]
                    code = self._dispatch(GenerationSeen(event.generation))
                    if code is not None:
                        return code
                event = JobEnded(event.status.state, event.status.reason)
            elif isinstance(event, JoinRefused):
                console.error("error: cannot join again: %s", event)
                return ExitCode.ERROR
            code = self._dispatch(event)  # type: ignore[arg-type]
            if code is not None:
                return code
            self._track_workers()

    def _charge(self, tick: Tick) -> None:
        """Charge the time since the last tick to goodput or a badput cause (:mod:`pliant.agent.goodput`)."""
        held_out = self._job[0] is JobState.WAITING or (
            self.group is None and self.state.reason.startswith(("spare", "excluded", "left out"))
        )
        activity = Activity(self.group is not None, tick.progress, held_out)
        self.metrics.charge(*self._goodput.charge(self._ticked_at or time.monotonic(), activity))

    def _dispatch(self, event: Event) -> int | None:
        if isinstance(event, GroupExited) and not event.result.stopped and event.result.first_failure is not None:
            self._goodput.interrupted("failure", decided=False)
        if isinstance(event, (GenerationSeen, SignalReceived)) and self.group is not None:
            self._dispatch(Tick(self.group.progress(), self._fence, self.group.ready()))  # on fresh readiness
        before = self.state
        self.state, actions = core.decide(self.state, event, time.monotonic())
        if self.state.lifecycle is not before.lifecycle or self.state.reason != before.reason:
            logger.info(
                "agent %s: %s -> %s (%s)",
                self.config.node_id,
                before.lifecycle.value,
                self.state.lifecycle.value,
                self.state.reason,
            )
            self.metrics.set_state(self.state.lifecycle)
            if self.state.reason.startswith(("excluded", "left out")):
                console.warning("agent %s: %s", self.config.node_id, self.state.reason)
        for action in actions:
            code = self._perform(action)
            if code is not None:
                return code
        if isinstance(event, GroupExited) and self.group is not None:
            self.group.forget_dead()  # the others stay in place; the next generation replaces the dead
        return None

    def _perform(self, action: Action) -> int | None:
        if isinstance(action, Prepare):
            self._open_store(action.generation)
        elif isinstance(action, ReadStorePort):
            self._in_background(lambda: self._read_port(action.generation), "store-port")
        elif isinstance(action, Stop):
            self._stop_group(action)
        elif isinstance(action, Escalate):
            self._escalate(action.stage)
        elif isinstance(action, Reconfigure):
            self._reconfigure(action.generation, action.port)
        elif isinstance(action, ReadArrivals):
            self._read_arrivals(action.generation, action.port, WARM_KEY if action.warm else ARRIVED_KEY)
        elif isinstance(action, ProbeNewcomers):
            self._in_background(lambda: self._probe_newcomers(action), "probe-newcomers")
        elif isinstance(action, Start):
            try:
                self._spawn(action.generation, action.port)
            except AgentError as exc:
                logger.warning(
                    "agent %s: cannot start generation %d: %s", self.config.node_id, action.generation.number, exc
                )
                self._events.put(StartFailed(action.generation.number, str(exc)))
        elif isinstance(action, Send):
            self.membership.report(action.report)
        elif isinstance(action, Dump):
            self._dump_stacks(action.why)
        elif isinstance(action, ProbePeers):
            self._in_background(lambda: self._events.put(PeersProbed(*self._peers_renewing())), "probe-peers")
        elif isinstance(action, Leave):
            self.membership.leave()
        elif isinstance(action, Exit):
            ended = {ExitCode.SUCCEEDED: "succeeded", ExitCode.JOB_FAILED: "failed"}.get(action.code, "")
            if ended and action.message:
                console.info("job %s %s: %s", self.config.spec.job_id, ended, action.message)
            outcome = (
                {
                    Outcome.FULL: "succeeded at full size",
                    Outcome.REDUCED: "succeeded with a reduced world",
                }.get(self._outcome, ended)
                if action.code == ExitCode.SUCCEEDED
                else ended or "left by this node"
            )
            self._summary.steps = max(self._summary.steps, self._steps_recorded())
            now = time.monotonic()
            console.info("%s", self._summary.line(self.config.spec.job_id, outcome, now, self._goodput.line()))
            return action.code
        return None

    # -- actions -------------------------------------------------------------------------------------------------------

    def _stop_group(self, action: Stop) -> None:
        """Begin stopping the running group (:mod:`pliant.agent.stopping`); the core escalates on its ticks, and the
        loop reports the group gone (:class:`pliant.agent.events.GroupStopped`)."""
        group, self.group = self.group, None
        if self._stopping is not None:  # the core stops one group at a time: a second is a bug, not a wait
            logger.error(
                "agent %s: a stop came while generation %d still stopped; killing that one",
                self.config.node_id,
                self._stopping.generation,
            )
            self._stopping.stop(0.0)
            self._stopping = None
        if group is None:  # nothing runs (a group only planned): gone at once
            self._events.put(GroupStopped(0))
            return
        self._stopping = group
        if action.leave:
            self.metrics.rescales.labels("in-place").inc()
            logger.info(
                "agent %s: generation %d: this node's workers leave at the next step boundary; the others "
                "re-form in place",
                self.config.node_id,
                group.generation,
            )
        elif action.rescale:
            self.metrics.rescales.labels("restart").inc()
            logger.info(
                "agent %s: generation %d ends by the restart path (%s)",
                self.config.node_id,
                group.generation,
                self._why_restart(),
            )
        elif action.failed:
            logger.info(
                "agent %s: generation %d failed: its workers get SIGTERM, then SIGKILL after %gs (--abort-grace)",
                self.config.node_id,
                group.generation,
                self.config.abort_grace_s,
            )
        awaited = group.begin_stop(rescale=action.rescale, leave=action.leave, finish=action.finish, hung=action.hung)
        if action.rescale and not awaited:  # no worker takes the request: SIGTERM went at once
            self._events.put(StopStarted(StopStage.TERM))

    def _escalate(self, stage: StopStage) -> None:
        """The stopping group's stage ran out (the core's deadline): enter ``stage``."""
        group = self._stopping
        if group is None:
            return
        if stage is StopStage.DUMP:
            group.dump_late(self.config.rescale_grace_s)
        elif stage is StopStage.TERM:
            group.signal(signal.SIGTERM)
        elif stage is StopStage.KILL:
            group.signal(signal.SIGKILL)
        elif stage is StopStage.GONE:  # what outlived SIGKILL: logged, and no longer waited for
            self._stopping = None
            group.reap()

    def _why_restart(self) -> str:
        if self.config.rescale != "in-place":
            return "--rescale restart"
        return (
            "not every worker announced in-place support (a script without pliant.worker, an engine that cannot "
            "move in place, or a worker still starting)"
        )

    def _read_arrivals(self, gen: Generation, port: int, key: str) -> None:
        """How many workers counted themselves in at ``gen``'s store on ``port`` (``key``), for the waiting hand-over
        (0 while the store is not reachable yet: the next tick reads again). A restart-path join's first read
        (``key`` :data:`WARM_KEY`) also tells the store that this node restarts into ``gen`` once its newcomers are
        warm (:data:`RESTARTING_KEY`), so that they fork only after it did."""
        master_addr = gen.store_address.rsplit(":", 1)[0]
        arrived = 0
        try:
            assert self.store is not None
            if key == WARM_KEY and gen.number not in self._restarting:  # the newcomers wait for this node to restart
                self.store.count_in(master_addr, port, RESTARTING_KEY, 1)
                self._restarting.add(gen.number)
            arrived = self.store.arrivals(master_addr, port, key)
        except Exception as exc:
            logger.debug("arrivals of generation %d not readable yet: %s", gen.number, exc)
        self._events.put(ArrivalsRead(gen.number, arrived))

    def _reconfigure(self, gen: Generation, port: int) -> None:
        """Hand the running group ``gen`` in place, its store on ``port`` (see :meth:`WorkerGroup.reconfigure`)."""
        assert self.group is not None
        kept, started = self.group.reconfigure(gen.number, self._envs(gen, port))
        self.metrics.rescales.labels("in-place").inc()
        self.metrics.generation.set(gen.number)
        console.info("%s", self._summary.handed(gen, kept, started, time.monotonic()))

    def _open_store(self, gen: Generation) -> None:
        """Open ``gen``'s store (this node is its rank 0) and answer with its port."""
        assert self.store is not None
        try:
            self._events.put(StorePortRead(gen.number, self.store.open_generation(gen.number)))
        except AgentError as exc:
            self._events.put(StorePortRead(gen.number, 0, f"this node could not open the generation's store: {exc}"))

    def _read_port(self, gen: Generation) -> None:
        """Read ``gen``'s store port from node rank 0's agent store (a background reader) and answer with it. Node
        rank 0 opens the store before it stops its old group, so this is normally at once; the bound is the longest
        node rank 0 may take to stop that group, so a slow checkpoint never fails a join. A newer generation, or the
        core no longer waiting for the port, ends the wait."""
        assert self.store is not None
        wait_s = self.config.rescale_grace_s + self.config.stop_grace_s + 15.0

        def superseded() -> bool:
            return self.membership.newest_seen > gen.number or not core.wants_port(self.state, gen.number)

        try:
            port = self.store.generation_port(gen.store_address, gen.number, timeout_s=wait_s, superseded=superseded)
        except AgentError as exc:
            self._events.put(StorePortRead(gen.number, 0, str(exc)))
            return
        self._events.put(StorePortRead(gen.number, port))

    def _spawn(self, gen: Generation, master_port: int) -> None:
        log_dir = None
        if self.config.log_dir:
            log_dir = Path(self.config.log_dir) / self.config.spec.job_id / f"gen-{gen.number}"
        envs = self._envs(gen, master_port)
        self._warm_up(gen, master_port, len(envs))
        self.group = WorkerGroup(gen.number, envs, self.command, log_dir, self.base_env, self.zygote)
        self.group.start()
        self._tracked.append(self.group)
        self.metrics.group_started(gen.number)
        console.info("%s", self._summary.started(gen, self._me(gen), time.monotonic()))

    def _warm_up(self, gen: Generation, port: int, workers: int) -> None:
        """Before this node's ``workers`` for ``gen`` fork: wait for the zygote's imports (the warm-up), count them in
        at ``gen``'s store (:data:`pliant.agent.stores.WARM_KEY`), and when the other nodes wait for this one to
        restart into ``gen`` (a join by the restart path, :data:`pliant.agent.stores.RESTARTING_KEY`), wait until
        every node counted in: the others saved and restarted, so these workers read no checkpoint older than the
        rescale's. A store that does not answer, nodes that do not count in within the rescale and stop graces, or a
        newer generation (the workers then start only to be stopped) end the wait."""
        started = time.monotonic()
        if self.zygote is not None:
            self.zygote.wait_ready(ZYGOTE_READY_S)
        assert self.store is not None
        host, waits = gen.store_address.rsplit(":", 1)[0], gen.number not in self._restarting
        try:
            counted = self.store.count_in(host, port, WARM_KEY, workers)
            waits = waits and self.store.arrivals(host, port, RESTARTING_KEY) > 0
        except StoreHostError as exc:
            logger.warning("agent %s: generation %d's store: %s", self.config.node_id, gen.number, exc)
            return
        if not waits:
            return
        warm = time.monotonic()
        console.info(
            "generation %d: warmed up in %.1fs; the other nodes save and restart into it (a join by the restart path)",
            gen.number,
            warm - started,
        )
        deadline = warm + self.config.rescale_grace_s + self.config.stop_grace_s
        while counted < gen.world_size and time.monotonic() < deadline and self.membership.newest_seen <= gen.number:
            time.sleep(WARM_POLL_S)
            with contextlib.suppress(StoreHostError):
                counted = self.store.arrivals(host, port, WARM_KEY)
        logger.info(
            "agent %s: generation %d: %d of %d workers counted in after %.1fs",
            self.config.node_id,
            gen.number,
            counted,
            gen.world_size,
            time.monotonic() - warm,
        )

    def _steps_recorded(self) -> int:
        """The highest step any of this node's workers recorded in its progress file (a finished one's too)."""
        records = (read_record(str(path)) for path in Path(self.progress_dir).glob("gen-*-rank-*"))
        return max([0, *(record[0] for record in records if record is not None)])

    def _me(self, gen: Generation) -> GenerationMember:
        return next(m for m in gen.members if m.node_id == self.config.node_id)

    def _envs(self, gen: Generation, master_port: int) -> list[WorkerEnv]:
        """This node's workers' env contracts in ``gen``, whose store listens on ``master_port``."""
        assert self.store is not None
        me = self._me(gen)
        master_addr, config = gen.store_address.rsplit(":", 1)[0], self.config
        return [
            WorkerEnv(
                rank=me.rank_offset + local_rank,
                local_rank=local_rank,
                world_size=gen.world_size,
                local_world_size=me.nproc,
                node_rank=me.node_rank,
                num_nodes=len(gen.members),
                master_addr=master_addr,
                master_port=master_port,
                job_id=config.spec.job_id,
                generation=gen.number,
                max_restarts=config.spec.max_restarts,
                node_id=config.node_id,
                agent_store=self.store.address,
                checkpoint_dir=config.checkpoint_dir,
                metrics_dir=self.metrics.worker_dir,
                incarnation=gen.incarnation,
                checkpoint_key=self.membership.checkpoint_key.hex(),
                control_key=self.membership.control_key.hex(),
                warrant=gen.warrant,
                published_at=gen.created_at,
                allow_fresh_start=config.allow_fresh_start,
                rescale=config.rescale,
                progress_file=os.path.join(self.progress_dir, f"gen-{gen.number}-rank-{local_rank}"),
                error_file=self._error_file(gen.number, local_rank),
                snapshot_every=config.snapshot_every,
                snapshot_dir=self.snapshot_dir,
            )
            for local_rank in range(me.nproc)
        ]

    def _error_file(self, generation: int, local_rank: int) -> str:
        """Where the worker of ``local_rank`` in ``generation`` writes the exception it dies of
        (:mod:`pliant.errorfile`)."""
        return os.path.join(self.progress_dir, f"error-gen-{generation}-rank-{local_rank}.json")

    def _errors_of(self, result: GroupResult) -> dict[int, str]:
        """The exceptions the group's failed workers died of, by local rank (none for a signal, ``sys.exit``); each
        file is removed once read, so a worker started again in its place writes its own."""
        errors = {}
        for local_rank, _code in result.failed:
            path = self._error_file(result.generation, local_rank)
            error = read_error(path)
            with contextlib.suppress(OSError):
                os.unlink(path)
            if error:
                errors[local_rank] = truncate_reason(error, MAX_ERROR_BYTES)
        return errors

    def _describe(self, result: GroupResult, error: str) -> str:
        failure = result.first_failure
        if failure is None:
            return ""
        local_rank, code = failure
        gen = self._generations.get(result.generation)
        me = next((m for m in gen.members if m.node_id == self.config.node_id), None) if gen else None
        rank = me.rank_offset + local_rank if me else local_rank
        return f"local rank {local_rank} (rank {rank}) exited with code {code}" + (f": {error}" if error else "")

    def _dump_stacks(self, why: str) -> None:
        """Ask every worker for its Python stacks (faulthandler), waking stopped ones first, and count the hang."""
        logger.error("agent %s: hang detected (%s); dumping every worker's stacks", self.config.node_id, why)
        self.metrics.hangs.inc()
        if self.group is not None:
            self.group.dump_stacks()

    def _in_background(self, work: Callable[[], None], name: str) -> None:
        """Run ``work`` (network calls, each with a timeout: a store port's read, a probe) on a thread of its own: it
        answers with an event, so the loop never waits on a peer that does not answer."""
        threading.Thread(target=work, name=name, daemon=True).start()

    def _probe_newcomers(self, action: ProbeNewcomers) -> None:
        """Which of ``action``'s newcomers' agents this node cannot reach (a probe thread; answered with
        :class:`pliant.agent.events.NewcomersProbed`)."""
        gen, newcomers = action.generation, set(action.newcomers)
        unreachable = frozenset(m.node_id for m in gen.members if m.node_id in newcomers and not reachable(m.address))
        self._events.put(NewcomersProbed(gen.number, action.arrived, unreachable))

    def _peers_renewing(self) -> tuple[float, int]:
        """The longest unbroken renewal streak among (up to 8 of) the generation's other agents, and the newest
        generation they have seen; -1 for what none says."""
        gen = self.state.generation
        peers = [m.address for m in gen.members if m.node_id != self.config.node_id] if gen else []
        return self.store.longest_renewing(peers[:8]) if self.store is not None else (-1.0, -1)

    def _track_workers(self) -> None:
        """Feed the worker gauges and exit counters; forget groups whose every exit was counted."""
        for group in self._tracked:
            if group is not self.group:
                group.poll()  # a stopped group was reaped; this only refreshes cached exit codes
        exits = [e for g in self._tracked for e in g.exits()]
        self.metrics.track(exits, self.group.exits() if self.group else [])
        self._tracked = [g for g in self._tracked if g is self.group or any(c is None for _p, c in g.exits())]
