"""The seats of an embedded control plane: the nodes of a ``pliant run`` job that each host an etcd member and a
coordinator replica, so that the control plane outlives any one of them, the first included.

A control plane started by ``pliant run`` wants a number of seats (1, 3 or 5; by default 3 when the job may have 3
nodes or more). The first node takes seat 0 when it starts the control plane; every other node of the job asks for a
seat (``ClaimSeat``) until it holds one or the seats are full. A seat holds the run's CA key, etcd's CA key and the
sealing root, so a node takes a new seat only with a **seat key**: a secret the control plane makes (the first node
at start, an admin's ``CreateSeatKey`` later), printed apart from the workers' join line, kept in the record as its
SHA-256 only, and valid for :data:`SEAT_KEY_TTL_S` (kubeadm's ``--certificate-key``). A grant returns the seat's
**proof**, a secret whose SHA-256 the seat records (a fresh one whenever the key grants the seat): the node keeps it
with the seat, and a new agent of the node (its etcd member started again from its data) claims the seat back with it.
Where a claimant would listen proves nothing. A node takes a seat in etcd's safe order
(:mod:`pliant.coordinator.etcd_cluster`): its member joins as a learner, which votes only once promoted, and etcd
holds one learner at a time. A learner is promoted once it has started when the cluster then has three voting
members or more, or when another node waits for a seat: a second member that votes before a third arrives would make
the loss of either node cost the quorum. The leader keeps the seats: it promotes, and it removes the member and the
seat of a node that has not been a live member of any job for :data:`GONE_AFTER_S` (and a learner that never
started), so that a node that joins later can take that seat and the quorum is whole again.

**A seat is handed over** when its node leaves gracefully while a node that **stands by** runs. A node stands by when
it claimed with a valid seat key while the seats were full (``standby``, by node id): the operator gave it the key,
so it may hold the control plane, and it waits for a seat. The leaving node records a hand-over (``handover``: from
it, to a live standby node it names, until a deadline). The named node's agent learns it from its heartbeat's answer
and claims again with its key; the claim makes room for one more seat while the hand-over lasts, its member joins as
a learner, and the leader promotes it once it started. The workers' join line alone never stands by, so it never
receives a seat. Once it votes, the leaving node gives up the
lead (it stops its replica), and a replica other than the leaving node's removes the leaving node's member and seat:
the control plane then runs on the named node, as it did on the one that left. A hand-over that does not complete by
its deadline lapses (the record keeps the seats as they are).

Record: one etcd key, ``{prefix}/control-plane/seats``, a JSON object written with a compare on its mod revision:
``{"wanted": N, "seats": [{"node": ID, "coordinator": "HOST:PORT", "etcd_client": URL, "etcd_peer": URL,
"since": WALL, "proof": SHA256_HEX}], "keys": [{"digest": SHA256_HEX, "expires_at": WALL}], "standby": [ID],
"handover": {"node": ID, "to": ID, "expires_at": WALL} | null}``, the seats in the order they were taken, the keys
that have not expired, the nodes standing by (the latest :data:`MAX_STANDBY`).
An agent learns the coordinators, and a seat handed to it, from every heartbeat's answer.

Decisions are pure functions of the record, etcd's member list, the live nodes and the time
(:func:`decide_claim`, :func:`decide_upkeep`); :class:`pliant.coordinator.seat_keeper.SeatKeeper` performs them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

from pliant.coordinator.etcd_cluster import EtcdMember

__all__ = [
    "GONE_AFTER_S",
    "MAX_STANDBY",
    "NEVER_STARTED_S",
    "SEAT_KEY_TTL_S",
    "AddLearner",
    "Deny",
    "Grant",
    "Handover",
    "Promote",
    "Refuse",
    "Remove",
    "Seat",
    "SeatAnswer",
    "SeatKey",
    "Seats",
    "Sightings",
    "StandBy",
    "decide_claim",
    "decide_upkeep",
    "digest",
    "wanted_seats",
]

GONE_AFTER_S = 15.0
"""A seat whose node has not been a live member of any job for this long is given up (its member removed)."""
NEVER_STARTED_S = 60.0
"""A learner that has not started this long after its seat was granted is removed (its node died on the way)."""
SEAT_KEY_TTL_S = 2 * 3600.0
"""How long a seat key admits new seats unless its maker says otherwise (kubeadm's certificate key: two hours)."""
MAX_SEAT_KEY_TTL_S = 7 * 24 * 3600.0
"""The longest a seat key may be made to last."""
MAX_STANDBY = 16
"""The nodes standing by that the record keeps (the latest to claim)."""


def wanted_seats(max_nodes: int, asked: int = 0) -> int:
    """The seats of a control plane for a job of at most ``max_nodes`` nodes: ``asked`` (1, 3 or 5) when given,
    else 3 when the job may have 3 nodes, else 1."""
    if asked:
        return asked
    return 3 if max_nodes >= 3 else 1


@dataclass(frozen=True)
class SeatAnswer:
    """The answer to a node's claim of a seat (:func:`decide_claim` decides it; the seat keeper performs it).

    Attributes:
        granted: the seat is this node's: it starts its etcd member (joining the cluster) and its replica.
        reason: why not, when not granted (the seats are full and the node stands by, or busy: ask again).
        initial_cluster: etcd's ``--initial-cluster`` for the new member.
        member_name: the new member's name.
        etcd_endpoints: the voting members' client URLs.
        ca_cert_pem: the control plane's CA, with its key ``ca_key_pem``: the seat's replica signs with it.
        ca_key_pem: see ``ca_cert_pem``.
        etcd_ca_cert_pem: etcd's CA, with its key ``etcd_ca_key_pem``: the seat issues its member's certificates.
        etcd_ca_key_pem: see ``etcd_ca_cert_pem``.
        seal_root: the control plane's sealing root.
        leader_ttl_s: the control plane's leader lease.
        seat_proof: the proof of this grant, with which the node comes back to its seat.
    """

    granted: bool = False
    reason: str = ""
    initial_cluster: str = ""
    member_name: str = ""
    etcd_endpoints: tuple[str, ...] = ()
    ca_cert_pem: bytes = field(default=b"", repr=False)
    ca_key_pem: bytes = field(default=b"", repr=False)
    etcd_ca_cert_pem: bytes = field(default=b"", repr=False)
    etcd_ca_key_pem: bytes = field(default=b"", repr=False)
    seal_root: bytes = field(default=b"", repr=False)
    leader_ttl_s: float = 0.0
    seat_proof: bytes = field(default=b"", repr=False)


@dataclass(frozen=True)
class Seat:
    """One node's seat: where its coordinator replica and its etcd member listen.

    Attributes:
        node: the node id.
        coordinator: HOST:PORT of its coordinator replica (its Bootstrap service on the next port).
        etcd_client: its etcd member's client URL.
        etcd_peer: its etcd member's peer URL (how etcd knows the member).
        since: when the seat was granted (the granting replica's wall clock).
        proof: the SHA-256 (hex) of the seat's proof, the secret its last grant returned ("": none, the first seat).
    """

    node: str
    coordinator: str
    etcd_client: str
    etcd_peer: str
    since: float = 0.0
    proof: str = ""


@dataclass(frozen=True)
class SeatKey:
    """A seat key the control plane made: its SHA-256 (hex) and when it stops admitting seats (wall clock)."""

    digest: str
    expires_at: float


def digest(secret: str | bytes) -> str:
    """The SHA-256 (hex) a seat key or a seat's proof is recorded as (both are 256 random bits: no salt is needed)."""
    return hashlib.sha256(secret.encode() if isinstance(secret, str) else secret).hexdigest()


@dataclass(frozen=True)
class Handover:
    """``node``'s seat goes to ``to`` (a live member of the job), if it takes it before ``expires_at`` (wall clock)."""

    node: str
    to: str
    expires_at: float


@dataclass(frozen=True)
class Seats:
    """The seats record: how many seats the control plane wants, who holds them (in the order they were taken), the
    seat keys that admit new seats, and a seat being handed over."""

    wanted: int
    seats: tuple[Seat, ...] = ()
    keys: tuple[SeatKey, ...] = ()
    handover: Handover | None = None
    standby: tuple[str, ...] = ()

    def standing_by(self, node: str) -> Seats:
        """This record with ``node`` among the nodes that stand by (the latest :data:`MAX_STANDBY` kept)."""
        others = tuple(n for n in self.standby if n != node)
        return replace(self, standby=(*others, node)[-MAX_STANDBY:])

    def seated(self, node: str) -> Seats:
        """This record once ``node`` holds a seat: no longer standing by."""
        return replace(self, standby=tuple(n for n in self.standby if n != node))

    def handing_to(self, node: str, now: float) -> Handover | None:
        """The hand-over of a seat to ``node`` that lasts at ``now`` (None: none)."""
        handover = self.handover
        return handover if handover is not None and handover.to == node and now < handover.expires_at else None

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
        """This record without ``node``'s seat (and without a hand-over from or to it)."""
        handover = (
            self.handover if self.handover is None or node not in (self.handover.node, self.handover.to) else None
        )
        return replace(self, seats=tuple(s for s in self.seats if s.node != node), handover=handover)

    def with_key(self, key: SeatKey, now: float) -> Seats:
        """This record with ``key`` among its keys, and without the keys expired at ``now``."""
        return replace(self, keys=(*(k for k in self.keys if k.expires_at > now), key))

    def admits(self, key: str, now: float) -> bool:
        """``key`` is a seat key of this control plane that has not expired at ``now``."""
        asked = digest(key)
        return any(hmac.compare_digest(k.digest, asked) and now < k.expires_at for k in self.keys)

    def proven(self, proof: bytes) -> Seat | None:
        """The seat whose proof is ``proof`` (None: none; an empty proof proves no seat)."""
        if not proof:
            return None
        asked = digest(proof)
        return next((s for s in self.seats if s.proof and hmac.compare_digest(s.proof, asked)), None)

    def to_json(self) -> str:
        return json.dumps(
            {
                "wanted": self.wanted,
                "seats": [asdict(s) for s in self.seats],
                "keys": [asdict(k) for k in self.keys],
                "handover": asdict(self.handover) if self.handover is not None else None,
                "standby": list(self.standby),
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Seats:
        data = json.loads(text)
        handover = data.get("handover")
        return cls(
            int(data["wanted"]),
            tuple(Seat(**seat) for seat in data.get("seats", [])),
            tuple(SeatKey(**key) for key in data.get("keys", [])),
            Handover(**handover) if handover else None,
            tuple(str(n) for n in data.get("standby", [])),
        )


def _member_of(seat: Seat, members: Sequence[EtcdMember]) -> EtcdMember | None:
    return next((m for m in members if seat.etcd_peer in m.peer_urls), None)


# -- decisions ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Grant:
    """The node holds ``seat`` (granted earlier, its member in etcd; or its member's, come back under a new node id
    with the seat's proof): record it with a new proof, and send the node what it needs again."""

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


@dataclass(frozen=True)
class StandBy:
    """The seats are full, and the claimant holds a valid seat key: record it among the nodes that stand by (a seat
    whose node leaves may be handed to it); ``reason`` says so."""

    reason: str


@dataclass(frozen=True)
class Deny:
    """The claimant proves no right to a seat: refused for good (PERMISSION_DENIED); ``reason`` says what it lacks."""

    reason: str


Claim = Grant | AddLearner | Promote | Refuse | StandBy | Deny

NO_KEY = (
    "a control-plane seat takes the control plane's seat key (PLIANT_SEAT_KEY, in the seat line the first node "
    "printed, or made by `pliant seat-key`); the workers' join line holds none"
)
BAD_KEY = (
    "the seat key given is not one this control plane made, or it expired; make a new one with `pliant seat-key` "
    "(an admin's)"
)


def decide_claim(seats: Seats, members: Sequence[EtcdMember], claim: Seat, key: str, proof: bytes, now: float) -> Claim:
    """What to do with ``claim`` (a node asking for a seat, where it would listen) given the record, etcd's members,
    the seat key and the seat proof the claimant gave ("": none), at ``now`` (wall clock)."""
    back = seats.proven(proof)
    if back is not None and _member_of(back, members) is not None:
        # The seat's own node (its agent again, or a new one with its member's data, under a new node id).
        return Grant(replace(back, node=claim.node, coordinator=claim.coordinator))
    if not key:
        return Deny(NO_KEY)
    if not seats.admits(key, now):
        return Deny(BAD_KEY)
    held = seats.holder(claim.node)
    if held is not None and _member_of(held, members) is not None:
        return Grant(held)
    others = seats.without(claim.node)
    handed = seats.handing_to(claim.node, now)  # a leaving seat's node named this one: its place is this one's
    if len(others.seats) >= seats.wanted + (handed is not None):
        return StandBy(
            f"the control plane's {seats.wanted} seat(s) are taken; this node stands by to take one whose node leaves"
        )
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


def _handed_over(seats: Seats, members: Sequence[EtcdMember], me: str, wall: float) -> list[Promote | Remove]:
    """The steps of a hand-over that lasts at ``wall``: promote the named node's learner once it started; once it
    votes, remove the leaving node's member and seat (never by the leaving node's own replica, ``me``, which gives
    up the lead first)."""
    handover = seats.handover
    if handover is None or wall >= handover.expires_at:
        return []
    target = seats.holder(handover.to)
    member = _member_of(target, members) if target is not None else None
    if member is None or not member.started:
        return []
    if member.learner:
        return [Promote(member.id, f"{handover.to} takes the seat of {handover.node}, which leaves")]
    leaving = seats.holder(handover.node)
    if leaving is None or me == handover.node:
        return []
    gone = _member_of(leaving, members)
    return [
        Remove(gone.id if gone is not None else 0, handover.node, f"{handover.node} handed its seat to {handover.to}")
    ]


def decide_upkeep(
    seats: Seats, members: Sequence[EtcdMember], seen: Sightings, now: float, me: str = "", wall: float = 0.0
) -> list[Promote | Remove]:
    """The leader's upkeep of the seats, by the record, etcd's members, and what the leader saw (``now`` on its
    clock); ``me``: the node of the replica that leads; ``wall``: the wall clock a hand-over's deadline is in.

    At most one change per call, the safest first: removing a learner that holds no seat (a claim that failed half
    way) or one that never started, then a hand-over's step, then the member of a node that is gone (never the last
    voting member), then a promotion.
    """
    voters = [m for m in members if not m.learner]
    for member in members:
        seat = next((s for s in seats.seats if s.etcd_peer in member.peer_urls), None)
        if seat is None and member.learner and now - seen.seatless.get(member.id, now) > GONE_AFTER_S:
            return [Remove(member.id, "", "a learner without a seat")]
        if seat is not None and not member.started and now - seen.seated.get(seat.node, now) > NEVER_STARTED_S:
            return [Remove(member.id, seat.node, f"{seat.node}'s member never started")]
    handing = _handed_over(seats, members, me, wall)
    if handing:
        return handing
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
