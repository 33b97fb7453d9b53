"""The rules of a pliant.worker script, enforced where they are broken (pliant.worker.rescale): a script that catches
the RescaleExit ending its rank and steps again gets an error naming the mistake and the fix, not a rank that trains
outside any world."""

from __future__ import annotations

import pytest

from pliant.worker.rescale import Protocol, RescaleError, RescaleExit


def test_a_step_after_a_swallowed_rescale_exit_is_refused_with_the_fix() -> None:
    protocol = Protocol.__new__(Protocol)  # the exit's bookkeeping alone; a real session is not needed for it
    protocol.exited = ""
    exit_ = protocol._exit("leave")
    assert isinstance(exit_, RescaleExit) and isinstance(exit_, SystemExit) and exit_.code == 75
    with pytest.raises(RescaleError, match=r"after RescaleExit \('leave'\).*let RescaleExit propagate"):
        protocol.step(None, None, None)  # type: ignore[arg-type]
