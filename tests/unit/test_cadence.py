"""The protocol's cadence (pliant.worker.inplace.cadence): when every rank votes and when it takes a buddy snapshot,
from the integers the vote all-reduces, so every rank computes the same steps."""

from __future__ import annotations

import itertools

import pytest

from pliant.rescale_vote import VOTE_WITHIN_S, votes_apart
from pliant.worker.inplace.cadence import (
    FIRST_SNAPSHOT_EVERY,
    MAX_SNAPSHOT_EVERY,
    MIN_SNAPSHOT_EVERY,
    SNAPSHOT_BUDGET,
    Cadence,
    snapshots_apart,
)

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("slowest_s", "apart"),
    [
        (0.0, 1),  # no step measured yet (a job's or a new world's first): vote again at once
        (2.0, 1),  # long steps: every step, so a rescale waits one step, not several
        (0.1, 1),
        (0.05, 2),
        (0.007, 14),  # the 7 ms DDP step of bench/engine.py: the vote's all-reduce is about 0.5 % of the time
        (0.0001, 32),  # bounded
    ],
)
def test_votes_come_about_every_tenth_of_a_second_or_every_step(slowest_s: float, apart: int) -> None:
    assert votes_apart(slowest_s) == apart
    assert votes_apart(slowest_s) * slowest_s <= max(VOTE_WITHIN_S, slowest_s)


@pytest.mark.parametrize(
    ("cost", "every"),
    [
        (None, FIRST_SNAPSHOT_EVERY),  # not measured yet: far enough apart for a clean base
        (0.0, MIN_SNAPSHOT_EVERY),  # free: as often as the base allows
        (0.03, MIN_SNAPSHOT_EVERY),
        (0.25, 17),  # 539 MB per ZeRO rank on 2 busy cores: 0.28 s over a 1.1 s step
        (0.24, 16),
        (50.0, MAX_SNAPSHOT_EVERY),  # bounded: at most this many steps run again after a death
    ],
)
def test_snapshots_are_as_frequent_as_the_budget_allows(cost: float | None, every: int) -> None:
    assert snapshots_apart(cost) == every
    if cost is not None and MIN_SNAPSHOT_EVERY < every < MAX_SNAPSHOT_EVERY:
        assert cost / every <= SNAPSHOT_BUDGET < cost / (every - 1)


class Clock:
    """A rank's monotonic and CPU clocks, moved by the steps the test runs."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0


def run(
    cadence: Cadence,
    steps: range,
    step_s: float,
    excess_s: float,
    cpu_excess_s: float | None = None,
    clock: Clock | None = None,
    held: dict[int, float] | None = None,
) -> list[int]:
    """Steps as the protocol runs them, with every step voting: a step takes ``step_s`` (half of it CPU time), and the
    one that takes a snapshot and the next one ``excess_s`` more between them (``cpu_excess_s`` more CPU time, by
    default as much); ``held``: step -> seconds more of both. Returns the committed steps at each snapshot."""
    clock = clock or Clock()
    cpu_excess_s = excess_s if cpu_excess_s is None else cpu_excess_s
    taken: list[int] = []
    for step in steps:
        cadence.tick(step, clock.wall, clock.cpu)
        if step >= cadence.next_vote:  # one rank: the all-reduce is its own ballot
            last_us, ppm = cadence.ballot()
            cadence.agreed(step, last_us, ppm)
        share = 0.0
        if cadence.last_snapshot is not None and step == cadence.last_snapshot:
            share += 0.5  # the step after a snapshot: the copy ran
        if cadence.snapshot_due(step + 1):
            cadence.took(step + 1)
            taken.append(step + 1)
            share += 0.5
        clock.wall += step_s + share * excess_s + (held or {}).get(step, 0.0)
        clock.cpu += step_s / 2 + share * cpu_excess_s + (held or {}).get(step, 0.0)
    return taken


def test_the_automatic_interval_follows_the_measured_cost() -> None:
    cadence = Cadence()
    taken = run(cadence, range(200), step_s=1.0, excess_s=0.25)
    assert cadence.cost == pytest.approx(0.25)
    assert cadence.every == 17
    assert taken[:5] == [1, 17, 33, 49, 66]  # the first step; FIRST_SNAPSHOT_EVERY until 3 are measured; then K
    assert {b - a for a, b in itertools.pairwise(taken[3:])} == {17}


def test_cheap_snapshots_stay_frequent_and_a_fixed_interval_stays_fixed() -> None:
    cheap = Cadence()
    run(cheap, range(100), step_s=1.0, excess_s=0.01)
    assert cheap.every == MIN_SNAPSHOT_EVERY
    fixed = Cadence(snapshot_every=8)
    taken = run(fixed, range(100), step_s=1.0, excess_s=0.9)
    assert fixed.every == 8 and fixed.ballot()[1] == 8  # asked for as is: ranks set differently still agree
    assert taken == list(range(1, 101, 8))


def test_one_held_up_step_is_not_a_trend_and_the_first_steps_are_not_measured() -> None:
    cadence, clock = Cadence(), Clock()
    clock.wall += 30.0  # a job's first steps are slow: warm-up, page faults
    run(cadence, range(3), step_s=3.0, excess_s=0.0, clock=clock)
    run(cadence, range(3, 100), step_s=1.0, excess_s=0.25, clock=clock)
    assert cadence.every == 17 and cadence.last_snapshot == 100
    # Another process holds up the step after the snapshot of step 100, once (on both clocks, so the min keeps it).
    run(cadence, range(100, 120), step_s=1.0, excess_s=0.25, clock=clock, held={100: 5.0})
    assert cadence.last_snapshot == 117
    assert cadence.every == 17 and cadence.cost == pytest.approx(0.25, rel=1e-3)


def test_the_smaller_of_the_wall_clock_and_the_cpu_cost_counts() -> None:
    idle_cores = Cadence()  # a GPU's host: the copies' CPU work does not slow the steps
    run(idle_cores, range(100), step_s=1.0, excess_s=0.0, cpu_excess_s=2.0)
    assert idle_cores.every == MIN_SNAPSHOT_EVERY
    noisy = Cadence()  # other processes share the cores: the wall clock swings, the CPU time does not
    clock = Clock()
    for start in range(0, 100, 10):
        run(noisy, range(start, start + 10), step_s=1.0, excess_s=0.0, cpu_excess_s=0.0, clock=clock)
        clock.wall += 0.8  # a step held up by a neighbour, wherever it falls
    assert noisy.every == MIN_SNAPSHOT_EVERY


def test_a_newcomer_agrees_with_the_survivors_at_its_first_vote() -> None:
    survivor, newcomer = Cadence(), Cadence()
    run(survivor, range(60), step_s=1.0, excess_s=0.25)
    for cadence in (survivor, newcomer):
        cadence.reformed(60)
        cadence.took(60, by_step=False)
    ballots = [survivor.ballot(), newcomer.ballot()]
    assert newcomer.ballot()[1] == 0  # it has measured nothing: no opinion
    agreed = [max(b[0] for b in ballots), max(b[1] for b in ballots)]
    for cadence in (survivor, newcomer):
        assert cadence.next_vote == 60
        cadence.agreed(60, *agreed)
    assert survivor.every == newcomer.every == 17
    assert [c.snapshot_due(s) for c in (survivor, newcomer) for s in (61, 76, 77)] == [False, False, True] * 2


def test_a_re_formation_snapshot_and_the_new_world_first_step_are_not_measured() -> None:
    cadence, clock = Cadence(), Clock()
    run(cadence, range(40), step_s=1.0, excess_s=0.25, clock=clock)
    cost = cadence.cost
    cadence.reformed(40)
    cadence.took(40, by_step=False)
    clock.wall += 30.0  # the re-formation
    cadence.tick(40, clock.wall, clock.cpu)
    clock.wall += 5.0  # the new world's first step: slow for its own reasons
    cadence.tick(41, clock.wall, clock.cpu)
    assert cadence.cost == cost
    run(cadence, range(41, 80), step_s=2.0, excess_s=0.5, clock=clock)  # a smaller world: longer steps, same cost
    assert cadence.cost == pytest.approx(0.25)


def test_a_cost_that_wavers_keeps_k_and_one_that_falls_far_lowers_it() -> None:
    cadence, clock = Cadence(), Clock()
    run(cadence, range(200), step_s=1.0, excess_s=0.25, clock=clock)
    assert cadence.every == 17
    run(cadence, range(200, 400), step_s=1.0, excess_s=0.22, clock=clock)  # needs 15: 17 is enough, and not far off
    assert cadence.every == 17
    run(cadence, range(400, 600), step_s=1.0, excess_s=0.1, clock=clock)  # needs 7
    assert cadence.every == 7


def test_ranks_set_differently_take_the_larger_interval() -> None:
    fixed, auto = Cadence(snapshot_every=32), Cadence()
    run(auto, range(100), step_s=1.0, excess_s=0.25)
    ballots = [fixed.ballot(), auto.ballot()]
    for cadence in (fixed, auto):
        cadence.agreed(100, max(b[0] for b in ballots), max(b[1] for b in ballots))
    assert fixed.every == auto.every == 32


def test_a_checkpoint_takes_a_snapshot_only_half_an_interval_after_the_last() -> None:
    cadence = Cadence(20)
    assert cadence.save_may_snapshot(5), "no snapshot yet in this world"
    cadence.took(100)
    assert not cadence.save_may_snapshot(109), "the cadence's own is 11 steps away: the save copies the state itself"
    assert cadence.save_may_snapshot(110)
    cadence.took(110, by_step=False)  # the save's snapshot stands in for the next: that one comes 20 steps later
    assert not cadence.snapshot_due(129) and cadence.snapshot_due(130)
