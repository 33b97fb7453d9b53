"""The one backoff: exponential ceilings up to a cap, each wait in [ceiling/2, ceiling], reset by a success."""

from __future__ import annotations

import random

import pytest

from pliant.backoff import Backoff


def test_waits_double_up_to_the_cap_within_half_their_ceiling_and_reset_on_success() -> None:
    backoff = Backoff(0.1, 1.0, random.Random(7))
    assert not backoff.failing
    waits = [backoff.next() for _ in range(8)]
    ceilings = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0, 1.0]
    assert all(c / 2 <= w <= c for w, c in zip(waits, ceilings, strict=True)), waits
    assert backoff.failing
    backoff.reset()
    assert not backoff.failing and 0.05 <= backoff.next() <= 0.1


def test_clients_that_fail_together_retry_apart() -> None:
    """A thousand agents whose coordinator went away at once do not come back at once."""
    firsts = [Backoff(0.2, 5.0, random.Random(seed)).next() for seed in range(1000)]
    assert min(firsts) >= 0.1 and max(firsts) <= 0.2
    assert len({round(w, 3) for w in firsts}) > 90, "spread over the window, not on one instant"


def test_a_backoff_needs_a_positive_first_wait_below_its_cap() -> None:
    with pytest.raises(ValueError, match="0 < first_s <= cap_s"):
        Backoff(2.0, 1.0)
