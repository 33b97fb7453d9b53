"""A node's seat in an embedded control plane (:mod:`pliant.coordinator.seats`): it asks for one until it holds one
or the seats are full, then runs the etcd member and the coordinator replica the seat holds until the agent stops.

A node asks for a new seat only with the control plane's seat key (``PLIANT_SEAT_KEY``, from the seat line the
first node printed, or ``pliant seat-key``); without one it holds no seat, unless it comes back to the seat it held.
With the key and the seats full, it stands by and asks again now and then, and at once when a leaving seat's node
hands its seat to it (its heartbeat's answer says so; :mod:`pliant.coordinator.seats`).

The node listens for them on its own address (the one it advertises): the coordinator on the port the node joined
the control plane with when it is free here (the Bootstrap service on the next one), etcd's client and peer ports on
the two after (free ones where those are taken). What it gets with the seat (the run's CA and etcd's CA with their
keys, the sealing root), the certificates it issues itself from those CAs for its address, and its etcd member's data
go into the seat's home, a directory only this user reads: ``<state home>/seats/<the run's CA pin>-<host>-<etcd
peer port>``, locked (``flock``) by the agent that holds the seat.

**A node comes back to its seat.** The home outlives an agent killed with its node (kill -9, a power loss; an agent
that ends on its own, with its job or by leaving, removes it). An agent of the same run started again on the same
address finds it (a home of this run and address that no live agent locks): before it joins, it starts its etcd
member from the member's data, and its replica, so that a control plane that lost its quorum with this node (two of
three seats at once) has it back, and the join can be answered; once joined, it claims the seat under its new node
id with the seat's proof (``seat-proof`` in the home: the secret each grant returns). A home whose member etcd no
longer knows (its seat was given up meanwhile), or whose proof the control plane refuses, is removed, and the node
asks for a seat as a newcomer when it has the seat key.

The agent keeps its seat's etcd member running: one that exits (killed, crashed) is started again from its data,
after a backoff.

Thread ownership: :meth:`SeatHolder.run` runs on its own thread, which starts the seat (``plane``: its etcd member
and replica, :mod:`pliant.coordinator.embedded`), restarts the member, and lives until :meth:`SeatHolder.close` (the
agent's main thread, at exit) stops the replica, sets ``stop``, joins it, and stops the member: the etcd member is
started with a parent-death signal, which the kernel sends when the thread that started it ends. The agent waits for
``resumed`` before it joins, and sets ``joined`` once it has.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from pliant.agent.contract import state_home
from pliant.backoff import Backoff
from pliant.coordinator.client import CoordinatorClient
from pliant.coordinator.contract import CoordinatorError, FailedPrecondition, PermissionDenied
from pliant.coordinator.embedded import EmbeddedSeat, SeatPlan
from pliant.coordinator.etcd_server import MEMBER_CN, EtcdServer
from pliant.coordinator.seat_keeper import SeatKit
from pliant.coordinator.seats import SeatAnswer
from pliant.coordinator.server import CoordinatorServer
from pliant.net import free_port, parse_host_port
from pliant.ports import SeatPorts, free_api_port
from pliant.security.identity import Role
from pliant.security.issuance import IssuedCert, LocalCA

__all__ = ["SeatHolder", "seat_ports"]

logger = logging.getLogger(__name__)

ASK_EVERY_S = (1.0, 5.0)  # a node without a seat asks again after this backoff (first, longest)
RESUME_WAIT_S = 60.0  # how long a member started from its data may take to answer (it waits for its peers)
RESTART_AFTER_S = (1.0, 30.0)  # a seat's etcd member that exited is started again after this backoff


def seat_ports(host: str, joined_port: int) -> tuple[int, int, int]:
    """Where a seat's coordinator, etcd client and etcd peer listen on ``host``: the block of ports of the control
    plane's port the node joined on (:mod:`pliant.ports`) when all four are free here (the ports a firewall already
    opens), else free ones."""
    block = SeatPorts.of(joined_port)
    if block.free_on(host):
        return block.api, block.etcd_client, block.etcd_peer
    return free_api_port(host), free_port(host), free_port(host)


@dataclass(frozen=True)
class _Saved:
    """``seat.json`` in the seat's home: what its member and replica are started with again."""

    member_name: str
    initial_cluster: str
    etcd_endpoints: tuple[str, ...]
    coordinator_port: int
    client_port: int
    peer_port: int
    leader_ttl_s: float


class SeatHolder:
    """This node's seat: resumed or asked for on :meth:`run`'s thread, held until :meth:`close`.

    Args:
        job: the job this node is a member of.
        node_id: this node's id (its replica's id; its etcd member's name when it takes a new seat).
        host: the address this node advertises; the seat listens there.
        pin: the run's CA pin (``sha256:HEX``, the join line's): the seat's home is the run's and this address's.
        key: the control plane's seat key ("": this node asks for no new seat, and only comes back to its own).
        client: the agent's coordinator client.
        registry: where the replica's metrics go (the node's endpoint).
        said: called with a line for the console when the seat is taken.
        handed: set (by the agent's heartbeat) when a leaving seat's node hands its seat to this node, which stands
            by with its seat key: it asks at once.
    """

    def __init__(
        self,
        job: str,
        node_id: str,
        host: str,
        pin: str,
        key: str,
        client: CoordinatorClient,
        registry: CollectorRegistry,
        said: Callable[[str], None],
        handed: threading.Event | None = None,
    ) -> None:
        self.job = job
        self.handed = handed if handed is not None else threading.Event()  # a seat is handed to this node
        self.key = key
        self.node_id = node_id
        self.host = host
        self.client = client
        self.registry = registry
        self.said = said
        self._homes = state_home() / "seats"
        self._prefix = f"{pin.rpartition(':')[2][:16]}-{host.replace(':', '_')}-"
        self.home = self._homes / f"{self._prefix}new"  # the seat's home, once it has one (see _lock)
        self._lock: int | None = None  # the home's lock file, held while this agent holds the seat
        self.stop = threading.Event()
        self.resumed = threading.Event()  # set once a saved seat was started again, or there was none
        self.joined = threading.Event()  # set by the agent once it joined (a claim needs its membership)
        self.plane: EmbeddedSeat | None = None  # the seat's etcd member and replica, while it holds one
        self._thread = threading.Thread(target=self.run, name="seat", daemon=True)

    @property
    def etcd(self) -> EtcdServer | None:
        """The seat's etcd member, while this node holds a seat."""
        return self.plane.etcd if self.plane is not None else None

    @property
    def coordinator(self) -> CoordinatorServer | None:
        """The seat's coordinator replica, while this node holds a seat."""
        return self.plane.coordinator if self.plane is not None else None

    def start(self) -> SeatHolder:
        self._thread.start()
        return self

    def run(self) -> None:
        """Start a saved seat again, then (once the agent joined) ask for a seat until granted, the seats are full,
        or the agent stops; then keep this thread (the etcd member's parent) until :meth:`close`."""
        try:
            saved = self._resume()
        finally:
            self.resumed.set()
        if saved is not None:
            ports = (saved.coordinator_port, saved.client_port, saved.peer_port)
            proof = (self.home / "seat-proof").read_bytes() if (self.home / "seat-proof").is_file() else b""
        elif self.key:
            ports = seat_ports(self.host, parse_host_port(self.client.targets[0], what="--coordinator")[1])
            proof = b""
        else:
            return  # no seat held before, and no key for a new one: this node is a worker node only
        while not self.joined.wait(0.5):
            if self.stop.is_set():
                return
        backoff = Backoff(*ASK_EVERY_S)
        standing = False  # the console was told that this node stands by
        while not self.stop.is_set():
            try:
                answer = self.client.claim_seat(self.job, self.node_id, self.host, ports, self.key, proof)
            except FailedPrecondition as exc:  # no seats in this control plane
                logger.info("agent %s: no control-plane seat to take: %s", self.node_id, exc)
                return
            except PermissionDenied as exc:  # no valid key, and no seat this node held
                logger.warning("pliant: this node takes no control-plane seat: %s", exc)
                if self.coordinator is not None:  # a seat it held that is no longer its own
                    self._stop_services()
                    shutil.rmtree(self.home, ignore_errors=True)
                    self._release_home()
                return
            except CoordinatorError as exc:
                logger.info("agent %s: asking for a control-plane seat failed (%s); asking again", self.node_id, exc)
                self.stop.wait(backoff.next())
                continue
            if not answer.granted:  # full (this node stands by) or busy: asked again, at once when a seat is handed
                logger.info("agent %s: no control-plane seat yet: %s", self.node_id, answer.reason)
                if "stands by" in answer.reason and not standing:
                    self.said("the control plane's seats are taken: this node stands by to take one handed over")
                    standing = True
                if self.handed.wait(backoff.next()):
                    self.handed.clear()
                continue
            self._keep_proof(answer.seat_proof)
            if self.coordinator is None:
                try:
                    self._take(answer, ports)
                except Exception:  # its etcd or replica did not start: the leader gives the seat up in time
                    logger.exception(
                        "agent %s: taking the control-plane seat failed; this node holds none", self.node_id
                    )
                    self._stop_services()
                    return
            self._supervise()
            return

    def _supervise(self) -> None:
        """Keep the seat's etcd member running until the agent stops: one that exits (killed, crashed) is started
        again from its data, after a backoff. This thread is the member's parent: etcd dies with the thread that
        started it (PR_SET_PDEATHSIG is a thread's)."""
        backoff = Backoff(*RESTART_AFTER_S)
        while not self.stop.wait(1.0):
            etcd = self.etcd
            if etcd is None or etcd.proc is None or etcd.proc.poll() is None:
                continue
            code = etcd.proc.returncode
            wait = backoff.next()
            logger.warning(
                "agent %s: this node's etcd member (its control-plane seat) exited with code %s; starting it again "
                "from its data in %.0fs",
                self.node_id,
                code,
                wait,
            )
            if self.stop.wait(wait):
                return
            try:
                etcd.start(timeout_s=RESUME_WAIT_S)
            except Exception as exc:  # its peers do not answer yet, or etcd removed it: tried again after a backoff
                logger.warning("agent %s: this node's etcd member did not start again: %s", self.node_id, exc)
                continue
            logger.warning("agent %s: this node's etcd member runs again", self.node_id)
            backoff.reset()

    def _take_home(self, home: Path) -> bool:
        """Make ``home`` this seat's, locked while this agent holds it (another agent of the run on this address,
        alive, holds its own); False when another agent holds it."""
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(home / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._release_home()
        self.home, self._lock = home, fd
        return True

    def _release_home(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def _resume(self) -> _Saved | None:
        """Start the member and the replica of a seat saved in a home of this run and address that no live agent
        holds (None: none saved, or it did not start)."""
        homes = sorted(self._homes.glob(f"{self._prefix}*/seat.json")) if self._homes.is_dir() else []
        path = next((p for p in homes if self._take_home(p.parent)), None)
        if path is None:
            return None
        try:
            data = json.loads(path.read_text())
            saved = _Saved(**{**data, "etcd_endpoints": tuple(data["etcd_endpoints"])})
            self._start_services(saved, self._kit(), resume=True)
        except Exception as exc:  # its member was removed, its data is unusable, or its files are not whole
            logger.warning(
                "agent %s: the control-plane seat saved in %s did not start again (%s); asking for a seat anew",
                self.node_id,
                self.home,
                exc,
            )
            self._stop_services()
            shutil.rmtree(self.home, ignore_errors=True)
            self._release_home()
            return None
        self.said(f"back in this node's control-plane seat: coordinator on {self.coordinator.address}")  # type: ignore[union-attr]
        return saved

    def _keep_proof(self, proof: bytes) -> None:
        """Keep the seat's proof of its latest grant in the seat's home (a new home is made by :meth:`_take` first)."""
        if self._lock is None or not proof:
            return
        path = self.home / "seat-proof"
        fresh = path.with_suffix(".new")
        fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(proof)
        fresh.replace(path)

    def _take(self, answer: SeatAnswer, ports: tuple[int, int, int]) -> None:
        """Save what the seat needs in its home, then start its etcd member (joining the cluster) and replica."""
        home = self._homes / f"{self._prefix}{ports[2]}"
        shutil.rmtree(home, ignore_errors=True)
        if not self._take_home(home):
            raise OSError(f"another agent holds {home}")
        self._keep_proof(answer.seat_proof)
        for name, pem in (
            ("ca.crt", answer.ca_cert_pem),
            ("ca.key", answer.ca_key_pem),
            ("etcd-ca.crt", answer.etcd_ca_cert_pem),
            ("etcd-ca.key", answer.etcd_ca_key_pem),
            ("seal-root", answer.seal_root),
        ):
            fd = os.open(self.home / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(pem)
        saved = _Saved(
            member_name=answer.member_name,
            initial_cluster=answer.initial_cluster,
            etcd_endpoints=tuple(answer.etcd_endpoints),
            coordinator_port=ports[0],
            client_port=ports[1],
            peer_port=ports[2],
            leader_ttl_s=answer.leader_ttl_s,
        )
        self._start_services(saved, self._kit(), resume=False)
        (self.home / "seat.json").write_text(json.dumps(asdict(saved)))
        # The agent calls this node's replica too from now on: a seat handed over by a node that leaves may be all
        # that is left of the control plane before a heartbeat's answer lists it.
        own = self.coordinator.address  # type: ignore[union-attr]
        if own not in self.client.targets:
            self.client.use_targets([*self.client.targets, own])
        self.said(
            f"this node holds a control-plane seat: coordinator on {self.coordinator.address}, etcd member "  # type: ignore[union-attr]
            f"{self.etcd.endpoint}"  # type: ignore[union-attr]
        )

    def _kit(self) -> SeatKit:
        read = lambda name: (self.home / name).read_bytes()  # noqa: E731
        return SeatKit(
            ca=IssuedCert(read("ca.crt"), read("ca.key")),
            etcd_ca=IssuedCert(read("etcd-ca.crt"), read("etcd-ca.key")),
            seal_root=read("seal-root"),
            leader_ttl_s=0.0,
            wanted=0,  # a record exists: only the first seat writes it
        )

    def _start_services(self, saved: _Saved, kit: SeatKit, resume: bool) -> None:
        """Start the seat (:mod:`pliant.coordinator.embedded`): its etcd member (from its data when ``resume``, else
        joining the cluster) and its replica, with certificates issued here from the control plane's CAs."""
        hosts = [self.host, "127.0.0.1", "localhost"]
        ca = LocalCA(self.home / "pki", ca=kit.ca)
        etcd_ca = LocalCA(self.home / "etcd-pki", ca=kit.etcd_ca)
        plan = SeatPlan(
            host=self.host,
            listen=f"{'[' + self.host + ']' if ':' in self.host else self.host}:{saved.coordinator_port}",
            member_name=saved.member_name,
            replica_id=self.node_id,
            client_port=saved.client_port,
            peer_port=saved.peer_port,
            etcd_tls=etcd_ca.issue("server", Role.COORDINATOR, MEMBER_CN, hosts),
            coordinator_tls=ca.issue("coordinator", Role.COORDINATOR, f"seat-{self.node_id}", hosts),
            etcd_client_tls=etcd_ca.issue("client", Role.COORDINATOR, f"etcd-client-{self.node_id}"),
            ca=kit.ca,
            seal_root=kit.seal_root,
            seats=SeatKit(kit.ca, kit.etcd_ca, kit.seal_root, saved.leader_ttl_s, 0),
            leader_ttl_s=saved.leader_ttl_s,
            data_dir=str(self.home / "etcd"),
            initial_cluster=saved.initial_cluster,
            cluster_state="existing",
            peers=saved.etcd_endpoints,
        )
        self.plane = EmbeddedSeat(plan, self.registry)
        self.plane.start(etcd_timeout_s=RESUME_WAIT_S if resume else 60.0)

    def close(self) -> None:
        """Stop asking, stop the seat's replica and etcd member, and remove the seat's home (the leader gives the seat
        up once this node is gone). The replica stops first: the member stops with this seat's thread, and a
        replica whose etcd is gone only warns until it stops."""
        plane = self.plane
        if plane is not None:
            plane.stop_replica()
        self.stop.set()
        self.joined.set()
        self.handed.set()
        if self._thread.is_alive():
            self._thread.join(RESUME_WAIT_S + 10)
        self._stop_services()
        if self._lock is not None:  # this agent's seat (never another live agent's)
            shutil.rmtree(self.home, ignore_errors=True)
            self._release_home()

    def _stop_services(self) -> None:
        plane, self.plane = self.plane, None
        if plane is not None:
            plane.stop()
