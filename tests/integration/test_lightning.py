"""Lightning made elastic with one line (pliant.lightning): a Lightning script with
``strategy=pliant.lightning.DDP(global_batch=32)`` (or ``FSDP(...)``, where a GPU exists) and a fixed ``num_nodes=1``
goes through a join, a kill -9 of a worker and a graceful leave under real agents and a real coordinator, and
finishes with ``global_step == max_steps``: each step trains the samples a static run at one world size trains (every
sample of a pass once), the parameters end within 1e-4 of that run's, and a step is trained twice only after the kill
(on the same samples), never after a graceful rescale. Without the plugin the agent says in one line what to add."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import wait_for
from tests.integration.framework_jobs import (
    EXAMPLES,
    agent_argv,
    assert_like_a_static_run,
    join_kill_worker_leave,
    script_flags,
    trained_twice,
)

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(300)]

SCRIPT = EXAMPLES / "train_lightning_elastic.py"
STEPS = 500
DATASET = 4096  # the example's samples
GLOBAL_BATCH, BATCH = 32, 16  # 2 batches a step alone, 1 at two nodes


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="Lightning's FSDP needs a GPU")


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=GPU)])
def test_a_lightning_script_with_the_plugin_trains_a_static_runs_steps_through_a_join_a_kill_and_a_leave(
    make_coordinator, spawn_agent, tmp_path: Path, strategy: str
) -> None:
    server = make_coordinator()
    accelerator = "gpu" if strategy == "fsdp" else "cpu"
    data = ("--global-batch", str(GLOBAL_BATCH), "--batch-size", str(BATCH))
    own = ("--save-every", "5", "--save-dir", str(tmp_path / "own"))  # the script's own last.ckpt, every 5 steps
    # A GPU steps this tiny model far faster than a CPU does: 0.2 s a step keeps the steps longer than the three
    # world changes, each newcomer's CUDA start included.
    step_time_s = 0.2 if accelerator == "gpu" else 0.04
    flags = ("--strategy", strategy, "--accelerator", accelerator, *data, *own)
    extra = script_flags(tmp_path, STEPS, *flags, step_time_s=step_time_s)
    run = join_kill_worker_leave(server, spawn_agent, tmp_path, SCRIPT, extra, wait_s=90)
    a, joined, killed_in = run.agent, run.joined, run.killed_in

    final = json.loads((tmp_path / "final.json").read_text())
    assert final["global_step"] == STEPS, final
    twice = trained_twice(tmp_path, STEPS)
    # Only the kill ends a world without a save: a step trained twice was first trained in the world the kill ended.
    assert all(gens[0] == killed_in and len(gens) == 2 for gens in twice.values()), twice
    # The kill came 10 steps or more after the join's rescale checkpoint: the script's own last.ckpt (every 5 steps)
    # is the newer one, and the next world resumes from it.
    assert len(twice) <= 5, twice
    output = a.output()
    assert "saved for the rescale" in output and "resuming from the rescale checkpoint" in output
    assert "resuming from the script's checkpoint " + str(tmp_path / "own") in output
    assert "workers stopped for the rescale" in output
    assert "exactly-once data: global batch 32 = batch size 16 x accumulation 2 x world 1 (fixed)" in output
    assert "exactly-once data: global batch 32 = batch size 16 x accumulation 1 x world 2 (fixed)" in output
    # The joins take the restart path: node a trains on until node b's workers are ready to fork (its warm-up), and
    # node b forks them once node a restarted (every step trained once: the assertions above).
    assert "by the restart path: the newcomers warmed up" in output
    assert "warmed up in" in run.rejoined.output()
    # The world the kill broke is aborted (its collectives cannot complete), not asked to save.
    assert f"generation {killed_in} failed: its workers get SIGTERM, then SIGKILL after 0.5s" in output

    # The static run: the same script in one process, the same global batch, no change of world.
    flags = ("--strategy", strategy, "--accelerator", accelerator, *data)
    diff = assert_like_a_static_run(tmp_path, SCRIPT, flags, STEPS, DATASET)
    print(
        f"lightning {strategy} with the plugin, global batch {GLOBAL_BATCH}: {len(twice)} steps trained twice (on "
        f"the same samples), all after the kill -9 (generation {killed_in}); join at generation {joined}; every "
        f"step's samples those of the static run; parameters {diff:.1e} from it; {STEPS} steps in all"
    )


def test_without_the_plugin_the_agent_says_what_to_add(make_coordinator, spawn_agent, tmp_path: Path) -> None:
    """An unchanged Lightning script with a fixed num_nodes fails the first join; the agent says the one line."""
    server = make_coordinator()
    plain = ("--num-nodes", "1", "--devices", "1", "--max-steps", "100000")
    argv = [*agent_argv(server.address, "node-a", tmp_path, EXAMPLES / "train_lightning.py", plain)]
    argv[argv.index("--max-restarts") + 1] = "0"
    a = spawn_agent(server, argv, name="agent-a")
    time.sleep(8.0)  # node a trains alone (a world of 1 matches num_nodes=1)
    b = spawn_agent(
        server, agent_argv(server.address, "node-b", tmp_path, EXAMPLES / "train_lightning.py", plain), name="agent-b"
    )
    wait_for(lambda: "strategy=pliant.lightning.DDP()" in a.output() + b.output(), 120, "the agent's hint")
    assert (a.output() + b.output()).count("pass strategy=pliant.lightning.DDP()") <= 2  # once per agent
