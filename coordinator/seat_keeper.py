"""The executor of an embedded control plane's seat decisions (:mod:`pliant.coordinator.seats`): it reads the seats
record and etcd's member list, asks the decision, and performs it (etcd membership changes through
:class:`pliant.coordinator.etcd_cluster.EtcdMembers`, the record through :class:`EtcdStore`).

Threads: :meth:`SeatKeeper.claim` runs on gRPC handler threads, one claim at a time on a replica (``_lock``; the
record's compare orders the replicas); :meth:`SeatKeeper.upkeep` runs on the server's seat thread while this replica
leads, and owns what it saw (``_live``, ``_seated``, ``_seatless``, ``_looked_at``); :meth:`SeatKeeper.coordinators`
runs on any thread (a cached read under ``_cache``).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from pliant.coordinator.contract import CoordinatorError, FailedPrecondition, PermissionDenied
from pliant.coordinator.etcd_cluster import EtcdClusterError, EtcdMember, EtcdMembers, NotInSync, initial_cluster
from pliant.coordinator.seats import (
    AddLearner,
    Deny,
    Grant,
    Handover,
    Promote,
    Refuse,
    Remove,
    Seat,
    SeatAnswer,
    SeatKey,
    Seats,
    Sightings,
    StandBy,
    decide_claim,
    decide_upkeep,
    digest,
)
from pliant.coordinator.store import EtcdStore
from pliant.security.issuance import IssuedCert

__all__ = ["SeatKeeper", "SeatKit"]

logger = logging.getLogger(__name__)

COORDINATORS_READ_EVERY_S = 2.0  # the seats record behind every heartbeat's list of coordinators, read this often
UNSEEN_AFTER_S = 5.0  # an upkeep pass this long after the last one starts the seats' sightings again


@dataclass(frozen=True)
class SeatKit:
    """What a node that takes a seat gets besides its place in etcd: the run's CA and etcd's CA (certificates and
    keys: it signs certificates from then on, as every seat does), the sealing root, and the replicas' leader TTL.

    Attributes:
        ca: the run's CA.
        etcd_ca: etcd's CA.
        seal_root: the sealing secret (:mod:`pliant.security.seal`).
        leader_ttl_s: the replicas' leader lease TTL.
        wanted: the seats the control plane wants (1, 3 or 5).
    """

    ca: IssuedCert = field(repr=False)
    etcd_ca: IssuedCert = field(repr=False)
    seal_root: bytes = field(repr=False)
    leader_ttl_s: float
    wanted: int


class SeatKeeper:
    """Seats of the control plane whose etcd is ``members``, recorded through ``store``.

    Args:
        store: the replica's etcd store.
        members: etcd's membership.
        kit: what a seat's node gets.
        clock: the monotonic clock of the upkeep (injected for tests).
        wall: the wall clock a seat's ``since`` is written in.
    """

    def __init__(
        self,
        store: EtcdStore,
        members: EtcdMembers,
        kit: SeatKit,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        node: str = "",
    ) -> None:
        self._store = store
        self._members = members
        self.kit = kit
        self.node = node  # the node whose seat this replica is ("": not known)
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()  # one claim at a time
        self._cache = threading.Lock()
        self._record: tuple[Seats | None, float] = (None, float("-inf"))  # the record, and when read (under _cache)
        # What the upkeep saw (upkeep thread): seated node -> last seen live (or its seat first seen), seated node ->
        # its seat first seen, etcd member without a seat -> first seen so.
        self._live: dict[str, float] = {}
        self._seated: dict[str, float] = {}
        self._seatless: dict[int, float] = {}
        self._looked_at = float("-inf")  # the last upkeep pass that read the seats (upkeep thread)

    def take_first(self, seat: Seat, key: str, ttl_s: float) -> None:
        """Record ``seat`` as seat 0, the node that started the control plane, and seat key ``key`` (valid ``ttl_s``)
        that admits the other seats (once: a record already there stays)."""
        now = self._wall()
        first = Seats(self.kit.wanted, (replace(seat, since=now),), (SeatKey(digest(key), now + ttl_s),))
        if self._store.write_seats(first, 0):
            logger.info("control plane: seat 0 on %s (%d seat(s) wanted)", seat.node, self.kit.wanted)

    def make_key(self, ttl_s: float) -> tuple[str, float]:
        """A new seat key, valid ``ttl_s``, recorded (its digest) with the others: (the key, when it expires).

        Raises:
            FailedPrecondition: this control plane has no seats record.
            CoordinatorError: etcd did not answer, or the record kept changing.
        """
        key = secrets.token_urlsafe(32)
        for _attempt in range(5):
            seats, rev = self._store.read_seats()
            if seats is None:
                raise FailedPrecondition("this control plane has no seats: it is a standalone deployment or has one")
            now = self._wall()
            if self._store.write_seats(seats.with_key(SeatKey(digest(key), now + ttl_s), now), rev):
                logger.warning("control plane: a new seat key was made (valid %.0fs)", ttl_s)
                return key, now + ttl_s
        raise CoordinatorError("the seats record kept changing while a seat key was added; try again")

    def _cached(self) -> Seats | None:
        """The seats record, read at most every :data:`COORDINATORS_READ_EVERY_S` (the last one read when etcd does
        not answer)."""
        with self._cache:
            record, read_at = self._record
            if self._clock() - read_at < COORDINATORS_READ_EVERY_S:
                return record
        try:
            record, _rev = self._store.read_seats()
        except CoordinatorError:
            return record
        with self._cache:
            self._record = (record, self._clock())
        return record

    def coordinators(self) -> tuple[str, ...]:
        """The coordinators of the control plane as the seats record lists them (read at most every few seconds)."""
        record = self._cached()
        return record.coordinators if record is not None else ()

    def seats_of(self) -> tuple[str, ...]:
        """The nodes that hold the control plane's seats, in the order they took them (read at most every few
        seconds): what an agent names when the control plane is unreachable."""
        record = self._cached()
        return tuple(seat.node for seat in record.seats) if record is not None else ()

    def handed_to(self, node: str) -> bool:
        """Whether a seat is being handed to ``node`` (read at most every few seconds)."""
        record = self._cached()
        return record is not None and record.handing_to(node, self._wall()) is not None

    def hand_over(self, node: str, to: str, ttl_s: float) -> bool:
        """Record that ``node``'s seat goes to ``to`` if it takes it within ``ttl_s`` (see :mod:`seats`); False when
        ``node`` holds no seat.

        Raises:
            CoordinatorError: etcd did not answer, or the record kept changing.
        """
        for _attempt in range(5):
            seats, rev = self._store.read_seats()
            if seats is None or seats.holder(node) is None:
                return False
            handover = Handover(node, to, self._wall() + ttl_s)
            if self._store.write_seats(replace(seats, handover=handover), rev):
                logger.warning("control plane: %s hands its seat to %s (for %.0fs)", node, to, ttl_s)
                self._forget_coordinators()
                return True
        raise CoordinatorError("the seats record kept changing while a hand-over was recorded; try again")

    def members(self) -> list[EtcdMember]:
        """etcd's members now.

        Raises:
            EtcdClusterError: etcd did not answer.
        """
        return self._members.list()

    def seats(self) -> Seats | None:
        """The seats record as etcd has it now (None: none).

        Raises:
            CoordinatorError: etcd did not answer.
        """
        return self._store.read_seats()[0]

    def claim(self, seat: Seat, key: str, proof: bytes) -> SeatAnswer:
        """Answer a node's claim for a seat (``seat``: its node and where it would listen; ``key``: the seat key it
        gave, ``proof``: the proof of the seat it held, each empty when not given).

        Raises:
            PermissionDenied: the claim proves no right to a seat (nothing was changed).
            CoordinatorError: etcd did not answer.
        """
        with self._lock:
            seats, rev = self._store.read_seats()
            if seats is None:
                return SeatAnswer(reason="this control plane has no seats record; it has one seat")
            members = self._members.list()
            decision = decide_claim(seats, members, seat, key, proof, self._wall())
            if isinstance(decision, Deny):
                logger.warning("control plane: seat refused to node %s: %s", seat.node, decision.reason)
                raise PermissionDenied(f"seat refused to node {seat.node}: {decision.reason}")
            if isinstance(decision, Refuse):
                return SeatAnswer(reason=decision.reason)
            if isinstance(decision, StandBy):
                if seat.node not in seats.standby and self._store.write_seats(seats.standing_by(seat.node), rev):
                    logger.warning("control plane: %s stands by to take a seat handed over", seat.node)
                return SeatAnswer(reason=decision.reason)
            if isinstance(decision, Promote):
                return SeatAnswer(reason=self._promote(decision) + "; ask again shortly")
            secret = secrets.token_bytes(32)  # the proof of a seat granted by the key: a new holder, a new proof
            if isinstance(decision, AddLearner):
                taken = replace(decision.seat, since=self._wall(), proof=digest(secret))
                try:
                    members = self._members.add_learner(taken.node, taken.etcd_peer)
                except EtcdClusterError as exc:
                    return SeatAnswer(reason=f"etcd cannot add a member now ({exc}); ask again shortly")
                if not self._store.write_seats(seats.with_seat(taken).seated(taken.node), rev):
                    self._remove_quietly(members, taken)
                    return SeatAnswer(reason="the seats changed meanwhile; ask again")
                logger.warning("control plane: seat granted to %s (etcd learner %s)", taken.node, taken.etcd_peer)
                self._forget_coordinators()
                return self._granted(taken, members, secret)
            assert isinstance(decision, Grant)
            if proof and decision.seat.proof == digest(proof):
                secret = proof  # claimed back by its proof: the proof stays (a lost answer is asked again with it)
            granted = replace(decision.seat, proof=digest(secret))
            if granted not in seats.seats:
                if not self._store.write_seats(seats.back(granted), rev):
                    return SeatAnswer(reason="the seats changed meanwhile; ask again")
                self._forget_coordinators()
            if granted.node not in {s.node for s in seats.seats}:  # its node is back under a new node id
                logger.warning("control plane: %s is back in its seat (%s)", granted.node, granted.etcd_peer)
            return self._granted(granted, members, secret)

    def upkeep(self, live: set[str]) -> None:
        """One pass of the leader's upkeep; ``live``: the nodes that are live members of a job now.

        Raises:
            CoordinatorError: etcd did not answer.
        """
        seats, rev = self._store.read_seats()
        if seats is None:
            return
        members = self._members.list()
        now = self._clock()
        if now - self._looked_at > UNSEEN_AFTER_S:
            # This replica did not look for a while (it did not lead, or etcd did not answer): what it saw is stale,
            # and every seat gets a full GONE_AFTER_S from now, as every member gets a full TTL after an outage.
            self._live = dict.fromkeys(self._live, now)
        self._looked_at = now
        nodes = {seat.node for seat in seats.seats}
        for node in nodes:
            self._seated.setdefault(node, now)
            if node in live or node not in self._live:
                self._live[node] = now
        seatless = {m.id for m in members if not any(url == s.etcd_peer for s in seats.seats for url in m.peer_urls)}
        for ident in seatless:
            self._seatless.setdefault(ident, now)
        for seen, keep in ((self._live, nodes), (self._seated, nodes), (self._seatless, seatless)):
            for key in set(seen) - keep:  # type: ignore[operator]
                del seen[key]  # type: ignore[attr-defined]
        sightings = Sightings(self._live, self._seated, self._seatless)
        for action in decide_upkeep(seats, members, sightings, now, self.node, self._wall()):
            if isinstance(action, Promote):
                self._promote(action)
            elif isinstance(action, Remove):
                self._remove(action, seats, rev)

    def forget(self) -> None:
        """Read the seats record again at the next heartbeat (a hand-over's step changed what it lists)."""
        self._forget_coordinators()

    def _forget_coordinators(self) -> None:
        with self._cache:
            self._record = (None, float("-inf"))

    def _promote(self, action: Promote) -> str:
        try:
            self._members.promote(action.member_id)
        except NotInSync:
            return "a learner is catching up"
        except EtcdClusterError as exc:
            logger.warning("control plane: promoting etcd member %x failed: %s", action.member_id, exc)
            return f"a learner's promotion failed ({exc})"
        logger.warning("control plane: etcd learner %x promoted (%s)", action.member_id, action.why)
        return "a learner was promoted"

    def _remove(self, action: Remove, seats: Seats, rev: int) -> None:
        try:
            if action.member_id:
                self._members.remove(action.member_id)
        except EtcdClusterError as exc:
            logger.warning("control plane: removing etcd member %x failed: %s", action.member_id, exc)
            return
        if action.node and self._store.write_seats(seats.without(action.node), rev):
            self._forget_coordinators()
        logger.warning("control plane: seat of %s given up: %s", action.node or "no node", action.why)

    def _remove_quietly(self, members: list[EtcdMember], seat: Seat) -> None:
        for member in members:
            if seat.etcd_peer in member.peer_urls:
                try:
                    self._members.remove(member.id)
                except EtcdClusterError as exc:
                    logger.warning("control plane: an unrecorded learner stays until the upkeep removes it: %s", exc)

    def _granted(self, seat: Seat, members: list[EtcdMember], proof: bytes) -> SeatAnswer:
        kit = self.kit
        voters = [url for m in members if m.started and not m.learner for url in m.client_urls]
        return SeatAnswer(
            granted=True,
            initial_cluster=initial_cluster(members, seat.node, seat.etcd_peer),
            member_name=seat.node,
            etcd_endpoints=tuple(voters),
            ca_cert_pem=kit.ca.cert_pem,
            ca_key_pem=kit.ca.key_pem,
            etcd_ca_cert_pem=kit.etcd_ca.cert_pem,
            etcd_ca_key_pem=kit.etcd_ca.key_pem,
            seal_root=kit.seal_root,
            leader_ttl_s=kit.leader_ttl_s,
            seat_proof=proof,
        )
