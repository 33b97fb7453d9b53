"""A PyTorch Lightning script with ``Trainer(strategy="ddp")``: it imports nothing of pliant and runs unchanged under
``pliant run`` (Lightning recognises the torchelastic environment pliant's agent provides, as under torchrun).

    pliant run --nproc-per-node 2 examples/train_lightning.py --max-steps 20
"""

from __future__ import annotations

import argparse
import json
import os

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    parser.add_argument("--num-nodes", type=int, default=int(os.environ.get("GROUP_WORLD_SIZE", "1")))
    parser.add_argument("--out", default="", help="append {global_rank, world_size} as JSON here after training")
    args = parser.parse_args()

    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=16)
    trainer = L.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression(), data)
    if args.out:
        with open(args.out, "a") as out:
            line = {
                "global_rank": trainer.global_rank,
                "world_size": trainer.world_size,
                "cluster": type(trainer.strategy.cluster_environment).__name__,
                "steps": trainer.global_step,
            }
            out.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
