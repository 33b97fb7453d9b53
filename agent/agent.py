"""The node agent: joins the job, heartbeats, follows generations, and runs this node's workers for each of them.

Threads feed one event queue (generations from the watch, a lost lease from the heartbeat, signals); the main thread
owns every process decision, so workers are always spawned from the thread that outlives them. On a worker failure
the agent stops its other workers, probes the other nodes' agents, and reports the failure with the unreachable ones
(the coordinator evicts those at once: a killed node is noticed without waiting for its lease to expire).
"""

from __future__ import annotations

import logging
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from pliant.agent.contract import AgentConfig, AgentError, AgentState, GroupResult
from pliant.agent.metrics import AgentMetrics
from pliant.agent.stores import NodeStore, reachable
from pliant.agent.workers import WorkerCommand, WorkerGroup, Zygote, worker_base_env
from pliant.coordinator.client import CoordinatorClient, JoinGrant
from pliant.coordinator.contract import (
    CoordinatorError,
    Generation,
    JobState,
    NotFound,
    PermissionDenied,
    WatchEvent,
)
from pliant.env import WorkerEnv
from pliant.metrics import MetricsServer, serve_metrics
from pliant.net import free_port
from pliant.tls import Role

__all__ = ["Agent"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _LeaseLost:
    error: Exception


@dataclass(frozen=True)
class _Signal:
    signum: int


class Agent:
    """One node's supervisor. ``run()`` returns the process exit code: 0 when the job succeeded or this node left
    gracefully, 1 when the job failed.

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
        self.zygote = zygote
        self.address = ""
        self.tls = config.tls.load(expect=Role.AGENT) if config.tls else None
        self.client = CoordinatorClient(list(config.coordinator), self.tls, retry_for_s=config.heartbeat_retry_s)
        self.join_token = config.join_token
        self.state = AgentState.JOINING
        self.generation: Generation | None = None
        self.group: WorkerGroup | None = None
        self.grant: JoinGrant | None = None
        self.job_reason = ""
        self.store: NodeStore | None = None
        self._events: queue.Queue[object] = queue.Queue()
        self._stop = threading.Event()
        registry = CollectorRegistry(auto_describe=True) if registry is None else registry
        self.metrics = AgentMetrics(registry, config.spec.job_id, config.node_id)
        self.metrics.set_state(self.state)
        self.metrics_server: MetricsServer | None = None
        self._tracked: list[WorkerGroup] = []  # groups whose workers may not all have been seen exiting

    # -- lifecycle -----------------------------------------------------------------------------------------------------

    def run(self) -> int:
        """Join, supervise until the job ends or SIGTERM, clean up, and return the exit code."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda signum, _frame: self._events.put(_Signal(signum)))
        try:
            if self.zygote is None and not self.config.no_python:
                self.zygote = Zygote(self.base_env)  # imports torch while the agent joins
            port = self.config.store_port or free_port(self.config.host)
            self.address = f"{self.config.host}:{port}"
            if self.config.metrics_port is not None:
                self.metrics_server = serve_metrics(self.metrics.registry,
                                                    f"{self.config.host}:{self.config.metrics_port}")  # fmt: skip
            self._join()
            threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()
            threading.Thread(target=self._watch_loop, name="watch", daemon=True).start()
            # The join grace runs while the store starts (the agent's torch import); heartbeats are already going.
            self.store = NodeStore(self.config.host, port)
            return self._loop()
        except (CoordinatorError, AgentError) as exc:
            logger.error("agent %s: %s", self.config.node_id, exc)
            print(f"pliant agent: error: {exc}", file=sys.stderr, flush=True)
            return 1
        finally:
            self._stop.set()
            if self.group is not None:
                self.group.stop(self.config.stop_grace_s)
            if self.zygote is not None:
                self.zygote.close()
            if self.store is not None:
                self.store.close()
            self.client.close()
            if self.metrics_server is not None:
                self.metrics_server.close()
            self.metrics.close()

    def _set_state(self, state: AgentState, why: str = "") -> None:
        if state is not self.state:
            logger.info("agent %s: %s -> %s%s", self.config.node_id, self.state.value, state.value,
                        f" ({why})" if why else "")  # fmt: skip
            self.state = state
            self.metrics.set_state(state)

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
            raise AgentError(
                f"job {spec.job_id!r} does not exist, and this agent may not create it ({exc}); an admin creates it "
                f"with `pliant job create {spec.job_id}` and gives the agents its join token (--join-token)"
            ) from exc
        finally:
            if client is not self.client:
                client.close()
        if not created and not self.join_token:
            raise AgentError(f"job {spec.job_id!r} already exists; pass its join token with --join-token (or "
                             f"PLIANT_JOIN_TOKEN): the one printed when the job was created")  # fmt: skip
        self.join_token = token
        logger.info("agent %s: job %s %s", self.config.node_id, spec.job_id, "created" if created else "exists")

    def _join(self) -> None:
        job = self.config.spec.job_id
        if not self.join_token:
            self._create_job()
        try:
            self.grant = self.client.join(job, self.config.node_id, self.address, self.config.nproc_per_node,
                                          self.join_token)  # fmt: skip
        except NotFound:
            self._create_job()
            self.grant = self.client.join(job, self.config.node_id, self.address, self.config.nproc_per_node,
                                          self.join_token)  # fmt: skip
        self._set_state(AgentState.WAITING, f"joined job {job}")

    # -- background threads --------------------------------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        failing = False
        while not self._stop.is_set():
            grant = self.grant
            assert grant is not None
            if self._stop.wait(grant.heartbeat_interval_s):
                return
            try:
                step = self.metrics.latest_step()
                self.client.heartbeat(self.config.spec.job_id, self.config.node_id, grant.lease_id, step)
                if failing:
                    logger.info("agent %s: heartbeats reach the coordinator again", self.config.node_id)
                failing = False
            except (NotFound, PermissionDenied) as exc:  # the membership is gone (or another's): join again
                if grant is self.grant:  # not already re-joined
                    self._events.put(_LeaseLost(exc))
                    while self.grant is grant and not self._stop.wait(0.05):
                        pass
            except CoordinatorError as exc:
                self.metrics.heartbeat_failures.inc()
                if not failing:
                    logger.warning("agent %s: heartbeat failed (%s); retrying", self.config.node_id, exc)
                failing = True

    def _watch_loop(self) -> None:
        next_number = 0
        while not self._stop.is_set():
            try:
                for event in self.client.watch(self.config.spec.job_id, next_number):
                    if event.generation is not None:
                        next_number = event.generation.number + 1
                    self._events.put(event)
                    if self._stop.is_set():
                        return
            except CoordinatorError as exc:
                if self._stop.is_set():
                    return
                logger.warning("agent %s: generation watch failed (%s); resuming", self.config.node_id, exc)
                self._stop.wait(1.0)

    # -- the main loop -------------------------------------------------------------------------------------------------

    def _loop(self) -> int:
        while True:
            try:
                event = self._events.get(timeout=0.1)
            except queue.Empty:
                event = None
            if isinstance(event, WatchEvent):
                code = self._on_watch_event(event)
                if code is not None:
                    return code
            elif isinstance(event, _LeaseLost):
                self._on_lease_lost(event.error)
            elif isinstance(event, _Signal):
                return self._leave(event.signum)
            if self.group is not None:
                result = self.group.poll()
                if result is not None:
                    self._on_group_done(result)
            self._track_workers()

    def _track_workers(self) -> None:
        """Feed the worker gauges and exit counters; forget groups whose every exit was counted."""
        for group in self._tracked:
            if group is not self.group:
                group.poll()  # a stopped group was reaped; this only refreshes cached exit codes
        exits = [e for g in self._tracked for e in g.exits()]
        self.metrics.track(exits, self.group.exits() if self.group else [])
        self._tracked = [g for g in self._tracked if g is self.group or any(c is None for _p, c in g.exits())]

    def _on_watch_event(self, event: WatchEvent) -> int | None:
        gen = event.generation
        if gen is not None and (self.generation is None or gen.number > self.generation.number):
            self._on_generation(gen)
        if event.status.state.terminal:
            return self._on_job_finished(event.status.state, event.status.reason)
        return None

    def _on_generation(self, gen: Generation) -> None:
        self.generation = gen
        logger.info("agent %s: generation %d (%s): world size %d on %s", self.config.node_id, gen.number, gen.reason,
                    gen.world_size, ",".join(gen.node_ids) or "no nodes")  # fmt: skip
        if self.group is not None:
            self.group.stop(self.config.stop_grace_s, self.config.rescale_grace_s)
            self.group = None
        if self.config.node_id not in gen.node_ids:
            why = "spare: the job is at max nodes" if gen.members else "the job waits for more nodes"
            self._set_state(AgentState.WAITING, why)
            return
        try:
            self._start_workers(gen)
        except AgentError as exc:
            # Node rank 0's agent is gone: report it, so the coordinator evicts it now rather than at lease expiry.
            logger.warning("agent %s: cannot start generation %d: %s", self.config.node_id, gen.number, exc)
            self._report_failure(gen, -1, str(exc))

    def _start_workers(self, gen: Generation) -> None:
        assert self.store is not None
        me = next(m for m in gen.members if m.node_id == self.config.node_id)
        if me.node_rank == 0:
            master_port = self.store.open_generation(gen.number)
        else:
            master_port = NodeStore.generation_port(gen.store_address, gen.number, timeout_s=10)
        master_addr = gen.store_address.rsplit(":", 1)[0]
        envs = [
            WorkerEnv(
                rank=me.rank_offset + local_rank,
                local_rank=local_rank,
                world_size=gen.world_size,
                local_world_size=me.nproc,
                node_rank=me.node_rank,
                num_nodes=len(gen.members),
                master_addr=master_addr,
                master_port=master_port,
                job_id=self.config.spec.job_id,
                generation=gen.number,
                max_restarts=self.config.spec.max_restarts,
                node_id=self.config.node_id,
                agent_store=self.store.address,
                checkpoint_dir=self.config.checkpoint_dir,
                metrics_dir=self.metrics.worker_dir,
            )
            for local_rank in range(me.nproc)
        ]
        log_dir = None
        if self.config.log_dir:
            log_dir = Path(self.config.log_dir) / self.config.spec.job_id / f"gen-{gen.number}"
        self.group = WorkerGroup(gen.number, envs, self.command, log_dir, self.base_env, self.zygote)
        self.group.start()
        self._tracked.append(self.group)
        self.metrics.group_started(gen.number)
        self._set_state(AgentState.RUNNING, f"generation {gen.number}, ranks {envs[0].rank}..{envs[-1].rank}")

    def _on_group_done(self, result: GroupResult) -> None:
        assert self.group is not None and self.generation is not None
        gen = self.generation
        if result.succeeded:
            logger.info("agent %s: all workers of generation %d exited 0", self.config.node_id, gen.number)
            self.group = None
            self._set_state(AgentState.WAITING, "workers done; waiting for the job to finish")
            try:
                self.client.report_success(self.config.spec.job_id, self.config.node_id, gen.number, self._lease())
            except (NotFound, PermissionDenied) as exc:  # the membership is gone: the heartbeat re-joins
                logger.warning("agent %s: success of generation %d not reported: %s", self.config.node_id,
                               gen.number, exc)  # fmt: skip
            return
        if result.saved_for_rescale:
            # Workers checkpointed and exited for a rescale another node asked for; the new generation follows.
            self.group = None
            self._set_state(AgentState.WAITING, f"workers of generation {gen.number} saved for a rescale")
            return
        failure = result.first_failure
        assert failure is not None
        local_rank, code = failure
        self.group.stop(self.config.stop_grace_s)
        self.group = None
        message = f"local rank {local_rank} (rank {self._rank_of(local_rank)}) exited with code {code}"
        logger.warning("agent %s: generation %d: %s", self.config.node_id, gen.number, message)
        self._set_state(AgentState.WAITING, "worker failure reported")
        self._report_failure(gen, code, message)

    def _lease(self) -> int:
        return self.grant.lease_id if self.grant else 0

    def _rank_of(self, local_rank: int) -> int:
        gen = self.generation
        me = next((m for m in gen.members if m.node_id == self.config.node_id), None) if gen else None
        return me.rank_offset + local_rank if me else local_rank

    def _report_failure(self, gen: Generation, code: int, message: str) -> None:
        others = [m for m in gen.members if m.node_id != self.config.node_id]
        unreachable = [m.node_id for m in others if not reachable(m.address)]
        if unreachable:
            logger.warning("agent %s: agents of %s are unreachable", self.config.node_id, ",".join(unreachable))
        try:
            accepted, current = self.client.report_failure(
                self.config.spec.job_id, self.config.node_id, gen.number, code, message, unreachable, self._lease()
            )
        except (NotFound, PermissionDenied) as exc:  # evicted meanwhile; the heartbeat re-joins
            logger.warning("agent %s: failure of generation %d not reported: %s", self.config.node_id, gen.number, exc)
            return
        logger.info("agent %s: failure of generation %d reported (%s; current generation %d)", self.config.node_id,
                    gen.number, "accepted" if accepted else "stale", current)  # fmt: skip

    def _on_lease_lost(self, error: Exception) -> None:
        logger.warning("agent %s: membership lost (%s); stopping workers and joining again", self.config.node_id, error)
        if self.group is not None:
            self.group.stop(self.config.stop_grace_s)
            self.group = None
        self._set_state(AgentState.JOINING, "lease lost")
        self._join()

    def _on_job_finished(self, state: JobState, reason: str) -> int:
        self.job_reason = reason
        if state is JobState.SUCCEEDED and self.group is not None:
            deadline = time.monotonic() + self.config.finish_grace_s
            while self.group.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
        if self.group is not None:
            self.group.stop(self.config.stop_grace_s)
            self.group = None
        if state is JobState.SUCCEEDED:
            self._set_state(AgentState.SUCCEEDED, reason)
            return 0
        self._set_state(AgentState.FAILED, reason)
        print(f"pliant: job {self.config.spec.job_id} failed: {reason}", file=sys.stderr, flush=True)
        return 1

    def _leave(self, signum: int) -> int:
        logger.info("agent %s: %s received; leaving the job", self.config.node_id, signal.Signals(signum).name)
        if self.group is not None:
            self.group.stop(self.config.stop_grace_s, self.config.rescale_grace_s)
            self.group = None
        if self.grant is not None:
            try:
                self.client.leave(self.config.spec.job_id, self.config.node_id, self.grant.lease_id)
            except CoordinatorError as exc:
                logger.warning("agent %s: leave failed (%s); the lease expires by itself", self.config.node_id, exc)
        self._set_state(AgentState.LEFT, "graceful leave")
        return 0
