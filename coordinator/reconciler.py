"""The reconciler: while this replica leads, read each job, ask the planner, and execute the decision, fenced.

It wakes on any change under the jobs prefix (a prefix watch that survives etcd restarts), at the earliest deadline a
planner asked for, and every ``resync_s`` regardless. It is the only writer of generations and of job state
transitions that are not API calls.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pliant.coordinator.contract import (
    CoordinatorError,
    FailJob,
    FencingError,
    JobSnapshot,
    JobState,
    JobStatus,
    Keep,
    NewGeneration,
    NotFound,
    WaitUntil,
)
from pliant.coordinator.election import LeaderElection
from pliant.coordinator.etcd_watch import PrefixWatch
from pliant.coordinator.metrics import CoordinatorMetrics
from pliant.coordinator.planner import plan
from pliant.coordinator.store import EtcdStore, Fence

__all__ = ["Reconciler"]

logger = logging.getLogger(__name__)

PACING_FACTOR = 2.0  # after a pass that took t seconds, the next one starts no sooner than PACING_FACTOR * t later
PACING_MAX_S = 0.25


class Reconciler:
    """Leader-only loop that turns planner decisions into etcd writes.

    Args:
        store: the etcd store.
        election: this replica's election; the loop idles unless it leads.
        clock: wall clock (the planner's ``now``).
        resync_s: longest sleep between passes.
        metrics: the replica's metrics (plan latency, per-job gauges, generations by reason).
        finished_job_ttl_s: a finished job is deleted this long after it finished (0: never), as Kubernetes'
            ``ttlSecondsAfterFinished``.
    """

    def __init__(
        self,
        store: EtcdStore,
        election: LeaderElection,
        clock: Callable[[], float] = time.time,
        resync_s: float = 5.0,
        metrics: CoordinatorMetrics | None = None,
        finished_job_ttl_s: float = 0.0,
    ) -> None:
        self._store = store
        self._election = election
        self._clock = clock
        self._resync_s = resync_s
        self._metrics = metrics
        self._finished_job_ttl_s = finished_job_ttl_s
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._watch = PrefixWatch(store, store.jobs_prefix, self._dirty.set)
        self._thread = threading.Thread(target=self._run, name="reconciler", daemon=True)

    def start(self) -> Reconciler:
        self._watch.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._dirty.set()
        self._watch.stop()
        self._thread.join(10)

    def poke(self) -> None:
        """Ask for a pass now (e.g. after an API call changed a job)."""
        self._dirty.set()

    def _run(self) -> None:
        delay = 0.1
        while not self._stop.is_set():
            fence = self._election.fence
            if fence is None:
                self._election.wait_for(True, 0.5)
                self._dirty.set()  # a new leader re-reads everything
                continue
            self._dirty.clear()
            wake = self._clock() + self._resync_s
            started = time.perf_counter()
            try:
                for job in self._store.list_job_ids():
                    deadline = self.reconcile(job, fence)
                    if deadline is not None:
                        wake = min(wake, deadline)
                delay = 0.1
            except CoordinatorError as exc:
                logger.warning("reconcile pass failed (%s); retrying in %.1fs", exc, delay)
                self._stop.wait(delay)
                delay = min(delay * 2, 2.0)
                continue
            # Pace passes by their own cost: a burst of changes (1000 joins) is read in a few big passes instead of
            # back-to-back ones that take the CPU the joins need. Small jobs' passes take milliseconds: no delay.
            self._stop.wait(min(PACING_MAX_S, PACING_FACTOR * (time.perf_counter() - started)))
            self._dirty.wait(max(0.0, wake - self._clock()))

    def reconcile(self, job: str, fence: Fence) -> float | None:
        """Plan and execute once for ``job``. Returns the wall-clock time to look again, if the planner asked for one.

        Raises:
            Unavailable: etcd did not answer.
        """
        try:
            snap = self._store.read_job(job)
        except NotFound:
            return None
        now = self._clock()
        if snap.status.state.terminal and self._finished_job_ttl_s:
            expires = snap.status.since + self._finished_job_ttl_s
            if now < expires:
                return expires
            self._store.delete_job(job)
            logger.info("job %s deleted %.0fs after it %s (finished-job TTL)", job, now - snap.status.since,
                        snap.status.state.value)  # fmt: skip
            return None
        started = time.perf_counter()
        decision = plan(snap, now)
        if self._metrics:
            self._metrics.observe_plan(snap, time.perf_counter() - started)
        try:
            return self._execute(snap, decision, fence, now)
        except FencingError as exc:
            logger.info("job %s: %s; re-reading", job, exc)
            self._dirty.set()
            return None

    def _execute(self, snap: JobSnapshot, decision: object, fence: Fence, now: float) -> float | None:
        job, status = snap.spec.job_id, snap.status
        if isinstance(decision, Keep):
            return None
        if isinstance(decision, NewGeneration):
            gen = decision.generation
            since = status.since if decision.state is status.state else now
            self._store.publish(snap, gen, JobStatus(decision.state, since), fence)
            if self._metrics:
                self._metrics.observe_published(decision)
            logger.info(
                "job %s: generation %d published (%s): world size %d on %s; job %s",
                job, gen.number, gen.reason, gen.world_size, ",".join(gen.node_ids) or "no nodes", decision.state.value,
            )  # fmt: skip
            return None
        if isinstance(decision, WaitUntil):
            if decision.state is not status.state:
                self._store.set_status(job, JobStatus(decision.state, now, decision.why), fence)
                logger.info("job %s: %s -> %s (%s)", job, status.state.value, decision.state.value, decision.why)
            return decision.deadline
        if isinstance(decision, FailJob):
            self._store.set_status(job, JobStatus(JobState.FAILED, now, decision.reason), fence)
            logger.error("job %s failed: %s", job, decision.reason)
            return None
        raise TypeError(f"unknown planner decision {decision!r}")
