"""Nodes on one machine with their own addresses: Linux network namespaces on a bridge, and the faults a fleet sees.

Shared by the partition tests and ``bench/chaos.py``. Root only: :func:`unavailable` says why it cannot run here.

A :class:`Fabric` makes one bridge (``<prefix>br``, the host's address ``10.213.<net>.1`` on it, where the control
plane listens) and, per :meth:`Fabric.node`, a namespace ``<prefix><name>`` with a veth pair to the bridge and the
address ``10.213.<net>.<10 + i>``. Processes started with :meth:`Node.spawn` run inside the namespace. Faults:

- :meth:`Fabric.isolate` / :meth:`Fabric.heal`: the node's link down or up (a partition from everything: no reset,
  the peers just go silent);
- :meth:`Fabric.block` / :meth:`Fabric.unblock`: blackhole routes in the node's namespace (and the peer's) to one
  address, e.g. the control plane's only, or one peer's;
- :meth:`Fabric.slow`: a token-bucket rate limit on the node's link (``tc tbf``); ``tc netem`` delay and loss need
  the ``sch_netem`` kernel module, which :meth:`Fabric.netem` reports missing with the reason.

:meth:`Fabric.close` kills every process in the namespaces and deletes them and the bridge, and runs at exit too, so
nothing outlives a failed test.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Fabric", "Node", "unavailable"]


def _ip(*args: str, netns: str = "", check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = ["ip", *(["netns", "exec", netns, "ip"] if netns else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=10)


def unavailable() -> str:
    """Why namespaces cannot be used here ("" when they can): not root, no ``ip``, or the kernel refuses."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    try:
        name = f"plprobe{os.getpid()}"
        _ip("netns", "add", name)
        _ip("netns", "del", name)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot create a network namespace: {exc}"
    return ""


@dataclass
class Node:
    """One namespace: its name, address and interface (``GLOO_SOCKET_IFNAME`` for workers inside)."""

    fabric: Fabric
    name: str
    netns: str
    address: str
    ifname: str
    host_if: str
    procs: list[subprocess.Popen] = field(default_factory=list)

    def spawn(
        self, argv: Sequence[str], log: Path, env: dict[str, str] | None = None, gloo_ifname: bool = True
    ) -> subprocess.Popen:
        """Run ``argv`` inside this node's namespace (its own session), output to ``log``; ``gloo_ifname=False``
        leaves ``GLOO_SOCKET_IFNAME`` to the processes (as a user who sets nothing)."""
        # The nodes share this machine's cores: one torch thread per worker unless the caller's environment says
        # otherwise (a real node of one worker would use all of its cores).
        full = {"OMP_NUM_THREADS": "1", **os.environ, "GLOO_SOCKET_IFNAME": self.ifname, **(env or {})}
        if not gloo_ifname:
            full.pop("GLOO_SOCKET_IFNAME", None)
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.netns, *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=full,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def kill_all(self) -> None:
        """SIGKILL every process in this namespace (what a dead machine does)."""
        pids = _ip("netns", "pids", self.netns, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)


class Fabric:
    """A bridge and namespaces on it (see the module docstring).

    Args:
        prefix: names of the bridge, namespaces and links (short: interface names hold 15 characters).
        net: the third octet of the 10.213.x.0/24 subnet.
    """

    def __init__(self, prefix: str = "plnt", net: int = 0) -> None:
        self.prefix, self.net = prefix, net
        self.bridge = f"{prefix}br"
        self.host = f"10.213.{net}.1"
        self.nodes: dict[str, Node] = {}
        self._readdressed = 0
        self._closed = False
        self._remove()  # what an earlier run that was killed left behind
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.host}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        atexit.register(self.close)

    def node(self, name: str) -> Node:
        """A new namespace on the bridge."""
        index = len(self.nodes)
        netns, host_if, ifname = f"{self.prefix}{name}", f"{self.prefix}v{index}", f"{self.prefix}p{index}"
        address = f"10.213.{self.net}.{10 + index}"
        _ip("netns", "add", netns)
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ifname)
        _ip("link", "set", ifname, "netns", netns)
        _ip("link", "set", host_if, "master", self.bridge, "up")
        _ip("addr", "add", f"{address}/24", "dev", ifname, netns=netns)
        _ip("link", "set", ifname, "up", netns=netns)
        _ip("link", "set", "lo", "up", netns=netns)
        node = Node(self, name, netns, address, ifname, host_if)
        self.nodes[name] = node
        return node

    def readdress(self, node: Node) -> str:
        """Move ``node`` to a new address (a machine that comes back under another IP); returns it. Its processes
        should be gone: their sockets keep the old address."""
        self._readdressed += 1
        address = f"10.213.{self.net}.{110 + self._readdressed % 140}"
        _ip("addr", "del", f"{node.address}/24", "dev", node.ifname, netns=node.netns)
        _ip("addr", "add", f"{address}/24", "dev", node.ifname, netns=node.netns)
        node.address = address
        return address

    # -- faults ----------------------------------------------------------------------------------------------------

    def isolate(self, node: Node) -> None:
        """Partition ``node`` from everything: its link goes down (no reset reaches anyone)."""
        _ip("link", "set", node.host_if, "down")

    def heal(self, node: Node) -> None:
        _ip("link", "set", node.host_if, "up")

    def block(self, node: Node, address: str) -> None:
        """Drop ``node``'s traffic to and from ``address`` (a blackhole route on each side that is a node here)."""
        _ip("route", "add", "blackhole", f"{address}/32", netns=node.netns)
        peer = next((n for n in self.nodes.values() if n.address == address), None)
        if peer is not None:
            _ip("route", "add", "blackhole", f"{node.address}/32", netns=peer.netns)

    def unblock(self, node: Node, address: str) -> None:
        _ip("route", "del", "blackhole", f"{address}/32", netns=node.netns, check=False)
        peer = next((n for n in self.nodes.values() if n.address == address), None)
        if peer is not None:
            _ip("route", "del", "blackhole", f"{node.address}/32", netns=peer.netns, check=False)

    def slow(self, node: Node, rate: str = "10mbit") -> None:
        """Limit ``node``'s outgoing rate (``tc tbf``); :meth:`fast` lifts it."""
        subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                node.netns,
                "tc",
                "qdisc",
                "replace",
                "dev",
                node.ifname,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "64kb",
                "latency",
                "400ms",
            ],
            check=True,
            capture_output=True,
            timeout=10,
        )

    def fast(self, node: Node) -> None:
        subprocess.run(
            ["ip", "netns", "exec", node.netns, "tc", "qdisc", "del", "dev", node.ifname, "root"],
            capture_output=True,
            timeout=10,
        )

    def netem(self, node: Node, *args: str) -> str:
        """Delay or loss (``tc netem`` arguments) on ``node``'s link; returns "" or why it cannot be done here."""
        result = subprocess.run(
            ["ip", "netns", "exec", node.netns, "tc", "qdisc", "replace", "dev", node.ifname, "root", "netem", *args],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return "" if result.returncode == 0 else f"tc netem: {result.stderr.strip()} (no sch_netem in this kernel)"

    # -- cleanup ---------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process in the namespaces, delete them and the bridge (once)."""
        if not self._closed:
            self._closed = True
            self._remove()

    def _remove(self) -> None:
        """Kill every process in namespaces of this prefix, delete them, their veth pairs and the bridge."""
        names = [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line.strip()]
        for netns in names:
            if netns.startswith(self.prefix) and netns != self.bridge:
                for pid in _ip("netns", "pids", netns, check=False).stdout.split():
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
        deadline = time.monotonic() + 5
        for node in self.nodes.values():
            for proc in node.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(0.1, deadline - time.monotonic()))
        for netns in names:
            if netns.startswith(self.prefix):
                _ip("netns", "del", netns, check=False)
        for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
            link = line.split(":")[1].strip().split("@")[0] if line.count(":") >= 2 else ""
            if link.startswith(f"{self.prefix}v"):  # a namespace still held open keeps its veth pair
                _ip("link", "del", link, check=False)
        _ip("link", "del", self.bridge, check=False)
        self.nodes = {}
