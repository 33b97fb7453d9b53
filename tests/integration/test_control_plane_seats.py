"""`pliant run`'s embedded control plane without a single point of failure, on machines that share nothing but a
network (tests/integration/machines.py): the first three nodes each hold a seat (an etcd member and a coordinator
replica); kill -9 of the node that started the job, and later of a second seat's node, costs the job no step, no
sample and no join, and a node that joins later takes the lost seat, so that etcd has three voting members again.
Root only."""

from __future__ import annotations

import re
import shlex
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from bench.common import elastic_args
from bench.netns import unavailable
from pliant.coordinator.etcd_cluster import EtcdMembers
from pliant.security.tlsdir import TlsConfig
from tests.conftest import wait_for
from tests.integration.harness import GLOBAL_BATCH, SAMPLES, TOLERANCE, batches_counted, max_param_diff, static_params
from tests.integration.machines import Machine, fabric_fixture, first_step_at, ranks_at

WHY = unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(420), pytest.mark.skipif(bool(WHY), reason=WHY)]

PORT = 29400
SCRIPT = [
    "train.py",
    *elastic_args(100000, SAMPLES, GLOBAL_BATCH, step_time=0.05, events="events.jsonl", params_out="final.pt"),
    "--stop-file",
    "stop",
    "--float64",
]


fabric = fabric_fixture("pls", 15)  # 10.213.15.0/24 down to .12.0/24: no other test's (the short soak's is .11)


def _join_lines(machine: Machine) -> list[str]:
    """The join lines ``machine`` printed, the first one and each one after its control plane changed."""
    return re.findall(r"other nodes join with:\n  (.+)\n", machine.output())


def _seat_key(machine: Machine) -> str:
    """The seat key the first node printed, as a word the shell takes (``PLIANT_SEAT_KEY=...``)."""
    found = wait_for(lambda: re.search(r"join instead with .*:\n  (PLIANT_SEAT_KEY=\S+) ", machine.output()), 30, "key")
    return found.group(1)  # type: ignore[union-attr]


def _voting(members: EtcdMembers) -> list[str]:
    """The names of etcd's voting members (empty while no member answers)."""
    try:
        listed = members.list()
    except Exception:
        return []
    return sorted(m.name for m in listed if m.started and not m.learner)


def _seats_taken_again(members: EtcdMembers, lost: str) -> list[str]:
    """etcd's three voting members once none is ``lost``'s (empty until then)."""
    voters = _voting(members)
    return voters if len(voters) == 3 and lost not in voters else []


def _members(machines: list[Machine], tls: TlsConfig) -> EtcdMembers:
    """etcd's membership, asked of the members on ``machines`` (seats listen on the ports after the coordinator's)."""
    return EtcdMembers([f"https://{m.node.address}:{PORT + 2}" for m in machines], tls, timeout_s=3.0)


def _node_id(machine: Machine) -> str:
    found = re.search(r"agent (host\S+): joined job", machine.output())
    assert found, machine.output()[-2000:]
    return found.group(1)


def _stepping(machines: list[Machine], world: int, since: float) -> None:
    wait_for(lambda: ranks_at(machines, world, since) == set(range(world)), 120, f"world {world} stepping")


def _join(machine: Machine, line: str) -> None:
    """Run the join ``line`` on ``machine`` (its user's state directory, in its working directory, outlives its
    processes, as a real machine's does)."""
    machine.run(["env", "PLIANT_LOG_LEVEL=INFO", *shlex.split(line)], hide_others=True)


def test_losing_the_first_node_and_then_another_seat_costs_nothing(fabric, tmp_path: Path) -> None:
    """A job of four nodes, three of them seats (the first node and two joined with the seat key; one joined with the
    workers' line holds none): kill -9 of the first node, then of a second seat's node after the first seat was
    taken again; each time the other three step on in place, a node joins with the seat key and a line printed
    before the loss, and takes the lost seat."""
    machines = [Machine(fabric, name, tmp_path) for name in "abcdef"]
    a, b, c, d, e, f = machines
    argv = [sys.executable, "-m", "pliant", "run", "--listen", f"0.0.0.0:{PORT}", "--nnodes", "1:4"]
    a.run(["env", "PLIANT_LOG_LEVEL=INFO", *argv, "--nproc-per-node", "1", *SCRIPT], hide_others=False)
    first_line = wait_for(lambda: _join_lines(a), 90, "the join command")[0]
    certs = re.search(r"certificates in (\S+);", a.output()).group(1)  # type: ignore[union-attr]
    etcd_tls = TlsConfig.from_dir(Path(certs) / "etcd" / "client")  # etcd's CA signs every member's client
    key = _seat_key(a)
    assert "PLIANT_SEAT_KEY" not in first_line
    _stepping([a], 1, 0.0)
    for world, (machine, seat) in enumerate(((b, True), (c, False), (d, True)), start=2):
        _join(machine, f"{key} {first_line}" if seat else first_line)
        _stepping(machines, world, time.time() - 1)
    names = {m.hostname: _node_id(m) for m in (a, b, c, d)}
    seated = sorted(names[m.hostname] for m in (a, b, d))
    wait_for(lambda: _voting(_members([a], etcd_tls)) == seated, 90, "three voting members", 0.5)
    three_line = wait_for(lambda: [x for x in _join_lines(a) if x.count(f":{PORT}") == 3], 30, "the 3-seat line")[-1]
    assert all(f"{m.node.address}:{PORT}" in three_line for m in (a, b, d)), three_line
    assert "control-plane seat" not in c.output(), "the workers' line took no seat"

    killed = time.time()
    a.node.kill_all()  # kill -9 of the machine that started the job: etcd's leader, the leading replica, rank 0
    _stepping([b, c, d], 3, killed)
    survivors_s = first_step_at([b, c, d], 3, killed, 3) - killed
    _join(e, f"{key} {three_line}")  # the key and the line the first node printed: it names the other seats
    wait_for(lambda: "certificate signed at" in e.output(), 60, "e's join accepted")
    joined_s = time.time() - killed
    _stepping([b, c, d, e], 4, killed)
    names[e.hostname] = _node_id(e)
    voters = wait_for(lambda: _seats_taken_again(_members([b, c, d, e], etcd_tls), names["hosta"]), 90, "a's seat")
    assert voters == sorted(names[m.hostname] for m in (b, d, e)), voters
    replaced_s = time.time() - killed

    killed_b = time.time()
    b.node.kill_all()  # a second seat's node, after the first was replaced
    _stepping([c, d, e], 3, killed_b)
    survivors_b_s = first_step_at([c, d, e], 3, killed_b, 3) - killed_b
    line = [x for x in _join_lines(c) if f"{b.node.address}:{PORT}" in x][-1]  # c's line naming b and the others
    _join(f, f"{key} {line}")
    _stepping([c, d, e, f], 4, killed_b)
    joined_b_s = first_step_at([c, d, e, f], 4, killed_b, 4) - killed_b
    names[f.hostname] = _node_id(f)
    voters = wait_for(lambda: _seats_taken_again(_members([c, d, e, f], etcd_tls), names["hostb"]), 90, "b's seat")
    assert voters == sorted(names[m.hostname] for m in (d, e, f)), voters
    live = [c, d, e, f]

    newest = max(ev["step"] for m in machines for ev in m.events())
    for m in live:
        m.stop_at(newest + 10)
    wait_for(lambda: all(m.procs[-1].poll() is not None for m in live), 90, "every live machine to exit")
    assert [m.procs[-1].returncode for m in live] == [0] * 4, [m.output()[-2000:] for m in live]
    steps = newest + 10
    events = [ev for m in machines for ev in m.events()]
    steps_run, per_epoch, wrong, unlogged = batches_counted(events, SAMPLES, GLOBAL_BATCH)
    assert wrong == 0 and unlogged <= 2, (wrong, unlogged)
    assert steps_run == list(range(steps)), "every step ran"
    complete = [ep for ep in per_epoch if ep < max(per_epoch)]
    assert complete, "the run covered at least one whole epoch"
    for epoch in complete:
        assert sorted(per_epoch[epoch]) == list(range(SAMPLES)), f"epoch {epoch}: every sample exactly once"
    final = next(m.cwd / "final.pt" for m in live if (m.cwd / "final.pt").exists())
    diff = max_param_diff(torch.load(final), static_params(tmp_path, steps))
    assert diff <= TOLERANCE, diff
    print(
        f"embedded control plane, 3 seats: first node killed -> survivors stepping {survivors_s:.2f}s, a join "
        f"accepted {joined_s:.2f}s, quorum 3 again {replaced_s:.1f}s; a second seat's node killed -> survivors "
        f"stepping {survivors_b_s:.2f}s, a newcomer stepping {joined_b_s:.2f}s; max |param diff| {diff:.1e}"
    )


def _etcd_of(machine: Machine) -> psutil.Process:
    """The etcd member ``machine``'s agent runs (its seat's)."""
    found = [p for p in psutil.Process(machine.procs[-1].pid).children(recursive=True) if p.name() == "etcd"]
    assert len(found) == 1, found
    return found[0]


def test_two_seats_lost_at_once_stop_the_control_plane_not_the_training(fabric, tmp_path: Path) -> None:
    """Two of three seats' etcd members gone at once (frozen: hung or cut off, their nodes' workers alive): the
    workers train on, the agents say in one line what is lost and what brings it back, and once one of the two
    answers again the world changes again (a node joins). An etcd member killed is started again by its agent; a
    seat's node killed and started again, with the workers' line (no seat key), takes its seat back by its proof."""
    machines = [Machine(fabric, name, tmp_path) for name in "abcd"]
    a, b, c, d = machines
    argv = [sys.executable, "-m", "pliant", "run", "--listen", f"0.0.0.0:{PORT}", "--nnodes", "1:4"]
    a.run(["env", "PLIANT_LOG_LEVEL=INFO", *argv, "--nproc-per-node", "1", *SCRIPT], hide_others=False)
    first_line = wait_for(lambda: _join_lines(a), 90, "the join command")[0]
    certs = re.search(r"certificates in (\S+);", a.output()).group(1)  # type: ignore[union-attr]
    etcd_tls = TlsConfig.from_dir(Path(certs) / "etcd" / "client")
    key = _seat_key(a)
    _stepping([a], 1, 0.0)
    _join(b, f"{key} {first_line}")
    _stepping(machines, 2, time.time() - 1)
    _join(c, f"{key} {first_line}")
    _stepping(machines, 3, time.time() - 1)
    wait_for(lambda: len(_voting(_members([a], etcd_tls))) == 3, 90, "three voting members", 0.5)

    _etcd_of(b).kill()  # its agent starts it again from its data
    wait_for(lambda: "this node's etcd member runs again" in b.output(), 60, "b's etcd member again")
    wait_for(lambda: len(_voting(_members([a, b], etcd_tls))) == 3, 60, "b's member voting again", 0.5)

    frozen_at = time.time()
    frozen = [_etcd_of(m) for m in (b, c)]
    for proc in frozen:
        proc.send_signal(signal.SIGSTOP)
    try:
        said = wait_for(lambda: re.search(r".*has been unreachable for.*", a.output()), 60, "the agents' line")
        line = said.group(0)  # type: ignore[union-attr]
        assert re.search(
            r"an embedded control plane on 3 nodes \(hosta-\d+, hostb-\d+, hostc-\d+\): its etcd needs 2", line
        ), line
        assert "the workers keep training" in line and "takes its seat back" in line, line
        _stepping(machines, 3, time.time())  # the workers train on through the outage
        frozen[1].send_signal(signal.SIGCONT)  # c's member answers again: two of three, a quorum
        back = time.time()
        _join(d, first_line)
        _stepping(machines, 4, back)  # the world changes again
        print(f"two of three seats lost for {back - frozen_at:.0f}s; a join stepping {time.time() - back:.1f}s later")
    finally:
        for proc in frozen:
            proc.send_signal(signal.SIGCONT)

    seated_as = _node_id(c)
    killed = time.time()
    c.node.kill_all()  # a seat's whole node, then its `pliant run` again: the seat comes back from its saved state
    _stepping([a, b, d], 3, killed)
    without_c = first_step_at([a, b, d], 3, killed, 3)  # world 4's steps from here on are c's new world's
    _join(c, first_line)
    wait_for(lambda: "back in this node's control-plane seat" in c.output(), 90, "c back in its seat")
    _stepping(machines, 4, without_c)
    voters = sorted([_node_id(a), _node_id(b), seated_as])  # etcd's member keeps its name
    wait_for(lambda: _voting(_members([a, b, c], etcd_tls)) == voters, 60, "c's member voting again", 0.5)
    newest = max(ev["step"] for m in machines for ev in m.events())
    for m in machines:
        m.stop_at(newest + 10)
    wait_for(lambda: all(m.procs[-1].poll() is not None for m in machines), 90, "every machine to exit")
    assert [m.procs[-1].returncode for m in machines] == [0] * 4, [m.output()[-2000:] for m in machines]
