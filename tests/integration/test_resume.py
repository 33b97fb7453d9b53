"""Resume after losing every node: the job, started again with the same command and ``--checkpoint-dir``, trains on
from its newest checkpoint and ends where a run that never stopped ends. The embedded control plane comes back with a
fresh etcd (a new incarnation of the job takes the directory over); a standalone one keeps its etcd, and a job deleted
and created again there is a new incarnation too."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import time
from pathlib import Path

import pytest
import torch

from bench.common import PLIANT
from pliant.coordinator.contract import JobSpec
from tests.conftest import TEST_JOIN_TOKEN, wait_for
from tests.integration.harness import (
    assert_all_gone,
    descendants,
    elastic_agent,
    elastic_script,
    max_param_diff,
    read_jsonl,
    static_params,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEPS, EVERY = 70, 5
# A job that a node joins by the restart path: node a trains on while node b warms up (its imports, seconds on a busy
# machine), so the job must outlast that for a world of 2 to train.
JOINED_STEPS = 200
TOLERANCE = 1e-5  # float64 runs: a resumed run's parameters differ from an unbroken one's by rounding only


def _events(tmp: Path) -> list[dict]:
    return read_jsonl(tmp / "events.jsonl")


def _kill_all(*procs: object) -> None:
    """kill -9 every process of every tree, as losing every machine does."""
    tree = [pid for p in procs for pid in (p.pid, *descendants(p.pid))]  # type: ignore[attr-defined]
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert_all_gone(tree)


def _newest_committed(ckpt: Path) -> int:
    steps = [int(p.name.split("-")[1]) for p in ckpt.glob("step-*") if (p / "pliant-commit.json").exists()]
    return max(steps, default=-1)


def _resumed(tmp: Path, before: int, restarted_at: float, newest: int) -> None:
    """The run after the restart began at the newest checkpoint's step, soon; print how soon."""
    after = _events(tmp)[before:]
    first = min(after, key=lambda e: e["time"])
    print(
        f"restarted: first step {first['step']} {first['time'] - restarted_at:.1f}s after the command "
        f"(newest checkpoint: step {newest})"
    )
    assert min(e["step"] for e in after) == newest, "resumed from the newest committed checkpoint"


def _same_as_static(tmp: Path, steps: int = STEPS) -> None:
    diff = max_param_diff(torch.load(tmp / "final.pt"), static_params(tmp, steps))
    print(f"max |param diff| vs a run that never stopped = {diff:.2e}")
    assert diff <= TOLERANCE


@pytest.mark.parametrize("rescaled", [True, False], ids=["after-a-rescale", "no-rescale"])
def test_pliant_run_started_again_after_every_node_died_resumes(spawn, tmp_path: Path, rescaled: bool) -> None:
    ckpt = tmp_path / "ckpt"
    run = [
        *PLIANT,
        "run",
        "--job",
        "job",
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "1",
        "--heartbeat-ttl",
        "3",
        "--join-grace",
        "0.3",
        "--max-restarts",
        "0",
        "--checkpoint-dir",
        str(ckpt),
        *elastic_script(tmp_path, STEPS, 0.08),
        "--save-every",
        str(EVERY),
    ]
    first = spawn(run, name="first")
    procs = [first]
    if rescaled:
        join = wait_for(lambda: re.search(r"other nodes join with:\n  (\S+ .*run .*)\n", first.output()), 60, "join")
        argv = ["env", *shlex.split(join.group(1))]  # type: ignore[union-attr]
        argv[argv.index("run") + 1 : argv.index("run") + 1] = ["--node-id", "second"]
        procs.append(spawn(argv, name="second"))
        wait_for(lambda: [e for e in _events(tmp_path) if e["world"] == 2], 90, "world 2 stepping")
        rescale_step = min(e["step"] for e in _events(tmp_path) if e["world"] == 2)
    else:
        rescale_step = 0
    wait_for(lambda: _newest_committed(ckpt) >= rescale_step + EVERY, 90, "a checkpoint")
    _kill_all(*procs)
    fence = json.loads((ckpt / "pliant-fence.json").read_text())
    assert fence["owner"]["warrant"] and fence["owner"]["generation"] >= (2 if rescaled else 1), fence
    newest, before = _newest_committed(ckpt), len(_events(tmp_path))

    restarted_at = time.time()
    again = spawn(run, name="again")  # the same command, a fresh embedded etcd: a new incarnation of the job
    wait_for(lambda: again.proc.poll() is not None, 120, "the restarted job to finish")
    assert again.proc.returncode == 0, again.output()[-3000:]
    _resumed(tmp_path, before, restarted_at, newest)
    taken = json.loads((ckpt / "pliant-fence.json").read_text())
    assert taken["superseded"][-1] == fence["owner"], "the new incarnation took the directory over"
    _same_as_static(tmp_path)


def test_a_standalone_job_created_again_after_every_node_died_resumes(
    make_coordinator, spawn_agent, fleet, tmp_path: Path
) -> None:
    server = make_coordinator()
    extra = ("--rescale", "restart")
    argv = {
        n: [
            *elastic_agent(server.address, n, 1, tmp_path, JOINED_STEPS, extra, step_time=0.08),
            *("--save-every", str(EVERY)),
        ]
        for n in ("a", "b")
    }
    a = spawn_agent(server, argv["a"], name="a")
    wait_for(lambda: _events(tmp_path), 90, "node a stepping")
    b = spawn_agent(server, argv["b"], name="b")
    wait_for(lambda: [e for e in _events(tmp_path) if e["world"] == 2], 90, "world 2 stepping")
    rescale_step = min(e["step"] for e in _events(tmp_path) if e["world"] == 2)
    wait_for(lambda: _newest_committed(tmp_path / "ckpt") >= rescale_step + EVERY, 90, "a checkpoint")
    _kill_all(a, b)
    newest, before = _newest_committed(tmp_path / "ckpt"), len(_events(tmp_path))

    # The admin cleans up and creates the job again: a new incarnation, whose key (from the deployment's sealing
    # secret in etcd) is the old one's.
    client = fleet(server)
    client.finish_job("job", False)  # every node is gone: the admin ends it, then deletes it
    client.delete_job("job")
    spec = JobSpec(
        "job", min_nodes=1, max_nodes=3, nproc_per_node=1, heartbeat_ttl_s=3, join_grace_s=0.5, max_restarts=0
    )
    client.create_job(spec, TEST_JOIN_TOKEN)
    restarted_at = time.time()
    again = spawn_agent(server, argv["a"], name="a-again")
    wait_for(lambda: again.proc.poll() is not None, 120, "the restarted job to finish")
    assert again.proc.returncode == 0, again.output()[-3000:]
    _resumed(tmp_path, before, restarted_at, newest)
    _same_as_static(tmp_path, JOINED_STEPS)
