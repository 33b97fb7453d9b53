"""When a hand-over in place waits for its newcomers and when it reports them (pliant.agent.handover; pure, time passed
in). On network namespaces: tests/integration/test_partitions.py."""

from __future__ import annotations

import pytest

from pliant.agent.handover import PROBE_EVERY_S, PROBES_FAILED, HandOver, probe_due, probed

pytestmark = pytest.mark.timeout(10)

GRACE_S = 30.0


def _pending(now: float = 100.0) -> HandOver:
    return HandOver(("c", "d"), needed=4, deadline=now + GRACE_S)


def test_a_newcomer_unreachable_for_two_probes_in_a_row_is_reported_long_before_the_grace_ends() -> None:
    pending = _pending()
    assert probe_due(pending, 0, 100.0)  # the first probe at once
    pending, verdict = probed(pending, 0, {"d"}, 100.0, GRACE_S)
    assert not verdict.hand and not verdict.cut  # once is not enough: a blip
    assert not probe_due(pending, 2, 100.0 + PROBE_EVERY_S / 2)
    assert probe_due(pending, 2, 100.0 + PROBE_EVERY_S)
    pending, verdict = probed(pending, 2, {"d"}, 100.0 + PROBE_EVERY_S, GRACE_S)
    assert PROBES_FAILED == 2 and verdict.cut == ("d",) and not verdict.hand
    assert verdict.message == (
        "newcomers d have not arrived yet and their agents are unreachable from this node "
        f"(2 probes {PROBE_EVERY_S:g}s apart)"
    )


def test_a_probe_that_answers_again_starts_the_count_over() -> None:
    pending, _ = probed(_pending(), 0, {"c"}, 100.0, GRACE_S)
    pending, verdict = probed(pending, 0, set(), 101.0, GRACE_S)
    assert verdict == verdict.__class__() and dict(pending.failed) == {"c": 0, "d": 0}  # wait
    pending, verdict = probed(pending, 0, {"c"}, 102.0, GRACE_S)
    assert not verdict.cut


def test_once_all_counted_in_or_the_grace_ran_out_one_probe_decides() -> None:
    # Counted in at node rank 0's store, but this node cannot reach d: reported at once (a cut in a world of three).
    _, verdict = probed(_pending(), 4, {"d"}, 100.0, GRACE_S)
    assert verdict.cut == ("d",)
    assert verdict.message == "newcomers d counted themselves in and their agents are unreachable from this node"
    _, verdict = probed(_pending(), 4, set(), 100.0, GRACE_S)
    assert verdict.hand and not verdict.cut
    # The grace ran out with c slow to start but reachable: handed over (the meeting waits for c).
    pending = _pending()
    assert probe_due(pending, 2, 100.0 + GRACE_S)
    _, verdict = probed(pending, 2, set(), 100.0 + GRACE_S, GRACE_S)
    assert verdict.hand
    _, verdict = probed(pending, 2, {"c", "d"}, 100.0 + GRACE_S, GRACE_S)
    assert verdict.cut == ("c", "d") and "did not arrive within the rescale grace (30s)" in verdict.message
