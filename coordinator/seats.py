"""The seats of an embedded control plane: the nodes of a ``pliant run`` job that each host an etcd member and a
coordinator replica, so that the control plane outlives any one of them, the first included.

A control plane started by ``pliant run`` wants a number of seats (1, 3 or 5; by default 3 when the job may have 3
nodes or more). The first node takes seat 0 when it starts the control plane; every other node of the job asks for a
seat (``ClaimSeat``) until it holds one or the seats are full. A node takes a seat in etcd's safe order
(:mod:`pliant.coordinator.etcd_cluster`): its member joins as a learner, which votes only once promoted, and etcd
holds one learner at a time. A learner is promoted once it has started when the cluster then has three voting
members or more, or when another node waits for a seat: a second member that votes before a third arrives would make
the loss of either node cost the quorum. The leader keeps the seats: it promotes, and it removes the member and the
seat of a node that has not been a live member of any job for :data:`GONE_AFTER_S` (and a learner that never
started), so that a node that joins later can take that seat and the quorum is whole again.

Record: one etcd key, ``{prefix}/control-plane/seats``, a JSON object written with a compare on its mod revision:
``{"wanted": N, "seats": [{"node": ID, "coordinator": "HOST:PORT", "etcd_client": URL, "etcd_peer": URL,
"since": WALL}]}`` in the order the seats were taken. An agent learns the coordinators from every heartbeat's answer.

Decisions are pure functions of the record, etcd's member list, the live nodes and the time
(:func:`decide_claim`, :func:`decide_upkeep`); :class:`pliant.coordinator.seat_keeper.SeatKeeper` performs them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace

from pliant.coordinator.etcd_cluster import EtcdMember

__all__ = [
    "GONE_AFTER_S",
    "NEVER_STARTED_S",
    "AddLearner",
    "Grant",
    "Promote",
    "Refuse",
    "Remove",
    "Seat",
    "Seats",
    "Sightings",
    "decide_claim",
    "decide_upkeep",
    "wanted_seats",
]

GONE_AFTER_S = 15.0
"""A seat whose node has not been a live member of any job for this long is given up (its member removed)."""
NEVER_STARTED_S = 60.0
"""A learner that has not started this long after its seat was granted is removed (its node died on the way)."""


def wanted_seats(max_nodes: int, asked: int = 0) -> int:
    """The seats of a control plane for a job of at most ``max_nodes`` nodes: ``asked`` (1, 3 or 5) when given,
    else 3 when the job may have 3 nodes, else 1."""
    if asked:
        return asked
    return 3 if max_nodes >= 3 else 1


@dataclass(frozen=True)
class Seat:
    """One node's seat: where its coordinator replica and its etcd member listen.

    Attributes:
        node: the node id.
        coordinator: HOST:PORT of its coordinator replica (its Bootstrap service on the next port).
        etcd_client: its etcd member's client URL.
        etcd_peer: its etcd member's peer URL (how etcd knows the member).
        since: when the seat was granted (the granting replica's wall clock).
    """

    node: str
    coordinator: str
    etcd_client: str
    etcd_peer: str
    since: float = 0.0


@dataclass(frozen=True)
class Seats:
    """The seats record: how many seats the control plane wants, and who holds them, in the order they were taken."""

    wanted: int
    seats: tuple[Seat, ...] = ()

    @property
    def coordinators(self) -> tuple[str, ...]:
        return tuple(seat.coordinator for seat in self.seats)

    def holder(self, node: str) -> Seat | None:
        return next((seat for seat in self.seats if seat.node == node), None)

    def with_seat(self, seat: Seat) -> Seats:
        """This record with ``seat`` in it (replacing the node's earlier seat)."""
        return replace(self, seats=(*(s for s in self.seats if s.node != seat.node), seat))

    def back(self, seat: Seat) -> Seats:
        """This record with ``seat`` in the place of the seat of its etcd member (a node come back to its seat)."""
        return replace(self, seats=tuple(seat if s.etcd_peer == seat.etcd_peer else s for s in self.seats))

    def without(self, node: str) -> Seats:
        return replace(self, seats=tuple(s for s in self.seats if s.node != node))

    def to_json(self) -> str:
        return json.dumps({"wanted": self.wanted, "seats": [asdict(s) for s in self.seats]}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Seats:
        data = json.loads(text)
        return cls(int(data["wanted"]), tuple(Seat(**seat) for seat in data.get("seats", [])))


def _member_of(seat: Seat, members: Sequence[EtcdMember]) -> EtcdMember | None:
    return next((m for m in members if seat.etcd_peer in m.peer_urls), None)


# -- decisions ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Grant:
    """The node holds ``seat`` (granted earlier, its member in etcd; or its member's, come back under a new node id):
    record it if it changed, and send the node what it needs again."""

    seat: Seat


@dataclass(frozen=True)
class AddLearner:
    """Add ``seat``'s member as a learner, then record the seat, then send the node what it needs."""

    seat: Seat


@dataclass(frozen=True)
class Promote:
    """Promote learner ``member_id`` (it started); a claim is answered "not yet" after it."""

    member_id: int
    why: str


@dataclass(frozen=True)
class Remove:
    """Remove etcd member ``member_id`` (0: none in etcd) and ``node``'s seat (""; a member without a seat)."""

    member_id: int
    node: str
    why: str


@dataclass(frozen=True)
class Refuse:
    """No seat for the node now; ``reason`` says why and whether to ask again."""

    reason: str
    final: bool = False  # the seats are full: asking again is pointless until one is given up


Claim = Grant | AddLearner | Promote | Refuse


def decide_claim(seats: Seats, members: Sequence[EtcdMember], claim: Seat) -> Claim:
    """What to do with ``claim`` (a node asking for a seat, where it would listen) given the record and etcd's
    members."""
    held = seats.holder(claim.node)
    if held is not None and _member_of(held, members) is not None:
        return Grant(held)
    back = next((seat for seat in seats.seats if seat.etcd_peer == claim.etcd_peer), None)
    if back is not None and _member_of(back, members) is not None:
        # The node came back to its seat (a new agent, its member restarted from its data): the seat is its own.
        return Grant(replace(back, node=claim.node, coordinator=claim.coordinator))
    others = seats.without(claim.node)
    if len(others.seats) >= seats.wanted:
        return Refuse(f"the control plane's {seats.wanted} seat(s) are taken", final=True)
    learner = next((m for m in members if m.learner), None)
    if learner is not None:
        if learner.started:
            return Promote(learner.id, f"{claim.node} waits for a seat")
        return Refuse("a learner is starting; ask again shortly")
    return AddLearner(replace(claim, since=0.0))


@dataclass(frozen=True)
class Sightings:
    """What the leader saw of the seats, on its monotonic clock: when it last saw each seated node a live member of a
    job (or first saw its seat, if later), when it first saw each seat, and when it first saw each etcd member that
    holds no seat."""

    live: Mapping[str, float]
    seated: Mapping[str, float]
    seatless: Mapping[int, float]


def decide_upkeep(seats: Seats, members: Sequence[EtcdMember], seen: Sightings, now: float) -> list[Promote | Remove]:
    """The leader's upkeep of the seats, by the record, etcd's members, and what the leader saw (``now`` on its
    clock).

    At most one change per call, the safest first: removing a learner that holds no seat (a claim that failed half
    way) or one that never started, then the member of a node that is gone (never the last voting member), then a
    promotion.
    """
    voters = [m for m in members if not m.learner]
    for member in members:
        seat = next((s for s in seats.seats if s.etcd_peer in member.peer_urls), None)
        if seat is None and member.learner and now - seen.seatless.get(member.id, now) > GONE_AFTER_S:
            return [Remove(member.id, "", "a learner without a seat")]
        if seat is not None and not member.started and now - seen.seated.get(seat.node, now) > NEVER_STARTED_S:
            return [Remove(member.id, seat.node, f"{seat.node}'s member never started")]
    for seat in seats.seats:
        member = _member_of(seat, members)
        if member is None and now - seen.seated.get(seat.node, now) > NEVER_STARTED_S:
            return [Remove(0, seat.node, f"{seat.node}'s seat has no etcd member")]
        if now - seen.live.get(seat.node, now) <= GONE_AFTER_S:
            continue
        if member is not None and not member.learner and len(voters) <= 1:
            continue  # the last vote: removing it ends the cluster
        why = f"node {seat.node} has not been a live member of a job for {GONE_AFTER_S:g}s"
        return [Remove(member.id if member is not None else 0, seat.node, why)]
    learner = next((m for m in members if m.learner and m.started), None)
    if learner is not None and len(voters) >= 2:
        return [Promote(learner.id, f"{len(voters) + 1} voting members then")]
    return []
