"""The rules of a pliant.worker script, enforced where they are broken: a script that catches the RescaleExit ending
its rank and steps again (pliant.worker.inplace.protocol), or runs a collective of its own between init() and its loop
(pliant.worker.inplace.setup_window), gets an error naming the mistake and the fix, not a rank that trains outside any
world or a newcomer that hangs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from pliant.worker.contract import ExitReason, RescaleExit
from pliant.worker.inplace.protocol import Protocol, RescaleError
from pliant.worker.inplace.setup_window import SetupCollectiveError, SetupWindow, scripts_own


def test_a_step_after_a_swallowed_rescale_exit_is_refused_with_the_fix() -> None:
    protocol = Protocol.__new__(Protocol)  # the exit's bookkeeping alone; a real session is not needed for it
    protocol.exited = None
    exit_ = protocol._exit("leave")
    assert isinstance(exit_, RescaleExit) and isinstance(exit_, SystemExit) and exit_.code == 75
    assert exit_.reason is ExitReason.LEAVE and protocol.exited is ExitReason.LEAVE
    with pytest.raises(RescaleError, match=r"after RescaleExit \('leave'\).*let RescaleExit propagate"):
        protocol.step(None, None, None)  # type: ignore[arg-type]


def test_the_scripts_own_code_is_anything_but_torch_and_pliant() -> None:
    assert scripts_own("__main__") and scripts_own("mylib.metrics") and scripts_own("torchmetrics")
    assert not scripts_own("torch.distributed.checkpoint") and not scripts_own("pliant.worker.engines")


def test_a_collective_of_the_scripts_own_in_the_setup_window_is_refused_and_torchs_pass() -> None:
    original = dist.all_reduce
    window = SetupWindow()
    window.start()
    try:
        assert distributed_c10d.all_reduce is dist.all_reduce is not original, "both spellings are checked"
        with pytest.raises(SetupCollectiveError, match=r"torch.distributed.all_reduce at .*test_script_rules.py:\d+"):
            dist.all_reduce(torch.ones(1))
        with pytest.raises(SetupCollectiveError, match=r"torch.distributed.barrier .*session.all_reduce_sum"):
            distributed_c10d.barrier()
        # pliant's own collective in the window reaches torch (which has no process group here)
        with pytest.raises(ValueError, match="Default process group has not been initialized"):
            exec("dist.all_reduce(torch.ones(1))", {"__name__": "pliant.worker.engines", "dist": dist, "torch": torch})
    finally:
        window.close()
    assert dist.all_reduce is original and distributed_c10d.all_reduce is original, "the loop's are torch's own"
    with pytest.raises(ValueError, match="Default process group has not been initialized"):
        dist.all_reduce(torch.ones(1))
