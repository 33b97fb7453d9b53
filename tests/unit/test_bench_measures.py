"""The benchmarks' in-run cost estimate (bench.common.in_run_cost) on synthetic step times."""

from __future__ import annotations

import itertools

import pytest

from bench.common import in_run_cost


def _times(durations: list[float]) -> dict[int, float]:
    """step -> end time for steps 0..len-1 whose durations are ``durations``."""
    return dict(enumerate(itertools.accumulate(durations)))


def test_a_slower_step_after_each_snapshot_is_its_share_of_the_time() -> None:
    every = 8
    durations = [1.0 + (0.3 if step % every == 0 else 0.0) for step in range(81)]
    cost = in_run_cost(_times(durations), range(17, 81), every)
    assert cost == pytest.approx(0.3 / (every + 0.3))


def test_steps_of_one_length_cost_nothing() -> None:
    assert in_run_cost(_times([1.1] * 81), range(17, 81), 8) == pytest.approx(0.0, abs=1e-12)
