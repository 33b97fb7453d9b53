"""The benchmarks' measures on synthetic step times: the in-run cost estimate (bench.common.in_run_cost) and the
gaps around a join (longest_pause, change_gap)."""

from __future__ import annotations

import itertools

import pytest

from bench.common import change_gap, in_run_cost, longest_pause, snapshot_steps
from pliant.worker.inplace.cadence import FIRST_SNAPSHOT_EVERY


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


def test_the_gap_across_a_world_change_leaves_out_a_slow_step_before_it() -> None:
    events = [{"rank": 0, "world": 1, "time": t} for t in (0.0, 0.5, 1.0, 6.4, 6.9)]  # a 5.4 s step before the change
    events += [{"rank": r, "world": 2, "time": t} for t in (8.4, 9.6, 10.8) for r in (0, 1)]
    events.append({"rank": 1, "world": 1, "time": 7.5})  # another rank's step is not rank 0's
    assert longest_pause(events, since=0.0) == pytest.approx(5.4)
    assert change_gap(events, 1, 2) == pytest.approx(1.5)
