"""A torchrun script with pliant.data's loader (examples/train_torchrun_data.py, a few lines) goes through a join, a
kill -9 of a worker and a graceful leave under real agents and a real coordinator: each step trains the samples a
static run under torchrun at one rank trains (every sample of a pass once), the optimizer steps are the static run's,
and the parameters end within 1e-4 of its; a step is trained twice only after the kill (on the same samples)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.integration.framework_jobs import (
    EXAMPLES,
    assert_like_a_static_run,
    join_kill_worker_leave,
    script_flags,
    trained_twice,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SCRIPT = EXAMPLES / "train_torchrun_data.py"
STEPS = 400
DATASET = 2000  # the example's samples
GLOBAL_BATCH, BATCH = 32, 8  # 4 micro-batches a step alone, 2 at two nodes


def test_a_torchrun_script_with_the_loader_trains_a_static_runs_steps_through_a_join_a_kill_and_a_leave(
    make_coordinator, spawn_agent, tmp_path: Path
) -> None:
    server = make_coordinator()
    data = ("--global-batch", str(GLOBAL_BATCH), "--batch-size", str(BATCH))
    extra = script_flags(tmp_path, STEPS, "--ckpt", str(tmp_path / "ckpt.pt"), *data, step_time_s=0.04)
    run = join_kill_worker_leave(server, spawn_agent, tmp_path, SCRIPT, extra, wait_s=90)

    final = json.loads((tmp_path / "final.json").read_text())
    assert final["global_step"] == STEPS, final
    twice = trained_twice(tmp_path, STEPS)
    # Rank 0 saves every step: a rescale redoes none, the kill at most the step in flight.
    assert all(gens[0] == run.killed_in and len(gens) == 2 for gens in twice.values()) and len(twice) <= 1, twice

    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1")
    flags = ("--ckpt", str(tmp_path / "static" / "ckpt.pt"), *data)
    diff = assert_like_a_static_run(tmp_path, SCRIPT, flags, STEPS, DATASET, launcher=torchrun)
    print(
        f"torchrun script with pliant.data, global batch {GLOBAL_BATCH}: {len(twice)} steps trained twice (on the "
        f"same samples), after the kill -9 (generation {run.killed_in}); join at generation {run.joined}; every "
        f"step's samples those of the static run; parameters {diff:.1e} from it; {STEPS} steps in all"
    )
