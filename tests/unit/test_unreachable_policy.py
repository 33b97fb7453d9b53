"""Who a failure report naming unreachable peers evicts, how long an evicted node is held back when it comes back,
and how long reports of merely waiting workers wait for the failure's cause (coordinator.policy and the planner;
pure, time passed in). The same rules on a real etcd and coordinator:
tests/contract/test_errors_and_lifecycle.py; a real cut between two nodes: tests/integration/test_partitions.py."""

from __future__ import annotations

import dataclasses

import pytest

from pliant.coordinator.contract import (
    FailureCause,
    FailureReport,
    Generation,
    GenerationMember,
    InvalidArgument,
    JobSnapshot,
    JobSpec,
    JobState,
    JobStatus,
    Keep,
    Member,
    NewGeneration,
    PermissionDenied,
    Strike,
    WaitUntil,
)
from pliant.coordinator.planner import plan
from pliant.coordinator.policy import (
    BACKOFF_BASE_S,
    BACKOFF_MAX_S,
    REPORT_GRACE_S,
    SILENCE_POLL_S,
    LeaderClock,
    backoff_s,
    check_report,
    corroboration_s,
    evictions,
    held_back,
    judge_report,
    next_strike,
    reported_evictions,
    side,
    silent_members,
    struck,
)

T0 = 1_000.0
SPEC = JobSpec("job", min_nodes=1, max_nodes=3, nproc_per_node=1, join_grace_s=0.0)
TTL = SPEC.heartbeat_ttl_s


def gen(number: int, since: dict[str, int]) -> Generation:
    members = tuple(GenerationMember(n, i, i, 1, f"{n}:1", s) for i, (n, s) in enumerate(since.items()))
    return Generation("job", number, members, "join")


def test_a_report_evicts_the_live_members_it_names_when_they_are_not_the_larger_side() -> None:
    g3 = gen(3, {"a": 1, "b": 1, "c": 1, "d": 1})
    assert evictions(g3, "a", ["b", "c", "a", "b"], ["a", "b", "c", "d"]) == ("b", "c")  # a, d against b, c: a tie
    assert evictions(g3, "a", ["b"], ["a", "b", "c", "d"]) == ("b",)
    assert evictions(g3, "a", ["b", "c", "d"], ["a", "b", "c", "d"]) == ()  # a cut off from all: the smaller side
    assert evictions(g3, "b", ["a"], ["a", "b", "c", "d"]) == ("a",)  # the others name a: a is evicted
    assert evictions(gen(3, {"a": 1, "b": 1}), "a", ["b"], ["a"]) == ()  # b already gone: nothing more to do
    assert evictions(gen(4, {"a": 1, "b": 4}), "b", ["a"], ["a", "b"]) == ("a",)  # a newcomer's word counts too ...
    assert evictions(gen(4, {"c": 1, "a": 1, "b": 4}), "b", ["a"], ["a", "b", "c"]) == ()  # ... unless c may say it
    assert evictions(gen(4, {"c": 1, "a": 1, "b": 4}), "a", ["b"], ["a", "b", "c"]) == ("b",)
    assert evictions(gen(4, {"a": 1, "b": 4, "c": 4}), "b", ["a"], ["a", "b", "c"]) == ("a",)  # b, c: two processes
    assert evictions(gen(4, {"a": 1, "b": 4, "c": 4}), "a", ["b", "c"], ["a", "b", "c"]) == ()  # the smaller side


def test_a_side_counts_processes_and_those_of_older_members() -> None:
    g = Generation(
        "job",
        5,
        (
            GenerationMember("a", 0, 0, 2, "a:1", 3),
            GenerationMember("b", 1, 2, 1, "b:1", 4),
            GenerationMember("c", 2, 3, 4, "c:1", 5),
        ),
        "join",
    )
    assert side(g, ["a"]) == (2, 2) and side(g, ["b", "c"]) == (1, 5) and side(g, ["c", "x"]) == (0, 4)
    assert evictions(g, "c", ["a"], ["a", "b", "c"]) == ()  # c is new; b, on its side, would say so itself
    assert evictions(g, "b", ["a"], ["a", "b", "c"]) == ("a",)  # 5 processes against 2
    # Once generation 5 trained a step (c's workers say so), c is no newcomer: its word counts like b's.
    assert side(g, ["b", "c"], arrived=True) == (5, 5)
    assert evictions(g, "c", ["a"], ["a", "b", "c"], arrived=True) == ("a",)


def test_a_report_from_the_smaller_side_evicts_later_unless_the_named_report() -> None:
    """a, cut off from b and c, names both: nothing at once. If b and c are dead they never report and fall silent,
    and they are evicted REPORT_GRACE_S after a's report; if either reports, it is alive, and its own report decides."""
    g, live, dead = gen(3, {"a": 1, "b": 1, "c": 1}), ["a", "b", "c"], {"b", "c"}

    def deferred(reports: list[FailureReport], live: list[str], now: float, silent: set[str] = dead) -> object:
        reported = reported_evictions(g, reports, live, silent, TTL, now)
        return reported.nodes, reported.pending

    lone = FailureReport("a", 3, 0, reported_at=T0, unreachable=("b", "c"), cause=FailureCause.WAITING)
    assert deferred([lone], live, T0 + 1) == ((), T0 + REPORT_GRACE_S)
    assert deferred([lone], live, T0 + REPORT_GRACE_S) == (("b", "c"), None)
    answer = FailureReport("b", 3, 0, reported_at=T0 + 0.1, unreachable=("a",), cause=FailureCause.WAITING)
    assert deferred([lone, answer], live, T0 + 9) == (("a",), None)  # b's own report decides: a goes (2 against 1)
    assert deferred([lone], ["b", "c"], T0 + 9) == ((), None)  # a itself was evicted meanwhile
    assert deferred([lone], ["a", "c"], T0 + 9) == (("c",), None)  # b went with its lease
    stale = reported_evictions(gen(4, {"a": 1, "b": 1, "c": 1}), [lone], live, dead, TTL, T0 + 9)
    assert (stale.nodes, stale.pending) == ((), None)
    snap = dataclasses.replace(
        _snap([Member("a", "a:1"), Member("b", "b:1"), Member("c", "c:1")], g, []),
        failures=(lone,),
        silent=frozenset(dead),
    )
    waiting = plan(snap, T0 + 1)  # the planner waits for it, and restarts nothing meanwhile
    assert isinstance(waiting, WaitUntil) and waiting.deadline == T0 + REPORT_GRACE_S, waiting
    assert "smaller side of a cut" in waiting.why and "b, c named unreachable" in waiting.why


def test_one_members_word_alone_evicts_no_healthy_peer() -> None:
    """a names b, an established member that still heartbeats and names nobody: b stays. a's report waits for b to
    fall silent (a dead b would have) and is then a failure like any other, charged to a."""
    g = gen(6, {"a": 1, "b": 2})
    lie = FailureReport("a", 6, 1, "gloo: connection reset", reported_at=T0, unreachable=("b",))
    assert evictions(g, "a", ["b"], ["a", "b"]) == ("b",)  # the sides alone would allow it ...
    now = reported_evictions(g, [lie], ["a", "b"], (), TTL)  # ... as the report is recorded: nothing
    assert (now.nodes, now.doubted) == ((), ("b",))
    soon = reported_evictions(g, [lie], ["a", "b"], (), TTL, T0 + 1)
    assert soon.nodes == () and soon.pending == T0 + 1 + SILENCE_POLL_S  # the leader looks at b's lease again
    assert reported_evictions(g, [lie], ["a", "b"], {"b"}, TTL, T0 + 2).nodes == ("b",)  # b fell silent: it died
    late = reported_evictions(g, [lie], ["a", "b"], (), TTL, T0 + corroboration_s(TTL))
    assert (late.nodes, late.pending, late.doubted) == ((), None, ())
    a, b = Member("a", "a:1", order=1), Member("b", "b:1", order=2)
    snap = dataclasses.replace(_snap([a, b], g, []), failures=(lie,))
    waiting = plan(snap, T0 + 1)
    assert isinstance(waiting, WaitUntil) and "b not silent yet" in waiting.why
    restart = plan(snap, T0 + corroboration_s(TTL))
    assert isinstance(restart, NewGeneration) and restart.generation.node_ids == ("a", "b")
    assert restart.generation.reason == "restart" and dict(restart.generation.charged) == {"a": 1}


def test_the_other_side_or_another_member_corroborates_and_the_first_report_decides() -> None:
    """Both sides of a cut report each other: the second report corroborates the first, and the first evicts the
    other side (equal sides). A second member naming the same node corroborates too; a newcomer that never arrived,
    named by an older member, needs nobody's word but that member's."""
    g = gen(6, {"a": 1, "b": 2})
    first = FailureReport("b", 6, 1, reported_at=T0, unreachable=("a",))
    second = FailureReport("a", 6, 1, reported_at=T0 + 0.3, unreachable=("b",))
    assert reported_evictions(g, [first], ["a", "b"], (), TTL).nodes == ()
    both = reported_evictions(g, [first, second], ["a", "b"], (), TTL)
    assert both.nodes == ("a",) and [r.node_id for r, _nodes in both.evicted] == ["b"]
    three = gen(6, {"a": 1, "b": 2, "c": 3})
    named = [FailureReport("a", 6, 1, unreachable=("c",)), FailureReport("b", 6, 1, unreachable=("c",))]
    assert reported_evictions(three, named[:1], ["a", "b", "c"], (), TTL).nodes == ()
    assert reported_evictions(three, named, ["a", "b", "c"], (), TTL).nodes == ("c",)
    readmitted = gen(7, {"a": 1, "b": 7})
    never = FailureReport("a", 7, 0, "b never arrived", unreachable=("b",), cause=FailureCause.NOT_ARRIVED)
    assert reported_evictions(readmitted, [never], ["a", "b"], (), TTL).nodes == ("b",)
    arrived = dataclasses.replace(never, arrived=True)  # b trained in the world: an established member now
    assert reported_evictions(readmitted, [arrived], ["a", "b"], (), TTL).nodes == ()
    assert silent_members({"a": 1.0, "b": 3.0, "c": -1.0}, TTL) == {"b"}  # two heartbeats missed (TTL 5)


def test_only_a_failed_readmission_earns_a_strike() -> None:
    """b was admitted by generation 4; a and c have trained since earlier ones. An older member naming b: a strike.
    b naming an older member (which may have died), an eviction among established members (a partition, a death),
    or in a generation where all are new: none."""
    g = gen(4, {"a": 1, "c": 2, "b": 4})
    assert struck(g, "a", ["b"]) == ("b",)
    assert struck(g, "c", ["b", "a"]) == ("b",)
    assert struck(g, "b", ["a"]) == ()
    assert struck(gen(4, {"a": 1, "b": 2}), "a", ["b"]) == ()
    assert struck(gen(4, {"a": 4, "b": 4}), "a", ["b"]) == ()
    assert struck(g, "a", ["b"], arrived=True) == ()  # generation 4 trained a step: b arrived, a cut dropped it


def test_recording_a_report_evicts_and_strikes_as_the_policy_judges() -> None:
    """What the store writes with a report is the policy's: b (admitted by generation 4, never arrived) named by a,
    an older member, is evicted at once on a's word, which must still be a member's, and earns a strike."""
    g = gen(4, {"a": 1, "c": 2, "b": 4})
    report = FailureReport("a", 4, 1, reported_at=T0, unreachable=("b",))
    judged = judge_report(g, [report], ["a", "b", "c"], (), TTL)
    assert judged.evicted == ("b",) and judged.reporters == ("a",) and judged.struck == ("b",)
    assert judge_report(g, [report], ["b", "c"], (), TTL).evicted == (), "a's word is gone with a"
    check_report("job", g, report)
    with pytest.raises(PermissionDenied, match="not a member"):
        check_report("job", g, dataclasses.replace(report, node_id="z"))
    with pytest.raises(InvalidArgument, match="'y'"):
        check_report("job", g, dataclasses.replace(report, unreachable=("b", "y")))


def test_strikes_count_on_at_one_address_and_start_again_at_another() -> None:
    assert next_strike(0, "b:1", 0, "b:1") == (1, 0)
    assert next_strike(2, "b:1", 1, "b:1") == (3, 1)
    assert next_strike(2, "b:1", 1, "b:2") == (1, 0)


def test_the_backoff_starts_at_the_first_strike_and_doubles_to_a_cap() -> None:
    assert [backoff_s(n) for n in (0, 1, 2, 3)] == [0.0, BACKOFF_BASE_S, 2 * BACKOFF_BASE_S, 4 * BACKOFF_BASE_S]
    assert backoff_s(40) == BACKOFF_MAX_S


def test_a_strike_holds_back_only_the_address_it_was_given_at() -> None:
    assert not held_back([Strike("b", "b:1", 3, T0, lifted=True)], [Member("b", "b:1")], T0 + 1)  # it reaches all
    strikes = [Strike("b", "b:1", 3, T0)]
    assert held_back(strikes, [Member("b", "b:1")], T0 + 1) == {"b": T0 + backoff_s(3)}
    assert held_back(strikes, [Member("b", "b:2")], T0 + 1) == {}  # restarted or replaced: starts clean
    assert held_back(strikes, [Member("b", "b:1")], T0 + backoff_s(3)) == {}  # served


def test_a_spare_that_cannot_reach_every_member_is_held_until_it_does_within_a_bound() -> None:
    """While b's agent cannot reach every member (``missed``), its hold lasts past its backoff: a readmission would
    fail again. Up to BACKOFF_MAX_S after the strike, a try a few minutes, as the longest backoff gives."""
    missed = [Strike("b", "b:1", 1, T0, missed=True)]
    assert held_back(missed, [Member("b", "b:1")], T0 + backoff_s(1) + 1) == {"b": T0 + BACKOFF_MAX_S}
    assert held_back(missed, [Member("b", "b:1")], T0 + BACKOFF_MAX_S) == {}
    assert held_back(missed, [Member("b", "b:2")], T0 + 1) == {}  # another address: starts clean
    assert not held_back([Strike("b", "b:1", 1, T0, lifted=True, missed=True)], [Member("b", "b:1")], T0 + 1)


def _snap(members: list[Member], generation: Generation, strikes: list[Strike]) -> JobSnapshot:
    return JobSnapshot(SPEC, JobStatus(JobState.RUNNING, T0), tuple(members), generation, strikes=tuple(strikes))


def test_the_planner_holds_a_struck_node_back_then_admits_it() -> None:
    a, b = Member("a", "a:1", order=1), Member("b", "b:1", order=2, joined_at=T0)
    snap = _snap([a, b], gen(5, {"a": 1}), [Strike("b", "b:1", 1, T0)])
    held = plan(snap, T0 + 1)
    assert isinstance(held, WaitUntil) and held.deadline == T0 + BACKOFF_BASE_S and "holding back b" in held.why
    assert held.state is JobState.RUNNING
    admitted = plan(snap, T0 + BACKOFF_BASE_S)
    assert isinstance(admitted, NewGeneration) and admitted.generation.node_ids == ("a", "b")
    assert [m.since for m in admitted.generation.members] == [1, 6]  # a keeps its since; b is new in 6
    missed = dataclasses.replace(snap, strikes=(Strike("b", "b:1", 1, T0, missed=True),))
    cut = plan(missed, T0 + BACKOFF_BASE_S)  # b's agent cannot reach a's: a try would fail again
    assert isinstance(cut, WaitUntil) and cut.deadline == T0 + BACKOFF_MAX_S and "holding back b" in cut.why
    moved = plan(_snap([a, dataclasses.replace(b, address="b:2")], gen(5, {"a": 1}), list(snap.strikes)), T0 + 1)
    assert isinstance(moved, NewGeneration)  # back at another address: not held


def test_a_job_below_min_nodes_waits_for_the_hold_to_end_within_its_timeout() -> None:
    spec = dataclasses.replace(SPEC, min_nodes=2, min_nodes_timeout_s=60.0)
    a, b = Member("a", "a:1", order=1), Member("b", "b:1", order=2)
    waiting = JobSnapshot(
        spec,
        JobStatus(JobState.WAITING, T0),
        (a, b),
        Generation("job", 6, (), "failure"),
        strikes=(Strike("b", "b:1", 3, T0),),
    )
    decision = plan(waiting, T0 + 2)
    assert isinstance(decision, WaitUntil) and decision.deadline == T0 + backoff_s(3) < T0 + 60
    assert decision.state is JobState.WAITING
    started = plan(waiting, T0 + backoff_s(3))
    assert isinstance(started, NewGeneration) and started.generation.node_ids == ("a", "b")


def test_with_nobody_held_a_running_world_is_kept() -> None:
    a = Member("a", "a:1", order=1)
    assert isinstance(plan(_snap([a], gen(5, {"a": 1}), [Strike("a", "a:1", 3, T0)]), T0), Keep)


def test_the_leader_times_a_strike_from_when_it_first_saw_it() -> None:
    clock = LeaderClock()
    snap = _snap([], gen(1, {}), [Strike("b", "b:1", 2, seen_at=12345.0)])
    assert clock.view(snap, 50.0).strikes[0].seen_at == 50.0
    assert clock.view(snap, 70.0).strikes[0].seen_at == 50.0
    probed = dataclasses.replace(snap, strikes=(Strike("b", "b:1", 2, missed=True),))  # a probe's rewrite
    assert clock.view(probed, 75.0).strikes[0].seen_at == 50.0  # does not start the hold again
    again = dataclasses.replace(snap, strikes=(Strike("b", "b:1", 3),))  # a newer strike: a new record
    assert clock.view(again, 80.0).strikes[0].seen_at == 80.0
    moved = dataclasses.replace(snap, strikes=(Strike("b", "b:2", 1),))  # another address: counted from one
    assert clock.view(moved, 90.0).strikes[0].seen_at == 90.0


def test_reports_of_waiting_workers_give_the_failures_cause_a_moment() -> None:
    """A node whose workers only wait after a peer failed (a cut between two others, which it reaches) does not
    restart the world at once: the report naming the unreachable peer, or the failed worker's own, comes first."""
    a, b, c = (Member(n, f"{n}:1", order=i) for i, n in enumerate("abc"))
    world = gen(5, {"a": 1, "b": 1, "c": 1})
    waiting = FailureReport("c", 5, 0, "a peer failed", reported_at=T0, cause=FailureCause.WAITING)
    snap = dataclasses.replace(_snap([a, b, c], world, []), failures=(waiting,))
    held = plan(snap, T0 + 0.5)
    assert isinstance(held, WaitUntil) and held.deadline == T0 + REPORT_GRACE_S and "waiting for the cause" in held.why
    late = plan(snap, T0 + REPORT_GRACE_S)  # nothing more specific came: a restart, as before
    assert isinstance(late, NewGeneration) and late.generation.reason == "restart"
    died = FailureReport("b", 5, -9, "worker killed", reported_at=T0 + 0.2)
    now = plan(dataclasses.replace(snap, failures=(waiting, died)), T0 + 0.3)
    assert isinstance(now, NewGeneration) and now.generation.reason == "restart"
    cut = plan(dataclasses.replace(snap, members=(a, c)), T0 + 0.3)  # a's report evicted b: its loss, at once
    assert isinstance(cut, NewGeneration) and cut.generation.node_ids == ("a", "c")
    assert (cut.generation.reason, cut.generation.restarts_used) == ("failure", 0)


def test_the_leader_times_a_nodes_failure_reports_from_its_first() -> None:
    clock = LeaderClock()
    snap = dataclasses.replace(
        _snap([], gen(5, {}), []), failures=(FailureReport("c", 5, 0, cause=FailureCause.WAITING),)
    )
    assert clock.view(snap, 10.0).failures[0].reported_at == 10.0
    again = dataclasses.replace(snap, failures=(FailureReport("c", 5, -9, reported_at=99.0),))  # its second report
    assert clock.view(again, 11.0).failures[0].reported_at == 10.0
