"""The agent's Prometheus metrics, and the node's single scrape target.

The agent's own series (state, workers by state, exits by code, restarts, generation, heartbeat failures, hangs,
rescales by path, goodput and badput seconds) and its workers' are served from a registry its owner injects, each
sample with the agent's ``job_id``. Workers are other processes: they write prometheus_client multiprocess files into
a directory the agent owns (``PROMETHEUS_MULTIPROC_DIR``, set through the env contract), and the agent's registry
reads them at scrape time, so one endpoint per node serves the whole node. When a worker exits the agent marks it
dead, which drops its ``live*`` gauges; its counters and histograms stay, so totals never go backwards across
generations. Labelled series whose values are known in advance (the workers by state, the rescale paths, the badput
causes) exist at zero from the start.
"""

from __future__ import annotations

import logging
import struct
import threading
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Info
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector

from pliant import scratch
from pliant.agent.contract import AgentState
from pliant.agent.goodput import CAUSES, PHASES, PRODUCTIVE, RECOVERIES

__all__ = ["RESCALE_PATHS", "AgentMetrics", "WorkerExit"]

WORKER_METRICS_PREFIX = "pliant-metrics-"  # the workers' metric files: a scratch directory (pliant.scratch) per agent
RESCALE_PATHS = ("in-place", "restart")

logger = logging.getLogger(__name__)

WorkerExit = tuple[int, int | None]
"""(pid, exit code or None while it runs) of one worker process."""


class _JobLabelled(Collector):
    """The families of ``inner`` with ``job_id`` on every sample, so the node's endpoint serves the agent's and its
    workers' series each with the job it belongs to (the coordinator's, in the same registry under ``pliant run``,
    keep their own)."""

    def __init__(self, inner: Collector, job_id: str) -> None:
        self.inner, self.job_id = inner, job_id

    def collect(self) -> Iterable[Metric]:
        for family in self.inner.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [
                sample._replace(labels={**sample.labels, "job_id": self.job_id}) for sample in family.samples
            ]
            yield labelled


class AgentMetrics:
    """Every series one agent exports, plus its workers' (read from their multiprocess directory), each with the
    agent's ``job_id``.

    Threads: the agent's loop thread updates the series; the heartbeat thread reads :meth:`latest_step` and
    :meth:`goodput_seconds` (the seconds charged, guarded by ``_lock``); the metrics server's thread scrapes.

    Args:
        registry: where to register (never the global registry).
        job_id: the job the agent serves.
        node_id: the agent's node id.
    """

    def __init__(self, registry: CollectorRegistry, job_id: str, node_id: str) -> None:
        self.registry = registry
        own = CollectorRegistry(auto_describe=True)  # served through _JobLabelled, as the workers' series are
        Info("pliant_agent", "The node this agent is (instance: the scrape target).", registry=own).info(
            {"node_id": node_id}
        )
        self.worker_dir = scratch.make(WORKER_METRICS_PREFIX, node_id)
        self._workers = MultiProcessCollector(None, path=self.worker_dir)
        registry.register(_JobLabelled(own, job_id))
        registry.register(_JobLabelled(self._workers, job_id))
        self.state = Gauge("pliant_agent_state", "1 for the agent's state, 0 for the others.", ["state"], registry=own)
        self.workers = Gauge(
            "pliant_agent_workers", "Worker processes of the current group, by state.", ["state"], registry=own
        )
        self.exits = Counter(
            "pliant_agent_worker_exits",
            "Worker process exits, by exit code (negative: signal).",
            ["code"],
            registry=own,
        )
        self.restarts = Counter(
            "pliant_agent_worker_restarts",
            "Worker groups this agent started after its first (new generations and failures).",
            registry=own,
        )
        self.generation = Gauge("pliant_agent_generation", "The generation this agent last followed.", registry=own)
        self.heartbeat_failures = Counter(
            "pliant_agent_heartbeat_failures", "Heartbeats that did not reach a coordinator.", registry=own
        )
        self.hangs = Counter(
            "pliant_agent_hangs",
            "Worker groups this agent stopped because a worker made no progress for the hang (or start) timeout.",
            registry=own,
        )
        self.rescales = Counter(
            "pliant_agent_rescales",
            "New generations this agent's running group went through, by path: in-place (the workers re-formed "
            "with their processes and state) or restart (stopped, checkpointed, new processes).",
            ["path"],
            registry=own,
        )
        self.goodput = Counter(
            "pliant_agent_goodput_seconds",
            "Seconds this node's workers spent on steps beyond the highest the node completed (pliant.agent.goodput).",
            registry=own,
        )
        self.badput = Counter(
            "pliant_agent_badput_seconds",
            "Seconds of this node in the job that trained no new step, by cause (start, rescale, failure, redone, "
            "checkpoint, waiting) and, for a rescale or a failure, phase (decide, restart, restore; see "
            "pliant.agent.goodput).",
            ["cause", "phase"],
            registry=own,
        )
        for state in ("running", "exited"):
            self.workers.labels(state)
        for path in RESCALE_PATHS:
            self.rescales.labels(path)
        for cause in CAUSES:
            for phase in PHASES if cause in RECOVERIES else ("",):
                self.badput.labels(cause, phase)
        self._groups_started = 0
        self._counted: set[int] = set()
        self._lock = threading.Lock()
        self._seconds = dict.fromkeys((PRODUCTIVE, *CAUSES), 0.0)  # goodput and badput by category (under _lock)

    def charge(self, category: str, phase: str, seconds: float) -> None:
        """Add ``seconds`` to goodput (:data:`pliant.agent.goodput.PRODUCTIVE`) or to a badput cause and its phase (the
        agent's loop thread)."""
        if category == PRODUCTIVE:
            self.goodput.inc(seconds)
        else:
            self.badput.labels(category, phase).inc(seconds)
        with self._lock:
            self._seconds[category] += seconds

    def goodput_seconds(self) -> dict[str, float]:
        """The node's seconds so far by what they went to (the heartbeat thread reports them)."""
        with self._lock:
            return dict(self._seconds)

    def set_state(self, current: AgentState) -> None:
        for state in AgentState:
            self.state.labels(state.value).set(1 if state is current else 0)

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
        scratch.remove(self.worker_dir)
