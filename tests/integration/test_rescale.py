"""Checkpoint on rescale and resume after failure, through real agents, a real coordinator and gloo workers running
examples/train_elastic.py: 4 -> 2 -> 3 ranks reaches the parameters of a static run with every sample of each epoch
seen once; kill -9 of a node resumes from the last periodic checkpoint; another job's checkpoint is refused."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from bench.common import PLIANT
from pliant.agent.contract import left_on
from tests.conftest import wait_for
from tests.integration.harness import (
    ELASTIC,
    SAMPLES,
    TOLERANCE,
    assert_all_gone,
    counted_samples,
    descendants,
    elastic_agent,
    end_soon,
    max_param_diff,
    read_jsonl,
    static_params,
)

SCRIPT = ELASTIC

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _agent(coordinator: str, node: str, nproc: int, tmp: Path, steps: int, extra: tuple[str, ...] = ()) -> list[str]:
    return elastic_agent(coordinator, node, nproc, tmp, steps, ("--rescale", "restart", *extra))


def _events(tmp: Path) -> list[dict]:
    return read_jsonl(tmp / "events.jsonl")


def _stepping(tmp: Path, world: int, min_step: int = 0) -> bool:
    return any(e["world"] == world and e["step"] >= min_step for e in _events(tmp))


@pytest.mark.long
def test_rescale_4_to_2_to_3_matches_a_static_run(make_coordinator, spawn_agent, tmp_path: Path) -> None:
    steps = 160
    server = make_coordinator()
    a = spawn_agent(server, _agent(server.address, "node-a", 2, tmp_path, steps), name="agent-a")
    b = spawn_agent(server, _agent(server.address, "node-b", 2, tmp_path, steps), name="agent-b")
    wait_for(lambda: _stepping(tmp_path, 4, 5), 90, "world 4 stepping")
    b_pids = [b.pid, *descendants(b.pid)]
    b.kill(signal.SIGTERM)  # graceful leave: every rank checkpoints at one step, then b leaves
    wait_for(lambda: b.proc.poll() is not None, 60, "node b to leave")
    assert b.proc.returncode == left_on(signal.SIGTERM), b.output()[-3000:]
    assert_all_gone(b_pids)
    wait_for(lambda: _stepping(tmp_path, 2), 60, "world 2 stepping")
    c = spawn_agent(server, _agent(server.address, "node-c", 1, tmp_path, steps), name="agent-c")
    wait_for(lambda: _stepping(tmp_path, 3), 90, "world 3 stepping")
    steps = end_soon(tmp_path, steps)
    wait_for(lambda: a.proc.poll() is not None and c.proc.poll() is not None, 120, "the job to finish")
    assert (a.proc.returncode, c.proc.returncode) == (0, 0), a.output()[-3000:] + c.output()[-3000:]

    events = _events(tmp_path)
    assert {e["world"] for e in events} == {4, 2, 3}
    steps_run, per_epoch = counted_samples(events)
    assert steps_run == list(range(steps)), "every step ran"
    complete = [ep for ep in per_epoch if ep < max(per_epoch)]
    assert complete, "the run covered at least one whole epoch"
    for epoch in complete:
        assert sorted(per_epoch[epoch]) == list(range(SAMPLES)), f"epoch {epoch}: every sample exactly once"

    diff = max_param_diff(torch.load(tmp_path / "final.pt"), static_params(tmp_path, steps))
    print(f"rescaled 4 -> 2 -> 3: max |param diff| vs a static run = {diff:.2e}")
    assert diff <= TOLERANCE


def test_kill_9_of_a_node_resumes_from_the_last_periodic_checkpoint(
    make_coordinator, spawn_agent, tmp_path: Path, fleet
) -> None:
    steps, every = 400, 5
    server = make_coordinator()
    extra = ("--rescale-grace", "5")
    args = [*_agent(server.address, "node-a", 2, tmp_path, steps, extra), "--save-every", str(every)]
    a = spawn_agent(server, args, name="agent-a")
    b = spawn_agent(
        server,
        [*_agent(server.address, "node-b", 2, tmp_path, steps, extra), "--save-every", str(every)],
        name="agent-b",
    )
    wait_for(lambda: _stepping(tmp_path, 4, 12), 90, "world 4 past step 12")
    b.kill(signal.SIGKILL)
    killed = time.time()
    wait_for(lambda: _stepping(tmp_path, 2), 60, "the survivors stepping")
    events = _events(tmp_path)
    before = max(e["step"] for e in events if e["world"] == 4 and e["time"] < killed)
    resumed = min(e["step"] for e in events if e["world"] == 2)
    lost = before + 1 - resumed
    print(f"kill -9 node at step {before}: resumed at step {resumed}, {lost} steps redone (interval {every})")
    assert resumed % every == 0, "resumed from a periodic checkpoint"
    assert 0 <= lost <= every, f"lost {lost} steps, more than the checkpoint interval {every}"
    with fleet(server.address) as client:
        client.finish_job("job", True)
    wait_for(lambda: a.proc.poll() is not None, 60, "agent a to exit")


def test_a_checkpoint_of_another_job_is_refused(tmp_path: Path) -> None:
    base = [
        *PLIANT,
        "run",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "0",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
    ]
    script = [str(SCRIPT), "--steps", "4", "--save-every", "2", "--samples", "100"]
    first = subprocess.run([*base, "--job", "first", *script], capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr[-3000:]
    second = subprocess.run([*base, "--job", "second", *script], capture_output=True, text=True, timeout=120)
    assert second.returncode == 1
    out = second.stdout + second.stderr
    assert "belongs to job 'first', not 'second'; point --checkpoint-dir at this job's directory" in out
    assert (tmp_path / "ckpt" / "step-000000000004").exists(), "the other job's checkpoints are left alone"


def test_kill_9_during_saves_never_loads_a_partial_checkpoint(tmp_path: Path) -> None:
    """A job saving asynchronously every step is killed -9 (launcher, agent and workers) mid-run, then restarted from
    scratch: it resumes from a committed checkpoint, ignoring the save that was cut short, and finishes."""
    ckpt = tmp_path / "ckpt"
    events = tmp_path / "events.jsonl"
    cmd = [
        *PLIANT,
        "run",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "0",
        "--checkpoint-dir",
        str(ckpt),
        str(SCRIPT),
        "--steps",
        "60",
        "--save-every",
        "1",
        "--width",
        "1024",
        "--samples",
        "200",
        "--events",
        str(events),
    ]
    # TMPDIR: the embedded etcd's temporary data, which a kill -9 leaves, goes where the test's files go.
    run = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    try:
        wait_for(lambda: len([e for e in _events(tmp_path) if e["rank"] == 0]) >= 8, 90, "8 steps")
        time.sleep(0.15)  # a save (17 MB per checkpoint) is in flight nearly all the time
        tree = [run.pid, *descendants(run.pid)]
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        run.wait(10)
        assert_all_gone(tree)
    finally:
        if run.poll() is None:
            run.kill()
    committed = sorted(p.name for p in ckpt.iterdir() if (p / "pliant-commit.json").exists())
    partial = sorted(p.name for p in ckpt.iterdir() if not (p / "pliant-commit.json").exists())
    assert committed, "some checkpoints were committed before the kill"
    newest = int(committed[-1].split("-")[1])
    print(f"after kill -9: committed {committed[-1]}, partial {partial}")
    before = len(_events(tmp_path))
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    resumed = min(e["step"] for e in _events(tmp_path)[before:])
    assert resumed == newest, f"resumed at step {resumed}, the newest committed checkpoint is step {newest}"
