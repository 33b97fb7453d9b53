"""Metrics objects over injected registries: names, labels, leader-only job series, user gauges; the endpoint and its
``/healthz``."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from pliant.coordinator.contract import (
    Generation,
    GenerationMember,
    JobSnapshot,
    JobSpec,
    JobState,
    JobStatus,
    Member,
    NewGeneration,
)
from pliant.coordinator.metrics import CoordinatorMetrics
from pliant.env import WorkerEnv
from pliant.metrics import serve_metrics
from pliant.worker.contract import WorkerError
from pliant.worker.metrics import WorkerMetrics, tensor_bytes


def _sample(registry: CollectorRegistry, name: str, labels: dict[str, str] | None = None) -> float | None:
    return registry.get_sample_value(name, labels or {})


def test_coordinator_job_series_come_from_the_leader_only() -> None:
    registry, leading = CollectorRegistry(), [False]
    metrics = CoordinatorMetrics(registry, lambda: leading[0])
    spec = JobSpec("j", min_nodes=2, max_nodes=4, nproc_per_node=2)
    snap = JobSnapshot(spec, JobStatus(JobState.WAITING, 0.0), (Member("a", "h:1"), Member("b", "h:2")))
    metrics.observe_plan(snap, 0.002)
    assert _sample(registry, "pliant_job_members", {"job_id": "j"}) is None
    assert _sample(registry, "pliant_coordinator_leader") == 0.0
    leading[0] = True
    assert _sample(registry, "pliant_job_members", {"job_id": "j"}) == 2.0
    assert _sample(registry, "pliant_job_min_nodes", {"job_id": "j"}) == 2.0
    assert _sample(registry, "pliant_job_state", {"job_id": "j", "state": "waiting"}) == 1.0
    gen = Generation("j", 1, (GenerationMember("a", 0, 0, 2, "h:1"), GenerationMember("b", 1, 2, 2, "h:2")), "start")
    metrics.observe_published(NewGeneration(gen, JobState.RUNNING))
    assert _sample(registry, "pliant_job_world_size", {"job_id": "j"}) == 4.0
    assert _sample(registry, "pliant_job_generation", {"job_id": "j"}) == 1.0
    assert _sample(registry, "pliant_job_state", {"job_id": "j", "state": "running"}) == 1.0
    assert _sample(registry, "pliant_coordinator_generations_total", {"job_id": "j", "reason": "start"}) == 1.0
    assert _sample(registry, "pliant_coordinator_plan_duration_seconds_count") == 1.0
    assert _sample(registry, "pliant_coordinator_leader") == 1.0


def test_coordinator_rpc_and_etcd_series() -> None:
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(registry, lambda: True)
    metrics.observe_rpc("Join", grpc.StatusCode.OK, 0.003)
    metrics.observe_rpc("Join", grpc.StatusCode.NOT_FOUND, 0.001)
    metrics.observe_etcd("join", 0.002, failed=False)
    metrics.observe_etcd("join", 5.0, failed=True)
    assert _sample(registry, "pliant_coordinator_rpcs_total", {"method": "Join", "code": "NOT_FOUND"}) == 1.0
    assert _sample(registry, "pliant_coordinator_rpc_duration_seconds_count", {"method": "Join"}) == 2.0
    assert _sample(registry, "pliant_coordinator_etcd_errors_total", {"operation": "join"}) == 1.0
    assert _sample(registry, "pliant_coordinator_etcd_operation_duration_seconds_count", {"operation": "join"}) == 2.0
    assert b"pliant_coordinator_rpcs_total" in generate_latest(registry)


def test_worker_metrics_without_an_agent_stay_in_the_registry() -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(WorkerEnv(rank=1, world_size=2, local_rank=1, local_world_size=2), registry)
    metrics.observe_step(step=9, samples=16, seconds=0.01, shadow=False)
    metrics.observe_step(step=10, samples=0, seconds=0.01, shadow=True)
    assert _sample(registry, "pliant_worker_step") == 11.0
    assert _sample(registry, "pliant_worker_samples_total") == 16.0
    assert _sample(registry, "pliant_worker_shadow_steps_total") == 1.0
    assert _sample(registry, "pliant_worker_world_size") == 2.0
    metrics.publish(loss=0.5)
    metrics.gauge("lr", "Learning rate.").set(0.1)
    assert _sample(registry, "pliant_user_loss", {"rank": "1"}) == 0.5
    assert _sample(registry, "pliant_user_lr", {"rank": "1"}) == 0.1


def test_user_metric_names_are_checked() -> None:
    metrics = WorkerMetrics(WorkerEnv(), CollectorRegistry())
    with pytest.raises(WorkerError, match="'my-loss' must match"):
        metrics.publish(**{"my-loss": 1.0})


def test_tensor_bytes_counts_nested_state() -> None:
    import torch

    state = {"model": {"w": torch.zeros(4, 4), "b": torch.zeros(4)}, "optim": [torch.zeros(2, dtype=torch.float64)]}
    assert tensor_bytes(state) == 16 * 4 + 4 * 4 + 2 * 8


def test_agent_reads_no_step_from_a_worker_file_being_created() -> None:
    """A worker's multiprocess file exists but is still empty: the heartbeat's step read returns 0, not an error (it
    once killed the heartbeat thread, and the node lost its membership)."""
    from pathlib import Path

    from pliant.agent.metrics import AgentMetrics

    metrics = AgentMetrics(CollectorRegistry(), "job", "node")
    try:
        (Path(metrics.worker_dir) / "gauge_livemax_1234.db").write_bytes(b"")
        assert metrics.latest_step() == 0
    finally:
        metrics.close()


def test_the_endpoint_serves_healthz_beside_the_metrics() -> None:
    """``/healthz`` answers the owner's health check (503 with the reason when unwell); every other path the
    metrics."""
    registry = CollectorRegistry(auto_describe=True)
    Counter("pliant_test_events", "Events.", registry=registry).inc()
    problem = ["starting: joining the job"]
    server = serve_metrics(registry, "127.0.0.1:0", health=lambda: problem[0])
    try:
        base = f"http://{server.address}"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{base}/healthz", timeout=5)
        assert refused.value.code == 503 and refused.value.read() == b"starting: joining the job\n"
        problem[0] = ""
        with urllib.request.urlopen(f"{base}/healthz", timeout=5) as ok:
            assert (ok.status, ok.read()) == (200, b"ok\n")
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as metrics:
            assert b"pliant_test_events_total 1.0" in metrics.read()
    finally:
        server.close()


def test_an_agent_is_unhealthy_while_it_joins_and_when_its_loop_stops_ticking() -> None:
    """What an agent's ``/healthz`` says (a startup probe waits for the first; a liveness probe restarts the second);
    its control plane being away does not enter into it."""
    from types import SimpleNamespace

    from pliant.agent.agent import HEALTHY_WITHIN_S, Agent

    now = time.monotonic()
    assert Agent.health(SimpleNamespace(_ticked_at=None)) == "starting: joining the job"  # type: ignore[arg-type]
    assert Agent.health(SimpleNamespace(_ticked_at=now)) == ""  # type: ignore[arg-type]
    wedged = Agent.health(SimpleNamespace(_ticked_at=now - HEALTHY_WITHIN_S - 5))  # type: ignore[arg-type]
    assert wedged.startswith("the agent's loop has not ticked for 3")


def test_every_series_an_agent_serves_names_its_job_and_known_labels_start_at_zero() -> None:
    from pliant.agent.contract import AgentState
    from pliant.agent.metrics import AgentMetrics, _JobLabelled

    registry = CollectorRegistry(auto_describe=True)
    metrics = AgentMetrics(registry, "job-1", "node-a")
    try:
        metrics.set_state(AgentState.RUNNING)
        assert _sample(registry, "pliant_agent_state", {"state": "running", "job_id": "job-1"}) == 1
        assert _sample(registry, "pliant_agent_state", {"state": "waiting", "job_id": "job-1"}) == 0
        for path in ("in-place", "restart"):  # a panel shows 0, not "No data", before the first rescale
            assert _sample(registry, "pliant_agent_rescales_total", {"path": path, "job_id": "job-1"}) == 0
        assert _sample(registry, "pliant_agent_info", {"node_id": "node-a", "job_id": "job-1"}) == 1
        samples = [s for family in registry.collect() for s in family.samples]
        assert samples and all(s.labels.get("job_id") == "job-1" for s in samples)
    finally:
        metrics.close()
    workers = CollectorRegistry()  # what a worker writes (into the multiprocess files the agent reads)
    Counter("pliant_worker_steps", "Steps.", ["op"], registry=workers).labels("x").inc(3)
    (family, *_) = _JobLabelled(workers, "job-1").collect()
    assert [(s.name, s.labels, s.value) for s in family.samples if s.name.endswith("_total")] == [
        ("pliant_worker_steps_total", {"op": "x", "job_id": "job-1"}, 3.0)
    ]
