"""The agent's Prometheus metrics, and the node's single scrape target.

The agent's own series (state, workers by state, exits by code, restarts, generation, heartbeat failures) live in a
registry its owner injects. Workers are other processes: they write prometheus_client multiprocess files into a
directory the agent owns (``PROMETHEUS_MULTIPROC_DIR``, set through the env contract), and the agent's registry reads
them at scrape time, so one endpoint per node serves the whole node. When a worker exits the agent marks it dead, which
drops its ``live*`` gauges; its counters and histograms stay, so totals never go backwards across generations.
"""

from __future__ import annotations

import logging
import shutil
import struct
import tempfile
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Info
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from pliant.agent.contract import AgentState

__all__ = ["AgentMetrics", "WorkerExit"]

logger = logging.getLogger(__name__)

WorkerExit = tuple[int, int | None]
"""(pid, exit code or None while it runs) of one worker process."""


class AgentMetrics:
    """Every series one agent exports, plus its workers' (read from their multiprocess directory).

    Args:
        registry: where to register (never the global registry).
        job_id: the job the agent serves.
        node_id: the agent's node id.
    """

    def __init__(self, registry: CollectorRegistry, job_id: str, node_id: str) -> None:
        self.registry = registry
        # Worker series carry no job label; join them to this one: `* on (instance) group_left (job_id) ...`.
        Info("pliant_agent", "The job and node this agent serves.", registry=registry).info(
            {"job_id": job_id, "node_id": node_id}
        )
        self.worker_dir = tempfile.mkdtemp(prefix=f"pliant-metrics-{node_id}-")
        self._workers = MultiProcessCollector(registry, path=self.worker_dir)
        self.state = Enum(
            "pliant_agent_state", "The agent's state.", states=[s.value for s in AgentState], registry=registry
        )
        self.workers = Gauge(
            "pliant_agent_workers", "Worker processes of the current group, by state.", ["state"], registry=registry
        )
        self.exits = Counter(
            "pliant_agent_worker_exits",
            "Worker process exits, by exit code (negative: signal).",
            ["code"],
            registry=registry,
        )
        self.restarts = Counter(
            "pliant_agent_worker_restarts",
            "Worker groups this agent started after its first (new generations and failures).",
            registry=registry,
        )
        self.generation = Gauge(
            "pliant_agent_generation", "The generation this agent last followed.", registry=registry
        )
        self.heartbeat_failures = Counter(
            "pliant_agent_heartbeat_failures", "Heartbeats that did not reach a coordinator.", registry=registry
        )
        self.hangs = Counter(
            "pliant_worker_hangs",
            "Worker groups this agent stopped because a worker made no progress for the hang (or start) timeout.",
            registry=registry,
        )
        self.rescales = Counter(
            "pliant_agent_rescales",
            "New generations this agent's running group went through, by path: in-place (the workers re-formed "
            "with their processes and state) or restart (stopped, checkpointed, new processes).",
            ["path"],
            registry=registry,
        )
        self._groups_started = 0
        self._counted: set[int] = set()

    def set_state(self, state: AgentState) -> None:
        self.state.state(state.value)

    def group_started(self, generation: int) -> None:
        if self._groups_started:
            self.restarts.inc()
        self._groups_started += 1
        self.generation.set(generation)

    def track(self, workers: Iterable[WorkerExit], current: Iterable[WorkerExit]) -> None:
        """Count each worker exit once and update the gauges.

        Args:
            workers: (pid, exit code) of every worker process the agent still tracks, of any generation.
            current: those of the current group.
        """
        running = 0
        for pid, code in workers:
            if code is None:
                running += 1
            elif pid not in self._counted:
                self._counted.add(pid)
                self.exits.labels(str(code)).inc()
                mark_process_dead(pid, self.worker_dir)
        self.workers.labels("running").set(running)
        self.workers.labels("exited").set(sum(code is not None for _pid, code in current))

    def latest_step(self) -> int:
        """The highest ``pliant_worker_step`` the node's live workers published (0: none)."""
        step = 0.0
        try:
            for family in self._workers.collect():
                if family.name == "pliant_worker_step":
                    step = max([step, *(s.value for s in family.samples)])
        except (OSError, ValueError, struct.error) as exc:  # a file being created, written or removed: next time
            logger.debug("reading worker metrics failed: %s", exc)
        return int(step)

    def close(self) -> None:
        shutil.rmtree(self.worker_dir, ignore_errors=True)
