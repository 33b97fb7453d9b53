"""This node's membership of the job, kept with the control plane: the join (creating the job when this agent may,
waiting while an earlier agent of the node id still holds it), heartbeats (and a re-join after an eviction), the
generation watch and the reports, each on a thread of its own that answers the agent's loop with events.

What reaches the agent's event queue: :class:`pliant.agent.events.Joined` for each join, ``HeartbeatOk``,
``HeartbeatFailed`` and ``LeaseLost`` from the heartbeat, every :class:`~pliant.coordinator.contract.WatchEvent` of
the watch, and :class:`JoinRefused` when a re-join is refused for good. Nothing here waits on the agent's loop, and the
loop never waits on the control plane: reports are queued and sent in order, retried while no coordinator answers.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from pliant.agent import actions, events
from pliant.agent.console import unreachable
from pliant.agent.contract import COORDINATORS, AgentConfig, AgentError
from pliant.agent.credentials import Credentials
from pliant.agent.metrics import AgentMetrics
from pliant.agent.stores import reachable
from pliant.backoff import Backoff
from pliant.coordinator.client import CoordinatorClient, JoinGrant
from pliant.coordinator.contract import (
    AlreadyExists,
    CoordinatorError,
    FailedPrecondition,
    Generation,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from pliant.coordinator.convert import job_info_to_pb
from pliant.logsetup import CONSOLE
from pliant.security.identity import Role
from pliant.statusview import ViewServer, serve_view

__all__ = ["JoinRefused", "Membership"]

logger = logging.getLogger(__name__)
LEAVE_UNREACHABLE_S = 1.0  # a leave tries this long when the last heartbeat was not answered
console = logging.getLogger(CONSOLE)  # the job's own lines (pliant.logsetup)

_GONE = (NotFound, PermissionDenied, FailedPrecondition)  # a report the coordinator will never take: drop it


class JoinRefused(Exception):
    """A re-join refused for good (the job was deleted, the token rotated): the agent ends."""


class Membership:
    """One agent's membership of its job.

    Threads: the agent's main thread makes the first join (:meth:`enter`) and then starts the heartbeat, watch and
    reporter threads (:meth:`start`). From then on the heartbeat thread owns ``grant`` (a re-join replaces it whole;
    the agent's loop reads its checkpoint key), ``tls``, ``join_token`` and ``_reached``; the watch thread writes
    ``newest_seen`` (read by the agent's loop); :meth:`report` and :meth:`leave` are called from the agent's loop
    thread. ``client`` is shared; its calls are thread-safe.

    Args:
        config: the agent's configuration.
        events: the agent's event queue, where every answer goes.
        metrics: the agent's metrics (the step a heartbeat says, its failures).
        stop: set when the agent stops; every thread here ends then.
        world: the agent's current generation (read from the heartbeat and reporter threads).
        generation: a generation the agent has seen, by number (None once forgotten).
    """

    def __init__(
        self,
        config: AgentConfig,
        events: queue.Queue[object],
        metrics: AgentMetrics,
        stop: threading.Event,
        world: Callable[[], Generation | None],
        generation: Callable[[int], Generation | None],
    ) -> None:
        self.config = config
        self._events = events
        self.metrics = metrics
        self._stop = stop
        self._world = world
        self._generation = generation
        self.tls = config.tls.load(expect=Role.AGENT) if config.tls else None
        # With a bootstrap join the certificate comes later; the channels made here are replaced before any call.
        self.client = CoordinatorClient(list(config.coordinator), self.tls, retry_for_s=config.heartbeat_retry_s)
        self.credentials = Credentials(config, self.client, stop)  # bootstrap on the main thread, then the heartbeat's
        self.join_token = config.join_token
        self.address = ""  # the node's agent store, which peers reach it on: set before the first join
        self.grant: JoinGrant | None = None
        self.newest_seen = 0  # the newest generation the watch delivered (it may still wait in the event queue)
        self._reports: queue.Queue[actions.Report] = queue.Queue()
        self._left = threading.Event()
        self._reached = 0  # the last generation whose every member this node, a spare, reached (see _probe)
        # Heartbeat thread: the nodes that hold the control plane's seats, as the last answer listed them (what the
        # line of an unreachable control plane names), and whether a seat is handed to this node (its seat takes it).
        self.seated: tuple[str, ...] = ()
        self.seat_handed = threading.Event()
        self._handed_said = False  # the console was told of a seat handed to this node
        self.reachable = True  # the last heartbeat was answered (heartbeat thread; read by a leave)
        self._view: ViewServer | None = None  # this node's view of its job for `pliant status` (main thread)

    def _granted(self, key: str) -> bytes:
        grant = self.grant
        return getattr(grant, key) if grant is not None else b""

    @property
    def checkpoint_key(self) -> bytes:
        """The job's checkpoint sealing key, as the last join granted it (empty before the first): its workers'."""
        return self._granted("checkpoint_key")

    @property
    def agent_key(self) -> bytes:
        """The job's agent key, as the last join granted it (empty before the first): the agent's own, never its
        workers'."""
        return self._granted("agent_key")

    @property
    def control_key(self) -> bytes:
        """The job's control public key, as the last join granted it (empty before the first)."""
        return self._granted("control_key")

    def enter(self, address: str, waiting: Callable[[str, str], None]) -> None:
        """The first join (the agent's main thread), as the node's agent store at ``address``; with a bootstrap join,
        the node's certificate first. ``waiting`` is told what each retry waits for.

        Raises:
            BootstrapError: the bootstrap join was refused, or nothing answered it.
            CoordinatorError: the join was refused, or no coordinator answered it.
            AgentError: the job is missing and this agent may not create it.
        """
        self.address = address
        self.client.waiting = waiting
        try:
            if self.config.ca_cert_hash:
                self.tls = self.credentials.bootstrap(self.join_token, waiting)
            self.join(waiting)
        finally:
            self.client.waiting = None  # the heartbeat thread uses the client from now on; it says its own lines
        if self.tls is not None and self._view is None:
            self._view = serve_view(self.config.spec.job_id, self.config.node_id, self._job_status)

    def start(self) -> None:
        """Start the heartbeat, the generation watch and the reporter (after the first join)."""
        for target, name in (
            (self._heartbeat_loop, "heartbeat"),
            (self._watch_loop, "watch"),
            (self._report_loop, "reporter"),
        ):
            threading.Thread(target=target, name=name, daemon=True).start()

    def report(self, report: actions.Report) -> None:
        """Queue ``report``; the reporter sends it after those before it, however long the coordinator is away."""
        self._reports.put(report)

    def close(self) -> None:
        """Stop serving this node's view of its job, and close the coordinator channels (the threads end with
        ``stop``)."""
        if self._view is not None:
            self._view.close()
        self.client.close()

    def _job_status(self) -> bytes:
        """The job as this agent may read it (GetJob: the member view), serialized: this node's view for
        ``pliant status`` (:mod:`pliant.statusview`; its server's threads)."""
        return job_info_to_pb(self.client.get_job(self.config.spec.job_id, progress=True)).SerializeToString()

    def _say_unreachable(self, since: float) -> None:
        """One line, once per outage (:func:`pliant.agent.console.unreachable`)."""
        line = unreachable(self.config.node_id, tuple(self.client.targets), self.seated, time.monotonic() - since)
        console.warning("%s", line)

    def _create_job(self) -> None:
        """Create the job with this agent's token (or a new one): only an admin (or a plaintext coordinator) may.

        Raises:
            AgentError: the job exists and this agent has no token, or it may not create the job.
        """
        spec = self.config.spec
        admin = self.config.admin_tls
        client = self.client
        if admin is not None:
            client = CoordinatorClient(list(self.config.coordinator), admin.load(expect=Role.ADMIN))
        try:
            _info, created, token = client.create_job(spec, self.join_token)
        except PermissionDenied as exc:
            if self.join_token:  # the join said the job is missing: only then is that known
                raise AgentError(
                    f"job {spec.job_id!r} does not exist, and this agent may not create it ({exc}); an admin creates "
                    f"it with `pliant job create {spec.job_id}` and gives the agents its join token (--join-token)"
                ) from exc
            raise AgentError(
                f"job {spec.job_id!r}: this agent has no join token and may not create jobs; pass the job's token "
                f"(--join-token, PLIANT_JOIN_TOKEN or --join-token-file: `pliant job create {spec.job_id}` printed "
                f"it), or have an admin create the job first"
            ) from exc
        finally:
            if client is not self.client:
                client.close()
        if not created and not self.join_token:
            raise AgentError(
                f"job {spec.job_id!r} already exists; pass its join token with --join-token (or "
                f"PLIANT_JOIN_TOKEN): the one printed when the job was created"
            )
        self.join_token = token
        logger.info("agent %s: job %s %s", self.config.node_id, spec.job_id, "created" if created else "exists")
        if created and admin is None:  # no one else was told the token: say it, as `pliant job create` does
            coordinators = ",".join(self.config.coordinator)
            console.info(
                "job %s created; other nodes join it with --coordinator %s --job %s --join-token=%s",
                spec.job_id,
                coordinators,
                spec.job_id,
                token,
            )

    def join(self, waiting: Callable[[str, str], None] | None = None) -> None:
        """Join the job (creating it when this agent may), waiting while an earlier agent of this node id still holds
        its membership; ``waiting`` (the first join's status line) is told what it waits for."""
        job = self.config.spec.job_id
        if not self.join_token:
            self._create_job()
        # A node restarted at once (kill -9, a pod restart) finds its earlier agent's membership still live until
        # the leader drops that silent member: it waits for that, as long as a heartbeat TTL allows, then gives up
        # with the error (two live agents given the same --node-id).
        patience = self.config.held_membership_wait_s
        deadline, waited = time.monotonic() + patience, False
        while True:
            try:
                grant = self._join_once(job)
                break
            except AlreadyExists:
                if time.monotonic() > deadline:
                    raise
                if waiting is not None:
                    waiting(f"waiting for an earlier agent of node {self.config.node_id} to be dropped", "")
                if not waited:
                    waited = True
                    logger.info(
                        "agent %s: an earlier agent of this node id still holds its membership; waiting up to "
                        "%.0fs for it to be dropped",
                        self.config.node_id,
                        patience,
                    )
                self._stop.wait(0.5)
        self.grant = grant
        self._events.put(events.Joined(grant.heartbeat_ttl_s))
        logger.info("agent %s: joined job %s", self.config.node_id, job)
        self._say_spec_differences(job)

    def _say_spec_differences(self, job: str) -> None:
        """One line when this node's flags disagree with the job's spec (an existing job keeps its own): which values
        win. Nothing when the job cannot be read now (the join stands either way)."""
        try:
            spec = self.client.get_job(job).spec
        except CoordinatorError:
            return
        mine = self.config.spec
        differ = []
        if (mine.min_nodes, mine.max_nodes) != (spec.min_nodes, spec.max_nodes):
            theirs, ours = f"{spec.min_nodes}:{spec.max_nodes}", f"{mine.min_nodes}:{mine.max_nodes}"
            differ.append(f"its --nnodes {theirs} wins over this node's {ours}")
        if self.config.nproc_per_node != spec.nproc_per_node:
            differ.append(
                f"this node runs {self.config.nproc_per_node} workers where its nodes run up to "
                f"{spec.nproc_per_node} (--nproc-per-node)"
            )
        if differ:
            logger.warning("agent %s: job %s exists with its own spec: %s", self.config.node_id, job, "; ".join(differ))

    def _join_once(self, job: str) -> JoinGrant:
        try:
            return self.client.join(job, self.config.node_id, self.address, self.config.nproc_per_node, self.join_token)
        except NotFound:
            self._create_job()
            return self.client.join(job, self.config.node_id, self.address, self.config.nproc_per_node, self.join_token)

    def _follow_coordinators(self, coordinators: tuple[str, ...]) -> None:
        """Call the control plane's coordinators as its seats list them (heartbeat thread), and say the join line
        with them when they change."""
        if not coordinators or sorted(coordinators) == sorted(self.client.targets):
            return
        self.client.use_targets(coordinators)
        logger.info("agent %s: the control plane's coordinators are %s", self.config.node_id, ",".join(coordinators))
        if self.config.join_line:
            line = self.config.join_line.replace(COORDINATORS, ",".join(coordinators))
            nodes = f"{len(coordinators)} node{'' if len(coordinators) == 1 else 's'}"
            console.info("control plane on %s; other nodes join with:\n  %s", nodes, line)

    def _heartbeat_loop(self) -> None:
        node = self.config.node_id
        failing, down_since, said = False, 0.0, False
        while not self._stop.is_set():
            grant = self.grant
            assert grant is not None
            if self._stop.wait(grant.heartbeat_interval_s) or self._left.is_set():
                return
            try:
                step, (reaches, misses) = self.metrics.latest_step(), self._probe(grant.heartbeat_interval_s / 2)
                beat = self.client.beat(
                    self.config.spec.job_id,
                    self.config.node_id,
                    grant.lease_id,
                    step,
                    timeout_s=max(0.5, grant.heartbeat_ttl_s / 3),
                    reaches_generation=reaches,
                    misses_generation=misses,
                    goodput=self.metrics.goodput_seconds(),
                )
                self._events.put(events.HeartbeatOk())
                self.reachable = True
                self._follow_coordinators(beat.coordinators)
                self.seated = beat.seated or self.seated
                if beat.seat_handed:
                    if not self._handed_said:
                        console.info("agent %s: a control-plane seat is handed to this node; taking it", node)
                        self._handed_said = True
                    self.seat_handed.set()
                if failing:
                    back_after = time.monotonic() - down_since
                    logger.info("agent %s: heartbeats reach the coordinator again after %.0fs", node, back_after)
                    if said:
                        console.info("agent %s: the control plane is reachable again", node)
                failing, said = False, False
                self.tls = self.credentials.renew_if_due() or self.tls
            except (NotFound, PermissionDenied) as exc:  # evicted (or another's lease): join again
                if self._left.is_set():
                    return
                self._events.put(events.LeaseLost(str(exc)))
                self._rejoin()
            except CoordinatorError as exc:
                self.metrics.heartbeat_failures.inc()
                self.reachable = False
                self._events.put(events.HeartbeatFailed())
                if not failing:
                    # The call retried for heartbeat_retry_s before it failed: the outage began about then.
                    down_since = time.monotonic() - self.config.heartbeat_retry_s
                    # An unreachable control plane gets its one line below; any other failure is said here.
                    log = logger.info if isinstance(exc, Unavailable) else logger.warning
                    log("agent %s: heartbeat failed (%s); retrying, workers keep training", self.config.node_id, exc)
                if not said and isinstance(exc, Unavailable):
                    self._say_unreachable(down_since)
                    said = True
                failing = True

    def _probe(self, timeout_s: float) -> tuple[int, int]:
        """(reaches, misses): the current generation's number in the first if this node is a spare and reaches every
        member's agent (the coordinator then lifts a hold of its strikes: the cut that earned them healed), in the
        second if it is a spare and cannot reach one (a hold lasts while that is so); else 0."""
        gen = self._world()
        if gen is None or not gen.members or self.config.node_id in gen.node_ids:
            return 0, 0
        if gen.number != self._reached:  # once reached, a generation is not probed again (a spare may wait for long)
            timeout_s = min(0.5, timeout_s)  # a member behind a cut that drops packets delays this heartbeat that long
            if not all(reachable(m.address, timeout_s) for m in gen.members):
                return 0, gen.number
            self._reached = gen.number
        return self._reached, 0

    def _rejoin(self) -> None:
        """Join again until it works, however long the coordinator is away; a refusal that will not change (the job
        was deleted, the token rotated) ends the agent."""
        backoff = Backoff(0.2, 5.0)
        while not self._stop.is_set() and not self._left.is_set():
            try:
                self.join()
                return
            except FailedPrecondition as exc:  # the job finished: the watch tells the main loop
                logger.info("agent %s: not joining again: %s", self.config.node_id, exc)
                return
            except (NotFound, Unauthenticated, PermissionDenied, AgentError) as exc:
                self._events.put(JoinRefused(str(exc)))
                return
            except CoordinatorError as exc:
                log = logger.debug if backoff.failing else logger.warning  # said once; the retries are quiet
                log("agent %s: join failed (%s); retrying", self.config.node_id, exc)
                self._stop.wait(backoff.next())

    def _watch_loop(self) -> None:
        next_number, failing = 0, False
        while not self._stop.is_set():
            try:
                for event in self.client.watch(self.config.spec.job_id, next_number):
                    failing = False
                    if event.generation is not None:
                        next_number = event.generation.number + 1
                        self.newest_seen = event.generation.number
                    self._events.put(event)
                    if self._stop.is_set():
                        return
            except CoordinatorError as exc:
                if self._stop.is_set():
                    return
                # Said once per outage; an unreachable control plane gets the heartbeat's one line instead.
                log = logger.debug if failing else logger.info if isinstance(exc, Unavailable) else logger.warning
                log("agent %s: generation watch failed (%s); resuming", self.config.node_id, exc)
                failing = True
                self._stop.wait(1.0)

    def _report_loop(self) -> None:
        """Send queued reports in order, retrying while the coordinator is away."""
        while not self._stop.is_set():
            try:
                report = self._reports.get(timeout=0.5)
            except queue.Empty:
                continue
            backoff = Backoff(0.5, 5.0)
            while not self._stop.is_set():
                try:
                    self._send(report)
                    break
                except _GONE as exc:
                    logger.warning(
                        "agent %s: %s of generation %d not reported: %s",
                        self.config.node_id,
                        report.kind,
                        report.generation,
                        exc,
                    )
                    break
                except CoordinatorError as exc:
                    log = logger.debug if backoff.failing else logger.warning  # said once per report
                    why = f"{report.kind} of generation {report.generation} queued, the coordinator did not take it"
                    log("agent %s: %s (%s); retrying", self.config.node_id, why, exc)
                    self._stop.wait(backoff.next())

    def _send(self, report: actions.Report) -> None:
        job, node, lease = self.config.spec.job_id, self.config.node_id, self.grant.lease_id if self.grant else 0
        if report.kind == "success":
            accepted, current = self.client.report_success(job, node, report.generation, lease, report.untrained)
        else:
            gen = self._generation(report.generation)
            others = [m for m in gen.members if m.node_id != node] if gen else []
            unreachable = [m.node_id for m in others if not reachable(m.address)]
            if unreachable:
                logger.warning("agent %s: agents of %s are unreachable", node, ",".join(unreachable))
            accepted, current = self.client.report_failure(
                job,
                node,
                report.generation,
                report.exit_code,
                report.message,
                unreachable,
                lease,
                arrived=report.arrived,
                cause=report.cause,
                error=report.error,
            )
        logger.info(
            "agent %s: %s of generation %d reported (%s; current generation %d)%s",
            node,
            report.kind,
            report.generation,
            "accepted" if accepted else "stale",
            current,
            "; every member had arrived (its workers trained in it)" if report.arrived else "",
        )

    def leave(self) -> None:
        """Leave the job: no heartbeat and no re-join from here on; the coordinator is told, once (a membership not
        given back expires by itself)."""
        self._left.set()  # no heartbeat, and no re-join, from here on
        if self.grant is None:
            return
        # A control plane that does not answer the heartbeats is not waited for: the membership expires by itself.
        retry_for_s = None if self.reachable else LEAVE_UNREACHABLE_S
        try:
            self.client.leave(self.config.spec.job_id, self.config.node_id, self.grant.lease_id, retry_for_s)
        except CoordinatorError as exc:
            logger.warning("agent %s: leave failed (%s); the membership expires by itself", self.config.node_id, exc)
