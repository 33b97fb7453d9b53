"""Hugging Face Trainer made elastic with one line (pliant.transformers): a Trainer script with
``callbacks=[pliant.transformers.Elastic(global_batch=16)]`` goes through a join, a kill -9 of a worker and a graceful
leave under real agents and a real coordinator, and finishes with ``global_step == max_steps``: each step trains the
sequences a static run at one world size trains (every sample of a pass once), the parameters end within 1e-4 of that
run's, and a step is trained twice only after the kill (on the same samples), never after a graceful rescale."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.framework_jobs import (
    EXAMPLES,
    assert_like_a_static_run,
    join_kill_worker_leave,
    script_flags,
    trained_twice,
)

pytest.importorskip("transformers", reason="the Hugging Face tests need transformers (the dev extras)")

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(300)]

SCRIPT = EXAMPLES / "train_hf_trainer.py"
STEPS = 400
DATASET = 4096  # the example's sequences
GLOBAL_BATCH, BATCH = 16, 8  # 2 batches a step alone, 1 at two nodes


def test_a_trainer_script_with_the_callback_trains_a_static_runs_steps_through_a_join_a_kill_and_a_leave(
    make_coordinator, spawn_agent, tmp_path: Path
) -> None:
    server = make_coordinator()
    output_dir = str(tmp_path / "ckpt" / "hf")
    data = ("--global-batch", str(GLOBAL_BATCH), "--batch-size", str(BATCH))
    # No periodic checkpoints: after the kill the next world resumes from the join's.
    extra = script_flags(tmp_path, STEPS, "--output-dir", output_dir, "--save-steps", "100000", *data)
    run = join_kill_worker_leave(server, spawn_agent, tmp_path, SCRIPT, extra, wait_s=120)
    a, joined, killed_in = run.agent, run.joined, run.killed_in

    final = json.loads((tmp_path / "final.json").read_text())
    assert final["global_step"] == STEPS, final
    twice = trained_twice(tmp_path, STEPS)
    # Only the kill ends a world without a save: a step trained twice was first trained in the world the kill ended.
    assert all(gens[0] == killed_in and len(gens) == 2 for gens in twice.values()), twice
    output = a.output()
    assert "saved for the rescale" in output and "resuming from the last complete checkpoint" in output
    assert "workers stopped for the rescale" in output
    assert "exactly-once data: global batch 16 = batch size 8 x accumulation 2 x world 1 (fixed)" in output
    assert "exactly-once data: global batch 16 = batch size 8 x accumulation 1 x world 2 (fixed)" in output
    # The joins take the restart path: node a trains on until node b's workers are ready to fork (its warm-up), and
    # node b forks them once node a restarted (every step trained once: the assertions above).
    assert "by the restart path: the newcomers warmed up" in output
    assert "warmed up in" in run.rejoined.output()

    # The static run: the same script in one process, the same global batch, no change of world.
    flags = ("--output-dir", str(tmp_path / "static" / "hf"), "--save-steps", "100000", *data)
    diff = assert_like_a_static_run(tmp_path, SCRIPT, flags, STEPS, DATASET)
    print(
        f"transformers Trainer with the callback, global batch {GLOBAL_BATCH}: {len(twice)} steps trained twice (on "
        f"the same samples), all after the kill -9 (generation {killed_in}); join at generation {joined}; every "
        f"step's samples those of the static run; parameters {diff:.1e} from it; {STEPS} steps in all"
    )
