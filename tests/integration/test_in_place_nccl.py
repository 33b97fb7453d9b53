"""In-place rescale on NCCL (skipped without a CUDA GPU; CI has none): real agents and coordinator, one worker per node.

On a one-GPU machine every node's worker shares the GPU; each agent is a host of its own to NCCL (``NCCL_HOSTID``, set
by the ``spawn_agent`` fixture), so its ranks talk over NCCL's network transport as on separate machines. A join, a
kill -9 of a worker (its agent replaces it in place) and a kill -9 of a whole node: node a's worker keeps its process
throughout, the failures are caught by the step guard (:mod:`pliant.worker.inplace.guard`) rather than the collective
timeout, and the result equals a static run on the same global batches with every sample once."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import wait_for
from tests.integration.harness import TOLERANCE, elastic_agent, longest_pause
from tests.integration.test_in_place import _check_exact, _check_redone, _events, _pids, _stepping

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL)"),
]


@pytest.mark.parametrize("engine", ["ddp", "zero", "fsdp", "hsdp"])  # hsdp: one rank per node, a replica each
def test_nccl_join_and_kills_in_place(make_coordinator, spawn_agent, tmp_path: Path, engine: str) -> None:
    steps = 300  # a newcomer's CUDA and NCCL start takes seconds: the job must still be running
    server = make_coordinator()
    args = dict(checkpoints=False, script=("--engine", engine), step_time=0.05)
    extra = ("--max-restarts", "3")
    a = spawn_agent(
        server, elastic_agent(server.address, "node-a", 1, tmp_path, steps, extra=extra, **args), name="agent-a"
    )
    wait_for(lambda: _stepping(tmp_path, 1, 5), 120, "node a stepping")
    joined_at = time.time()
    b = spawn_agent(
        server, elastic_agent(server.address, "node-b", 1, tmp_path, steps, extra=extra, **args), name="agent-b"
    )
    wait_for(lambda: len(_pids(_events(tmp_path), 2)) == 2, 90, "world 2 stepping")
    joined = time.time() - joined_at
    pause = longest_pause(_events(tmp_path), joined_at)
    first = min(e["step"] for e in _events(tmp_path) if e["world"] == 2)
    wait_for(lambda: _stepping(tmp_path, 2, first + 18), 60, "world 2 past its first snapshots")

    world2 = _pids(_events(tmp_path), 2)
    worker_killed = time.time()
    os.kill(world2[1], signal.SIGKILL)  # node b's worker; its agent starts another, which joins in place
    wait_for(lambda: _stepping(tmp_path, 2, generation=3), 90, "world 2 stepping again")
    events = _events(tmp_path)
    worker_back = max(min(e["time"] for e in events if e["generation"] == 3 and e["rank"] == r) for r in range(2))
    assert _pids([e for e in events if e["generation"] == 3], 2)[0] == world2[0], "node a's worker lived on"
    worker_redone = _check_redone(engine, events, worker_killed, a.output())

    wait_for(
        lambda: _stepping(tmp_path, 2, max(e["step"] for e in events) + 13, generation=3),
        60,
        "world 2 past its next snapshots",
    )
    node_killed = time.time()
    b.kill(signal.SIGKILL)
    wait_for(lambda: _stepping(tmp_path, 1, generation=4), 90, "node a stepping alone")
    wait_for(lambda: a.proc.poll() is not None, 150, "the job to finish")
    assert a.proc.returncode == 0, a.output()[-3000:]

    events = _events(tmp_path)
    node_back = min(e["time"] for e in events if e["generation"] == 4)
    assert {e["pid"] for e in events if e["rank"] == 0} == {world2[0]}, "node a's worker kept its process throughout"
    node_redone = _check_redone(engine, events, node_killed, a.output())
    diff = _check_exact(tmp_path, steps, engine, kills=2)  # a worker of b, then node b's
    print(f"{engine} on NCCL: join -> 2 ranks stepping {joined:.2f}s (node a's longest pause {pause:.2f}s)")
    for what, (before, resumed), back, killed in (
        ("worker", worker_redone, worker_back, worker_killed),
        ("node", node_redone, node_back, node_killed),
    ):
        print(
            f"{engine} on NCCL: kill -9 {what}: {before + 1 - resumed} committed steps redone, all stepping "
            f"{back - killed:.2f}s after the kill"
        )
    print(f"{engine} on NCCL: max |param diff| vs static {diff:.2e}")
    assert "rescale in place (failure)" in a.output()
    assert diff <= TOLERANCE
