"""A torchrun DDP script with exactly-once data and a fixed global batch: ``pliant.data.GlobalBatchLoader`` in place of
a ``DataLoader`` with a ``DistributedSampler``, and its ``state_dict`` saved with the checkpoint. It runs unchanged
under ``torchrun`` and ``pliant run``; at every world size a step trains the same ``--global-batch`` samples (each
rank accumulates the micro-batches of its share), and a world that resumes from the checkpoint continues at the next
unseen sample.

    pliant run --nnodes 1:2 --nproc-per-node 2 examples/train_torchrun_data.py --global-batch 64 --ckpt /shared/c.pt
    torchrun --nproc-per-node 2 examples/train_torchrun_data.py --global-batch 64

Rank 0 saves the checkpoint after every step; on SIGTERM (a rescale, a preemption) the process ends at the end of the
step in progress (a step whose peer already stopped fails its collective and ends the process there). With
``--events FILE`` each rank appends one JSON line per step (the step, the world and the dataset indices it trained);
``--out FILE``: rank 0 writes the final step and the parameters there. ``--sampler distributed`` trains as a torchrun
script commonly does instead, for comparison (``bench/data_resume.py``): a ``DistributedSampler`` (global batch =
batch size x world), an epoch loop, and a resumed epoch's trained batches skipped by count.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from pliant.data import GlobalBatchLoader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-steps", type=int, default=100, help="total optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per micro-batch (per rank)")
    parser.add_argument("--global-batch", type=int, default=32, help="samples per step at every world size")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (simulated compute)")
    parser.add_argument("--ckpt", default="", help="checkpoint file (rank 0 writes it; every rank resumes from it)")
    parser.add_argument("--events", default="", help="append one JSON line per rank and step to this file")
    parser.add_argument("--out", default="", help="rank 0 writes the final step and parameters here")
    parser.add_argument("--sampler", choices=["pliant", "distributed"], default="pliant")
    parser.add_argument("--samples", type=int, default=2000, help="samples in the dataset")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + 1

    x = torch.randn(args.samples, 8, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, x.sum(dim=1, keepdim=True), torch.arange(len(x)))
    if args.sampler == "distributed":
        sampler = DistributedSampler(data, seed=0)
        loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
        accumulation = 1
    else:
        loader = GlobalBatchLoader(data, args.batch_size, args.global_batch)  # pliant: the loader (rank, world: dist's)
        accumulation = loader.global_batch_sampler.accumulation

    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = 0
    if args.ckpt and os.path.exists(args.ckpt):
        state = torch.load(args.ckpt, weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if isinstance(loader, GlobalBatchLoader):
            loader.load_state_dict(state["data"])  # pliant: where the last world stopped in the sample stream
        step = int(state["step"])
    print(f"rank {rank}/{world}: step {step}, {accumulation} micro-batches a step", flush=True)

    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.set())  # ends at the step's end, below
    events = open(args.events, "a") if args.events else None  # noqa: SIM115
    samples: list[int] = []
    skip = step % len(loader) if args.sampler == "distributed" else 0  # the resumed epoch's trained batches
    while step < args.max_steps:
        if args.sampler == "distributed":
            sampler.set_epoch(step // len(loader))
        for i, (inputs, targets, index) in enumerate(loader):  # the rest of this epoch
            if args.sampler == "distributed" and i < skip:
                continue
            last = (i + 1) % accumulation == 0
            with contextlib.nullcontext() if last else model.no_sync():
                loss = torch.nn.functional.mse_loss(model(inputs), targets) / accumulation
                loss.backward()
            samples += index.tolist()
            if not last:
                continue
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if rank == 0 and args.ckpt:
                state = {
                    "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": step,
                    "data": loader.state_dict() if isinstance(loader, GlobalBatchLoader) else {},  # pliant
                }
                torch.save(state, f"{args.ckpt}.tmp")
                os.replace(f"{args.ckpt}.tmp", args.ckpt)
            if events is not None:
                line = {"rank": rank, "world": world, "step": step - 1, "generation": generation, "pid": os.getpid()}
                events.write(json.dumps({**line, "time": time.time(), "samples": samples}) + "\n")
                events.flush()
            samples = []
            if stopping.is_set():  # rank 0's checkpoint holds this step: nothing to save, and no exit handler to run
                os._exit(0)
            time.sleep(args.step_time)
            if step >= args.max_steps:
                break
        skip = 0
    if args.out and rank == 0:
        params = torch.cat([p.detach().flatten() for p in model.module.parameters()]).tolist()
        with open(args.out, "w") as out:
            json.dump({"global_step": step, "world_size": world, "params": params}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Without the interpreter's teardown, like train_ddp.py: gloo's run-loop thread may still be releasing the last
    # gradient all-reduce, and a thread that takes the GIL while the interpreter finalizes aborts the process (PyTorch
    # issue 117762).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
