"""Hugging Face Trainer made elastic with one line (pliant.transformers): a Trainer script with
``callbacks=[pliant.transformers.Elastic()]`` goes through a join, a kill -9 of a node, a join again and a graceful
leave under real agents and a real coordinator, and finishes with ``global_step == max_steps``; a step is trained
twice only after the kill (from the last complete checkpoint), never after a graceful rescale."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.framework_jobs import EXAMPLES, join_kill_join_leave, script_flags, trained_twice

pytest.importorskip("transformers", reason="the Hugging Face tests need transformers (the dev extras)")

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(300)]

SCRIPT = EXAMPLES / "train_hf_trainer.py"
STEPS = 600


def test_a_trainer_script_with_the_callback_follows_joins_kills_and_leaves(
    make_coordinator, spawn_agent, tmp_path: Path
) -> None:
    server = make_coordinator()
    output_dir = str(tmp_path / "ckpt" / "hf")
    # No periodic checkpoints: after the kill the next world resumes from the join's.
    extra = script_flags(tmp_path, STEPS, "--output-dir", output_dir, "--save-steps", "100000")
    run = join_kill_join_leave(server, spawn_agent, tmp_path, SCRIPT, extra, wait_s=120)
    a, joined, killed_in = run.agent, run.joined, run.killed_in

    final = json.loads((tmp_path / "final.json").read_text())
    assert final["global_step"] == STEPS, final
    twice = trained_twice(tmp_path, STEPS)
    # Only the kill ends a world without a save: a step trained twice was first trained in the world the kill ended.
    assert all(gens[0] == killed_in and len(gens) == 2 for gens in twice.values()), twice
    output = a.output()
    assert "saved for the rescale" in output and "resuming from the last complete checkpoint" in output
    assert "workers stopped for the rescale" in output
    # The joins take the restart path: node a trains on until node b's workers are ready to fork (its warm-up), and
    # node b forks them once node a restarted (every step trained once: the assertions above).
    assert "by the restart path: the newcomers warmed up" in output
    assert (
        "warmed up in" in run.rejoined.output() and "the other nodes save and restart into it" in run.rejoined.output()
    )
    print(
        f"transformers Trainer with the callback: {len(twice)} steps trained twice, all after the kill -9 "
        f"(generation {killed_in}); join at generation {joined}; {STEPS} steps in all"
    )
