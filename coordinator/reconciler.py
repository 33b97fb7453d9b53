"""The reconciler: while this replica leads, read each job, ask the policies and the planner, and execute, fenced.

It wakes on any change under the jobs prefix (a prefix watch that survives etcd restarts), at the earliest deadline a
planner or the liveness sweep asked for, and every ``resync_s`` regardless. A pass reads only the jobs that changed
(the keys the watch saw, the jobs an API call poked) and those whose deadline came; every ``resync_s``, after a new
term, a re-armed watch or a pass that etcd broke, it reads them all. So a leader of many jobs that wait and change
nothing reads none of them between those full passes. Member keys that arrive while a job's plan waits for more
members than it can have yet (its minimum, or its maximum while it batches joins) are counted, not read
(:func:`needs_read`): a burst of thousands of Joins is read once it could fill the job, or at the plan's deadline.
It is the only writer of generations, of evictions, and of job state transitions that are not API calls.

Each job is reconciled on its own: a job whose records cannot be read (or whose pass raises anything) is logged,
counted (``pliant_coordinator_unreadable_jobs``) and skipped, and every other job goes on. etcd not answering ends the
pass (it is retried with backoff); when etcd answers again, and whenever this replica becomes leader, members get a
full heartbeat TTL before anyone is evicted (:mod:`pliant.coordinator.policy`). Any other error outside one job's pass
is a fault: the replica resigns (another takes over) and reports NOT_SERVING until it campaigns again.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable

from pliant.backoff import Backoff
from pliant.coordinator.contract import (
    CoordinatorError,
    CorruptRecord,
    FailJob,
    FencingError,
    JobSnapshot,
    JobState,
    JobStatus,
    JobStore,
    Keep,
    NewGeneration,
    NotFound,
    Outcome,
    Unavailable,
    WaitUntil,
)
from pliant.coordinator.election import LeaderElection
from pliant.coordinator.etcd_watch import PrefixWatch
from pliant.coordinator.metrics import CoordinatorMetrics
from pliant.coordinator.planner import plan
from pliant.coordinator.policy import (
    REPORT_GRACE_S,
    SILENT_FRACTION,
    LeaderClock,
    overdue_members,
    reported_evictions,
    silent_members,
)
from pliant.coordinator.store_base import Fence

__all__ = ["Reconciler", "needs_read"]

logger = logging.getLogger(__name__)

PACING_FACTOR = 2.0  # after a pass that took t seconds, the next one starts no sooner than PACING_FACTOR * t later
PACING_MAX_S = 0.25
SWEEP_MIN_S = 0.5  # lease ages of one job are read at most this often


def needs_read(quiet: tuple[int, int] | None, arrivals: int) -> bool:
    """Whether a job whose only changes since its last read are ``arrivals`` member keys must be read again now.

    Args:
        quiet: from that read, when its plan waited for members: (member keys it had, how many it needs before an
            arrival alone can change the plan: its min nodes while it waits for them, its max while it batches joins).
            None: the plan waits for nothing of the kind, so any change is read.
        arrivals: member keys changed since (an upper bound of the members that came: a key may also have gone).
    """
    return quiet is None or quiet[0] + arrivals >= quiet[1]


class Reconciler:
    """Leader-only loop that turns planner decisions into etcd writes.

    Args:
        store: the store (etcd's, or a fake in unit tests).
        election: this replica's election; the loop idles unless it leads.
        clock: the leader's monotonic clock: every deadline (the planner's ``now``, the sweep, the finished-job TTL).
        wall: wall clock, only for the times written for people to read (a state's ``since``, a generation's
            ``created_at``).
        resync_s: every job is read at least this often, whatever the watch saw (a full pass).
        metrics: the replica's metrics (plan latency, per-job gauges, generations by reason).
        finished_job_ttl_s: a finished job is deleted this long after it finished (0: never), as Kubernetes'
            ``ttlSecondsAfterFinished``.
    """

    def __init__(
        self,
        store: JobStore,
        election: LeaderElection | None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        resync_s: float = 30.0,
        metrics: CoordinatorMetrics | None = None,
        finished_job_ttl_s: float = 0.0,
        jobs_prefix: str = "",
    ) -> None:
        self._store = store
        self._election = election
        self._clock = clock
        self._wall = wall
        self._times = LeaderClock()
        self._heard_since = clock()
        self._next_sweep: dict[str, float] = {}
        self.unreadable: dict[str, str] = {}  # job -> why it is skipped (leader only)
        self._resync_s = resync_s
        self._metrics = metrics
        self._finished_job_ttl_s = finished_job_ttl_s
        self._dirty = threading.Event()
        self._stop = threading.Event()
        # What the next pass reads: the watch thread and API calls add, the loop takes (under _lock).
        self._lock = threading.Lock()
        self._changed: set[str] = set()  # jobs whose keys changed
        self._arrivals: dict[str, int] = {}  # job -> member keys changed since it was last read, and nothing else
        self._full = True  # every job
        # job -> (member keys it had, how many it needs before an arrival alone can change its plan), from the job's
        # last read whose decision was such a wait (loop thread writes, the pass reads under _lock)
        self._quiet: dict[str, tuple[int, int]] = {}
        self._due: dict[str, float] = {}  # job -> leader-clock time its next look is due (loop thread only)
        self._full_at = 0.0  # leader-clock time of the next full pass (loop thread only)
        self._jobs_prefix = jobs_prefix
        self._watch = (
            PrefixWatch(store, jobs_prefix, self._dirty.set, on_keys=self._keys_changed, on_rearm=self.poke)
            if jobs_prefix
            else None
        )
        self._thread = threading.Thread(target=self._run, name="reconciler", daemon=True)

    def start(self) -> Reconciler:
        if self._watch is not None:
            self._watch.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._dirty.set()
        if self._watch is not None:
            self._watch.stop()
        if self._thread.is_alive():
            self._thread.join(10)

    def poke(self, job: str = "") -> None:
        """Ask for a pass now that reads ``job`` (after an API call changed it), or every job ("")."""
        with self._lock:
            if job:
                self._changed.add(job)
            else:
                self._full = True
        self._dirty.set()

    def _keys_changed(self, keys: list[str]) -> None:
        """The watch saw ``keys`` change: the jobs they belong to are read at the next pass, except a job whose only
        changes are member keys (arrivals) while its plan waits for more members than it can have yet
        (:func:`needs_read`)."""
        with self._lock:
            for key in keys:
                if not key.startswith(self._jobs_prefix):
                    continue
                job, _, rest = key[len(self._jobs_prefix) :].partition("/")
                if rest.startswith("members/"):
                    self._arrivals[job] = self._arrivals.get(job, 0) + 1
                else:
                    self._changed.add(job)

    def lead(self) -> None:
        """A new term: forget the last term's clocks, and give every member a full TTL before any eviction."""
        self._times.reset()
        self._next_sweep.clear()
        with self._lock:
            self._quiet.clear()
        self._heard_since = self._clock()
        self.poke()

    def _run(self) -> None:
        assert self._election is not None
        backoff, term = Backoff(0.1, 2.0), None
        while not self._stop.is_set():
            fence = self._election.fence
            if fence is None:
                self._election.wait_for(True, 0.5)
                self._dirty.set()  # a new leader re-reads everything
                continue
            if fence != term:
                term = fence
                self.lead()
            self._dirty.clear()
            started = time.perf_counter()
            try:
                wake = self._pass(fence)
            except CoordinatorError as exc:
                self.poke()  # the pass was cut short: the next reads every job
                if not backoff.failing:
                    logger.warning("reconcile pass failed (%s); retrying with backoff", exc)
                self._stop.wait(backoff.next())
                continue
            except Exception as exc:
                logger.exception("reconciler fault; this replica resigns")
                if self._metrics:
                    self._metrics.faults.inc()
                self._election.fault(f"reconciler: {type(exc).__name__}: {exc}")
                term = None
                continue
            if backoff.failing:  # etcd answers again: members get a full TTL to reach us before any eviction
                logger.info("reconciler reaches etcd again; every member gets a full heartbeat TTL")
                self._heard_since = self._clock()
                backoff.reset()
            # Pace passes by their own cost: a burst of changes (1000 joins) is read in a few big passes instead of
            # back-to-back ones that take the CPU the joins need. Small jobs' passes take milliseconds: no delay.
            self._stop.wait(min(PACING_MAX_S, PACING_FACTOR * (time.perf_counter() - started)))
            self._dirty.wait(max(0.0, wake - self._clock()))

    def _pass(self, fence: Fence) -> float:
        """One pass: every job when a full one is wanted or due, else the jobs that changed and those whose deadline
        came. Returns the leader-clock time of the next pass."""
        now = self._clock()
        with self._lock:
            full, self._full = self._full or now >= self._full_at, False
            changed, self._changed = self._changed, set()
            for job, count in list(self._arrivals.items()):
                if needs_read(self._quiet.get(job), count):
                    changed.add(job)
        if full:
            return self.pass_once(fence)
        jobs = changed | {job for job, due in self._due.items() if due <= now}
        self._reconcile_each(sorted(jobs), fence)
        return min([self._full_at, *self._due.values()])

    def pass_once(self, fence: Fence) -> float:
        """Reconcile every job once, each on its own (a full pass). Returns the leader-clock time of the next pass.

        Raises:
            CoordinatorError: etcd did not answer (the pass is over; nothing half-done is left).
        """
        self._full_at = self._clock() + self._resync_s
        jobs = self._store.list_job_ids()
        self._due = {job: due for job, due in self._due.items() if job in set(jobs)}
        self._reconcile_each(jobs, fence)
        for gone in set(self.unreadable) - set(jobs):
            del self.unreadable[gone]
        if self._metrics:
            self._metrics.unreadable_jobs.set(len(self.unreadable))
        return min([self._full_at, *self._due.values()])

    def _reconcile_each(self, jobs: list[str], fence: Fence) -> None:
        """Reconcile ``jobs``, each on its own, and note when each is due again.

        Raises:
            Unavailable: etcd did not answer (the pass is over).
        """
        for job in jobs:
            self._due.pop(job, None)
            with self._lock:  # what it is read for now; arrivals from here on count toward the next read
                self._arrivals.pop(job, None)
                self._quiet.pop(job, None)
            try:
                deadline = self.reconcile(job, fence)
            except Unavailable:
                raise
            except FencingError as exc:
                logger.info("job %s: %s; re-reading", job, exc)
                self.poke(job)
                continue
            except Exception as exc:  # one job's bad record or bug never stops the others
                self._skip(job, exc)
                continue
            if self.unreadable.pop(job, None) is not None:
                logger.info("job %s is readable again", job)
            if deadline is not None:
                self._due[job] = deadline
        if self._metrics:
            self._metrics.unreadable_jobs.set(len(self.unreadable))

    def _skip(self, job: str, exc: Exception) -> None:
        why = f"{type(exc).__name__}: {exc}"
        if self.unreadable.get(job) != why:
            if isinstance(exc, CorruptRecord):
                logger.error("job %s skipped: %s", job, exc)
            else:
                logger.exception("job %s skipped: reconciling it failed", job)
        self.unreadable[job] = why
        if self._metrics:
            self._metrics.job_errors.labels(job).inc()

    def reconcile(self, job: str, fence: Fence) -> float | None:
        """Sweep, plan and execute once for ``job``. Returns the leader-clock time to look again, if any.

        Raises:
            Unavailable: etcd did not answer. CorruptRecord: a record of the job cannot be read.
            FencingError: leadership or the job changed under the write; nothing was written.
        """
        try:
            snap = self._store.read_job(job)
        except NotFound:
            self._times.forget(job)
            self._next_sweep.pop(job, None)
            return None
        now = self._clock()
        view = self._times.view(snap, now)
        if snap.status.state.terminal:
            if self._metrics:
                self._metrics.observe_job(snap)  # its state and outcome, as it ended
            return self._expire(snap, view.status.since, now)
        sweep = self._sweep(snap, fence, now)
        if sweep is None:
            return None  # evicted: the next pass plans with the new membership
        view, evicted = self._evict_reported(view, fence, now)
        if evicted:
            return None
        started = time.perf_counter()
        decision = plan(view, now)
        if self._metrics:
            self._metrics.observe_plan(snap, time.perf_counter() - started)
        if isinstance(decision, WaitUntil) and decision.replan_at_members:
            with self._lock:
                self._quiet[job] = (len(snap.members), decision.replan_at_members)
        deadline = self._execute(snap, decision, fence)
        return sweep if deadline is None else min(deadline, sweep)

    def _expire(self, snap: JobSnapshot, finished_at: float, now: float) -> float | None:
        """Delete a finished job once the finished-job TTL passed (counted from when this leader saw it finish)."""
        if not self._finished_job_ttl_s:
            return None
        expires = finished_at + self._finished_job_ttl_s
        if now < expires:
            return expires
        job = snap.spec.job_id
        self._store.delete_job(job)
        self._times.forget(job)
        logger.info(
            "job %s deleted %.0fs after it %s (finished-job TTL)",
            job,
            self._finished_job_ttl_s,
            snap.status.state.value,
        )
        return None

    def _sweep(self, snap: JobSnapshot, fence: Fence, now: float) -> float | None:
        """Evict members silent for the heartbeat TTL (see :func:`overdue_members`). Returns when to sweep next, or
        None when it evicted someone.

        Lease ages are read only when someone could be overdue: after a sweep, no member can pass the TTL before the
        oldest one does (ages grow at one second per second at most), so the next sweep is due then.
        """
        job, ttl = snap.spec.job_id, snap.spec.heartbeat_ttl_s
        if not snap.members:  # nobody to evict until someone joins, which is a change (the watch, a poke)
            self._next_sweep.pop(job, None)
            return math.inf
        due = self._next_sweep.get(job, 0.0)
        if now < due:
            return due
        if now - self._heard_since < ttl:
            self._next_sweep[job] = self._heard_since + ttl
            return self._next_sweep[job]
        ages = self._store.lease_ages(job, snap.members)
        gone = overdue_members(ages, ttl, self._heard_since, now)
        if gone:
            self._store.evict(snap, gone, fence)
            if self._metrics:
                self._metrics.evictions.labels(job).inc(len(gone))
            logger.warning("job %s: evicted %s: no heartbeat for %gs", job, ", ".join(gone), ttl)
            self.poke(job)
            self._next_sweep.pop(job, None)
            return None
        oldest = max((age for age in ages.values() if age >= 0), default=0.0)
        # An age is reported rounded up (etcd gives whole seconds left), so no member can pass the TTL before
        # ``ttl - oldest`` from now; it may take up to a second more, and the next sweep then comes SWEEP_MIN_S later.
        self._next_sweep[job] = now + max(SWEEP_MIN_S, ttl - oldest)
        return self._next_sweep[job]

    def _evict_reported(self, view: JobSnapshot, fence: Fence, now: float) -> tuple[JobSnapshot, bool]:
        """Evict the nodes named by failure reports once their absence is corroborated and any grace ran out (see
        :func:`reported_evictions`; the planner waits for them meanwhile). The leases of named nodes not
        corroborated otherwise are read to see whether they fell silent, once this leader could hear every heartbeat
        for long enough to tell.

        Returns:
            (``view`` with the silent members it found, whether it evicted anyone).
        """
        gen, live, ttl = view.generation, [m.node_id for m in view.members], view.spec.heartbeat_ttl_s
        if gen is None or not any(f.unreachable for f in view.failures):
            return view, False
        reported = reported_evictions(gen, view.failures, live, (), ttl, now)
        if reported.doubted and now - self._heard_since > ttl * SILENT_FRACTION:
            doubted = [m for m in view.members if m.node_id in reported.doubted]
            silent = silent_members(self._store.lease_ages(view.spec.job_id, doubted), ttl)
            if silent:
                view = dataclasses.replace(view, silent=silent)
                reported = reported_evictions(gen, view.failures, live, silent, ttl, now)
        if not reported.evicted:
            return view, False
        job, due = view.spec.job_id, reported.nodes
        reporters = tuple(sorted({report.node_id for report, _nodes in reported.evicted}))
        self._store.evict(view, due, fence, keep=reporters)
        if self._metrics:
            self._metrics.evictions.labels(job).inc(len(due))
        why = (
            "silent on their leases too"
            if view.silent.intersection(due)
            else f"no report from them in {REPORT_GRACE_S:g}s"
        )
        logger.warning(
            "job %s: evicted %s: named unreachable by %s, %s", job, ", ".join(due), ", ".join(reporters), why
        )
        self.poke(job)
        return view, True

    def _execute(self, snap: JobSnapshot, decision: object, fence: Fence) -> float | None:
        job, status = snap.spec.job_id, snap.status
        if isinstance(decision, Keep):
            return None
        if isinstance(decision, NewGeneration):
            gen = dataclasses.replace(decision.generation, created_at=self._wall())
            gen = dataclasses.replace(gen, warrant=self._store.warrant(gen))
            since = status.since if decision.state is status.state else self._wall()
            self._store.publish(snap, gen, JobStatus(decision.state, since), fence)
            if self._metrics:
                self._metrics.observe_published(decision)
            logger.info(
                "job %s: generation %d published (%s): world size %d on %s; job %s",
                job,
                gen.number,
                gen.reason,
                gen.world_size,
                ",".join(gen.node_ids) or "no nodes",
                decision.state.value,
            )
            return None
        if isinstance(decision, WaitUntil):
            if decision.state is not status.state:
                self._store.set_status(snap, JobStatus(decision.state, self._wall(), decision.why), fence)
                logger.info("job %s: %s -> %s (%s)", job, status.state.value, decision.state.value, decision.why)
            return decision.deadline
        if isinstance(decision, FailJob):
            failed = JobStatus(JobState.FAILED, self._wall(), decision.reason, Outcome.FAILED)
            self._store.set_status(snap, failed, fence)
            logger.warning("job %s failed: %s", job, decision.reason)
            return None
        raise TypeError(f"unknown planner decision {decision!r}")
