"""One scrape target per node, for real: an agent serves its own and its workers' metrics (prometheus_client
multiprocess files) on --metrics-port, through a worker kill -9, a restart and checkpoint saves and loads; heartbeats
carry the workers' step to `pliant status`; the goodput and badput counters match the run's own timeline (what the
workers logged at each step, and when the test killed one).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from bench.common import PLIANT
from pliant.agent.goodput import CAUSES, PHASES
from pliant.coordinator.status import goodput_line, job_goodput, render_table
from pliant.net import free_port
from tests.conftest import ROOT, wait_for
from tests.integration.harness import read_jsonl, sample, scrape, worker_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SCRIPT = ROOT / "examples" / "train_elastic.py"


def _workers(agent_pid: int) -> list[psutil.Process]:
    return worker_processes(agent_pid)


def _assert_goodput_matches_the_timeline(
    metrics: dict[str, float], events: list[dict], spawned: float, killed: float, scraped: float
) -> None:
    """The node's goodput and badput seconds against what rank 0 logged at each step and when the test killed a
    worker: the start ends at the first step, the failure and the redone steps span the kill to the first step beyond
    the old ones, training is the rest; each within 0.75 s (the agent charges at its 0.25 s ticks) and a fifth."""
    badput = {c: sample(metrics, "pliant_agent_badput_seconds_total", cause=c) for c in CAUSES}
    goodput = sample(metrics, "pliant_agent_goodput_seconds_total")
    steps = [e for e in events if e["rank"] == 0]
    first = steps[0]["time"]
    before = [e for e in steps if e["generation"] == 1 and e["time"] < killed]
    again = [e for e in steps if e["generation"] == 2]
    new = next(e for e in again if e["step"] > before[-1]["step"])  # the first step beyond the old ones
    recovery = new["time"] - killed  # the kill to the first new step: the failure's, then the steps redone

    def near(measured: float, expected: float, what: str) -> None:
        assert abs(measured - expected) <= 0.75 + 0.2 * expected, f"{what}: {measured:.2f}s charged, {expected:.2f}s"

    near(badput["start"], first - spawned, "start: the agent's start to the first step")
    near(badput["failure"] + badput["redone"], recovery, "failure and redone: the kill to the first new step")
    near(badput["redone"], new["time"] - again[0]["time"], "redone: the restored world's first step to its first new")
    assert badput["redone"] > 0, "the restore from the last periodic checkpoint redoes steps"
    near(goodput, (killed - first) + (scraped - new["time"]) - badput["checkpoint"], "training")
    near(goodput + sum(badput.values()), scraped - spawned, "all the node's time")
    assert badput["waiting"] == badput["rescale"] == 0
    phases = {p: sample(metrics, "pliant_agent_badput_seconds_total", cause="failure", phase=p) for p in PHASES}
    assert sum(phases.values()) == pytest.approx(badput["failure"])
    print(
        f"goodput {goodput:.1f}s of {goodput + sum(badput.values()):.1f}s; badput "
        + ", ".join(f"{c} {s:.2f}s" for c, s in badput.items())
        + " (failure: "
        + ", ".join(f"{p} {s:.2f}s" for p, s in phases.items())
        + ")"
        + f"; the timeline: first step {first - spawned:.2f}s after the start, the kill to a new step {recovery:.2f}s"
    )


def test_node_endpoint_follows_a_worker_kill_restart_and_checkpoints(
    make_coordinator, spawn_agent, tmp_path: Path, fleet
) -> None:
    server = make_coordinator()
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    events = tmp_path / "events.jsonl"
    spawned = time.time()
    agent = spawn_agent(
        server,
        [
            *PLIANT,
            "agent",
            "--coordinator",
            server.address,
            "--job",
            "job",
            "--node-id",
            "a",
            "--host",
            "127.0.0.1",
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--heartbeat-ttl",
            "3",
            "--join-grace",
            "0.2",
            "--stop-grace",
            "2",
            "--metrics-port",
            str(port),
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--rescale",
            "restart",  # the restart path's series; test_in_place checks the in-place ones
            str(SCRIPT),
            "--steps",
            "100000",
            "--step-time",
            "0.1",  # the steps the restore redoes take a second or two: several of the agent's ticks
            "--save-every",
            "20",
            "--events",
            str(events),
        ],
        name="agent",
    )
    # Killed just before the third periodic save: the restore from the second redoes about 18 steps.
    wait_for(lambda: (sample(scrape(url), "pliant_worker_step") or 0) >= 57, 90, "two periodic checkpoints")
    first = scrape(url)
    assert sample(first, "pliant_worker_world_size") == 2 and sample(first, "pliant_worker_generation") == 1
    assert sample(first, "pliant_worker_checkpoint_saved_bytes_total") > 0
    assert sample(first, "pliant_worker_checkpoint_save_duration_seconds_count") >= 2
    assert sample(first, "pliant_agent_state", state="running") == 1
    assert sample(first, "pliant_agent_state", state="waiting") == 0
    assert sample(first, "pliant_agent_workers", state="running") == 2
    assert sample(first, "pliant_agent_info", node_id="a") == 1
    assert sample(first, "pliant_user_loss", rank="0") >= 0
    assert sample(first, "pliant_worker_collective_seconds_total", op="grad_allreduce") > 0
    # Every series the node serves names its job; labelled series known ahead start at zero; no _created series.
    served = [k for k in first if k.startswith(("pliant_worker_", "pliant_agent_", "pliant_user_"))]
    assert served and all('job_id="job"' in k for k in served), [k for k in served if 'job_id="job"' not in k]
    assert sample(first, "pliant_agent_rescales_total", path="restart") == 0
    assert sample(first, "pliant_worker_recovery_phase_seconds_count", phase="decide") == 0
    assert not [k for k in first if "_created" in k]

    killed = time.time()
    os.kill(_workers(agent.pid)[0].pid, signal.SIGKILL)
    wait_for(
        lambda: sample(m := scrape(url), "pliant_worker_generation") == 2 and sample(m, "pliant_worker_step") > 57,
        60,
        "the restarted generation stepping past the old step",
    )
    old = [e for e in read_jsonl(events) if e["rank"] == 0 and e["generation"] == 1]
    wait_for(
        lambda: sum(e["rank"] == 0 and e["step"] > old[-1]["step"] + 20 for e in read_jsonl(events)) > 0,
        60,
        "20 new steps after the kill",
    )
    after = scrape(url)
    scraped = time.time()
    _assert_goodput_matches_the_timeline(after, read_jsonl(events), spawned, killed, scraped)
    assert sample(after, "pliant_agent_worker_exits_total", code="-9") == 1
    assert sample(after, "pliant_agent_worker_restarts_total") == 1 and sample(after, "pliant_agent_generation") == 2
    assert sample(after, "pliant_worker_checkpoint_loaded_bytes_total") > 0  # the new generation restored
    assert sample(after, "pliant_worker_checkpoint_load_duration_seconds_count") == 2  # one load per rank
    # dead workers' totals stay
    assert sample(after, "pliant_worker_samples_total") >= sample(first, "pliant_worker_samples_total")
    assert sample(after, "pliant_agent_workers", state="running") == 2

    with fleet(server.address) as client:
        step = lambda: client.get_job("job", progress=True).progress["a"].step  # noqa: E731
        wait_for(lambda: step() > 0, 15, "the step in the job's status")
        # The agent's goodput reaches `pliant status` with its heartbeats.
        info = wait_for(
            lambda: (i := client.get_job("job", progress=True)).progress["a"].goodput.get("redone") and i,
            15,
            "the node's goodput in the job's status",
        )
        reported = job_goodput(info)
        assert reported["productive_s"] > 0 and set(reported["badput_s"]) == set(CAUSES)
        assert "goodput " in render_table([info], time.time()) and "failure" in goodput_line(reported)
        client.finish_job("job", True, "test done")
    wait_for(lambda: agent.proc.poll() is not None, 30, "the agent to exit")
    assert agent.proc.returncode == 0, agent.output()[-3000:]
