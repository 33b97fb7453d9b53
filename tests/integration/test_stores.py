"""The node's store host (pliant.agent.storehost): real TCPStores in a real host process, forked by a real zygote or
started on its own, reached by torch's own TCPStore clients as workers reach them."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from pliant.agent.contract import AgentError, ExitCode
from pliant.agent.storehost import PROCESS_NAME, StoreHost, StoreHostError
from pliant.agent.stores import ARRIVED_KEY, NodeStore, reachable, reserve
from pliant.agent.workers import Zygote
from pliant.net import free_port
from tests.conftest import wait_for
from tests.integration.harness import agent_args, assert_all_gone, descendants, is_store_host, wait_world

pytestmark = pytest.mark.timeout(120)


def test_the_zygote_forks_the_store_host_and_its_stores_serve_torch_clients() -> None:
    zygote = Zygote({"PATH": "/usr/bin:/bin", "PLIANT_WORKER_PRELOAD": "torch,torch.distributed"})
    other = StoreHost.standalone()  # another node's agent, without a zygote
    try:
        node0 = NodeStore(zygote.stores, "127.0.0.1")
        node1 = NodeStore(other, "127.0.0.1")
        node0.key = node1.key = b"k" * 32  # the job's key, which members hold
        wait_for(lambda: zygote.stores_pid is not None, 10, "the zygote to report its store host")
        host = psutil.Process(zygote.stores_pid)
        assert host.ppid() == zygote.proc.pid and host.name() == PROCESS_NAME, "ps tells it from the workers"

        port = node0.open_generation(7)
        assert node0.open_generation(7) == port, "opening a generation twice serves the same store"
        assert node1.generation_port(node0.address, 7, timeout_s=5) == port

        # A worker counts itself in the generation's store with torch's client; the agents read the count.
        worker = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
        worker.add(ARRIVED_KEY, 2)
        assert node0.arrivals("127.0.0.1", port) == 2
        worker.add(ARRIVED_KEY, 1)
        assert node0.arrivals("127.0.0.1", port) == 3, "the kept client reads the new count"

        assert node1.peer_renewing(node0.address) == (-1.0, -1), "nothing published yet"
        node0.set_renewing(42, 7)
        assert node1.peer_renewing(node0.address) == (42.0, 7)
        assert node1.peer_renewing(f"127.0.0.1:{port}") == (-1.0, -1), "a store without the key"
        gone = f"127.0.0.1:{free_port()}"
        assert node1.longest_renewing([gone, node0.address]) == (42.0, 7)
        assert node1.longest_renewing([gone]) == (-1.0, -1)
        # Another local user writes the records agents act on: without the job's key its values are ignored.
        stranger = dist.TCPStore(
            "127.0.0.1", int(node0.address.rsplit(":", 1)[1]), is_master=False, timeout=timedelta(seconds=5)
        )
        stranger.set("/pliant/agent/renewing", "9999 99")
        assert node1.peer_renewing(node0.address) == (-1.0, -1), "a forged renewal streak does not vote"
        stranger.set("/pliant/agent/renewing", f"9999 99 {'0' * 32}")
        assert node1.peer_renewing(node0.address) == (-1.0, -1)
        stranger.set("/pliant/gen/50/master_port", "1234")
        with pytest.raises(AgentError, match=r"generation 50's store port .* is not sealed with the job's agent key"):
            node1.generation_port(node0.address, 50, timeout_s=5)  # a loaded machine: connects may take a while
        node0.set_renewing(42, 7)

        for generation in (8, 9):  # the current and the previous generation's stores stay open
            node0.open_generation(generation)
        wait_for(lambda: not reachable(f"127.0.0.1:{port}"), 10, "generation 7's store to close")
        polled = []
        for generation in range(10, 16):  # another node's agent polls each hand-over's arrivals: it keeps few clients
            polled.append(node0.open_generation(generation))
            assert node1.arrivals("127.0.0.1", polled[-1]) == 0
        held = [
            c for c in psutil.Process(other.proc.pid).net_connections("tcp") if c.raddr and c.raddr.port in polled
        ]  # closed stores leave CLOSE_WAIT: fds held
        assert len(held) <= 4, held
        with pytest.raises(AgentError, match="did not give generation 99's store port within 1s"):
            node1.generation_port(node0.address, 99, timeout_s=1)
        with pytest.raises(AgentError, match=r"cannot start the agent store on 127\.0\.0\.1:"):
            NodeStore(other, "127.0.0.1", int(node0.address.rsplit(":", 1)[1]))  # that port is taken
    finally:
        other.close()
        zygote.close()
    address = node0.address
    wait_for(
        lambda: (
            not psutil.pid_exists(zygote.stores_pid)
            or psutil.Process(zygote.stores_pid).status() == psutil.STATUS_ZOMBIE
        ),
        10,
        "the store host to exit with its zygote's handle",
    )
    assert not reachable(address)
    with pytest.raises(StoreHostError, match="gone"):
        zygote.stores.request("get", 2.0, address=address, key="x")


def test_the_agent_stores_port_is_its_own_from_before_it_joins() -> None:
    """The agent binds its store's port before it joins with that address, and hands the socket to its store host
    once the host is up: nothing else can take the port in between, and a peer that connects early is served."""
    listening = reserve("127.0.0.1")
    port = int(listening.getsockname()[1])
    with socket.socket() as squatter, pytest.raises(OSError):
        squatter.bind(("127.0.0.1", port))
    early = socket.create_connection(("127.0.0.1", port), timeout=5)  # waits in the backlog meanwhile
    host = StoreHost.standalone()  # imports torch: the seconds in which the port used to be unbound
    try:
        node = NodeStore(host, "127.0.0.1", listening)
        assert node.address == f"127.0.0.1:{port}" and listening.fileno() == -1, "handed over, closed here"
        node.set_renewing(7)
        assert node.peer_renewing(node.address) == (7.0, 0)
    finally:
        early.close()
        host.close()
    assert not reachable(f"127.0.0.1:{port}")


_HOLDER = """
import os, time
from pliant.agent.stores import NodeStore
from pliant.agent.workers import Zygote
from pliant.net import free_port
zygote = Zygote(dict(os.environ, PLIANT_WORKER_PRELOAD="torch,torch.distributed"))
store = NodeStore(zygote.stores, "127.0.0.1")
while zygote.stores_pid is None:
    time.sleep(0.01)
print(zygote.stores_pid, store.address, flush=True)
time.sleep(60)
"""


def test_the_store_host_ends_when_its_agent_is_killed() -> None:
    """kill -9 of the agent closes its end of the socket: the host (forked by the zygote, in a session of its own,
    so no parent-death signal reaches it) exits, and its stores stop listening."""
    agent = subprocess.Popen([sys.executable, "-c", _HOLDER], stdout=subprocess.PIPE, text=True)
    try:
        assert agent.stdout is not None
        pid, address = agent.stdout.readline().split()
        assert reachable(address)
        assert "torch" not in "".join(m.path for m in psutil.Process(agent.pid).memory_maps()), (
            "the agent's side never loads torch"
        )
        agent.kill()
        agent.wait(10)
        started = time.monotonic()
        wait_for(lambda: not reachable(address), 10, "the agent store to close")
        wait_for(
            lambda: not psutil.pid_exists(int(pid)) or psutil.Process(int(pid)).status() == psutil.STATUS_ZOMBIE,
            10,
            "the store host to exit",
        )
        print(f"store host gone {time.monotonic() - started:.2f}s after its agent's kill -9")
    finally:
        agent.kill()
        agent.wait(10)


@pytest.mark.slow
def test_an_agent_whose_store_host_dies_leaves_the_job_and_exits(
    make_coordinator, spawn_agent, fleet, tmp_path: Path
) -> None:
    """Without its stores a node can neither meet nor hand over: the agent leaves at once (no TTL wait for the
    others), stops its workers and exits 1 with the reason, so that its supervisor restarts the node."""
    server = make_coordinator()
    agent = spawn_agent(server, agent_args(server.address, "job", "node-a", tmp_path), name="agent-a")
    wait_world(tmp_path / "events.jsonl", restart=0, world=2, timeout_s=90)
    tree = [agent.pid, *descendants(agent.pid)]
    host = next(p for p in map(psutil.Process, tree[1:]) if is_store_host(p))
    host.kill()
    killed = time.monotonic()
    wait_for(lambda: agent.proc.poll() is not None, 30, "the agent to exit")
    took = time.monotonic() - killed
    assert agent.proc.returncode == ExitCode.ERROR, agent.output()[-3000:]
    assert "store host (pliant-stores) exited" in agent.output()
    with fleet(server.address) as client:
        assert not client.get_job("job").members, "it left the job rather than wait to be evicted"
    assert_all_gone(tree)
    print(f"agent exited {took:.2f}s after its store host was killed")
