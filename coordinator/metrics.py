"""The coordinator's Prometheus metrics, over a registry its owner injects.

Per-replica series: RPCs by method and code, RPC and etcd operation latency, etcd errors, leadership. Per-job series
(members, node bounds, generation, world size, state, plan latency, generations by reason) come from the leader's
reconciler, so only the leading replica exports them; dashboards aggregate with ``max by (job_id)``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pliant.coordinator.contract import Generation, JobSnapshot, JobState, NewGeneration, Outcome
from pliant.metrics import FAST_BUCKETS_S

__all__ = ["CoordinatorMetrics"]


@dataclass(frozen=True)
class _JobView:
    members: int
    min_nodes: int
    max_nodes: int
    generation: int
    world_size: int
    state: JobState
    outcome: Outcome | None = None


class _JobCollector(Collector):
    """Exports the leader's latest view of each job at scrape time (nothing while this replica does not lead)."""

    def __init__(self, is_leader: Callable[[], bool]) -> None:
        self._is_leader = is_leader
        self._lock = threading.Lock()
        self.jobs: dict[str, _JobView] = {}

    def update(self, job: str, view: _JobView) -> None:
        with self._lock:
            self.jobs[job] = view

    def published(self, gen: Generation, state: JobState) -> None:
        with self._lock:
            view = self.jobs.get(gen.job_id)
            if view is not None:
                self.jobs[gen.job_id] = replace(view, generation=gen.number, world_size=gen.world_size, state=state)

    def collect(self) -> Iterator[Metric]:
        families = {
            "members": GaugeMetricFamily(
                "pliant_job_members", "Nodes holding a live membership lease.", labels=["job_id"]
            ),
            "min_nodes": GaugeMetricFamily("pliant_job_min_nodes", "The job's minimum node count.", labels=["job_id"]),
            "max_nodes": GaugeMetricFamily("pliant_job_max_nodes", "The job's maximum node count.", labels=["job_id"]),
            "generation": GaugeMetricFamily("pliant_job_generation", "Current generation number.", labels=["job_id"]),
            "world_size": GaugeMetricFamily(
                "pliant_job_world_size", "Ranks in the current generation.", labels=["job_id"]
            ),
        }
        state = GaugeMetricFamily("pliant_job_state", "1 for the job's current state.", labels=["job_id", "state"])
        outcome = GaugeMetricFamily(
            "pliant_job_outcome",
            "1 for how a finished job ended: full (at its full size), reduced (world sizes refused or nodes "
            "excluded), failed; no sample while it runs.",
            labels=["job_id", "outcome"],
        )
        if self._is_leader():
            with self._lock:
                jobs = dict(self.jobs)
            for job, view in sorted(jobs.items()):
                for name, family in families.items():
                    family.add_metric([job], float(getattr(view, name)))
                for s in JobState:
                    state.add_metric([job, s.value], 1.0 if s is view.state else 0.0)
                if view.outcome is not None:
                    for o in Outcome:
                        outcome.add_metric([job, o.value], 1.0 if o is view.outcome else 0.0)
        yield from families.values()
        yield state
        yield outcome


class CoordinatorMetrics:
    """Every metric one coordinator replica exports.

    Args:
        registry: where to register (never the global one from library code).
        is_leader: whether this replica leads right now.
    """

    def __init__(self, registry: CollectorRegistry, is_leader: Callable[[], bool]) -> None:
        self.rpcs = Counter(
            "pliant_coordinator_rpcs",
            "Coordinator RPCs served, by method and status code.",
            ["method", "code"],
            registry=registry,
        )
        self.rpc_seconds = Histogram(
            "pliant_coordinator_rpc_duration_seconds",
            "Time to serve a unary RPC.",
            ["method"],
            buckets=FAST_BUCKETS_S,
            registry=registry,
        )
        self.etcd_seconds = Histogram(
            "pliant_coordinator_etcd_operation_duration_seconds",
            "Time of one store operation (one or a few etcd requests).",
            ["operation"],
            buckets=FAST_BUCKETS_S,
            registry=registry,
        )
        self.etcd_errors = Counter(
            "pliant_coordinator_etcd_errors",
            "Store operations that etcd did not answer.",
            ["operation"],
            registry=registry,
        )
        self.plan_seconds = Histogram(
            "pliant_coordinator_plan_duration_seconds",
            "Time the planner took to decide for one job (leader only).",
            buckets=FAST_BUCKETS_S,
            registry=registry,
        )
        self.generations = Counter(
            "pliant_coordinator_generations",
            "Generations this replica published, by reason.",
            ["job_id", "reason"],
            registry=registry,
        )
        self.leader = Gauge(
            "pliant_coordinator_leader", "1 while this replica is the elected leader.", registry=registry
        )
        self.unreadable_jobs = Gauge(
            "pliant_coordinator_unreadable_jobs",
            "Jobs the leader skips because a record cannot be read or reconciling them failed (leader only).",
            registry=registry,
        )
        self.job_errors = Counter(
            "pliant_coordinator_job_errors",
            "Reconciler passes over a job that failed: the job was skipped, others went on.",
            ["job_id"],
            registry=registry,
        )
        self.evictions = Counter(
            "pliant_coordinator_evictions",
            "Members the leader evicted for silence (no heartbeat for the heartbeat TTL while it could hear them).",
            ["job_id"],
            registry=registry,
        )
        self.faults = Counter(
            "pliant_coordinator_faults",
            "Unexpected errors in the reconciler or election that made this replica resign.",
            registry=registry,
        )
        # Labelled series by their labels, looked up once: a heartbeat observes three (any thread writes a missing
        # entry; two writing one at once store the same series).
        self._rpc_children: dict[tuple[str, grpc.StatusCode], tuple[Counter, Histogram]] = {}
        self._etcd_children: dict[str, Histogram] = {}
        self.leader.set_function(lambda: float(is_leader()))
        self._jobs = _JobCollector(is_leader)
        registry.register(self._jobs)

    def observe_rpc(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        children = self._rpc_children.get((method, code))
        if children is None:  # a method's or code's first call (a bounded set: the served methods, the codes)
            children = self._rpc_children[(method, code)] = (
                self.rpcs.labels(method, code.name),
                self.rpc_seconds.labels(method),
            )
        children[0].inc()
        children[1].observe(seconds)

    def observe_etcd(self, operation: str, seconds: float, failed: bool) -> None:
        child = self._etcd_children.get(operation)
        if child is None:  # a store operation's first call (a bounded set: the store's methods)
            child = self._etcd_children[operation] = self.etcd_seconds.labels(operation)
        child.observe(seconds)
        if failed:
            self.etcd_errors.labels(operation).inc()

    def observe_plan(self, snap: JobSnapshot, seconds: float) -> None:
        self.plan_seconds.observe(seconds)
        self.observe_job(snap)

    def observe_job(self, snap: JobSnapshot) -> None:
        """The job's series as ``snap`` has it (a finished job's state and outcome too)."""
        gen = snap.generation
        spec = snap.spec
        view = _JobView(
            len(snap.members),
            spec.min_nodes,
            spec.max_nodes,
            gen.number if gen else 0,
            gen.world_size if gen else 0,
            snap.status.state,
            snap.status.outcome,
        )
        self._jobs.update(spec.job_id, view)

    def observe_published(self, decision: NewGeneration) -> None:
        gen = decision.generation
        self.generations.labels(gen.job_id, gen.reason).inc()
        self._jobs.published(gen, decision.state)
