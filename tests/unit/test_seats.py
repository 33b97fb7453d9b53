"""An embedded control plane's seats: who takes one, in etcd's safe order, and the leader's upkeep (pure decisions,
on a fake clock)."""

from __future__ import annotations

import pytest

from pliant.coordinator.etcd_cluster import EtcdMember, initial_cluster
from pliant.coordinator.seats import (
    GONE_AFTER_S,
    NEVER_STARTED_S,
    AddLearner,
    Grant,
    Promote,
    Refuse,
    Remove,
    Seat,
    Seats,
    Sightings,
    decide_claim,
    decide_upkeep,
    wanted_seats,
)

pytestmark = pytest.mark.timeout(10)


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
    seats = Seats(3, (_seat("a"),))
    one = [_member("a", 1)]
    assert decide_claim(seats, one, _seat("b")) == AddLearner(_seat("b"))
    seats = seats.with_seat(_seat("b"))
    learning = [*one, _member("b", 2, learner=True, started=False)]
    assert decide_claim(seats, learning, _seat("b")) == Grant(_seat("b")), "asked again: the same seat"
    assert isinstance(decide_claim(seats, learning, _seat("c")), Refuse), "b's learner has not started"
    started = [*one, _member("b", 2, learner=True)]
    assert decide_upkeep(seats, started, _seen({"a": 0.0, "b": 0.0}), 1.0) == [], (
        "b stays a learner: two voters are fragile"
    )
    claim = decide_claim(seats, started, _seat("c"))
    assert isinstance(claim, Promote) and claim.member_id == 2, "a third node waits: b votes first"
    voters = [*one, _member("b", 2)]
    assert decide_claim(seats, voters, _seat("c")) == AddLearner(_seat("c"))
    seats = seats.with_seat(_seat("c"))
    three = [*voters, _member("c", 3, learner=True)]
    assert decide_upkeep(seats, three, _seen({"a": 0.0, "b": 0.0, "c": 0.0}), 1.0) == [
        Promote(3, "3 voting members then")
    ]
    full = decide_claim(seats, [*voters, _member("c", 3)], _seat("d"))
    assert isinstance(full, Refuse) and full.final and "3 seat(s) are taken" in full.reason


def test_a_gone_nodes_seat_is_given_up_and_taken_by_a_newcomer() -> None:
    seats = Seats(3, (_seat("a"), _seat("b"), _seat("c")))
    members = [_member("a", 1), _member("b", 2), _member("c", 3)]
    seen = {"a": 0.0, "b": 0.0, "c": 0.0}
    assert decide_upkeep(seats, members, _seen(seen), GONE_AFTER_S) == [], "not gone for long enough"
    seen = {"a": 0.0, "b": GONE_AFTER_S, "c": GONE_AFTER_S}
    [remove] = decide_upkeep(seats, members, _seen(seen), GONE_AFTER_S + 1)
    assert isinstance(remove, Remove) and (remove.member_id, remove.node) == (1, "a")
    seats, members = seats.without("a"), members[1:]
    assert decide_claim(seats, members, _seat("d")) == AddLearner(_seat("d"))
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
    seats = Seats(3, (_seat("a"), Seat("b", "[::1]:29400", "https://[::1]:1", "https://[::1]:2", since=5.0)))
    assert Seats.from_json(seats.to_json()) == seats
    assert seats.coordinators == ("a:29400", "[::1]:29400")
    members = [_member("a", 1), EtcdMember(2, "", ("https://b:29403",), (), True)]
    assert initial_cluster(members, "b", "https://b:29403") == "a=https://a:29403,b=https://b:29403"


def test_a_node_back_with_its_members_data_keeps_its_seat_under_its_new_node_id() -> None:
    seats = Seats(3, (_seat("a"), _seat("b"), _seat("c")))
    members = [_member("a", 1), _member("b", 2), _member("c", 3)]
    again = Seat("b-2", "b:29400", "https://b:29402", "https://b:29403")  # b's agent again, with a new node id
    granted = decide_claim(seats, members, again)
    assert granted == Grant(Seat("b-2", "b:29400", "https://b:29402", "https://b:29403"))
    assert seats.back(granted.seat).coordinators == ("a:29400", "b:29400", "c:29400")
    assert [s.node for s in seats.back(granted.seat).seats] == ["a", "b-2", "c"]


def test_a_client_follows_the_coordinators_it_is_told_keeping_the_one_it_calls_first() -> None:
    from pliant.coordinator.client import CoordinatorClient

    with CoordinatorClient(["10.0.0.1:29400", "10.0.0.2:29400"]) as client:
        client._current = 1  # it calls 10.0.0.2 now
        client.use_targets(["10.0.0.3:29400", "10.0.0.2:29400"])
        assert client.targets == ["10.0.0.2:29400", "10.0.0.3:29400"] and client._current == 0
        client.use_targets([])  # nothing listed: the targets stay
        assert client.targets == ["10.0.0.2:29400", "10.0.0.3:29400"] and len(client._stubs) == 2
