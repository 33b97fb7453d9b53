"""A plain Hugging Face Accelerate script (examples/train_accelerate.py: periodic ``save_state``, ``load_state`` of the
newest at start) runs under real agents and a real coordinator unchanged, with torchrun's semantics: through a join,
a kill -9 of a node, a join again and a graceful leave it finishes every step, each world resuming from the newest
complete checkpoint, so a step runs again only if it came after the last save before a rescale."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.framework_jobs import EXAMPLES, events, join_kill_join_leave, script_flags, trained_twice

pytest.importorskip("accelerate", reason="the Accelerate test needs accelerate (the dev extras)")

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(300)]

SCRIPT = EXAMPLES / "train_accelerate.py"
STEPS, SAVE_EVERY = 400, 10


def test_a_plain_accelerate_script_resumes_from_its_newest_checkpoint_after_every_rescale(
    make_coordinator, spawn_agent, tmp_path: Path
) -> None:
    server = make_coordinator()
    output_dir = str(tmp_path / "ckpt" / "accelerate")
    # 0.05 s a step: 400 steps outlast a node's rejoin on a loaded machine (8 s and its warm-up), so the job does not
    # end before the world it waits for forms.
    extra = script_flags(tmp_path, STEPS, "--output-dir", output_dir, "--save-every", str(SAVE_EVERY), step_time_s=0.05)
    run = join_kill_join_leave(server, spawn_agent, tmp_path, SCRIPT, extra, wait_s=120)

    final = json.loads((tmp_path / "final.json").read_text())
    assert final["step"] == STEPS, final
    twice = trained_twice(tmp_path, STEPS)  # every step trained
    # Every world resumed from the newest complete checkpoint before it: the step after the last one trained, rounded
    # down to a save (one save earlier when the rescale came during that save: a rank died in it, or was stopped).
    firsts: dict[int, int] = {}
    for event in events(tmp_path):
        if event["rank"] == 0:
            firsts.setdefault(event["generation"], event["step"])
    trained_before = -1
    resumed = []
    for gen in sorted(firsts):
        if gen > min(firsts):
            newest = (trained_before + 1) // SAVE_EVERY * SAVE_EVERY
            assert firsts[gen] in (newest, newest - SAVE_EVERY), (gen, firsts[gen], trained_before)
            resumed.append(firsts[gen])
        trained_before = max(e["step"] for e in events(tmp_path) if e["rank"] == 0 and e["generation"] <= gen)
    assert len(resumed) >= 4, firsts  # a join, a kill -9, a join, a leave
    output = run.agent.output()
    assert "resumed from step" in output
    print(
        f"Accelerate, unchanged: {len(resumed)} rescales, each resumed from the newest save (steps {resumed}); "
        f"{len(twice)} steps trained more than once; {STEPS} steps in all"
    )
