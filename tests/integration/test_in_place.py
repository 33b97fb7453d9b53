"""In-place rescale through real agents, a real coordinator and gloo workers running examples/train_elastic.py with no
checkpoint directory: a join, a graceful leave, a kill -9 of a worker and of a whole node. The survivors keep their
processes (the same PIDs step before and after), the final parameters equal a static run's on the same global
batches, every sample of each epoch is used once by the updates that count, and at most the in-flight step is redone
per failure."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from pliant.agent.contract import left_on
from pliant.coordinator.contract import JobState
from pliant.net import free_port
from pliant.worker.inplace.cadence import FIRST_SNAPSHOT_EVERY
from pliant.worker.metrics import RECOVERY_PHASES
from tests.conftest import wait_for
from tests.integration.harness import (
    GLOBAL_BATCH,
    SAMPLES,
    TOLERANCE,
    assert_kept,
    batches_counted,
    descendants,
    elastic_agent,
    end_soon,
    hsdp_transfers,
    longest_pause,
    max_param_diff,
    read_jsonl,
    replica_bytes,
    sample,
    scrape,
    static_params,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _events(tmp: Path) -> list[dict]:
    return read_jsonl(tmp / "events.jsonl")


def _stepping(tmp: Path, world: int, min_step: int = 0, generation: int = 0) -> bool:
    return any(e["world"] == world and e["step"] >= min_step and e["generation"] >= generation for e in _events(tmp))


def _back(events: list[dict], world: int, generation: int) -> float | None:
    """When the last rank of a world of ``world`` first stepped in generation ``generation`` or a later one (None:
    not every rank has yet)."""
    first: dict[int, float] = {}
    for e in events:
        if e["world"] == world and e["generation"] >= generation:
            first[e["rank"]] = min(first.get(e["rank"], e["time"]), e["time"])
    return max(first.values()) if len(first) == world else None


def _pids(events: list[dict], world: int) -> dict[int, int]:
    """rank -> pid of the ranks that stepped in a world of ``world``."""
    return {e["rank"]: e["pid"] for e in events if e["world"] == world}


def _check_exact(tmp: Path, steps: int, engine: str = "ddp", kills: int = 0) -> float:
    """Assert every step ran and every sample of each complete epoch counted once; returns the max parameter
    difference against a static run. A rank killed (``kills``) between its step's commit and its log line leaves that
    step's line missing: such a step counts with its global batch (``batches_counted``)."""
    steps_run, per_epoch, wrong, unlogged = batches_counted(_events(tmp), SAMPLES, GLOBAL_BATCH)
    assert wrong == 0 and unlogged <= kills, (wrong, unlogged)
    assert steps_run == list(range(steps)), "every step ran"
    complete = [ep for ep in per_epoch if ep < max(per_epoch)]
    assert complete, "the run covered at least one whole epoch"
    for epoch in complete:
        assert sorted(per_epoch[epoch]) == list(range(SAMPLES)), f"epoch {epoch}: every sample exactly once"
    return max_param_diff(torch.load(tmp / "final.pt"), static_params(tmp, steps, engine))


@pytest.mark.parametrize("engine", ["ddp", "zero", "fsdp", "hsdp"])
def test_a_join_and_a_leave_keep_the_survivors_processes(
    make_coordinator, spawn_agent, tmp_path: Path, engine: str
) -> None:
    steps = 150  # node b's agent and zygote import torch in 8-10 s on 2 loaded cores: world 2 must not end first
    server = make_coordinator()
    args = dict(checkpoints=False, script=("--engine", engine))
    a = spawn_agent(server, elastic_agent(server.address, "node-a", 2, tmp_path, steps, **args), name="agent-a")
    wait_for(lambda: _stepping(tmp_path, 2, 5), 90, "world 2 stepping")
    joined_at = time.time()
    b = spawn_agent(server, elastic_agent(server.address, "node-b", 2, tmp_path, steps, **args), name="agent-b")
    wait_for(lambda: _stepping(tmp_path, 4), 60, "world 4 stepping")
    four = time.time()
    wait_for(
        lambda: _stepping(tmp_path, 4, generation=2) and len(_pids(_events(tmp_path), 4)) == 4,
        30,
        "every rank of world 4 stepping",
    )
    b.kill(signal.SIGTERM)  # a graceful leave: b's ranks leave at a step boundary, a's re-form without them
    wait_for(lambda: b.proc.poll() is not None, 60, "node b to leave")
    assert b.proc.returncode == left_on(signal.SIGTERM), b.output()[-3000:]  # left; the job goes on
    wait_for(lambda: _stepping(tmp_path, 2, generation=3), 60, "world 2 stepping again")
    steps = end_soon(tmp_path, steps)
    wait_for(lambda: a.proc.poll() is not None, 120, "the job to finish")
    assert a.proc.returncode == 0, a.output()[-3000:]

    events = _events(tmp_path)
    before, during = _pids([e for e in events if e["generation"] == 1], 2), _pids(events, 4)
    after = _pids([e for e in events if e["generation"] == 3], 2)
    assert before == after == {0: during[0], 1: during[1]}, "node a's workers kept their processes throughout"
    assert {e["generation"] for e in events} == {1, 2, 3}
    if engine == "hsdp":  # a replica per node: node b's ranks took one replica's shards from node a's, nothing else
        assert hsdp_transfers(a.output()) == [], "node a's ranks kept their own shards"
        moved = hsdp_transfers(b.output())
        assert sorted((rank, index, source) for rank, index, _n, source in moved) == [(2, 0, 0), (3, 1, 1)], moved
        shard_bytes = sum(n for _rank, _index, n, _source in moved)
        assert replica_bytes() <= shard_bytes <= replica_bytes() + 16 * 24, "one replica's shards (and alignment)"
    pause = longest_pause(events, joined_at)
    diff = _check_exact(tmp_path, steps, engine)
    print(
        f"{engine} in place: join -> 4 ranks stepping {four - joined_at:.2f}s, longest rank-0 pause after the "
        f"join {pause:.2f}s; max |param diff| vs static {diff:.2e}"
    )
    assert diff <= TOLERANCE
    assert "rescale in place (boundary)" in a.output()


def _redone(events: list[dict], failed_at: float) -> tuple[int, int]:
    """(the last step the world of ``failed_at`` committed, the first step a later generation ran): the world by rank
    0's events, its last step by any rank's (a rank whose vote failed while its peers' completed takes their state and
    logs no line for that step), the first step after by rank 0's. By generation, not by time: a step the whole world
    committed as the kill landed is logged just after it."""
    mine = [e for e in events if e["rank"] == 0]
    generation = max(e["generation"] for e in mine if e["time"] < failed_at)
    before = max(e["step"] for e in events if e["generation"] == generation)
    resumed = min(e["step"] for e in mine if e["generation"] > generation)
    return before, resumed


def snapshot_intervals(output: str) -> list[int]:
    """The automatic snapshot intervals (K) the workers logged (pliant.worker.inplace.cadence), the first one
    included."""
    return [FIRST_SNAPSHOT_EVERY] + [int(k) for k in re.findall(r"buddy snapshots every (\d+) steps", output)]


def _check_redone(engine: str, events: list[dict], killed_at: float, output: str) -> tuple[int, int]:
    """(the last step committed before the kill, the first run after it), asserting what may run again: the step in
    flight, and for the sharded engines the steps since the last snapshot (at most K, the largest K the workers chose
    automatically)."""
    before, resumed = _redone(events, killed_at)
    if engine in ("ddp", "hsdp"):  # replicas: the survivors hold every committed step
        assert resumed == before + 1, "no committed step is redone; only the one in flight runs again"
    else:  # the survivors roll back to the newest snapshot that the buddies' copies complete
        assert 0 <= before + 1 - resumed <= max(snapshot_intervals(output)) + 1, (before, resumed)
    return before, resumed


def test_a_node_that_joins_as_the_job_ends_neither_trains_nor_holds_the_job_up(
    make_coordinator, spawn_agent, fleet, tmp_path: Path
) -> None:
    """Node b joins while node a runs the job's last steps, and b's workers come after a's have finished (its
    zygote's preload takes 8 s): a completes the new generation untrained, the job succeeds without b, and b's agent
    ends with the job instead of waiting out its start timeout with workers that have no one to train with."""
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "slow_import.py").write_text("import time\n\ntime.sleep(8)\n")
    server = make_coordinator()
    a = spawn_agent(server, elastic_agent(server.address, "node-a", 1, tmp_path, 100000), name="agent-a")
    wait_for(lambda: _stepping(tmp_path, 1, 5), 90, "node a stepping")
    late = elastic_agent(server.address, "node-b", 1, tmp_path, 100000, extra=("--preload", "slow_import"))
    b = spawn_agent(server, late, name="agent-b", env={"PYTHONPATH": str(slow)})
    wait_for(lambda: "once node-b arrive" in a.output(), 60, "the hand-over waiting for node b's workers")
    steps = end_soon(tmp_path, 100000, margin=5)
    wait_for(lambda: a.proc.poll() is not None and b.proc.poll() is not None, 60, "both nodes to end")
    assert (a.proc.returncode, b.proc.returncode) == (0, 0), (a.output()[-3000:], b.output()[-3000:])
    status = fleet(server).get_job("job").status
    assert status.state is JobState.SUCCEEDED and "node-b joined generation 2" in status.reason, status
    events = _events(tmp_path)
    assert {e["world"] for e in events} == {1}, "node b never trained"
    steps_run, _per_epoch, wrong, unlogged = batches_counted(events, SAMPLES, GLOBAL_BATCH)
    assert steps_run == list(range(steps)) and wrong == unlogged == 0, "every step ran once"


@pytest.mark.long
@pytest.mark.parametrize("engine", ["ddp", "zero", "fsdp"])
def test_a_kill_9_of_a_worker_then_of_a_node_redoes_at_most_a_snapshot(
    make_coordinator, spawn_agent, tmp_path: Path, engine: str
) -> None:
    """World 4 on two nodes; kill -9 one of node b's workers (its agent replaces it in place), then node b whole."""
    steps = 140  # world 4 forms in the first steps; the node kill comes near step 60-80 on 2 loaded cores
    server = make_coordinator()
    args = dict(checkpoints=False, script=("--engine", engine), step_time=0.05)
    a = spawn_agent(
        server,
        elastic_agent(server.address, "node-a", 2, tmp_path, steps, extra=("--max-restarts", "3"), **args),
        name="agent-a",
    )
    port = free_port()
    # Both nodes start at once: node b's start (its agent's and zygote's torch imports, 6-20 s on 2 loaded cores)
    # overlaps node a's, so world 4 forms early in the job, in the first generation or by a join.
    b = spawn_agent(
        server,
        elastic_agent(
            server.address,
            "node-b",
            2,
            tmp_path,
            steps,
            **args,
            extra=("--max-restarts", "3", "--metrics-port", str(port)),
        ),
        name="agent-b",
    )
    wait_for(lambda: len(_pids(_events(tmp_path), 4)) == 4, 120, "every rank of world 4 stepping")
    first = min(e["step"] for e in _events(tmp_path) if e["world"] == 4)
    formed = max(e["generation"] for e in _events(tmp_path) if e["world"] == 4)
    wait_for(lambda: _stepping(tmp_path, 4, first + 18), 60, "world 4 past its first snapshots")

    world4 = _pids(_events(tmp_path), 4)
    on_b = {rank: pid for rank, pid in world4.items() if pid in descendants(b.pid)}
    on_a = {rank: pid for rank, pid in world4.items() if rank not in on_b}
    assert len(on_a) == len(on_b) == 2, (world4, on_b)
    victim = max(on_b)  # node b's second worker; its agent and its first worker live on
    survivors = {rank: pid for rank, pid in world4.items() if rank != victim}
    worker_killed = time.time()
    os.kill(world4[victim], signal.SIGKILL)
    wait_for(lambda: _back(_events(tmp_path), 4, formed + 1), 60, "every rank of world 4 stepping again")
    events = _events(tmp_path)
    worker_back = _back(events, 4, formed + 1)
    metrics = scrape(f"http://127.0.0.1:{port}/metrics")  # node b's: the agent's and its workers' series
    rescales = {k: v for k, v in metrics.items() if "rescales_total" in k or "reconfigurations_total" in k}
    assert sample(metrics, "pliant_agent_rescales_total", path="in-place") >= 1, rescales
    assert sample(metrics, "pliant_agent_rescales_total", path="restart") == 0, rescales
    assert sample(metrics, "pliant_worker_reconfigurations_total", why="failure") >= 1, rescales  # its survivor
    assert sample(metrics, "pliant_worker_state_sync_bytes_total") > 0  # ... and the new one's state from peers
    assert sample(metrics, "pliant_agent_worker_exits_total", code="-9") == 1
    for phase in RECOVERY_PHASES:  # the surviving worker's recovery, phase by phase
        assert sample(metrics, "pliant_worker_recovery_phase_seconds_count", phase=phase) >= 1, (phase, metrics)
    if engine != "ddp":  # the automatic interval in force (pliant.worker.inplace.cadence)
        assert sample(metrics, "pliant_worker_snapshot_every") in snapshot_intervals(a.output()), metrics
    after = _pids([e for e in events if e["generation"] > formed], 4)
    assert_kept(survivors.values(), after.values(), a.output() + b.output())
    on_a, seen = {rank: after[rank] for rank in on_a}, len(a.output())  # (a give-up is counted once)
    worker_redone = _check_redone(engine, events, worker_killed, a.output())

    wait_for(
        lambda: _stepping(tmp_path, 4, max(e["step"] for e in events) + 13, generation=formed + 1),
        60,
        "world 4 past its next snapshots",
    )
    node_killed = time.time()
    b.kill(signal.SIGKILL)  # the agent; its workers die with it (parent-death signal)
    wait_for(lambda: _stepping(tmp_path, 2, generation=formed + 2), 60, "the survivors stepping")
    steps = end_soon(tmp_path, steps)
    wait_for(lambda: a.proc.poll() is not None, 120, "the job to finish")
    assert a.proc.returncode == 0, a.output()[-3000:]

    events = _events(tmp_path)
    alone = [e for e in events if e["generation"] >= formed + 2 and e["world"] == 2]
    node_back = min(e["time"] for e in alone)
    assert_kept(on_a.values(), _pids(alone, 2).values(), a.output()[seen:])  # node a's workers, throughout
    node_redone = _check_redone(engine, events, node_killed, a.output())
    # Node a's report of the loss says that generation trained: node b, however new, earns no strike.
    assert re.search(
        rf"failure of generation {formed + 1} reported \(accepted; current generation \d+\); every "
        "member had arrived",
        a.output(),
    ), a.output()[-3000:]
    diff = _check_exact(tmp_path, steps, engine, kills=2)  # a worker, then node b's
    for what, (before, resumed), back, killed in (
        ("worker", worker_redone, worker_back, worker_killed),
        ("node", node_redone, node_back, node_killed),
    ):
        print(
            f"{engine} kill -9 {what} in place: step {before} was the last committed, the survivors resumed at "
            f"{resumed} ({before + 1 - resumed} committed steps redone), all stepping {back - killed:.2f}s after "
            f"the kill"
        )
    print(f"{engine}: max |param diff| vs static {diff:.2e}")
    if engine != "ddp":
        assert "rolled back to the snapshot of step" in a.output()
    assert diff <= TOLERANCE


@pytest.mark.long
@pytest.mark.parametrize("engine", ["zero", "fsdp"])
def test_a_worker_killed_with_its_buddys_node_rolls_back_in_place_from_its_kept_copies(
    make_coordinator, spawn_agent, tmp_path: Path, engine: str
) -> None:
    """ZeRO or FSDP2, world 4 on two nodes: kill -9 node a's second worker and, at the same moment, node b whole.
    Every rank's buddy is on the other node, so that worker's shard and its ward's are in no live process (as in the
    soaks with two workers per node, where a survivor blocked on the dead node gave up). Its replacement on node a
    reads back the copies it kept in node-local memory (pliant.worker.inplace.kept), and node a rolls back in place: no
    restart, no disk (there is no checkpoint directory), the survivor keeps its process, exact."""
    steps = 140
    server = make_coordinator()
    args = dict(checkpoints=False, script=("--engine", engine), step_time=0.05)
    port = free_port()
    a = spawn_agent(
        server,
        elastic_agent(
            server.address,
            "node-a",
            2,
            tmp_path,
            steps,
            **args,
            extra=("--max-restarts", "3", "--metrics-port", str(port)),
        ),
        name="agent-a",
    )
    b = spawn_agent(
        server,
        elastic_agent(server.address, "node-b", 2, tmp_path, steps, **args, extra=("--max-restarts", "3")),
        name="agent-b",
    )
    wait_for(lambda: len(_pids(_events(tmp_path), 4)) == 4, 120, "every rank of world 4 stepping")
    first = min(e["step"] for e in _events(tmp_path) if e["world"] == 4)
    wait_for(lambda: _stepping(tmp_path, 4, first + 18), 60, "world 4 past its first snapshots")

    world4 = _pids(_events(tmp_path), 4)
    on_b = {rank for rank, pid in world4.items() if pid in descendants(b.pid)}
    on_a = sorted(rank for rank in world4 if rank not in on_b)
    assert len(on_a) == len(on_b) == 2, (world4, on_b)
    survivor, victim = on_a
    # Node b may join before node a's first workers announced that they move in place (a restart at the start, on a
    # loaded machine): only what the kill costs is counted.
    restarts = sample(scrape(f"http://127.0.0.1:{port}/metrics"), "pliant_agent_rescales_total", path="restart")
    killed_at = time.time()
    os.kill(world4[victim], signal.SIGKILL)
    b.kill(signal.SIGKILL)  # the agent; its workers die with it (parent-death signal)
    wait_for(
        lambda: len(_pids([e for e in _events(tmp_path) if e["time"] > killed_at], 2)) == 2,
        90,
        "both ranks of node a stepping in a world of 2",
    )
    metrics = scrape(f"http://127.0.0.1:{port}/metrics")
    steps = end_soon(tmp_path, steps)
    wait_for(lambda: a.proc.poll() is not None, 120, "the job to finish")
    assert a.proc.returncode == 0, a.output()[-3000:]

    events = _events(tmp_path)
    after = [e for e in events if e["time"] > killed_at and e["world"] == 2]
    assert world4[survivor] in set(_pids(after, 2).values()), "node a's surviving worker kept its process"
    assert world4[victim] not in set(_pids(after, 2).values())
    output = a.output()
    assert re.search(r"holds the copies its predecessor \(rank \d of generation \d+\) kept", output), output[-3000:]
    assert "rolled back to the snapshot of step" in output
    assert sample(metrics, "pliant_agent_rescales_total", path="restart") == restarts, metrics
    before, resumed = _check_redone(engine, events, killed_at, output)
    back = min(e["time"] for e in after)
    diff = _check_exact(tmp_path, steps, engine, kills=2)
    print(
        f"{engine}: a worker and its buddy's node killed together: step {before} was the last committed, resumed at "
        f"{resumed} ({before + 1 - resumed} committed steps redone), node a stepping {back - killed_at:.2f}s after "
        f"the kill; max |param diff| vs static {diff:.2e}"
    )
    assert diff <= TOLERANCE
