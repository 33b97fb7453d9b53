"""The hsdp engine re-formed in place along its replicas, through real agents, a real coordinator and gloo workers
running examples/train_elastic.py (shard group = a node's 2 ranks): a joining node's ranks take one replica's shards
from a survivor, shard for shard, and nobody else moves any; survivors keep their processes; the final parameters
equal a static run's and every sample of each epoch counts once."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from pliant.agent.contract import left_on
from tests.conftest import wait_for
from tests.integration.harness import TOLERANCE, descendants, elastic_agent, end_soon
from tests.integration.test_in_place import _check_exact, _events, _pids, _stepping

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RECEIVED = re.compile(r"hsdp: rank (\d+) received shard (\d+) of (\d+) \((\d+) bytes\) from rank (\d+)")


def _received(output: str) -> list[tuple[int, int, int, int]]:
    """(rank, shard index, bytes, source rank) of each shard transfer an agent's workers logged."""
    return [(int(m[1]), int(m[2]), int(m[4]), int(m[5])) for m in RECEIVED.finditer(output)]


def _replica_bytes(width: int = 32) -> int:
    """The bytes of one replica's shards of examples/train_elastic.py's model (float64, its parameters and SGD's
    momentum), without the packing's alignment."""
    params = (16 * width + width) + (width * width + width) + (width + 1)
    return 2 * params * 8


def test_a_join_takes_one_replicas_shards_and_a_leave_moves_none(make_coordinator, spawn_agent, tmp_path: Path):
    steps = 150
    server = make_coordinator()
    args = dict(checkpoints=False, script=("--engine", "hsdp"))
    a = spawn_agent(server, elastic_agent(server.address, "node-a", 2, tmp_path, steps, **args), name="agent-a")
    wait_for(lambda: _stepping(tmp_path, 2, 5), 90, "world 2 (one replica) stepping")
    joined_at = time.time()
    b = spawn_agent(server, elastic_agent(server.address, "node-b", 2, tmp_path, steps, **args), name="agent-b")
    wait_for(lambda: _stepping(tmp_path, 4, generation=2) and len(_pids(_events(tmp_path), 4)) == 4, 90, "world 4")
    four = time.time()
    b.kill(signal.SIGTERM)  # a graceful leave: back to one replica, node a's shards untouched
    wait_for(lambda: b.proc.poll() is not None, 60, "node b to leave")
    assert b.proc.returncode == left_on(signal.SIGTERM), b.output()[-3000:]
    wait_for(lambda: _stepping(tmp_path, 2, generation=3), 60, "world 2 stepping again")
    steps = end_soon(tmp_path, steps)
    wait_for(lambda: a.proc.poll() is not None, 120, "the job to finish")
    assert a.proc.returncode == 0, a.output()[-3000:]

    events = _events(tmp_path)
    before, during = _pids([e for e in events if e["generation"] == 1], 2), _pids(events, 4)
    after = _pids([e for e in events if e["generation"] == 3], 2)
    assert before == after == {0: during[0], 1: during[1]}, "node a's workers kept their processes throughout"
    moved_a, moved_b = _received(a.output()), _received(b.output())
    assert moved_a == [], f"node a's ranks kept their own shards: {moved_a}"
    assert sorted((rank, index, source) for rank, index, _n, source in moved_b) == [(2, 0, 0), (3, 1, 1)], moved_b
    shard_bytes = sum(n for _rank, _index, n, _source in moved_b)
    assert _replica_bytes() <= shard_bytes <= _replica_bytes() + 16 * 24, "one replica's shards (and alignment)"
    diff = _check_exact(tmp_path, steps, "hsdp")
    print(
        f"hsdp in place: join -> 4 ranks stepping {four - joined_at:.2f}s, {shard_bytes} shard bytes moved (one "
        f"replica: {_replica_bytes()}); max |param diff| vs static {diff:.2e}"
    )
    assert diff <= TOLERANCE


def test_three_replicas_survive_a_join_a_node_kill_a_join_and_a_leave_in_place(
    make_coordinator, spawn_agent, tmp_path: Path
) -> None:
    """Nodes a and b (2 replicas), c joins (3), b is killed -9 (2: a and c step on from their own shards), d joins
    (3), c leaves (2). Each join moves one replica's shards to the newcomer's ranks and nothing else moves; node a's
    workers never restart, nor do c's through b's death; the result is a static run's."""
    steps = 220
    server = make_coordinator()
    args = dict(checkpoints=False, script=("--engine", "hsdp"), step_time=0.05)

    def agent(node: str):
        flags = elastic_agent(server.address, node, 2, tmp_path, steps, extra=("--max-restarts", "3"), **args)
        return spawn_agent(server, flags, name=f"agent-{node}")

    a, b = agent("node-a"), agent("node-b")
    wait_for(lambda: len(_pids(_events(tmp_path), 4)) == 4, 120, "world 4 (two replicas) stepping")
    formed = max(e["generation"] for e in _events(tmp_path) if e["world"] == 4)
    on_a = {pid for pid in _pids(_events(tmp_path), 4).values() if pid in descendants(a.pid)}
    assert len(on_a) == 2, on_a
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
    moved = {name: _received(output) for name, output in outputs.items()}
    for name in ("c", "d"):  # each newcomer's two ranks, ranks 4 and 5 of a world of 6, took one replica's shards
        joined = moved[name][:2]
        assert sorted((rank, index) for rank, index, _n, _source in joined) == [(4, 0), (5, 1)], moved
        shard_bytes = sum(n for _rank, _index, n, _source in joined)
        assert _replica_bytes() <= shard_bytes <= _replica_bytes() + 16 * 24, moved
    # After b's death, the ranks of a node that had not committed the step b died in (the others had) are behind:
    # they take that step's shards from a current holder, once. Nothing else moves.
    caught_up = {"a": moved["a"], "c": moved["c"][2:], "d": moved["d"][2:]}
    for name, transfers in caught_up.items():
        assert not transfers or "was committed by peers; taking their state" in outputs[name], moved
    assert sum(len(t) for t in caught_up.values()) <= 2, moved
    diff = _check_exact(tmp_path, steps, "hsdp", kills=2)
    print(
        f"hsdp, three replicas: kill -9 of node b -> a and c stepping {back - killed_at:.2f}s later; each join "
        f"moved one replica's shards; max |param diff| vs static {diff:.2e}"
    )
    assert diff <= TOLERANCE


def test_a_killed_worker_is_replaced_in_place_with_its_shard_from_the_other_replica(
    make_coordinator, spawn_agent, tmp_path: Path
) -> None:
    """Two replicas (nodes a and b); kill -9 of one of b's workers: its peers, blocked in the mesh's collectives, are
    released (the mesh's groups are the world's, which a failure severs), b's agent starts a new worker, which takes
    the dead one's shard from node a's rank of the same index; every other process steps on; exact."""
    steps = 160
    server = make_coordinator()
    args = dict(checkpoints=False, script=("--engine", "hsdp"), step_time=0.05)
    nodes = {}
    for node in ("node-a", "node-b"):
        flags = elastic_agent(server.address, node, 2, tmp_path, steps, extra=("--max-restarts", "3"), **args)
        nodes[node] = spawn_agent(server, flags, name=f"agent-{node}")
    a, b = nodes["node-a"], nodes["node-b"]
    wait_for(lambda: len(_pids(_events(tmp_path), 4)) == 4, 120, "world 4 (two replicas) stepping")
    formed = max(e["generation"] for e in _events(tmp_path) if e["world"] == 4)
    target = max(e["step"] for e in _events(tmp_path)) + 5
    wait_for(lambda: _stepping(tmp_path, 4, target, generation=formed), 60, "world 4 past a few steps")
    world4 = _pids([e for e in _events(tmp_path) if e["generation"] == formed], 4)
    on_b = {rank: pid for rank, pid in world4.items() if pid in descendants(b.pid)}
    victim = max(on_b)
    killed_at = time.time()
    os.kill(world4[victim], signal.SIGKILL)
    wait_for(
        lambda: len(_pids([e for e in _events(tmp_path) if e["generation"] > formed], 4)) == 4, 60, "world 4 again"
    )
    back = max(
        min(e["time"] for e in _events(tmp_path) if e["generation"] > formed and e["rank"] == rank) for rank in range(4)
    )
    steps = end_soon(tmp_path, steps)
    wait_for(lambda: a.proc.poll() is not None and b.proc.poll() is not None, 120, "the job to finish")
    assert a.proc.returncode == 0 and b.proc.returncode == 0, (a.output()[-2000:], b.output()[-2000:])

    events = _events(tmp_path)
    after = _pids([e for e in events if e["generation"] > formed], 4)
    survivors = {rank: pid for rank, pid in world4.items() if rank != victim}
    assert {r: after[r] for r in survivors} == survivors, "the other workers kept their processes"
    moved = _received(b.output())
    assert [(rank, index) for rank, index, _n, _source in moved[-1:]] == [(victim, victim % 2)], moved
    assert moved[-1][3] not in on_b, f"the shard came from node a's replica: {moved}"
    assert "guard" not in b.output() or "still blocked" not in b.output(), "no worker stayed blocked in a collective"
    diff = _check_exact(tmp_path, steps, "hsdp", kills=1)
    print(f"hsdp: kill -9 of a worker -> all 4 ranks stepping {back - killed_at:.2f}s later; diff {diff:.2e}")
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
        moved = _received(agents[name].output())
        assert len(moved) == 1 and moved[0][3] in (0, 1), f"{name} took its shard from the surviving replica: {moved}"
    diff = _check_exact(tmp_path, steps, "hsdp", kills=1)
    print(
        f"hsdp, a replica over two nodes: kill -9 of one -> the other replica stepping {back - killed_at:.2f}s later, "
        f"{first} waiting until node-e joined; max |param diff| vs static {diff:.2e}"
    )
    assert diff <= TOLERANCE
