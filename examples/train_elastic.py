"""A training loop on pliant.worker: a fixed global batch whatever the world size, exactly-once data, sharded
checkpoints that survive rescales, any engine.

Compared with a plain DDP loop, the changed lines are marked ``# pliant``. It runs under ``pliant run`` (with
``--checkpoint-dir`` it resumes across rescales and failures), under ``torchrun``, and as a single plain process.

    pliant run --nnodes 1:2 --nproc-per-node 2 --checkpoint-dir /tmp/ckpt examples/train_elastic.py --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch.utils.data import TensorDataset

import pliant.worker  # pliant


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default="ddp", choices=["ddp", "zero", "fsdp", "hsdp"])
    parser.add_argument("--shard-group", type=int, default=0, help="hsdp: ranks per shard group (default: a node's)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--width", type=int, default=32, help="hidden width (a bigger model makes bigger checkpoints)")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument(
        "--lr-period",
        type=int,
        default=20,
        help="steps per cosine cycle of the learning rate (0: a constant learning rate)",
    )
    parser.add_argument("--save-every", type=int, default=0, help="periodic checkpoints (with a checkpoint dir)")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (simulated compute)")
    parser.add_argument(
        "--events", default="", help="append one JSON line per rank and step (samples consumed, the global loss)"
    )
    parser.add_argument("--out", default="", help="rank 0 writes the final loss and world size here as JSON")
    parser.add_argument("--params-out", default="", help="rank 0 saves the final parameters here (torch.save)")
    parser.add_argument("--float64", action="store_true", help="train in double precision (long exactness checks)")
    parser.add_argument(
        "--stop-file",
        default="",
        help="once this file exists, end at the step it names (a soak "
        "ends its job when its faults are done; that many --steps make its static twin)",
    )
    args = parser.parse_args()
    if args.float64:
        torch.set_default_dtype(torch.float64)

    session = pliant.worker.init()  # pliant: reads the env, initialises the process group
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 16, generator=g)
    data = TensorDataset(x, x @ torch.randn(16, 1, generator=g), torch.arange(args.samples))
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, args.width),
        torch.nn.ReLU(),
        torch.nn.Linear(args.width, args.width),
        torch.nn.ReLU(),
        torch.nn.Linear(args.width, 1),
    )
    schedule = None
    if args.lr_period:  # pliant steps it after every committed step, and keeps its state with the optimizer's

        def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
            return torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=args.lr_period)

    grouped = {"shard_group": args.shard_group} if args.shard_group else {}
    engine = session.engine(  # pliant
        model, args.engine, torch.optim.SGD, lr=args.lr, momentum=0.9, scheduler=schedule, **grouped
    )
    loader = session.loader(data, args.global_batch, args.micro_batch, max_steps=args.steps)  # pliant
    ckpt = None
    if session.env.checkpoint_dir:  # pliant: resume from the newest checkpoint, at any world size
        ckpt = session.checkpoints(engine, loader, every_steps=args.save_every)
        ckpt.restore()

    def loss_fn(model: torch.nn.Module, micro: list[torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(micro[0]), micro[1])

    def stop_early() -> None:  # every rank reads the file before the step it names: all stop at that step
        if args.stop_file and os.path.exists(args.stop_file):
            with open(args.stop_file) as named:
                loader.max_steps = min(loader.max_steps, int(named.read()))

    stop_early()
    events = open(args.events, "a") if args.events else None  # noqa: SIM115
    loss = float("nan")
    for batch in loader:
        loss = session.all_reduce_sum(engine.step(batch, loss_fn)) / batch.num_samples  # pliant: one global step
        session.metrics.publish(loss=loss)  # pliant: served as pliant_user_loss{rank=...} on the node's endpoint
        if events is not None:
            seen = [int(i) for micro in batch.micro_batches for i in micro[2]]
            events.write(
                json.dumps(
                    {
                        "generation": session.env.generation,
                        "step": batch.step,
                        "rank": session.rank,
                        "world": session.world_size,
                        "epoch": batch.plan.epoch,
                        "samples": seen,
                        "pid": os.getpid(),
                        "time": time.time(),
                        "loss": loss,
                        "master_addr": session.env.master_addr,
                        "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME", ""),
                    }
                )
                + "\n"
            )
            events.flush()
        if session.rank == 0 and batch.step % 10 == 0:
            print(f"step {batch.step} world {session.world_size} loss {loss:.4f}", flush=True)
        if args.step_time:
            time.sleep(args.step_time)
        if ckpt is not None:
            ckpt.after_step(batch.step + 1)  # pliant: periodic saves, and the rescale protocol
        stop_early()
    if ckpt is not None:
        ckpt.wait()
    # The model is the module built above, whatever the engine and however often the world changed (fsdp's
    # parameters are DTensors: full_tensor() gathers one).
    params = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    if session.rank == 0 and args.out:
        with open(args.out, "w") as out:
            json.dump({"loss": loss, "world": session.world_size, "steps": args.steps}, out)
    if session.rank == 0 and args.params_out:
        torch.save({k: v.detach().cpu() for k, v in params.items()}, args.params_out)
    session.close()


if __name__ == "__main__":
    main()
