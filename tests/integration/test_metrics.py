"""One scrape target per node, for real: an agent serves its own and its workers' metrics (prometheus_client
multiprocess files) on --metrics-port, through a worker kill -9, a restart and checkpoint saves and loads; heartbeats
carry the workers' step to `pliant status`.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
import pytest

from bench.common import PLIANT
from pliant.net import free_port
from tests.conftest import ROOT, wait_for
from tests.integration.harness import sample, scrape, worker_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SCRIPT = ROOT / "examples" / "train_elastic.py"


def _workers(agent_pid: int) -> list[psutil.Process]:
    return worker_processes(agent_pid)


def test_node_endpoint_follows_a_worker_kill_restart_and_checkpoints(
    make_coordinator, spawn_agent, tmp_path: Path, fleet
) -> None:
    server = make_coordinator()
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
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
            "0.03",
            "--save-every",
            "20",
        ],
        name="agent",
    )
    wait_for(lambda: (sample(scrape(url), "pliant_worker_step") or 0) >= 45, 90, "two periodic checkpoints")
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

    os.kill(_workers(agent.pid)[0].pid, signal.SIGKILL)
    wait_for(
        lambda: sample(m := scrape(url), "pliant_worker_generation") == 2 and sample(m, "pliant_worker_step") > 45,
        60,
        "the restarted generation stepping past the old step",
    )
    after = scrape(url)
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
        client.finish_job("job", True, "test done")
    wait_for(lambda: agent.proc.poll() is not None, 30, "the agent to exit")
    assert agent.proc.returncode == 0, agent.output()[-3000:]
