"""The commit vote's spacing (pliant.worker.rescale.votes_apart): every rank computes the same next vote from the
slowest rank's last step time, which the vote itself all-reduces."""

from __future__ import annotations

import pytest

from pliant.worker.rescale import VOTE_WITHIN_S, votes_apart


@pytest.mark.parametrize(("slowest_s", "apart"), [
    (0.0, 1),  # no step measured yet (a job's or a new world's first): vote again at once
    (2.0, 1),  # long steps: every step, so a rescale waits one step, not several
    (0.1, 1),
    (0.05, 2),
    (0.007, 14),  # the 7 ms DDP step of bench/engine.py: the vote's all-reduce is about 0.5 % of the time
    (0.0001, 32),  # bounded
])  # fmt: skip
def test_votes_come_about_every_tenth_of_a_second_or_every_step(slowest_s: float, apart: int) -> None:
    assert votes_apart(slowest_s) == apart
    assert votes_apart(slowest_s) * slowest_s <= max(VOTE_WITHIN_S, slowest_s)
