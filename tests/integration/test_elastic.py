"""Restart-based elasticity with real agents and real gloo workers: 2 agents x 2 workers of an unmodified torchrun
script, against a real coordinator and etcd. Each test asserts the generations (restart counts) and world sizes the
workers observed, that training steps continue after the event, and that no process is left behind."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from pliant.agent.contract import left_on
from pliant.coordinator.contract import JobState
from tests.conftest import wait_for
from tests.integration.harness import agent_args, assert_all_gone, descendants, read_steps, wait_world

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def _last_step(events) -> int:
    return max(s.step for s in read_steps(events))


def test_second_node_joins_then_a_worker_is_killed(make_coordinator, spawn_agent, tmp_path, fleet) -> None:
    server = make_coordinator()
    events = tmp_path / "events.jsonl"
    a = spawn_agent(server, agent_args(server.address, "job", "node-a", tmp_path), name="agent-a")
    wait_world(events, restart=0, world=2, timeout_s=60)
    loaded = [m.path for m in psutil.Process(a.pid).memory_maps() if "torch" in m.path]
    assert not loaded, f"the agent process loaded torch ({loaded[:3]}): its stores belong in the store host"

    b = spawn_agent(server, agent_args(server.address, "job", "node-b", tmp_path), name="agent-b")
    before = _last_step(events)
    steps = wait_world(events, restart=1, world=4, timeout_s=60, after_step=before)
    assert min(s.step for s in steps) >= before, "the bigger world resumes from the checkpoint, not from 0"
    with fleet(server.address) as client:
        gen = client.get_job("job").generation
        assert (gen.number, gen.reason, gen.node_ids, gen.world_size) == (2, "join", ("node-a", "node-b"), 4)
        # node a's workers (a script without pliant.worker) were stopped as torchrun stops them: SIGTERM, which their
        # own handler saw; never the rescale signal, which would have killed them (exit -10)
        wait_for(lambda: a.output().count("SIGTERM at step") == 2, 10, "the script's SIGTERM handler on node a")
        assert "generation 1: workers stopped for the rescale (local rank 0 exited 0" in a.output()
        assert "SIGUSR1" not in a.output()

        # kill -9 one worker of node b: the generation restarts at the same size and spends one restart.
        victim = max((s for s in read_steps(events) if s.restart == 1), key=lambda s: s.rank)
        os.kill(victim.pid, signal.SIGKILL)
        before = _last_step(events)
        wait_world(events, restart=2, world=4, timeout_s=60, after_step=before)
        gen = client.get_job("job").generation
        assert (gen.number, gen.reason, gen.restarts_used) == (3, "restart", 1)
        client.finish_job("job", True, "test done")
    pids = [a.pid, b.pid, *descendants(a.pid), *descendants(b.pid)]
    wait_for(lambda: a.proc.poll() is not None and b.proc.poll() is not None, 30, "agents to exit")
    assert (a.proc.returncode, b.proc.returncode) == (0, 0), a.output()[-3000:] + b.output()[-3000:]
    assert_all_gone(pids)


def test_kill_9_of_a_node_and_the_survivors_continue(make_coordinator, spawn_agent, tmp_path, fleet) -> None:
    server = make_coordinator()
    events = tmp_path / "events.jsonl"
    a = spawn_agent(server, agent_args(server.address, "job", "node-a", tmp_path, nnodes="1:2"), name="agent-a")
    b = spawn_agent(server, agent_args(server.address, "job", "node-b", tmp_path, nnodes="1:2"), name="agent-b")
    steps = wait_world(events, restart=0, world=4, timeout_s=90)
    b_workers = descendants(b.pid)
    b_pids = [b.pid, *b_workers]
    ranks_of_b = {s.rank for s in steps if s.pid in b_workers}
    assert ranks_of_b, "node b ran some of the ranks"

    b.kill(signal.SIGKILL)  # the agent; its workers die with it (parent-death signal)
    killed = time.monotonic()
    before = _last_step(events)
    survivors = wait_world(events, restart=1, world=2, timeout_s=60, after_step=before)
    took = time.monotonic() - killed
    assert_all_gone(b_pids)
    assert min(s.step for s in survivors) >= before - 1, "survivors resume from the checkpoint"
    with fleet(server.address) as client:
        info = client.get_job("job")
        assert info.generation.node_ids == ("node-a",) and info.generation.reason == "failure"
        assert info.generation.restarts_used == 0, "a lost node is not a worker failure"
        assert info.status.state is JobState.RUNNING
        client.finish_job("job", True)
    wait_for(lambda: a.proc.poll() is not None, 30, "agent a to exit")
    assert a.proc.returncode == 0
    print(f"kill -9 node -> survivors stepping: {took:.2f}s")


def test_below_min_nodes_the_job_waits_then_fails(make_coordinator, spawn_agent, tmp_path, fleet) -> None:
    server = make_coordinator()
    events = tmp_path / "events.jsonl"
    extra = ("--min-nodes-timeout", "4")
    a = spawn_agent(
        server, agent_args(server.address, "job", "node-a", tmp_path, nnodes="2:2", extra=extra), name="agent-a"
    )
    b = spawn_agent(
        server, agent_args(server.address, "job", "node-b", tmp_path, nnodes="2:2", extra=extra), name="agent-b"
    )
    wait_world(events, restart=0, world=4, timeout_s=90)
    a_pids = [a.pid, *descendants(a.pid)]
    b.kill(signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: a.proc.poll() is not None, 30, "agent a to give up")
    assert time.monotonic() - killed >= 3.5, "it waited for the min-nodes timeout first"
    assert a.proc.returncode == 1
    out = a.output()
    assert "failed: job 'job' waited 4s with 1 of the 2 nodes it needs (live: node-a)" in out
    assert_all_gone(a_pids)
    with fleet(server.address) as client:
        assert client.get_job("job").status.state is JobState.FAILED


def test_sigterm_to_an_agent_is_a_graceful_leave(make_coordinator, spawn_agent, tmp_path, fleet) -> None:
    server = make_coordinator()
    events = tmp_path / "events.jsonl"
    a = spawn_agent(server, agent_args(server.address, "job", "node-a", tmp_path), name="agent-a")
    b = spawn_agent(server, agent_args(server.address, "job", "node-b", tmp_path), name="agent-b")
    wait_world(events, restart=0, world=4, timeout_s=90)
    b_pids = [b.pid, *descendants(b.pid)]
    b.kill(signal.SIGTERM)
    wait_for(lambda: b.proc.poll() is not None, 30, "agent b to leave")
    assert b.proc.returncode == left_on(signal.SIGTERM), b.output()[-3000:]
    assert "graceful leave" in b.output()
    assert_all_gone(b_pids)
    before = _last_step(events)
    wait_world(events, restart=1, world=2, timeout_s=60, after_step=before)
    with fleet(server.address) as client:
        gen = client.get_job("job").generation
        assert (gen.reason, gen.node_ids, gen.restarts_used) == ("leave", ("node-a",), 0)
        client.finish_job("job", True)
    wait_for(lambda: a.proc.poll() is not None, 30, "agent a to exit")
    assert a.proc.returncode == 0
