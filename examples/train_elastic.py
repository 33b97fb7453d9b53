"""A training loop on pliant.worker: a fixed global batch whatever the world size, exactly-once data, any engine.

Compared with a plain DDP loop, the changed lines are marked ``# pliant``. It runs under ``pliant run``, under
``torchrun``, and as a single plain process (``python examples/train_elastic.py``).

    pliant run --nnodes 1:2 --nproc-per-node 2 examples/train_elastic.py --engine fsdp --steps 100
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.utils.data import TensorDataset

import pliant.worker  # pliant


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default="ddp", choices=["ddp", "zero", "fsdp"])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--out", default="", help="rank 0 writes the final loss and world size here as JSON")
    args = parser.parse_args()

    session = pliant.worker.init()  # pliant: reads the env, initialises the process group
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, 16, generator=g)
    data = TensorDataset(x, x @ torch.randn(16, 1, generator=g))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    engine = session.engine(model, args.engine, torch.optim.SGD, lr=0.05)  # pliant: wraps model and optimizer
    loader = session.loader(data, args.global_batch, args.micro_batch, max_steps=args.steps)  # pliant

    def loss_fn(model: torch.nn.Module, micro: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(micro[0]), micro[1])

    loss = float("nan")
    for batch in loader:
        loss = session.all_reduce_sum(engine.step(batch, loss_fn)) / batch.num_samples  # pliant: one global step
        if session.rank == 0 and batch.step % 10 == 0:
            print(f"step {batch.step} world {session.world_size} loss {loss:.4f}", flush=True)
    if session.rank == 0 and args.out:
        with open(args.out, "w") as out:
            json.dump({"loss": loss, "world": session.world_size, "steps": args.steps}, out)
    session.close()


if __name__ == "__main__":
    main()
