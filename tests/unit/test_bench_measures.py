"""The benchmarks' in-run cost estimate (bench.common.in_run_cost) on synthetic step times."""

from __future__ import annotations

import itertools

import pytest

from bench.common import in_run_cost, snapshot_steps
from pliant.worker.cadence import FIRST_SNAPSHOT_EVERY


def _times(durations: list[float]) -> dict[int, float]:
    """step -> end time for steps 0..len-1 whose durations are ``durations``."""
    return dict(enumerate(itertools.accumulate(durations)))


def test_a_slower_step_after_each_snapshot_is_its_share_of_the_time() -> None:
    every = 8
    durations = [1.0 + (0.3 if step % every == 0 else 0.0) for step in range(81)]
    cost = in_run_cost(_times(durations), range(17, 81), list(range(every, 81, every)))
    assert cost == pytest.approx(0.3 / (every + 0.3))


def test_steps_of_one_length_cost_nothing() -> None:
    assert in_run_cost(_times([1.1] * 81), range(17, 81), [8, 24, 41, 58]) == pytest.approx(0.0, abs=1e-12)


def test_the_snapshot_schedule_follows_the_logged_intervals() -> None:
    # K = 16 at first; the vote of step 33 set 18, that of step 55 set 17.
    assert snapshot_steps([(18, 33), (17, 55)], 110, FIRST_SNAPSHOT_EVERY) == [1, 17, 33, 51, 68, 85, 102]
    assert snapshot_steps([], 40, 8) == [1, 9, 17, 25, 33]
