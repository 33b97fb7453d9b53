"""A plain Hugging Face Accelerate script, as Accelerate's documentation writes one, under ``pliant run`` unchanged: it
saves its state every ``--save-every`` steps (``accelerator.save_state`` into ``step-N``, with a registered step
counter; written under a temporary name and renamed once every process wrote its part, so a worker killed mid-save
leaves no partial checkpoint) and resumes from the newest at start (``accelerator.load_state``, then
``skip_first_batches``).

    pliant run --nnodes 1:4 --nproc-per-node 1 examples/train_accelerate.py --output-dir /shared/accelerate-run

pliant gives it torchrun's environment. A rescale stops its workers as torchrun does (SIGTERM, SIGKILL after
``--stop-grace``) and the next world starts fresh ones, which resume from the newest checkpoint: the steps since it
run again. (A Trainer or Lightning script loses none: ``pliant.transformers``, ``pliant.lightning``.) With
``--events FILE`` each rank appends one JSON line per trained step (used by the tests); ``--out FILE``: rank 0 writes
the final step there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch
from accelerate import Accelerator

KEEP = 3  # checkpoints kept


class Progress:
    """The training step, saved and loaded with the rest of the state (``register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


def save(accelerator: Accelerator, directory: Path, step: int) -> None:
    """``save_state`` into ``directory/step-<step>``, complete or not at all; the oldest beyond :data:`KEEP` go."""
    final, partial = directory / f"step-{step:08d}", directory / f".partial-step-{step:08d}"
    accelerator.save_state(str(partial))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        partial.rename(final)
        for old in sorted(directory.glob("step-*"))[:-KEEP]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", required=True, help="where the checkpoints go (shared by the nodes)")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (simulated compute)")
    parser.add_argument("--events", default="")
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    features = torch.randn(4096, 16)
    data = torch.utils.data.TensorDataset(features, features.sum(dim=1, keepdim=True))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)

    checkpoints = Path(args.output_dir)
    saved = sorted(checkpoints.glob("step-*"))
    if saved:
        accelerator.load_state(str(saved[-1]))  # the newest; the step counter comes with it
        accelerator.print(f"resumed from step {progress.step}")
    generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + 1
    model.train()
    while progress.step < args.max_steps:
        batches = accelerator.skip_first_batches(loader, progress.step % len(loader))
        for inputs, targets in batches:
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if args.events:
                line = {
                    "rank": accelerator.process_index,
                    "world": accelerator.num_processes,
                    "step": progress.step,
                    "generation": generation,
                    "pid": os.getpid(),
                }
                with open(args.events, "a") as out:
                    out.write(json.dumps(line) + "\n")
            progress.step += 1
            time.sleep(args.step_time)
            if progress.step % args.save_every == 0:
                save(accelerator, checkpoints, progress.step)
            if progress.step >= args.max_steps or progress.step % len(loader) == 0:
                break
    accelerator.wait_for_everyone()
    if args.out and accelerator.is_main_process:
        Path(args.out).write_text(json.dumps({"step": progress.step, "world_size": accelerator.num_processes}))
    accelerator.end_training()


if __name__ == "__main__":
    main()
