"""FSDP2 re-formed in place where survivors change rank (a node before them left): each rank must load the rows its
new rank owns, and the module the script built stays the model. Real gloo processes
(tests/integration/fsdp_reform_job.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("fsdp_reform_job.py")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("perm", "outputs"), [("1,2,0", 1), ("1,0", 2)], ids=["world-3-uneven-rows", "world-2-even-rows"]
)
def test_a_renumbered_fsdp_rank_loads_the_rows_of_its_new_rank(perm: str, outputs: int, tmp_path: Path) -> None:
    """Torch's DTensor caches key a device mesh by its ranks and names, not by this process's place in it: a world of
    the same size as an earlier one, with this process at another rank, must not reuse the earlier mesh (whose
    coordinate would cut another rank's rows). Uneven rows fail the load; even ones load right (torch scatters them by
    group rank), but the stale coordinate is the one DCP's save planner takes each shard's global offset from."""
    result = subprocess.run(
        [sys.executable, str(JOB), perm, str(tmp_path), str(outputs)], capture_output=True, text=True, timeout=100
    )
    assert result.returncode == 0, result.stderr[-4000:]
    processes = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("process-*.json"))]
    assert len(processes) == len(perm.split(","))
    errors = {process["rank"]: process["error"] for process in processes if process["error"]}
    assert not errors, errors
    for process in processes:
        assert process["coordinates"] == [[process["rank"]]], process["coordinates"]
        assert process["rows_ok"], f"rank {process['rank']} holds rows that are not its own"
        assert process["after"] == process["before"], f"rank {process['rank']}'s state changed in the move"
        live = ("same_object", "state_dict", "forward", "hook", "trained", "hooks_once", "stale_refused")
        assert process["live"] == dict.fromkeys(live, True), (
            f"rank {process['rank']}: the script's module is not the live model: {process['live']}"
        )
    print(
        f"{perm} ({outputs} outputs): every renumbered rank holds its own rows; full state unchanged by the move; "
        f"the script's module is the live model"
    )
