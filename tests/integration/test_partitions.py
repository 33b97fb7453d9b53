"""Partitions on real network namespaces (bench/netns.py): each node has its own address on a bridge, the control
plane listens on the host's. A node cut off from everything goes silent (no reset reaches anyone): the survivors'
collectives must notice within seconds (TCP keepalive on the process group's sockets), the coordinator evicts the
node, and the rest trains on in place, exactly. Root only: skipped with the reason elsewhere."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from bench.netns import unavailable
from pliant.coordinator.contract import Generation
from pliant.coordinator.policy import BACKOFF_BASE_S
from pliant.env import GUARD_EXIT_CODE
from pliant.net import free_port
from pliant.progress import Directive, write_directive
from pliant.security.identity import Role
from tests.conftest import wait_for
from tests.fleet import COORDINATOR_HOSTS
from tests.integration.harness import (
    GLOBAL_BATCH,
    SAMPLES,
    TOLERANCE,
    batches_counted,
    descendants,
    elastic_agent,
    end_soon,
    max_param_diff,
    read_jsonl,
    static_params,
)
from tests.integration.machines import fabric_fixture

WHY = unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240), pytest.mark.skipif(bool(WHY), reason=WHY)]


fabric = fabric_fixture("plt", 7)  # 10.213.7.0/24 down to .4.0/24: not the soaks' 9 and 11


def _events(tmp: Path) -> list[dict]:
    return read_jsonl(tmp / "events.jsonl")


def _stepping(tmp: Path, world: int, min_step: int = 0, generation: int = 0) -> bool:
    return any(e["world"] == world and e["step"] >= min_step and e["generation"] >= generation for e in _events(tmp))


def _world(
    make_coordinator,
    spawn_agent,
    pki,
    fabric,
    tmp: Path,
    steps: int,
    script: tuple[str, ...],
    checkpoints: bool,
    extra: tuple[str, ...] = (),
    names: tuple[str, ...] = ("a", "b"),
    nproc: int = 2,
    first: bool = False,
):  # type: ignore[no-untyped-def]
    """A coordinator on the host's bridge address, and nodes ``names`` in namespaces with ``nproc`` DDP workers each
    (0.05 s steps), all training together (``first``: the first node joins before the others, so it is node rank
    0). Returns (server, nodes, agents), in the order of ``names``."""
    tls = pki.issue("coordinator-netns", Role.COORDINATOR, "test-coordinator", (*COORDINATOR_HOSTS, fabric.host))
    server = make_coordinator(listen=f"{fabric.host}:{free_port()}", tls=tls)
    nodes = [fabric.node(name) for name in names]
    args = dict(checkpoints=checkpoints, script=("--engine", "ddp", *script), step_time=0.05)
    agents = []
    for node in nodes:  # all at once: their starts (torch imports, 6-20 s on 2 loaded cores) overlap
        argv = elastic_agent(
            server.address,
            f"node-{node.name}",
            nproc,
            tmp,
            steps,
            extra=("--host", node.address, "--max-restarts", "3", *extra),
            **args,
        )
        agents.append(spawn_agent(server, argv, name=f"agent-{node.name}", node=node))
        if first and len(agents) == 1:  # the first node joins first: it is node rank 0
            wait_for(lambda: "joined job" in agents[0].output(), 60, f"node {node.name} to join")
    world = nproc * len(names)
    wait_for(
        lambda: len({e["rank"] for e in _events(tmp) if e["world"] == world}) == world, 120, f"world {world} stepping"
    )
    return server, nodes, agents


def _world_of_4(
    make_coordinator,
    spawn_agent,
    pki,
    fabric,
    tmp: Path,
    steps: int,
    script: tuple[str, ...],
    checkpoints: bool,
    extra: tuple[str, ...] = (),
):  # type: ignore[no-untyped-def]
    """Nodes a and b with 2 DDP workers each (:func:`_world`). Returns (server, node a, node b, agent a, agent b)."""
    server, (a, b), (agent_a, agent_b) = _world(
        make_coordinator, spawn_agent, pki, fabric, tmp, steps, script, checkpoints, extra
    )
    return server, a, b, agent_a, agent_b


class _Published:
    """The generations a job published after number ``after``, in order, read from the coordinator's history: a poll
    of the current generation misses one that a successor replaced within the poll's interval (a rejoin can follow
    the eviction before it by 40 ms). Each change is read with one watch (a caller may hold few at once)."""

    def __init__(self, client, after: int) -> None:  # type: ignore[no-untyped-def]
        self.client = client
        self.seen: list[Generation] = []
        self._after = after

    def any(self, predicate) -> bool:  # type: ignore[no-untyped-def]
        """Whether a generation published so far satisfies ``predicate`` (reading what came since the last call)."""
        last = self.seen[-1].number if self.seen else self._after
        newest = self.client.get_job("job").generation.number
        if newest > last:
            for event in self.client.watch("job", last + 1):
                if event.generation is not None:
                    self.seen.append(event.generation)
                    if event.generation.number >= newest:
                        break
        return any(predicate(g) for g in self.seen)


def _exact(tmp: Path, events: list[dict], steps: int) -> float:
    """Assert that every step ran and every sample of each complete epoch counted once; returns the final parameters'
    largest difference from a static run on the same global batches. Each test cuts once: the ranks cut off may have
    finished their part of a step's all-reduce (so their gradients are in it) without the last bytes that end it on
    their side, so that step's line from them is missing; at most one step counts with its whole global batch that
    way (``batches_counted``)."""
    steps_run, per_epoch, wrong, unlogged = batches_counted(events, SAMPLES, GLOBAL_BATCH)
    assert wrong == 0 and unlogged <= 1, (wrong, unlogged)
    assert steps_run == list(range(steps))
    for epoch in [ep for ep in per_epoch if ep < max(per_epoch)]:
        assert sorted(per_epoch[epoch]) == list(range(SAMPLES)), f"epoch {epoch}: every sample exactly once"
    return max_param_diff(torch.load(tmp / "final.pt"), static_params(tmp, steps))


def _finish(tmp: Path, steps: int, agents: list, world: int) -> tuple[int, list[dict]]:  # type: ignore[type-arg]
    """Once a cut healed: wait for world ``world`` stepping again, end the job soon, and check that every agent
    exits 0. Returns (the job's step count, its events)."""
    healed = time.time()
    wait_for(lambda: any(e["world"] == world and e["time"] > healed for e in _events(tmp)), 90, f"world {world} again")
    steps = end_soon(tmp, steps)
    wait_for(lambda: all(agent.proc.poll() is not None for agent in agents), 120, "the job to finish")
    assert [agent.proc.returncode for agent in agents] == [0] * len(agents), agents[0].output()[-3000:]
    return steps, _events(tmp)


def _workers_of(agent: object, world: int, tmp: Path) -> set[int]:
    """The pids of ``agent``'s workers that stepped in a world of ``world`` (its descendants among them)."""
    mine = set(descendants(agent.pid))  # type: ignore[attr-defined]
    return {e["pid"] for e in _events(tmp) if e["world"] == world and e["pid"] in mine}


def test_a_node_cut_off_from_everything_is_dropped_and_the_rest_trains_on(
    make_coordinator, spawn_agent, pki, fabric, tmp_path: Path
) -> None:
    steps = 120  # both nodes start together: world 4 forms in the first steps
    _, _, b, agent_a, agent_b = _world_of_4(make_coordinator, spawn_agent, pki, fabric, tmp_path, steps, (), False)
    first = min(e["step"] for e in _events(tmp_path) if e["world"] == 4)
    wait_for(lambda: _stepping(tmp_path, 4, first + 5), 60, "world 4 stepping on")
    before = _workers_of(agent_a, 4, tmp_path)

    cut = time.time()
    fabric.isolate(b)  # node b's link goes down: its agent and workers go silent, nothing is reset
    wait_for(
        lambda: any(e["world"] == 2 and e["time"] > cut for e in _events(tmp_path)),
        90,
        "node a stepping without node b",
    )
    events = _events(tmp_path)
    back = min(e["time"] for e in events if e["world"] == 2 and e["time"] > cut)
    last = max(e["step"] for e in events if e["rank"] == 0 and e["time"] < cut)
    steps = end_soon(tmp_path, steps)
    wait_for(lambda: agent_a.proc.poll() is not None, 120, "the job to finish")
    assert agent_a.proc.returncode == 0, agent_a.output()[-3000:]
    agent_b.kill()

    events = _events(tmp_path)
    after = {e["pid"] for e in events if e["world"] == 2 and e["time"] > cut}
    assert len(before) == 2 and after <= before, "node a's workers kept their processes"
    diff = _exact(tmp_path, events, steps)
    resumed = min(e["step"] for e in events if e["world"] == 2 and e["time"] > cut)
    print(
        f"node b cut off at step {last}: node a stepping alone {back - cut:.2f}s later from step {resumed} "
        f"({last + 1 - resumed} committed steps redone); max |param diff| vs static {diff:.2e}"
    )
    assert "rescale in place (failure)" in agent_a.output()
    assert diff <= TOLERANCE


def test_a_node_cut_off_from_the_control_plane_fences_itself_then_rejoins(
    make_coordinator, spawn_agent, pki, fleet, fabric, tmp_path: Path
) -> None:
    """Node b still reaches node a but not the coordinator: it is evicted and its workers stop, node a's re-form in
    place without it, and no checkpoint of the old world is committed after the new world opened the directory;
    once the partition heals node b joins again, in place, and the job ends exact."""
    steps = 260  # periodic checkpoints give the fence commits to refuse; node a trains on alone until b is back
    server, _, b, agent_a, agent_b = _world_of_4(
        make_coordinator, spawn_agent, pki, fabric, tmp_path, steps, ("--save-every", "5"), True
    )
    b_pids = _workers_of(agent_b, 4, tmp_path)
    assert len(b_pids) == 2, b_pids

    cut = time.time()
    fabric.block(b, fabric.host)  # node b reaches node a, not the coordinator
    with fleet(server) as client:
        gen = wait_for(
            lambda: (g := client.get_job("job").generation) and g.node_ids == ("node-a",) and g, 30, "node b evicted"
        )
        assert gen.reason == "failure"
    wait_for(lambda: any(e["world"] == 2 and e["time"] > cut for e in _events(tmp_path)), 90, "node a alone")
    # Its workers stop: they leave at a step boundary when its agent still hears the new generation on its watch
    # (a blackhole drops only what node b sends), or its agent fences them when it hears nothing.
    wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in b_pids), 30, "node b's workers to be stopped")
    fence_at = (tmp_path / "ckpt" / "pliant-fence.json").stat().st_mtime
    for marker in (tmp_path / "ckpt").glob("step-*/pliant-commit.json"):
        info = json.loads(marker.read_text())
        assert info["generation"] >= gen.number or info["saved_at"] < fence_at, info

    fabric.unblock(b, fabric.host)
    healed = time.time()
    wait_for(lambda: any(e["world"] == 4 and e["time"] > healed for e in _events(tmp_path)), 90, "node b back")
    rejoined = min(e["time"] for e in _events(tmp_path) if e["world"] == 4 and e["time"] > healed)
    steps = end_soon(tmp_path, steps)
    wait_for(lambda: agent_a.proc.poll() is not None and agent_b.proc.poll() is not None, 120, "the job to finish")
    assert (agent_a.proc.returncode, agent_b.proc.returncode) == (0, 0), agent_b.output()[-3000:]

    events = _events(tmp_path)
    diff = _exact(tmp_path, events, steps)
    print(
        f"node b cut off from the control plane: evicted, its workers stopped; healed -> world 4 stepping again "
        f"{rejoined - healed:.2f}s later; max |param diff| vs static {diff:.2e}"
    )
    assert "restarted from the checkpoint" not in agent_a.output(), "node a's workers re-formed in place"
    assert diff <= TOLERANCE


def test_a_cut_between_two_nodes_that_never_heals_costs_the_training_nothing(  # type: ignore[no-untyped-def]
    make_coordinator, spawn_agent, pki, fleet, fabric, tmp_path: Path, caplog
) -> None:
    """Nodes a and b reach the control plane but not each other, for good. One is evicted (not both, though both
    report the other), and trains on in place with its processes. The other rejoins and is admitted once more; it
    never arrives, so the survivors' agent reports it instead of handing over, once its agent failed two probes (not
    at the end of the rescale grace), and the survivors train on. It is then held back: BACKOFF_BASE_S for its
    strike, and past that for as long as its agent, a spare, cannot reach every member (a try would fail again: before,
    each backoff ended in another futile try). Once the cut heals its agent reaches them all: the hold is lifted and
    it is admitted at once. The job ends exact, with no checkpoint directory: no progress was lost."""
    steps = 3000  # a bound: the job ends 10 steps after the test is done
    grace = 10  # the rescale grace: how long the survivors' agent waits for a newcomer to arrive
    caplog.set_level(logging.INFO, logger="pliant.coordinator.store_members")
    server, a, b, agent_a, agent_b = _world_of_4(
        make_coordinator, spawn_agent, pki, fabric, tmp_path, steps, (), False, extra=("--rescale-grace", str(grace))
    )
    with fleet(server) as client:
        cut, published = time.time(), _Published(client, client.get_job("job").generation.number)
        seen = published.seen
        fabric.block(a, b.address)
        wait_for(lambda: published.any(lambda g: len(g.node_ids) == 1), 60, "one node evicted")
        survivor = next(g for g in seen if len(g.node_ids) == 1).node_ids[0]
        kept = _workers_of(agent_a if survivor == "node-a" else agent_b, 4, tmp_path)
        wait_for(lambda: published.any(lambda g: g.reason == "join"), 30, "the other admitted again")
        rejoin, admitted = next((g.number, g.created_at) for g in seen if g.reason == "join")
        wait_for(
            lambda: published.any(lambda g: g.number > rejoin and g.node_ids == (survivor,)),
            grace + 30,
            "the newcomer that never arrived evicted",
        )
        dropped = next(g.created_at for g in seen if g.number > rejoin)
        while time.time() < dropped + BACKOFF_BASE_S + 8:  # the strike's backoff, and then some
            published.any(lambda g: False)
            time.sleep(0.2)
        retried = [g.number for g in seen if g.number > rejoin + 1 and g.reason == "join"]
    fabric.unblock(a, b.address)
    healed = time.time()
    wait_for(lambda: any(e["world"] == 4 and e["time"] > healed for e in _events(tmp_path)), 90, "world 4 again")
    back = min(e["time"] for e in _events(tmp_path) if e["world"] == 4 and e["time"] > healed)
    steps = end_soon(tmp_path, steps)
    wait_for(lambda: agent_a.proc.poll() is not None and agent_b.proc.poll() is not None, 120, "the job to finish")
    assert (agent_a.proc.returncode, agent_b.proc.returncode) == (0, 0), agent_a.output()[-3000:]

    events = _events(tmp_path)
    alone = [e for e in events if e["world"] == 2 and cut < e["time"] < healed]
    assert alone and {e["pid"] for e in alone} <= kept, "the survivor's workers kept their processes"
    times = sorted(e["time"] for e in alone if e["rank"] == 0)
    stall = max(b - a for a, b in itertools.pairwise(times))
    diff = _exact(tmp_path, events, steps)
    print(
        f"cut a-b for good: {survivor} trained on alone; the other's readmission failed {dropped - admitted:.1f}s "
        f"after it was admitted (rescale grace {grace}s), tries while the cut lasted {retried}; "
        f"longest gap between the survivor's steps {stall:.2f}s; generations "
        f"{[(g.number, g.reason, g.node_ids) for g in seen]}; world 4 stepping {back - healed:.1f}s after the "
        f"heal; max |param diff| vs static {diff:.2e}"
    )
    assert not retried, "held past its backoff while its agent could not reach every member"
    assert "cannot reach every member of generation" in caplog.text
    assert dropped - admitted < grace - 2, "reported once its agent failed two probes, before the grace ran out"
    assert "have not arrived yet and their agents are unreachable" in agent_a.output() + agent_b.output()
    assert "(1 strikes) lifted: its agent reaches every member" in caplog.text
    assert back - healed < BACKOFF_BASE_S / 2, "admitted once it reached every member"
    assert stall < 5.0, "a newcomer that cannot arrive does not stop the survivors"
    assert diff <= TOLERANCE


def test_a_node_cut_off_from_its_peers_only_is_the_one_dropped(
    make_coordinator, spawn_agent, pki, fleet, fabric, tmp_path: Path
) -> None:
    """Node a (node rank 0: it hosts the agent store) loses both its peers but still reaches the control plane; b
    and c lose only a. Every agent reports the peers it cannot reach, a naming both. Whoever reports first, a is the
    one evicted, as the smaller side (before, a report of a's that came first left a training alone), and b and c
    train on in place, with their processes. Once the cut heals a rejoins, and the job ends exact."""
    steps = 3000  # a bound: the job ends 10 steps after the test is done
    server, (a, b, c), agents = _world(
        make_coordinator,
        spawn_agent,
        pki,
        fabric,
        tmp_path,
        steps,
        (),
        False,
        extra=("--rescale-grace", "10"),
        names=("a", "b", "c"),
        nproc=1,
        first=True,
    )
    with fleet(server) as client:
        number = client.get_job("job").generation.number
        assert client.get_job("job").generation.node_ids[0] == "node-a"
        kept = _workers_of(agents[1], 3, tmp_path) | _workers_of(agents[2], 3, tmp_path)
        cut = time.time()
        for peer in (b, c):
            fabric.block(a, peer.address)
        published = _Published(client, number)
        wait_for(lambda: published.any(lambda g: True), 60, "a generation after the cut")
        gen = published.seen[0]  # node a's rejoin may follow at once
        assert (set(gen.node_ids), gen.reason, gen.restarts_used) == ({"node-b", "node-c"}, "failure", 0), gen
    wait_for(lambda: any(e["world"] == 2 and e["time"] > cut for e in _events(tmp_path)), 60, "b and c stepping")
    back = min(e["time"] for e in _events(tmp_path) if e["world"] == 2 and e["time"] > cut)
    for peer in (b, c):
        fabric.unblock(a, peer.address)
    healed, (steps, events) = time.time(), _finish(tmp_path, steps, agents, 3)
    pair = {e["pid"] for e in events if e["world"] == 2 and cut < e["time"] < healed}
    assert len(kept) == 2 and pair <= kept, "b's and c's workers kept their processes"
    diff = _exact(tmp_path, events, steps)
    said = f"failure of generation {number} reported"
    when = [next((line[:23] for line in agent.output().splitlines() if said in line), "~") for agent in agents]
    first = "abc"[when.index(min(when))]  # the agents' log lines start with their time
    print(
        f"node a cut off from its peers: generation {gen.number} trains on b and c, stepping {back - cut:.2f}s "
        f"after the cut (the first report came from node {first}); max |param diff| vs static "
        f"{diff:.2e}"
    )
    assert diff <= TOLERANCE


def test_a_cut_that_node_rank_0_does_not_see_keeps_the_member_that_stayed(
    make_coordinator, spawn_agent, pki, fleet, fabric, tmp_path: Path
) -> None:
    """Nodes a and b cannot reach each other, for good; c (node rank 0: it hosts the generation's store) reaches
    both. One of a and b is evicted; it rejoins (and may count itself in at c's store), but the member that stayed
    cannot reach it: that member's agent reports it within two probes, or at once once it counted in, instead of
    handing the generation over (so that nobody waits in a meeting that cannot form: 30 s, the meeting's timeout, on
    a network that drops packets; here the blackhole routes fail the connects at once), and the newcomer's own
    report, which names that member, evicts nobody (before: c counted on the newcomer's side too, and its report
    evicted the member that had stayed). The job ends exact."""
    steps = 3000  # a bound: the job ends 10 steps after the test is done
    server, (_, a, b), agents = _world(
        make_coordinator,
        spawn_agent,
        pki,
        fabric,
        tmp_path,
        steps,
        (),
        False,
        extra=("--rescale-grace", "10"),
        names=("c", "a", "b"),
        nproc=1,
        first=True,
    )
    with fleet(server) as client:
        assert client.get_job("job").generation.node_ids[0] == "node-c"
        cut, published = time.time(), _Published(client, client.get_job("job").generation.number)
        seen = published.seen
        fabric.block(a, b.address)
        wait_for(lambda: published.any(lambda g: True), 60, "a or b evicted")
        stayed = next(n for n in seen[0].node_ids if n != "node-c")
        wait_for(lambda: published.any(lambda g: g.reason == "join"), 30, "the other readmitted")
        joined = next(g.number for g in seen if g.reason == "join")
        wait_for(lambda: published.any(lambda g: g.number > joined), 60, "its readmission reported")
        time.sleep(5)  # the survivors train on
        published.any(lambda g: False)
    fabric.unblock(a, b.address)
    healed, (steps, events) = time.time(), _finish(tmp_path, steps, agents, 3)
    times = sorted(e["time"] for e in events if e["rank"] == 0 and cut + 12 < e["time"] < healed)  # after the loss
    stall = max(later - earlier for earlier, later in itertools.pairwise(times))
    diff = _exact(tmp_path, events, steps)
    worlds = [(g.number, g.reason, g.node_ids) for g in seen]
    print(
        f"cut a-b for good with c at node rank 0: {stayed} stayed; generations {worlds}; longest gap between rank "
        f"0's steps after the first eviction {stall:.2f}s; max |param diff| vs static {diff:.2e}"
    )
    assert all(stayed in g.node_ids for g in seen), "the member that stayed was never evicted"
    assert any(g.reason == "join" for g in seen) and len(seen[-1].node_ids) == 2, "its readmission failed"
    assert f"newcomers {'node-b' if stayed == 'node-a' else 'node-a'} " in "".join(x.output() for x in agents)
    assert stall < 10.0
    assert diff <= TOLERANCE


# One rank of a two-rank meeting whose ranks cannot reach each other, under the rendezvous watch; argv: rank, the
# store's host and port, the rank's progress file (its directive supersedes the meeting).
_MEETS = """
import sys
from datetime import timedelta
import torch.distributed as dist
import pliant.worker.inplace.groups as groups
from functools import partial
from pliant.worker.inplace.world import newer_directive
groups.MEET_GIVE_UP_S = 2.0
rank, host, port, progress = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
store = dist.TCPStore(host, port, 2, False, timeout=timedelta(seconds=30))
watch = groups.RendezvousWatch(partial(newer_directive, progress), generation=5)
print("meeting", flush=True)
try:
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=20))
    print("met", flush=True)
except RuntimeError as exc:
    print("failed:", str(exc).splitlines()[0][:120], flush=True)
watch.finish()
"""


def test_a_superseded_meeting_that_gloo_never_ends_ends_the_process(fabric, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Two ranks that cannot reach each other meet. The one whose connect fails raises at once; the pair's listening
    side waits past the group's 20 s timeout (pytorch/gloo #520), and shutting down its sockets does not free it.
    Once a newer generation supersedes the meeting, the rendezvous watch gives up on it: the process ends with its
    stacks and GUARD_EXIT_CODE, which its agent reports as a dead worker's, so a fresh worker takes the rank."""
    a, b = fabric.node("a"), fabric.node("b")
    port = free_port(fabric.host)
    master = dist.TCPStore(fabric.host, port, 2, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    fabric.block(a, b.address)
    logs = [tmp_path / f"rank{rank}.log" for rank in (0, 1)]
    progress = [str(tmp_path / f"progress-{rank}") for rank in (0, 1)]
    procs = [
        node.spawn([sys.executable, "-c", _MEETS, str(rank), fabric.host, str(port), progress[rank]], logs[rank])
        for rank, node in enumerate((a, b))
    ]
    try:
        wait_for(lambda: all("meeting" in log.read_text() for log in logs), 60, "both ranks meeting")
        time.sleep(3.0)  # past the failed connect; the listening side is still blocked
        assert sum(proc.poll() is None for proc in procs) == 1, [log.read_text()[-500:] for log in logs]
        superseded = time.monotonic()
        for path in progress:
            write_directive(path, Directive(6, "in-place"))
        for proc in procs:
            proc.wait(30)
        ended = time.monotonic() - superseded
        outs = [log.read_text() for log in logs]
        codes = sorted(proc.returncode for proc in procs)
        assert codes == sorted([0, GUARD_EXIT_CODE]), (codes, outs)
        stuck = outs[[proc.returncode for proc in procs].index(GUARD_EXIT_CODE)]
        assert "superseded by generation 6, is still blocked" in stuck, stuck
        assert "init_process_group" in stuck, stuck  # where it waited: faulthandler's stack of the main thread
        assert ended < 2.0 + 5.0, f"ended {ended:.1f}s after the newer generation came"
        print(f"the meeting's listening side ended {ended:.1f}s after it was superseded (give-up after 2 s)")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        del master
