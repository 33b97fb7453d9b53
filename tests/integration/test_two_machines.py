"""The README's "Two machines" recipe, verbatim, on machines that share nothing but a network.

Each machine is a network namespace with its own address (bench/netns.py), its own host name (a UTS namespace) and
its own view of the files (a mount namespace): a joining machine sees none of the first machine's files (the first
node's run and certificate directories, its temporary files and state directory among them: see
tests/integration/machines.py), runs from its own working directory with its own copy of the script, and is told
nothing but the one line the first node printed. Nothing sets GLOO_SOCKET_IFNAME: pliant picks the interface of the
address it advertises. Root only.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.common import PLIANT
from bench.netns import Fabric, unavailable
from pliant.coordinator.client import CoordinatorClient
from pliant.security.identity import Role
from pliant.security.tlsdir import TlsConfig
from tests.conftest import wait_for
from tests.integration.harness import SAMPLES
from tests.integration.machines import Machine, fabric_fixture, first_step_at, ranks_at

WHY = unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.skipif(bool(WHY), reason=WHY)]

PORT = 29400
SCRIPT_ARGS = (
    "--samples",
    str(SAMPLES),
    "--global-batch",
    "64",
    "--micro-batch",
    "8",
    "--step-time",
    "0.05",
    "--events",
    "events.jsonl",
    "--stop-file",
    "stop",
)


fabric = fabric_fixture("plm", 23)  # 10.213.23.0/24 down to .20.0/24: no other test's


def _worker_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def _recipe(
    tmp_path: Path, fabric: Fabric, nproc: int, nodes: int, seats: tuple[str, ...] = ("--control-plane-seats", "1")
) -> tuple[list[Machine], str]:
    """The first machine's command from the README, and the join line it prints (``seats``: the seat flags; one
    seat by default: what losing the control plane costs; seats: test_control_plane_seats)."""
    machines = [Machine(fabric, name, tmp_path) for name in "abc"[:nodes]]
    first = machines[0]
    argv = [
        *PLIANT,
        "run",
        "--listen",
        f"0.0.0.0:{PORT}",
        "--nnodes",
        f"1:{nodes}",
        *seats,
        "--nproc-per-node",
        str(nproc),
        "train.py",
        "--steps",
        "100000",
        *SCRIPT_ARGS,
    ]
    first.run(argv, hide_others=False)
    found = wait_for(lambda: re.search(r"other nodes join with:\n  (.+)\n", first.output()), 90, "the join command")
    return machines, found.group(1)  # type: ignore[union-attr]


def _check_addresses(first: Machine, machines: list[Machine], world: int) -> None:
    """Every address pliant advertised to another node is that node's own, never loopback: member addresses, the
    store, and the workers' MASTER_ADDR; and gloo runs on the interface of that address."""
    admin_dir = re.search(r"--tls-dir (\S+/admin)` shows the job", first.output()).group(1)  # type: ignore[union-attr]
    own = {m.node.address for m in machines}
    with CoordinatorClient(f"{first.node.address}:{PORT}", TlsConfig.from_dir(admin_dir).load(expect=Role.ADMIN)) as c:
        job = c.get_job("default")
    assert job.generation is not None and job.generation.world_size == world
    hosts = {m.address.rsplit(":", 1)[0] for m in job.members} | {job.generation.store_address.rsplit(":", 1)[0]}
    assert hosts <= own and not any(ipaddress.ip_address(h).is_loopback for h in hosts), hosts
    assert job.generation.store_address.rsplit(":", 1)[0] == first.node.address, "node rank 0 hosts the store"
    for machine in machines:
        seen = [e for e in machine.events() if e["world"] == world]
        assert seen and {e["master_addr"] for e in seen} == {first.node.address}, machine.hostname
        assert {e["gloo_ifname"] for e in seen} == {machine.node.ifname}, "gloo on the advertised address's interface"


@pytest.mark.long
@pytest.mark.parametrize("nproc", [1, 2])
def test_the_readme_recipe_grows_the_job_survives_a_kill_and_rejoins(fabric, tmp_path: Path, nproc: int) -> None:
    """With one worker per node, a third machine then joins with the same line, and the first machine's control
    plane goes (its etcd killed): all train on, the joiners' agents say so in one line, and all exit 0 once their
    workers finish."""
    machines, join = _recipe(tmp_path, fabric, nproc, nodes=3 if nproc == 1 else 2)
    first, second = machines[:2]
    assert f"--coordinator {first.node.address}:{PORT} " in join, join
    assert "127.0.0.1" not in join and str(tmp_path) not in join and "--tls-dir" not in join
    assert "open, and this node's store port" in first.output()
    wait_for(lambda: ranks_at([first], nproc) == set(range(nproc)), 120, "the first machine stepping")

    started = time.time()
    second.run(["env", *shlex.split(join)], hide_others=True)
    wait_for(lambda: ranks_at(machines, 2 * nproc, started) == set(range(2 * nproc)), 120, "world 2 stepping")
    joined_s = first_step_at(machines, 2 * nproc, started, 2 * nproc) - started
    assert "certificate signed at" in second.output(), second.output()[-3000:]
    _check_addresses(first, machines[:2], 2 * nproc)

    killed = time.time()
    second.node.kill_all()  # kill -9 of the whole machine
    wait_for(lambda: ranks_at([first], nproc, killed) == set(range(nproc)), 60, "the survivors stepping")
    survivors_s = first_step_at([first], nproc, killed, nproc) - killed

    rejoined = time.time()
    second.run(["env", *shlex.split(join)], hide_others=True)  # the same line again
    wait_for(lambda: ranks_at(machines, 2 * nproc, rejoined) == set(range(2 * nproc)), 120, "world 2 again")
    rejoin_s = first_step_at(machines, 2 * nproc, rejoined, 2 * nproc) - rejoined

    said_s = 0.0
    if len(machines) == 3:
        third = machines[2]
        grown = time.time()
        third.run(["env", *shlex.split(join)], hide_others=True)
        wait_for(lambda: ranks_at(machines, 3, grown) == {0, 1, 2}, 120, "world 3 stepping")
        _check_addresses(first, machines, 3)
        assert len({m.hostname for m in machines}) == 3
        said_s = _without_the_control_plane(machines)
    newest = max(e["step"] for m in machines for e in m.events())
    for m in machines:
        m.stop_at(newest + 10)
    wait_for(lambda: all(m.procs[-1].poll() is not None for m in machines), 90, "every machine to exit")
    assert [m.procs[-1].returncode for m in machines] == [0] * len(machines), [m.output()[-2000:] for m in machines]
    if said_s:
        assert all("the job's end cannot be recorded; exiting" in m.output() for m in machines[1:])
    print(
        f"two machines, {nproc} worker(s) each: join -> world 2 stepping {joined_s:.2f}s, kill -9 -> survivors "
        f"stepping {survivors_s:.2f}s, rejoin -> world 2 {rejoin_s:.2f}s"
        + (f"; control plane gone -> the agents' line after {said_s:.1f}s" if said_s else "")
    )


def _without_the_control_plane(machines: list[Machine]) -> float:
    """Kill the first machine's embedded etcd (the node and its workers stay): the workers train on, and every other
    agent says so in one line, once. Returns how long the last of those lines took."""
    import psutil

    first, others = machines[0], machines[1:]
    etcd = [p for p in psutil.Process(first.procs[0].pid).children(recursive=True) if p.name() == "etcd"]
    assert len(etcd) == 1, etcd
    gone = time.time()
    etcd[0].kill()
    for machine in others:
        said = wait_for(lambda m=machine: re.search(r".*has been unreachable for.*", m.output()), 30, "the line")
        line = said.group(0)  # type: ignore[union-attr]
        assert f"{first.node.address}:{PORT}" in line and "embedded in node hosta-" in line, line
        assert "Restart `pliant run` on node hosta-" in line and "or standalone replicas" in line, line
        assert machine.output().count("has been unreachable") == 1, "said once"
    said = time.time()
    said_s = said - gone
    world = len(machines)
    wait_for(lambda: ranks_at(machines, world, said) == set(range(world)), 30, "the world training on")
    return said_s


def test_ctrl_c_of_the_first_machine_hands_the_control_plane_to_the_second(fabric, tmp_path: Path) -> None:
    """The README's recipe on two machines (one seat, the default for two nodes), the second joined with the seat
    line: Ctrl-C of the first machine hands its seat to the second before it leaves, never to a third machine that
    holds only the workers' line (a spare, first by node id). The second trains on and holds the control plane; the
    spare takes the first's place in the world; a fourth machine joins with the line the second prints; `pliant
    status` works on the second; and the job finishes."""
    machines, join = _recipe(tmp_path, fabric, 1, nodes=2, seats=())
    first, second = machines
    seat_key = re.search(r"join instead with .*:\n  (PLIANT_SEAT_KEY=\S+) ", first.output()).group(1)  # type: ignore[union-attr]
    wait_for(lambda: ranks_at([first], 1) == {0}, 120, "the first machine stepping")
    started = time.time()
    second.run(["env", seat_key, *shlex.split(join)], hide_others=True)
    wait_for(lambda: ranks_at(machines, 2, started) == {0, 1}, 120, "world 2 stepping")
    wait_for(lambda: "stands by to take" in second.output(), 30, "the second machine standing by for a seat")
    spare = Machine(fabric, "c", tmp_path)  # the workers' line only: a spare at the job's maximum
    spare.run(["env", *shlex.split(join)], hide_others=True)
    wait_for(lambda: "certificate signed at" in spare.output(), 60, "the spare's join")

    pressed = time.time()
    os.killpg(first.procs[0].pid, signal.SIGINT)  # Ctrl-C
    wait_for(lambda: first.procs[0].poll() is not None, 120, "the first machine to leave")
    left_s = time.time() - pressed
    print(first.output()[-2500:], "\n----\n", second.output()[-2500:])
    assert first.procs[0].returncode == 130, first.output()[-3000:]
    assert "handing this node's control-plane seat to hostb-" in first.output()
    assert re.search(r"hostb-\S+ holds the control plane now", first.output()), first.output()[-3000:]
    assert "a control-plane seat is handed to this node" in second.output()
    assert "this node holds a control-plane seat" in second.output()
    assert "control-plane seat" not in spare.output(), "the workers' line never gets a seat"
    wait_for(lambda: ranks_at([second, spare], 2, pressed) == {0, 1}, 90, "the spare in the first machine's place")
    assert "has been unreachable" not in second.output() + spare.output(), "the control plane never went away"

    found = wait_for(
        lambda: re.search(
            rf"other nodes join with:\n  (.+--coordinator {second.node.address}:\S+ .+)\n", second.output()
        ),
        60,
        "the second machine's join line",
    )
    fourth = Machine(fabric, "d", tmp_path)
    fourth.run(["env", *shlex.split(found.group(1))], hide_others=True)  # type: ignore[union-attr]
    wait_for(lambda: "certificate signed at 10.213." in fourth.output(), 60, "a join through the second's line")

    pid = second.procs[-1].pid  # `pliant status` on the second machine, with no flags: its agent's view
    status = subprocess.run(
        ["nsenter", "-t", str(pid), "-m", "-n", "-u", "--", sys.executable, "-m", "pliant", "status", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=second.cwd,
        env={**os.environ, **second.env},
    )
    assert status.returncode == 0, status.stderr[-2000:]
    (job,) = json.loads(status.stdout)["jobs"]
    assert job["state"] == "running" and job["world_size"] == 2, job
    assert len(job["members"]) == 3, job  # the second, the spare in the world, the fourth waiting

    newest = max(e["step"] for m in (second, spare) for e in m.events())
    for m in (second, spare):
        m.stop_at(newest + 10)
    ends = (second, spare, fourth)
    wait_for(lambda: all(m.procs[-1].poll() is not None for m in ends), 90, "every machine to exit")
    assert [m.procs[-1].returncode for m in ends] == [0, 0, 0], [m.output()[-2000:] for m in ends]
    assert "succeeded at full size" in second.output()
    print(f"Ctrl-C of the first of two machines: it handed its seat over and left in {left_s:.1f}s")
