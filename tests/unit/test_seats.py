"""An embedded control plane's seats: who takes one, in etcd's safe order, and the leader's upkeep (pure decisions,
on a fake clock)."""

from __future__ import annotations

import pytest

from pliant.coordinator.etcd_cluster import EtcdMember, initial_cluster
from pliant.coordinator.seats import (
    GONE_AFTER_S,
    NEVER_STARTED_S,
    AddLearner,
    Deny,
    Grant,
    Handover,
    Promote,
    Refuse,
    Remove,
    Seat,
    SeatKey,
    Seats,
    Sightings,
    StandBy,
    decide_claim,
    decide_upkeep,
    digest,
    wanted_seats,
)

pytestmark = pytest.mark.timeout(10)

KEY = "k" * 43  # the seat key of the records below
KEYS = (SeatKey(digest(KEY), 100.0),)


def _claim(seats: Seats, members: list[EtcdMember], claim: Seat, key: str = KEY, proof: bytes = b"", now: float = 1.0):
    return decide_claim(seats, members, claim, key, proof, now)


def _seat(node: str) -> Seat:
    return Seat(node, f"{node}:29400", f"https://{node}:29402", f"https://{node}:29403")


def _member(node: str, ident: int, learner: bool = False, started: bool = True) -> EtcdMember:
    seat = _seat(node)
    return EtcdMember(
        ident, node if started else "", (seat.etcd_peer,), (seat.etcd_client,) if started else (), learner
    )


def _seen(live: dict[str, float], seated: dict[str, float] | None = None) -> Sightings:
    return Sightings(live, seated if seated is not None else live, {})


def test_the_seats_wanted_follow_the_jobs_size_unless_asked() -> None:
    assert [wanted_seats(n) for n in (1, 2, 3, 8)] == [1, 1, 3, 3]
    assert wanted_seats(8, asked=5) == 5 and wanted_seats(2, asked=1) == 1


def test_seats_fill_one_learner_at_a_time_and_a_second_voter_waits_for_a_third() -> None:
    seats = Seats(3, (_seat("a"),), KEYS)
    one = [_member("a", 1)]
    assert _claim(seats, one, _seat("b")) == AddLearner(_seat("b"))
    seats = seats.with_seat(_seat("b"))
    learning = [*one, _member("b", 2, learner=True, started=False)]
    assert _claim(seats, learning, _seat("b")) == Grant(_seat("b")), "asked again: the same seat"
    assert isinstance(_claim(seats, learning, _seat("c")), Refuse), "b's learner has not started"
    started = [*one, _member("b", 2, learner=True)]
    assert decide_upkeep(seats, started, _seen({"a": 0.0, "b": 0.0}), 1.0) == [], (
        "b stays a learner: two voters are fragile"
    )
    claim = _claim(seats, started, _seat("c"))
    assert isinstance(claim, Promote) and claim.member_id == 2, "a third node waits: b votes first"
    voters = [*one, _member("b", 2)]
    assert _claim(seats, voters, _seat("c")) == AddLearner(_seat("c"))
    seats = seats.with_seat(_seat("c"))
    three = [*voters, _member("c", 3, learner=True)]
    assert decide_upkeep(seats, three, _seen({"a": 0.0, "b": 0.0, "c": 0.0}), 1.0) == [
        Promote(3, "3 voting members then")
    ]
    full = _claim(seats, [*voters, _member("c", 3)], _seat("d"))
    assert isinstance(full, StandBy) and "3 seat(s) are taken; this node stands by" in full.reason


def test_a_gone_nodes_seat_is_given_up_and_taken_by_a_newcomer() -> None:
    seats = Seats(3, (_seat("a"), _seat("b"), _seat("c")), KEYS)
    members = [_member("a", 1), _member("b", 2), _member("c", 3)]
    seen = {"a": 0.0, "b": 0.0, "c": 0.0}
    assert decide_upkeep(seats, members, _seen(seen), GONE_AFTER_S) == [], "not gone for long enough"
    seen = {"a": 0.0, "b": GONE_AFTER_S, "c": GONE_AFTER_S}
    [remove] = decide_upkeep(seats, members, _seen(seen), GONE_AFTER_S + 1)
    assert isinstance(remove, Remove) and (remove.member_id, remove.node) == (1, "a")
    seats, members = seats.without("a"), members[1:]
    assert _claim(seats, members, _seat("d")) == AddLearner(_seat("d"))
    seats = seats.with_seat(_seat("d"))
    learner = [*members, _member("d", 4, learner=True)]
    assert decide_upkeep(seats, learner, _seen({"b": 30.0, "c": 30.0, "d": 30.0}), 31.0) == [
        Promote(4, "3 voting members then")
    ]


def test_the_last_voting_member_is_never_removed_and_a_learner_that_never_started_is() -> None:
    seats = Seats(3, (_seat("a"), _seat("b")))
    members = [_member("a", 1), _member("b", 2, learner=True, started=False)]
    seen = {"a": 0.0, "b": 0.0}
    [remove] = decide_upkeep(seats, members, _seen(seen), NEVER_STARTED_S + 1)
    assert (remove.member_id, remove.node) == (2, "b")
    alone = Seats(3, (_seat("a"),))
    assert decide_upkeep(alone, [_member("a", 1)], _seen({"a": 0.0}), 1000.0) == [], "no quorum without it"
    stray = [_member("a", 1), EtcdMember(9, "", ("https://x:1",), (), True)]
    assert decide_upkeep(alone, stray, Sightings({"a": 1000.0}, {"a": 0.0}, {9: 1000.0}), 1000.0) == [], "a claim's"
    [remove] = decide_upkeep(alone, stray, Sightings({"a": 1000.0}, {"a": 0.0}, {9: 900.0}), 1000.0)
    assert (remove.member_id, remove.node) == (9, "")


def test_the_record_and_the_initial_cluster() -> None:
    seats = Seats(
        3, (_seat("a"), Seat("b", "[::1]:29400", "https://[::1]:1", "https://[::1]:2", 5.0, digest(b"p"))), KEYS
    )
    assert Seats.from_json(seats.to_json()) == seats
    assert seats.coordinators == ("a:29400", "[::1]:29400")
    members = [_member("a", 1), EtcdMember(2, "", ("https://b:29403",), (), True)]
    assert initial_cluster(members, "b", "https://b:29403") == "a=https://a:29403,b=https://b:29403"


def test_a_node_back_with_its_seats_proof_keeps_its_seat_under_its_new_node_id() -> None:
    proof = b"p" * 32
    seats = Seats(3, (_seat("a"), Seat("b", "b:29400", "https://b:29402", "https://b:29403", 0.0, digest(proof))))
    seats = seats.with_seat(_seat("c"))
    members = [_member("a", 1), _member("b", 2), _member("c", 3)]
    again = Seat("b-2", "b:29400", "https://b:29402", "https://b:29403")  # b's agent again, with a new node id
    granted = _claim(seats, members, again, key="", proof=proof)
    assert isinstance(granted, Grant) and granted.seat.node == "b-2" and granted.seat.etcd_peer == again.etcd_peer
    assert seats.back(granted.seat).coordinators == ("a:29400", "b:29400", "c:29400")
    assert [s.node for s in seats.back(granted.seat).seats] == ["a", "b-2", "c"]


def test_a_seat_takes_a_key_or_its_proof_never_an_address() -> None:
    """What the workers' join line admits (an agent of the job, no seat key) takes no seat: naming a held seat's etcd
    URLs proves nothing, a wrong or expired key is refused, and only the proof of a seat gets it back."""
    proof = b"p" * 32
    seats = Seats(3, (_seat("a"), Seat("b", "b:29400", "https://b:29402", "https://b:29403", 0.0, digest(proof))), KEYS)
    members = [_member("a", 1), _member("b", 2)]
    thief = Seat("x", "x:29400", "https://b:29402", "https://b:29403")  # b's URLs, named
    for key, proof_given, now in (("", b"", 1.0), ("", b"q" * 32, 1.0), ("w" * 43, b"", 1.0), (KEY, b"", 100.0)):
        refused = _claim(seats, members, thief, key=key, proof=proof_given, now=now)
        assert isinstance(refused, Deny), (key, proof_given, now, refused)
    assert "PLIANT_SEAT_KEY" in _claim(seats, members, thief, key="").reason
    assert "expired" in _claim(seats, members, thief, now=100.0).reason
    held = _claim(seats, members, _seat("b"), key="")  # b itself, without its proof
    assert isinstance(held, Deny), "a node id proves no seat: its certificate may be anyone's"
    assert isinstance(_claim(seats, members, _seat("b"), key="", proof=proof), Grant)
    assert _claim(seats, members, _seat("c")) == AddLearner(_seat("c")), "with the key, a new seat"


def test_seat_keys_expire_and_the_record_forgets_them() -> None:
    seats = Seats(3, (_seat("a"),), KEYS)
    assert seats.admits(KEY, 99.9) and not seats.admits(KEY, 100.0) and not seats.admits("x" * 43, 1.0)
    newer = seats.with_key(SeatKey(digest("n" * 43), 300.0), now=150.0)
    assert newer.keys == (SeatKey(digest("n" * 43), 300.0),), "the expired key is dropped"
    assert newer.proven(b"") is None and seats.proven(b"x") is None


def test_a_client_follows_the_coordinators_it_is_told_keeping_the_one_it_calls_first() -> None:
    from pliant.coordinator.client import CoordinatorClient

    with CoordinatorClient(["10.0.0.1:29400", "10.0.0.2:29400"]) as client:
        client._current = 1  # it calls 10.0.0.2 now
        client.use_targets(["10.0.0.3:29400", "10.0.0.2:29400"])
        assert client.targets == ["10.0.0.2:29400", "10.0.0.3:29400"] and client._current == 0
        client.use_targets([])  # nothing listed: the targets stay
        assert client.targets == ["10.0.0.2:29400", "10.0.0.3:29400"] and len(client._stubs) == 2


def test_a_leaving_seat_is_handed_to_the_node_it_names_that_stands_by_with_the_key() -> None:
    """One seat (a two-node job): b claims with the seat key while the seat is taken and stands by; the first node
    leaves and names b. b claims again with its key, joins as a learner in the room the hand-over makes, is promoted
    once it started, and then a replica other than a's removes a. The workers' join line never gets the seat."""
    full = Seats(1, (_seat("a"),), KEYS)
    one = [_member("a", 1)]
    assert isinstance(_claim(full, one, _seat("b")), StandBy)  # the key, and no room: b stands by
    assert full.standing_by("b").standby == ("b",) and full.standing_by("b").seated("b").standby == ()
    handing = Seats(1, (_seat("a"),), KEYS, Handover("a", "b", expires_at=50.0), standby=("b",))
    assert handing.handing_to("b", 1.0) is not None and handing.handing_to("c", 1.0) is None
    assert isinstance(_claim(handing, one, _seat("b"), key=""), Deny)  # named, but without the key: nothing
    assert isinstance(_claim(handing, one, _seat("c")), StandBy)  # another key holder, not named: no room for it
    assert isinstance(_claim(handing, one, _seat("b"), now=60.0), StandBy)  # the hand-over lapsed
    assert _claim(handing, one, _seat("b")) == AddLearner(_seat("b"))  # room for one more while it lasts
    taken = Seats(1, (_seat("a"), _seat("b")), KEYS, handing.handover)
    seen = _seen({"b": 0.0})
    learner = [*one, _member("b", 2, learner=True, started=False)]
    assert decide_upkeep(taken, learner, seen, 1.0, me="a", wall=1.0) == []  # not started yet
    started = [*one, _member("b", 2, learner=True)]
    (promote,) = decide_upkeep(taken, started, seen, 1.0, me="a", wall=1.0)
    assert isinstance(promote, Promote) and promote.member_id == 2
    voting = [*one, _member("b", 2)]
    assert decide_upkeep(taken, voting, seen, 1.0, me="a", wall=1.0) == []  # a's own replica never removes a
    (remove,) = decide_upkeep(taken, voting, seen, 1.0, me="b", wall=1.0)
    assert remove == Remove(1, "a", "a handed its seat to b")
    assert taken.without("a") == Seats(1, (_seat("b"),), KEYS)  # the seat and the hand-over go together
    assert Seats.from_json(handing.to_json()) == handing
