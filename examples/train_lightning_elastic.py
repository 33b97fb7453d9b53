"""A PyTorch Lightning script made elastic with one line: ``strategy=pliant.lightning.DDP()`` (the rest is an ordinary
Lightning script, with a fixed ``num_nodes``). Nodes may join, leave or die: the world follows pliant's generations,
a rescale saves a Lightning checkpoint at a step boundary and the next world resumes from it.

    pliant run --nnodes 1:4 --nproc-per-node 1 --checkpoint-dir /shared/ckpt examples/train_lightning_elastic.py

``--global-batch N`` keeps N samples per optimizer step at every world size (``DDP(global_batch=N)``: the strategy
sets the gradient accumulation); the strategy feeds every sample of an epoch once across world changes either way.

With ``--events FILE`` each rank appends one JSON line per optimizer step (used by the tests: the step, the world and
the dataset indices of the samples it trained); ``--out FILE``: rank 0 writes the final ``global_step`` and (DDP) the
parameters there. ``--save-every N --save-dir DIR`` adds the script's own ``ModelCheckpoint`` (``last.ckpt`` every N
steps): after a kill the next world resumes from whichever of it and the rescale checkpoint is newer.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import pliant.lightning


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        x, y, _index = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class Events(L.Callback):
    """One JSON line per rank and optimizer step: its global step, the world, this process and the dataset indices of
    the samples this rank trained in it; then the simulated compute time."""

    def __init__(self, path: str, step_time: float) -> None:
        self.path, self.step_time = path, step_time
        self.samples: list[int] = []
        self.steps = 0

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.steps = trainer.global_step  # resumed: the steps done before this world

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: object, batch: tuple, batch_idx: int
    ) -> None:
        self.samples += batch[2].tolist()
        if trainer.global_step == self.steps:  # accumulating: the optimizer has not stepped
            return
        self.steps = trainer.global_step
        if self.path:
            line = {
                "rank": trainer.global_rank,
                "world": trainer.world_size,
                "step": trainer.global_step - 1,
                "generation": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + 1,
                "pid": os.getpid(),
                "time": time.time(),
                "samples": self.samples,
            }
            with open(self.path, "a") as out:
                out.write(json.dumps(line) + "\n")
        self.samples = []
        time.sleep(self.step_time)


def _local_world() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=200, help="-1: train --max-epochs epochs")
    parser.add_argument("--max-epochs", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=16, help="samples per batch (per rank)")
    parser.add_argument("--global-batch", type=int, default=None, help="samples per step at every world size")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (simulated compute)")
    parser.add_argument("--events", default="")
    parser.add_argument("--out", default="")
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--accelerator", default="cpu", help="Lightning's accelerator (fsdp needs a GPU)")
    parser.add_argument("--save-every", type=int, default=0, help="the script's own checkpoint every N steps")
    parser.add_argument("--save-dir", default="checkpoints", help="where the script's own checkpoints go")
    parser.add_argument(
        "--world-from-env",
        action="store_true",
        help="devices and num_nodes from torchrun's environment and ckpt_path='last': what a script under torchrun "
        "sets itself to run at each world size and resume (under pliant the strategy does it)",
    )
    args = parser.parse_args()
    callbacks: list[L.Callback] = [Events(args.events, args.step_time)]
    if args.save_every:
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(args.save_dir, every_n_train_steps=args.save_every, save_last=True)
        )

    x = torch.randn(4096, 8, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True), torch.arange(len(x))), batch_size=args.batch_size)
    torch.manual_seed(0)  # the same initial parameters in every run: the tests compare them with a static run
    model = Regression()
    elastic = pliant.lightning.DDP if args.strategy == "ddp" else pliant.lightning.FSDP
    trainer = L.Trainer(
        strategy=elastic(global_batch=args.global_batch),  # pliant: the one line
        accelerator=args.accelerator,
        devices=_local_world() if args.world_from_env else 1,
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // _local_world() if args.world_from_env else 1,
        max_steps=args.max_steps,
        max_epochs=args.max_epochs,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(args.save_every),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data, ckpt_path="last" if args.world_from_env and args.save_every else None)
    if args.out and trainer.is_global_zero:
        final = {"global_step": trainer.global_step, "world_size": trainer.world_size}
        if args.strategy == "ddp":
            final["params"] = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
        with open(args.out, "w") as out:
            json.dump(final, out)


if __name__ == "__main__":
    main()
