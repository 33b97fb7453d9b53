"""The pure step planner: a fixed global batch dealt as micro-batches to any world size."""

from __future__ import annotations

import pytest

from pliant.worker.contract import DataError
from pliant.worker.plan import plan_step


def test_a_full_step_dealt_round_robin() -> None:
    plan = plan_step(0, 0, 37, 10, 4, 4, drop_last=False)
    assert plan is not None
    assert (plan.size, plan.micro_sizes) == (10, (4, 4, 2))
    assert plan.counts() == (1, 1, 1, 0)
    assert plan.some_rank_idle and plan.uneven
    assert plan.rank_slices(0) == [(0, 4)] and plan.rank_slices(2) == [(8, 2)] and plan.rank_slices(3) == []


def test_the_epoch_tail_is_smaller() -> None:
    plan = plan_step(1, 30, 37, 10, 2, 3, drop_last=False)
    assert plan is not None
    assert (plan.epoch, plan.start, plan.size, plan.micro_sizes) == (1, 30, 7, (2, 2, 2, 1))
    assert plan.counts() == (2, 1, 1)
    assert plan_step(1, 30, 37, 10, 2, 3, drop_last=True) is None
    assert plan_step(1, 37, 37, 10, 2, 3, drop_last=False) is None


def test_even_worlds_need_no_join() -> None:
    plan = plan_step(0, 0, 100, 8, 2, 4, drop_last=False)
    assert plan is not None and plan.counts() == (1, 1, 1, 1)
    assert not plan.uneven and not plan.some_rank_idle


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 7])
def test_every_sample_of_the_step_is_dealt_once(world: int) -> None:
    plan = plan_step(0, 5, 37, 10, 3, world, drop_last=False)
    assert plan is not None
    positions = [p for r in range(world) for pos, size in plan.rank_slices(r) for p in range(pos, pos + size)]
    assert sorted(positions) == list(range(5, 15))


@pytest.mark.parametrize(
    ("args", "needle"),
    [((0, 0, 10, 0, 1, 1, False), "must be >= 1"), ((0, 11, 10, 4, 2, 1, False), "cursor 11 is outside")],
)
def test_bad_values(args: tuple, needle: str) -> None:
    with pytest.raises(DataError, match=needle):
        plan_step(*args)
