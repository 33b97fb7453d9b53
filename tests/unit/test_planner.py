"""Planner decisions, table-driven, with time passed in (no I/O, no clock)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pliant.coordinator.contract import (
    FailJob,
    FailureCause,
    FailureReport,
    Generation,
    InvalidArgument,
    JobSnapshot,
    JobSpec,
    JobState,
    JobStatus,
    Keep,
    Member,
    NewGeneration,
    WaitUntil,
)
from pliant.coordinator.planner import assign_ranks, grouped, plan

T0 = 1_000.0
SPEC = JobSpec(
    "job", min_nodes=2, max_nodes=4, nproc_per_node=2, join_grace_s=1.0, max_restarts=2, min_nodes_timeout_s=60.0
)


def member(node: str, order: int, joined_at: float = T0, slots: int = 0) -> Member:
    return Member(node, f"{node}.local:29500", slots, joined_at, order)


def generation(
    number: int,
    nodes: list[Member],
    reason: str = "start",
    restarts: int = 0,
    charged: tuple[tuple[str, int], ...] = (),
) -> Generation:
    return Generation("job", number, assign_ranks(SPEC, nodes), reason, restarts, T0, charged=charged)


@dataclass
class Case:
    name: str
    members: list[Member]
    now: float
    expect: type
    gen: Generation | None = None
    state: JobState = JobState.WAITING
    since: float = T0
    failures: list[FailureReport] = field(default_factory=list)
    departed: frozenset[str] = frozenset()
    spec: JobSpec = SPEC
    nodes: tuple[str, ...] | None = None  # expected node order of a NewGeneration
    reason: str | None = None
    restarts: int | None = None
    new_state: JobState | None = None
    deadline: float | None = None
    message: str | None = None  # substring of a FailJob reason
    charged: tuple[tuple[str, int], ...] | None = None  # expected failures charged per node in a NewGeneration


A, B, C, D, E = (member(n, i + 1, T0 + i * 0.4) for i, n in enumerate("abcde"))
RUNNING_AB = generation(1, [A, B])
RUNNING_ABC = generation(2, [A, B, C], "join")

CASES = [
    # -- first world and join batching ---------------------------------------------------------------------------------
    Case(
        "first world waits for the join grace",
        [A, B],
        now=T0 + 0.5,
        expect=WaitUntil,
        deadline=B.joined_at + 1.0,
        new_state=JobState.WAITING,
    ),
    Case(
        "first world after the grace",
        [A, B],
        now=B.joined_at + 1.0,
        expect=NewGeneration,
        nodes=("a", "b"),
        reason="start",
        new_state=JobState.RUNNING,
    ),
    Case(
        "joins arriving together are batched into one world",
        [A, B, C],
        now=C.joined_at + 0.99,
        expect=WaitUntil,
        deadline=C.joined_at + 1.0,
    ),
    Case(
        "reaching max nodes publishes at once",
        [A, B, C, D],
        now=D.joined_at,
        expect=NewGeneration,
        nodes=("a", "b", "c", "d"),
    ),
    Case(
        "nodes beyond max wait as spares",
        [A, B, C, D, E],
        now=E.joined_at,
        expect=NewGeneration,
        nodes=("a", "b", "c", "d"),
    ),
    Case(
        "scale-up of a running job waits for the grace",
        [A, B, C],
        gen=RUNNING_AB,
        state=JobState.RUNNING,
        now=C.joined_at + 0.5,
        expect=WaitUntil,
        deadline=C.joined_at + 1.0,
        new_state=JobState.RUNNING,
    ),
    Case(
        "scale-up appends joiners after the survivors",
        [A, B, C, D],
        gen=RUNNING_AB,
        state=JobState.RUNNING,
        now=D.joined_at + 1.0,
        expect=NewGeneration,
        nodes=("a", "b", "c", "d"),
        reason="join",
        restarts=0,
    ),
    Case(
        "a running job with its members is kept",
        [A, B],
        gen=RUNNING_AB,
        state=JobState.RUNNING,
        now=T0 + 100,
        expect=Keep,
    ),
    Case(
        "a spare does not disturb a full job",
        [A, B, C, D, E],
        gen=generation(3, [A, B, C, D]),
        state=JobState.RUNNING,
        now=T0 + 100,
        expect=Keep,
    ),
    # -- scale down and rank stability ---------------------------------------------------------------------------------
    Case(
        "a lost node publishes at once with the survivors",
        [A, C],
        gen=RUNNING_ABC,
        state=JobState.RUNNING,
        now=T0 + 10,
        expect=NewGeneration,
        nodes=("a", "c"),
        reason="failure",
        restarts=0,
    ),
    Case(
        "a graceful leave is reason leave",
        [A, C],
        gen=RUNNING_ABC,
        state=JobState.RUNNING,
        now=T0 + 10,
        departed=frozenset({"b"}),
        expect=NewGeneration,
        nodes=("a", "c"),
        reason="leave",
    ),
    Case(
        "rank 0's node keeps rank 0 and newcomers go last",
        [B, C, D],
        gen=generation(4, [C, B, A]),
        state=JobState.RUNNING,
        now=T0 + 10,
        expect=NewGeneration,
        nodes=("c", "b", "d"),
    ),
    Case(
        "a spare replaces a lost node",
        [A, B, C, E],
        gen=generation(3, [A, B, C, D]),
        state=JobState.RUNNING,
        now=T0 + 10,
        expect=NewGeneration,
        nodes=("a", "b", "c", "e"),
        reason="failure",
    ),
    Case(
        "a node whose agent restarted and rejoined before its eviction is lost, then rejoins last",
        [A, Member("b", "b.local:40001", 0, T0 + 9, 9), C],
        gen=RUNNING_ABC,
        state=JobState.RUNNING,
        now=T0 + 10,
        expect=NewGeneration,
        nodes=("a", "c", "b"),
        reason="failure",
        restarts=0,
    ),
    Case(
        "rank 0's node rejoined under a new address: the others take its place",
        [Member("a", "a.new:29500", 0, T0 + 9, 9), B],
        gen=RUNNING_AB,
        state=JobState.RUNNING,
        now=T0 + 10,
        expect=NewGeneration,
        nodes=("b", "a"),
        reason="failure",
    ),
    # -- min nodes -----------------------------------------------------------------------------------------------------
    Case(
        "below min while running stops every worker",
        [A],
        gen=RUNNING_AB,
        state=JobState.RUNNING,
        now=T0 + 10,
        expect=NewGeneration,
        nodes=(),
        reason="failure",
        new_state=JobState.WAITING,
    ),
    Case(
        "below min waits until the timeout",
        [A],
        gen=generation(2, []),
        since=T0 + 10,
        now=T0 + 30,
        expect=WaitUntil,
        deadline=T0 + 70,
        new_state=JobState.WAITING,
    ),
    Case(
        "below min past the timeout fails naming the nodes",
        [A],
        gen=generation(2, []),
        since=T0 + 10,
        now=T0 + 70,
        expect=FailJob,
        message="1 of the 2 nodes it needs (live: a)",
    ),
    Case(
        "a new job without nodes fails after the timeout", [], now=T0 + 60, expect=FailJob, message="0 of the 2 nodes"
    ),
    Case(
        "enough nodes again after waiting starts a world",
        [A, B],
        gen=generation(2, []),
        since=T0 + 10,
        now=T0 + 30,
        expect=NewGeneration,
        nodes=("a", "b"),
        reason="join",
        new_state=JobState.RUNNING,
    ),
    # -- restart budget ------------------------------------------------------------------------------------------------
    Case(
        "a worker failure restarts the world and is charged to its node",
        [A, B],
        gen=RUNNING_AB,
        state=JobState.RUNNING,
        now=T0 + 5,
        failures=[FailureReport("b", 1, 137)],
        expect=NewGeneration,
        nodes=("a", "b"),
        reason="restart",
        restarts=1,
        charged=(("b", 1),),
    ),
    Case(
        "waits after a peer failed are charged to the cause, not the waiters",
        [A, B, C],
        gen=generation(2, [A, B, C], "join"),
        state=JobState.RUNNING,
        now=T0 + 5,
        failures=[
            FailureReport("a", 2, 0, reported_at=T0, cause=FailureCause.WAITING),
            FailureReport("c", 2, 1, reported_at=T0),
        ],
        expect=NewGeneration,
        nodes=("a", "b", "c"),
        charged=(("c", 1),),
    ),
    Case(
        "a node past its own budget is excluded; the others train on",
        [A, B, C],
        gen=generation(5, [A, B, C], "restart", 2, (("b", 2),)),
        state=JobState.RUNNING,
        now=T0 + 5,
        failures=[FailureReport("b", 5, 1)],
        expect=NewGeneration,
        nodes=("a", "c"),
        reason="restart",
        restarts=3,
        charged=(("b", 3),),
    ),
    Case(
        "an excluded node waits as a spare for good",
        [A, B, C],
        gen=generation(6, [A, C], "restart", 3, (("b", 3),)),
        state=JobState.RUNNING,
        now=T0 + 500,
        expect=Keep,
    ),
    Case(
        "one member's repeated failures never spend the others' budget",
        [A, B],
        gen=generation(5, [A, B], "restart", 9, (("a", 1),)),
        state=JobState.RUNNING,
        now=T0 + 5,
        failures=[FailureReport("a", 5, 1)],
        expect=NewGeneration,
        nodes=("a", "b"),
        charged=(("a", 2),),
    ),
    Case(
        "fewer than min nodes left within their budget fails the job",
        [A, B],
        gen=generation(5, [A, B], "restart", 2, (("a", 2),)),
        state=JobState.RUNNING,
        now=T0 + 5,
        failures=[FailureReport("a", 5, 1)],
        expect=FailJob,
        message="spent its restart budget: a worker failed again on a, more than max_restarts=2 times",
    ),
    Case(
        "scaling events keep the restart count",
        [A, B, C],
        gen=generation(5, [A, B], "restart", 2),
        state=JobState.RUNNING,
        now=C.joined_at + 2,
        expect=NewGeneration,
        reason="join",
        restarts=2,
    ),
    Case(
        "a failure in a world that lost a node spends no restart",
        [A, C],
        gen=generation(5, [A, B, C], "join", 2),
        state=JobState.RUNNING,
        now=T0 + 5,
        failures=[FailureReport("a", 5, 1)],
        expect=NewGeneration,
        nodes=("a", "c"),
        reason="failure",
        restarts=2,
    ),
    Case(
        "a failure of an old generation is ignored",
        [A, B],
        gen=generation(2, [A, B]),
        state=JobState.RUNNING,
        now=T0 + 5,
        failures=[FailureReport("a", 1, 1)],
        expect=Keep,
    ),
    # -- terminal and slots --------------------------------------------------------------------------------------------
    Case("a finished job is left alone", [A, B], state=JobState.SUCCEEDED, now=T0 + 100, expect=Keep),
    Case("a failed job is left alone", [], state=JobState.FAILED, now=T0 + 1000, expect=Keep),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_plan(case: Case) -> None:
    snap = JobSnapshot(
        spec=case.spec,
        status=JobStatus(case.state, case.since),
        members=tuple(case.members),
        generation=case.gen,
        failures=tuple(case.failures),
        departed=case.departed,
    )
    decision = plan(snap, case.now)
    assert isinstance(decision, case.expect), decision
    if isinstance(decision, NewGeneration):
        gen = decision.generation
        assert gen.number == (case.gen.number + 1 if case.gen else 1)
        assert gen.created_at == case.now
        if case.nodes is not None:
            assert gen.node_ids == case.nodes
        if case.reason is not None:
            assert gen.reason == case.reason
        if case.restarts is not None:
            assert gen.restarts_used == case.restarts
        if case.charged is not None:
            assert gen.charged == case.charged
    if case.new_state is not None:
        assert decision.state is case.new_state  # type: ignore[union-attr]
    if case.deadline is not None:
        assert decision.deadline == pytest.approx(case.deadline)  # type: ignore[union-attr]
    if case.message is not None:
        assert case.message in decision.reason, decision.reason  # type: ignore[union-attr]


def test_ranks_follow_node_order_and_slots() -> None:
    nodes = [member("a", 1), member("b", 2, slots=3), member("c", 3)]
    ranks = assign_ranks(SPEC, nodes)
    assert [(m.node_rank, m.rank_offset, m.nproc) for m in ranks] == [(0, 0, 2), (1, 2, 3), (2, 5, 2)]
    gen = Generation("job", 1, ranks, "start")
    assert gen.world_size == 7
    assert gen.store_address == "a.local:29500"


def test_join_grace_zero_publishes_immediately() -> None:
    spec = JobSpec("job", min_nodes=1, max_nodes=8, join_grace_s=0.0)
    snap = JobSnapshot(spec=spec, status=JobStatus(JobState.WAITING, T0), members=(member("a", 1),))
    decision = plan(snap, T0)
    assert isinstance(decision, NewGeneration)
    assert decision.generation.node_ids == ("a",)


def test_rescale_sequence_never_reuses_a_number() -> None:
    """Replaying a run of events through the planner gives strictly increasing generation numbers."""
    spec = JobSpec("job", min_nodes=1, max_nodes=3, join_grace_s=0.5)
    gen: Generation | None = None
    state = JobStatus(JobState.WAITING, T0)
    numbers = []
    events = [[A], [A, B], [A, B, C], [A, C], [C], [C, D]]
    for step, members in enumerate(events):
        now = T0 + 10 * (step + 1)
        snap = JobSnapshot(spec=spec, status=state, members=tuple(members), generation=gen)
        decision = plan(snap, now)
        assert isinstance(decision, NewGeneration), (step, decision)
        gen, state = decision.generation, JobStatus(decision.state, now)
        numbers.append(gen.number)
        assert set(gen.node_ids) == {m.node_id for m in members}
    assert numbers == list(range(1, len(events) + 1))
    assert gen is not None and gen.node_ids == ("c", "d")


# -- a world's failure or a node's -------------------------------------------------------------------------------------

WIDE = JobSpec("job", min_nodes=1, max_nodes=2, nproc_per_node=2, join_grace_s=1.0, max_restarts=3)
ERROR = "ValueError: val_check_interval (50) must be less than or equal to the number of the training batches (40)"


def _snap(gen: Generation, members: list[Member], failures: list[FailureReport], spec: JobSpec = WIDE) -> JobSnapshot:
    return JobSnapshot(
        spec=spec,
        status=JobStatus(JobState.RUNNING, T0),
        members=tuple(members),
        generation=gen,
        failures=tuple(failures),
    )


def _exited(node: str, gen: int, error: str, at: float = T0 + 5) -> FailureReport:
    return FailureReport(node, gen, 1, f"local rank 0 exited with code 1: {error}", at, error=error)


def test_the_same_error_on_every_node_refuses_that_world_size_and_charges_nobody() -> None:
    world4 = Generation("job", 2, assign_ranks(WIDE, [A, B]), "join", 0, T0)
    snap = _snap(world4, [A, B], [_exited("a", 2, ERROR), _exited("b", 2, ERROR, T0 + 5.3)])
    decision = plan(snap, T0 + 5.4)
    assert isinstance(decision, NewGeneration), decision
    gen = decision.generation
    assert gen.node_ids == ("a",) and gen.world_size == 2  # the node that trains at world 2 keeps rank 0
    assert gen.refused == ((4, ERROR),)
    assert gen.charged == () and gen.excluded == ()
    assert gen.reason == "restart"
    # From then on the job never takes world 4 again: b waits, however long it stays
    later = _snap(gen, [A, B], [])
    assert isinstance(plan(later, T0 + 100), Keep)


def test_a_first_report_with_an_error_waits_for_the_other_nodes() -> None:
    world4 = Generation("job", 2, assign_ranks(WIDE, [A, B]), "join", 0, T0)
    decision = plan(_snap(world4, [A, B], [_exited("a", 2, ERROR)]), T0 + 5.5)
    assert isinstance(decision, WaitUntil) and decision.deadline == pytest.approx(T0 + 7.0)
    # nobody else reported in time: a's own failure, charged to a
    decision = plan(_snap(world4, [A, B], [_exited("a", 2, ERROR)]), T0 + 7.0)
    assert isinstance(decision, NewGeneration)
    assert decision.generation.charged == (("a", 1),) and decision.generation.refused == ()


PEER_GONE = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:4121"
THREE = JobSpec("job", min_nodes=1, max_nodes=3, nproc_per_node=2, join_grace_s=1.0, max_restarts=3)


def test_different_errors_or_a_signal_are_a_nodes_failure_at_once() -> None:
    world6 = Generation("job", 2, assign_ranks(THREE, [A, B, C]), "join", 0, T0)
    other = _exited("b", 2, "RuntimeError: CUDA error: out of memory")
    decision = plan(_snap(world6, [A, B, C], [_exited("a", 2, ERROR), other], THREE), T0 + 5.1)
    assert isinstance(decision, NewGeneration)
    assert decision.generation.charged == (("a", 1), ("b", 1)) and decision.generation.refused == ()
    killed = FailureReport("a", 2, -9, "local rank 0 exited with code -9", T0 + 5)
    decision = plan(_snap(world6, [A, B, C], [killed], THREE), T0 + 5.1)
    assert isinstance(decision, NewGeneration) and decision.generation.charged == (("a", 1),)


@pytest.mark.parametrize(
    "cause",
    [
        _exited("a", 2, ERROR),  # the script's exception on a
        FailureReport("a", 2, -9, "local rank 0 exited with code -9", T0 + 5),  # a worker of a killed
    ],
    ids=["exception", "kill"],
)
def test_the_peers_whose_collectives_a_nodes_failure_broke_are_not_charged(cause: FailureReport) -> None:
    """b's and c's workers die of the collective a's failure broke: a alone is charged, in either order."""
    world6 = Generation("job", 2, assign_ranks(THREE, [A, B, C]), "join", 0, T0)
    peers = [_exited("b", 2, PEER_GONE, T0 + 4.9), _exited("c", 2, PEER_GONE.replace("4121", "4122"), T0 + 4.95)]
    first = plan(_snap(world6, [A, B, C], peers, THREE), T0 + 5.0)
    assert isinstance(first, WaitUntil) and first.deadline == pytest.approx(T0 + 6.9), first  # the cause, not yet
    decision = plan(_snap(world6, [A, B, C], [*peers, cause], THREE), T0 + 5.1)
    assert isinstance(decision, NewGeneration), decision
    assert decision.generation.charged == (("a", 1),) and decision.generation.refused == ()
    assert decision.generation.node_ids == ("a", "b", "c")


def test_a_peers_going_away_on_every_node_is_no_world_error_and_charges_them_once_its_cause_never_comes() -> None:
    """The same peer error from every node says nothing of the world size: no size is refused; with no report of
    the cause within the grace, the nodes that reported are charged, as before."""
    world4 = Generation("job", 2, assign_ranks(WIDE, [A, B]), "join", 0, T0)
    reports = [_exited("a", 2, PEER_GONE), _exited("b", 2, PEER_GONE, T0 + 5.2)]
    waiting = plan(_snap(world4, [A, B], reports), T0 + 5.3)
    assert isinstance(waiting, WaitUntil) and waiting.deadline == pytest.approx(T0 + 7.0), waiting
    decision = plan(_snap(world4, [A, B], reports), T0 + 7.0)
    assert isinstance(decision, NewGeneration), decision
    assert decision.generation.refused == () and decision.generation.world_size == 4
    assert decision.generation.charged == (("a", 1), ("b", 1))


def test_pliants_own_in_place_failure_on_every_node_refuses_no_world_size() -> None:
    """A re-formation in place that failed (the restart path follows) says nothing of the world size."""
    world4 = Generation("job", 2, assign_ranks(WIDE, [A, B]), "join", 0, T0)
    moved = "RescaleError: re-forming generation 1 -> 2 in place failed: HSDPMoveError: no rank holds shard 1"
    decision = plan(_snap(world4, [A, B], [_exited("a", 2, moved)]), T0 + 5.1)
    assert isinstance(decision, NewGeneration), decision  # no wait for the other node's report
    decision = plan(_snap(world4, [A, B], [_exited("a", 2, moved), _exited("b", 2, moved, T0 + 5.3)]), T0 + 5.4)
    assert isinstance(decision, NewGeneration)
    assert decision.generation.refused == () and decision.generation.world_size == 4


def test_a_one_node_worlds_failure_is_the_nodes() -> None:
    world2 = Generation("job", 1, assign_ranks(WIDE, [A]), "start", 0, T0)
    decision = plan(_snap(world2, [A], [_exited("a", 1, ERROR)]), T0 + 5.1)
    assert isinstance(decision, NewGeneration)
    assert decision.generation.charged == (("a", 1),) and decision.generation.refused == ()


def test_a_job_whose_every_size_fails_fails_with_the_error() -> None:
    spec = JobSpec("job", min_nodes=2, max_nodes=2, nproc_per_node=2, max_restarts=3)
    world4 = Generation("job", 1, assign_ranks(spec, [A, B]), "start", 0, T0)
    snap = _snap(world4, [A, B], [_exited("a", 1, ERROR), _exited("b", 1, ERROR)], spec)
    decision = plan(snap, T0 + 6)
    assert isinstance(decision, FailJob)
    assert "world 4 fails on every node with ValueError: val_check_interval" in decision.reason


def test_a_node_over_its_budget_is_excluded_with_its_error() -> None:
    charged = (("b", 3),)
    world4 = Generation("job", 5, assign_ranks(WIDE, [A, B]), "restart", 3, T0, charged=charged)
    error = "RuntimeError: CUDA error: an illegal memory access was encountered"
    decision = plan(_snap(world4, [A, B], [_exited("b", 5, error)]), T0 + 8)
    assert isinstance(decision, NewGeneration)
    gen = decision.generation
    assert gen.node_ids == ("a",)
    assert gen.excluded == (("b", 4, error),)
    # the exclusion stays named in the generations after it
    after = plan(_snap(gen, [A, B], []), T0 + 20)
    assert isinstance(after, Keep)


def test_a_leave_into_a_refused_size_trains_at_the_next_size_down() -> None:
    spec = JobSpec("job", min_nodes=1, max_nodes=3, nproc_per_node=2)
    world6 = Generation("job", 4, assign_ranks(spec, [A, B, C]), "join", 0, T0, refused=((4, ERROR),))
    decision = plan(JobSnapshot(spec, JobStatus(JobState.RUNNING, T0), (A, C), world6, departed=frozenset("b")), T0)
    assert isinstance(decision, NewGeneration)
    assert decision.generation.node_ids == ("a",) and decision.generation.refused == ((4, ERROR),)


# -- node groups (an hsdp replica cut over several nodes) --------------------------------------------------------------

PAIRS = JobSpec("job", min_nodes=2, max_nodes=6, nproc_per_node=1, join_grace_s=1.0, node_group=2)


def _members(*names: str) -> list[Member]:
    return [member(name, order, T0) for order, name in enumerate(names)]


def test_a_world_holds_whole_groups_and_a_lone_node_waits() -> None:
    a, b, c = _members("a", "b", "c")
    snap = JobSnapshot(spec=PAIRS, status=JobStatus(JobState.WAITING, T0), members=(a, b, c))
    decision = plan(snap, T0 + 2)
    assert isinstance(decision, NewGeneration) and decision.generation.node_ids == ("a", "b"), decision


def test_a_group_that_lost_a_node_waits_and_a_newcomer_completes_it() -> None:
    """Groups (a, b), (c, d): b dies, so a waits and (c, d) trains alone, keeping its order; e joins and completes a
    group with a, after the whole ones."""
    a, b, c, d = _members("a", "b", "c", "d")
    world = Generation("job", 1, assign_ranks(PAIRS, [a, b, c, d]), "start", 0, T0)
    lost = plan(
        JobSnapshot(spec=PAIRS, status=JobStatus(JobState.RUNNING, T0), members=(a, c, d), generation=world), T0
    )
    assert isinstance(lost, NewGeneration) and lost.generation.node_ids == ("c", "d"), lost
    assert lost.generation.reason == "failure"
    gen = lost.generation
    waiting = JobSnapshot(spec=PAIRS, status=JobStatus(JobState.RUNNING, T0), members=(a, c, d), generation=gen)
    assert isinstance(plan(waiting, T0 + 10), Keep), "a alone makes no group: it waits"
    e = member("e", 5, T0 + 10)
    joined = plan(
        JobSnapshot(spec=PAIRS, status=JobStatus(JobState.RUNNING, T0), members=(a, c, d, e), generation=gen),
        T0 + 12,
    )
    assert isinstance(joined, NewGeneration) and joined.generation.node_ids == ("c", "d", "a", "e"), joined


def test_grouped_keeps_the_whole_groups_first_and_drops_a_short_one() -> None:
    a, b, c, d, e = _members("a", "b", "c", "d", "e")
    assert [m.node_id for m in grouped([a, c, d, e], ("a", "b", "c", "d"), 2)] == ["c", "d", "a", "e"]
    assert [m.node_id for m in grouped([a, b, c], ("a", "b", "c", "d"), 2)] == ["a", "b"]
    assert [m.node_id for m in grouped([b, a, c], (), 1)] == ["b", "a", "c"]


def test_a_node_range_that_is_not_whole_groups_is_refused_with_the_fix() -> None:
    with pytest.raises(InvalidArgument, match=r"--nnodes 1:4 must be multiples of --node-group 2"):
        JobSpec("job", min_nodes=1, max_nodes=4, node_group=2)
    with pytest.raises(InvalidArgument, match=r"node_group=0 must be an integer >= 1"):
        JobSpec("job", node_group=0)
