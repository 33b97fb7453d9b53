"""The hsdp engine re-formed in place along its replicas, through real agents, a real coordinator and gloo workers
running examples/train_elastic.py (a shard group is a node's ranks, or spans two nodes): a node's death, a worker's,
joins and leaves with three replicas; a joining node's ranks take one replica's shards from a survivor, shard for
shard, and nobody else moves any; survivors keep their processes; the final parameters equal a static run's and every
sample of each epoch counts once. The join and leave of a second replica: tests/integration/test_in_place.py."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from pliant.agent.contract import left_on
from tests.conftest import wait_for
from tests.integration.harness import (
    GAVE_UP,
    TOLERANCE,
    descendants,
    elastic_agent,
    end_soon,
    hsdp_transfers,
    replica_bytes,
)
from tests.integration.test_in_place import _check_exact, _events, _pids, _stepping

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_replicas_survive_a_worker_kill_a_join_a_node_kill_a_join_and_a_leave_in_place(
    make_coordinator, spawn_agent, tmp_path: Path
) -> None:
    """Nodes a and b (2 replicas); kill -9 of one of b's workers: its peers, blocked in the mesh's collectives, are
    released (the mesh's groups are the world's, which a failure severs) and b's agent starts a new worker, which takes
    the dead one's shard from node a's rank of the same index. Then c joins (3), b is killed -9 (2: a and c step on
    from their own shards), d joins (3), c leaves (2). Each join moves one replica's shards to the newcomer's ranks and
    nothing else moves; node a's workers never restart; the result is a static run's."""
    steps = 300
    server = make_coordinator()
    args = dict(checkpoints=False, script=("--engine", "hsdp"), step_time=0.05)

    def agent(node: str):
        flags = elastic_agent(server.address, node, 2, tmp_path, steps, extra=("--max-restarts", "3"), **args)
        return spawn_agent(server, flags, name=f"agent-{node}")

    a, b = agent("node-a"), agent("node-b")
    wait_for(lambda: len(_pids(_events(tmp_path), 4)) == 4, 120, "world 4 (two replicas) stepping")
    formed = max(e["generation"] for e in _events(tmp_path) if e["world"] == 4)
    world4 = _pids([e for e in _events(tmp_path) if e["generation"] == formed], 4)
    on_a = {pid for pid in world4.values() if pid in descendants(a.pid)}
    assert len(on_a) == 2, on_a
    target = max(e["step"] for e in _events(tmp_path)) + 5
    wait_for(lambda: _stepping(tmp_path, 4, target, generation=formed), 60, "world 4 past a few steps")
    victim = max(rank for rank, pid in world4.items() if pid not in on_a)
    worker_killed = time.time()
    os.kill(world4[victim], signal.SIGKILL)
    wait_for(
        lambda: len(_pids([e for e in _events(tmp_path) if e["generation"] > formed], 4)) == 4, 60, "world 4 again"
    )
    worker_back = max(
        min(e["time"] for e in _events(tmp_path) if e["generation"] > formed and e["rank"] == r) for r in range(4)
    )
    after = _pids([e for e in _events(tmp_path) if e["generation"] > formed], 4)
    assert {r: after[r] for r in world4 if r != victim} == {r: p for r, p in world4.items() if r != victim}
    replaced = hsdp_transfers(b.output())
    assert [(rank, index) for rank, index, _n, _source in replaced] == [(victim, victim % 2)], replaced
    assert world4[replaced[0][3]] in on_a, f"the new worker's shard came from node a's replica: {replaced}"
    c = agent("node-c")
    wait_for(lambda: len(_pids(_events(tmp_path), 6)) == 6, 90, "world 6 (three replicas) stepping")
    six = max(e["generation"] for e in _events(tmp_path) if e["world"] == 6)
    target = max(e["step"] for e in _events(tmp_path)) + 5
    wait_for(lambda: _stepping(tmp_path, 6, target, generation=six), 60, "world 6 past a few steps")
    killed_at = time.time()
    b.kill(signal.SIGKILL)  # the agent; its workers die with it
    wait_for(lambda: _stepping(tmp_path, 4, generation=six + 1), 60, "world 4 (a and c) stepping again")
    back = min(e["time"] for e in _events(tmp_path) if e["world"] == 4 and e["generation"] > six)
    d = agent("node-d")
    wait_for(lambda: len(_pids([e for e in _events(tmp_path) if e["generation"] > six + 1], 6)) == 6, 90, "world 6")
    last = max(e["generation"] for e in _events(tmp_path))
    c.kill(signal.SIGTERM)  # a graceful leave
    wait_for(lambda: c.proc.poll() is not None, 60, "node c to leave")
    assert c.proc.returncode == left_on(signal.SIGTERM), c.output()[-3000:]
    wait_for(lambda: _stepping(tmp_path, 4, generation=last + 1), 60, "world 4 (a and d) stepping")
    steps = end_soon(tmp_path, steps)
    wait_for(lambda: a.proc.poll() is not None and d.proc.poll() is not None, 120, "the job to finish")
    assert a.proc.returncode == 0, a.output()[-3000:]
    assert d.proc.returncode == 0, d.output()[-3000:]

    events = _events(tmp_path)
    for generation in {e["generation"] for e in events if e["generation"] >= formed}:
        stepped = {e["pid"] for e in events if e["generation"] == generation}
        assert on_a <= stepped, f"node a's workers stepped in generation {generation} without restarting"
    outputs = {"a": a.output(), "c": c.output(), "d": d.output()}
    moved = {name: hsdp_transfers(output) for name, output in outputs.items()}
    for name in ("c", "d"):  # each newcomer's two ranks, ranks 4 and 5 of a world of 6, took one replica's shards
        joined = moved[name][:2]
        assert sorted((rank, index) for rank, index, _n, _source in joined) == [(4, 0), (5, 1)], moved
        shard_bytes = sum(n for _rank, _index, n, _source in joined)
        assert replica_bytes() <= shard_bytes <= replica_bytes() + 16 * 24, moved
    # After b's death, the ranks of a node that had not committed the step b died in (the others had) are behind,
    # and a worker the step guard gave up on (blocked past its break on a loaded machine) is replaced: each takes its
    # shard from a current holder, once. Nothing else moves.
    caught_up = {"a": moved["a"], "c": moved["c"][2:], "d": moved["d"][2:]}
    for name, transfers in caught_up.items():
        explained = ("was committed by peers; taking their state", GAVE_UP)
        assert not transfers or any(why in outputs[name] for why in explained), moved
        assert len(transfers) <= 2, moved
    diff = _check_exact(tmp_path, steps, "hsdp", kills=3)  # a worker of b, then b's two
    print(
        f"hsdp, replicas: kill -9 of a worker -> all stepping {worker_back - worker_killed:.2f}s later; of node b -> a "
        f"and c stepping {back - killed_at:.2f}s later; each join moved one replica's shards; max |param diff| vs "
        f"static {diff:.2e}"
    )
    assert diff <= TOLERANCE


def test_a_group_spanning_two_nodes_that_loses_one_benches_the_other_until_a_node_joins(
    make_coordinator, spawn_agent, tmp_path: Path
) -> None:
    """One rank per node, shard groups of 2 ranks, so a replica spans two nodes (``--node-group 2``): four nodes are
    two replicas. kill -9 of the second node of the first group: the other group trains on alone in place, and the
    first group's other node waits as a spare (its worker leaves); a fifth node joins and completes a group with it,
    both taking their shards from the surviving replica. The result is a static run's."""
    steps = 400
    server = make_coordinator()
    args = dict(checkpoints=False, script=("--engine", "hsdp", "--shard-group", "2"), step_time=0.05)
    extra = ("--max-restarts", "3", "--nnodes", "2:4", "--node-group", "2")

    def agent(node: str):
        return spawn_agent(
            server, elastic_agent(server.address, node, 1, tmp_path, steps, extra=extra, **args), name=f"agent-{node}"
        )

    agents = {name: agent(name) for name in ("node-a", "node-b")}
    wait_for(lambda: len(_pids(_events(tmp_path), 2)) == 2, 120, "world 2 (one replica over two nodes) stepping")
    agents.update({name: agent(name) for name in ("node-c", "node-d")})
    wait_for(lambda: len(_pids(_events(tmp_path), 4)) == 4, 120, "world 4 (two replicas) stepping")
    formed = max(e["generation"] for e in _events(tmp_path) if e["world"] == 4)
    world4 = _pids([e for e in _events(tmp_path) if e["generation"] == formed], 4)
    node_of = {pid: name for name, p in agents.items() for pid in descendants(p.pid)}
    first, partner = node_of[world4[0]], node_of[world4[1]]
    other = {world4[2], world4[3]}
    killed_at = time.time()
    agents[partner].kill(signal.SIGKILL)
    wait_for(lambda: _stepping(tmp_path, 2, generation=formed + 1), 60, "the other replica stepping alone")
    back = min(e["time"] for e in _events(tmp_path) if e["world"] == 2 and e["generation"] > formed)
    assert set(_pids([e for e in _events(tmp_path) if e["generation"] > formed], 2).values()) == other
    wait_for(lambda: "waiting to be admitted" in agents[first].output(), 30, f"{first} to wait as a spare")
    assert agents[first].proc.poll() is None, f"{first}'s agent waits as a spare"
    agents["node-e"] = agent("node-e")
    wait_for(lambda: len(_pids([e for e in _events(tmp_path) if e["generation"] > formed + 1], 4)) == 4, 120, "world 4")
    steps = end_soon(tmp_path, steps)
    live = [agents[n] for n in agents if n != partner]
    wait_for(lambda: all(p.proc.poll() is not None for p in live), 120, "the job to finish")
    assert all(p.proc.returncode == 0 for p in live), [p.output()[-2000:] for p in live]

    events = _events(tmp_path)
    last = _pids([e for e in events if e["generation"] > formed + 1], 4)
    assert {last[0], last[1]} == other, "the surviving replica kept its processes and its ranks"
    for name in (first, "node-e"):
        moved = hsdp_transfers(agents[name].output())
        assert len(moved) == 1 and moved[0][3] in (0, 1), f"{name} took its shard from the surviving replica: {moved}"
    diff = _check_exact(tmp_path, steps, "hsdp", kills=1)
    print(
        f"hsdp, a replica over two nodes: kill -9 of one -> the other replica stepping {back - killed_at:.2f}s later, "
        f"{first} waiting until node-e joined; max |param diff| vs static {diff:.2e}"
    )
    assert diff <= TOLERANCE
