"""A rank meeting a generation that a newer one supersedes lets go at once: reaching the generation's store
(``connect_store``), the rendezvous sockets (``RendezvousWatch``), a rank whose earlier meeting failed (``new_world``),
and an agent reading a generation's store port; on real TCPStores, sockets and worker processes on loopback."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from functools import partial
from pathlib import Path

import pytest
import torch.distributed as dist

from pliant.env import WorkerEnv
from pliant.net import free_port
from pliant.progress import Directive, write_directive
from pliant.worker.inplace.groups import PROBE_S, RendezvousError, RendezvousWatch, Superseded, connect_store
from pliant.worker.inplace.world import newer_directive

pytestmark = pytest.mark.timeout(90)

# One rank of a two-rank world: with a first port, a meeting that fails (its peer never comes) before the real one;
# then the real one on the second port and an all-reduce. argv: rank, first port (0: none), second port, reset (0/1).
_RANK = """
import sys
from datetime import timedelta
import torch, torch.distributed as dist
from pliant.env import WorkerEnv
from pliant.worker.inplace.groups import connect_store, new_world
rank, first, second, reset = (int(a) for a in sys.argv[1:])
def meet(port, seconds):
    env = WorkerEnv(rank=rank, world_size=2, master_port=port)
    store = connect_store(env, timedelta(seconds=30), superseded=lambda: False)
    if reset:
        new_world()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=seconds))
if first:
    try:
        meet(first, 2)
    except RuntimeError:
        print("first meeting failed", flush=True)
meet(second, 15 if reset else 2)  # without the reset the meeting cannot succeed: fail it soon
t = torch.ones(1)
dist.all_reduce(t)
print("sum", int(t.item()), flush=True)
"""


def _env(port: int) -> WorkerEnv:
    return WorkerEnv(
        rank=1, local_rank=0, world_size=2, local_world_size=1, master_addr="127.0.0.1", master_port=port, generation=7
    )


def test_a_store_that_opens_late_is_reached() -> None:
    port = free_port()
    server: list[dist.TCPStore] = []
    opener = threading.Timer(
        3.0, lambda: server.append(dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False))
    )
    opener.start()
    try:
        started = time.monotonic()
        store = connect_store(_env(port), timedelta(seconds=30), superseded=lambda: False)
        assert time.monotonic() - started >= 2.5, "it connected before the store existed"
        store.set("k", "v")
        assert server[0].get("k") == b"v"
    finally:
        opener.join()


def test_reaching_a_closed_store_ends_when_a_newer_generation_comes() -> None:
    """The chaos soak's stall: a store its agent already closed, and torch's own loop retrying for 600 s."""
    port = free_port()
    came = time.monotonic() + 1.0
    started = time.monotonic()
    with pytest.raises(Superseded, match="generation 7 was superseded"):
        connect_store(_env(port), timedelta(seconds=600), superseded=lambda: time.monotonic() > came)
    assert time.monotonic() - started < 1.0 + PROBE_S + 1.0


def test_a_store_that_never_opens_fails_after_the_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(RendezvousError, match=r"store of generation 7 at 127.0.0.1:\d+ was not reachable within 3s"):
        connect_store(_env(free_port()), timedelta(seconds=3), superseded=lambda: False)
    assert 3.0 <= time.monotonic() - started < 3.0 + PROBE_S + 1.0


def _closed_by_peer(conn: socket.socket) -> bool:
    conn.settimeout(2.0)
    try:
        return conn.recv(1) == b""
    except TimeoutError:
        return False


def test_a_superseded_rendezvous_loses_every_socket_it_opened_until_it_returns(tmp_path: Path) -> None:
    progress = str(tmp_path / "progress")
    listener = socket.create_server(("127.0.0.1", 0))
    address = listener.getsockname()
    old = socket.create_connection(address)  # opened before the rendezvous: not the watch's
    old_peer, _ = listener.accept()
    watch = RendezvousWatch(partial(newer_directive, progress), generation=7)
    try:
        first = socket.create_connection(address)
        first_peer, _ = listener.accept()
        time.sleep(0.3)
        assert not watch.superseded()
        write_directive(progress, Directive(6, "in-place"))  # an older one changes nothing
        time.sleep(0.3)
        assert not watch.superseded()
        write_directive(progress, Directive(8, "in-place"))
        assert _closed_by_peer(first_peer), "a socket of the superseded rendezvous stayed open"
        assert watch.superseded()
        second = socket.create_connection(address)  # connected after the directive came: severed too
        second_peer, _ = listener.accept()
        assert _closed_by_peer(second_peer)
    finally:
        newer = watch.finish()
    assert newer is not None and newer.generation == 8
    third = socket.create_connection(address)  # after the rendezvous returned: the watch has stopped
    third_peer, _ = listener.accept()
    assert not _closed_by_peer(third_peer)
    assert not _closed_by_peer(old_peer)
    for sock in (old, old_peer, first, first_peer, second, second_peer, third, third_peer, listener):
        sock.close()


@pytest.mark.parametrize("reset", [True, False], ids=["new_world", "without"])
def test_a_rank_whose_earlier_meeting_failed_meets_a_fresh_one(reset: bool) -> None:
    """torch names the default group by a per-process count that only its destruction resets: after a failed
    ``init_process_group`` the next one's keys went under another prefix than a fresh rank's (the chaos soak's
    stall). ``new_world`` resets it; without it, the two ranks never meet (the control case)."""
    stores = [dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False) for _ in range(2)]
    first, second = (store.port for store in stores)
    argv = [sys.executable, "-c", _RANK]
    survivor = subprocess.Popen(
        [*argv, "0", str(first), str(second), str(int(reset))],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    fresh = subprocess.Popen(
        [*argv, "1", "0", str(second), str(int(reset))], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        out = [proc.communicate(timeout=60)[0] for proc in (survivor, fresh)]
    finally:
        for proc in (survivor, fresh):
            proc.kill()
    assert "first meeting failed" in out[0]
    if reset:
        assert "sum 2" in out[0] and "sum 2" in out[1], out
    else:
        assert "sum 2" not in out[0] and "sum 2" not in out[1], "torch now resets the count itself: drop new_world"


def test_an_agent_stops_reading_a_superseded_generations_port() -> None:
    """A non-rank-0 agent reads each generation's store port from node rank 0's agent store; when node rank 0 died,
    the wait (up to a minute, in the agent's main thread) ends as soon as a newer generation is seen."""
    from pliant.agent.contract import AgentError
    from pliant.agent.storehost import StoreHost
    from pliant.agent.stores import PORT_ATTEMPT_S, NodeStore

    address = f"127.0.0.1:{free_port()}"  # node rank 0's agent store, gone
    host = StoreHost.standalone()
    try:
        store = NodeStore(host, "127.0.0.1")  # this node's (waits for the host's torch import)
        seen = time.monotonic() + 1.0
        started = time.monotonic()
        with pytest.raises(AgentError, match="generation 5 was superseded"):
            store.generation_port(address, 5, timeout_s=60, superseded=lambda: time.monotonic() > seen)
        waited = time.monotonic() - started
        # Ended with the attempt in flight (PORT_ATTEMPT_S each), not after the minute: a loaded machine stretches
        # the attempts, never to the timeout.
        assert waited < 1.0 + 2 * PORT_ATTEMPT_S + 15.0, f"the superseded wait took {waited:.1f}s"
        with pytest.raises(AgentError, match="did not give generation 5's store port within 1s"):
            store.generation_port(address, 5, timeout_s=1)
    finally:
        host.close()
