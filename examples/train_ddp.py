"""A plain torchrun-style DDP training script: it imports nothing of pliant and runs unchanged under ``torchrun`` and
``pliant run``.

It trains a small MLP on synthetic data with env:// initialisation (RANK, WORLD_SIZE, MASTER_ADDR, ...). Like most
torchrun scripts it keeps its own small checkpoint (rank 0 saves after every step) so that a restarted world resumes
where it stopped, and it ends cleanly on SIGTERM (how torchrun, and pliant for a script like this one, stop workers for
a rescale or a preemption). With ``--events FILE`` each rank appends one JSON line per step (used by tests and
benchmarks).

    pliant run --nnodes 1:2 --nproc-per-node 2 examples/train_ddp.py --steps 200
    torchrun --nproc-per-node 2 examples/train_ddp.py --steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="total optimizer steps")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (simulated compute)")
    parser.add_argument("--ckpt", default="", help="checkpoint file (rank 0 writes it; every rank resumes from it)")
    parser.add_argument("--events", default="", help="append one JSON line per rank and step to this file")
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    if args.ckpt and os.path.exists(args.ckpt):
        state = torch.load(args.ckpt, weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
    print(f"rank {rank}/{world} (restart {restart}) starting at step {start}", flush=True)
    step = start

    def on_sigterm(signum: int, frame: object) -> None:
        """Stopped (a rescale, a preemption): rank 0's checkpoint already holds the last completed step, so the
        process ends at once. Not through the interpreter's exit: the peers are stopping too, and a gloo group whose
        collective they left would be torn down by threads that wait for them."""
        print(f"rank {rank}: SIGTERM at step {step}: stopping", flush=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)

    events = open(args.events, "a") if args.events else None  # noqa: SIM115
    for step in range(start, args.steps):
        gen = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(args.batch, 32, generator=gen)
        y = x.sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if args.step_time:
            time.sleep(args.step_time)
        if rank == 0 and args.ckpt:
            tmp = f"{args.ckpt}.tmp"
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1}
            torch.save(state, tmp)
            os.replace(tmp, args.ckpt)
        if events is not None:
            line = {
                "rank": rank,
                "world": world,
                "step": step,
                "restart": restart,
                "time": time.time(),
                "pid": os.getpid(),
            }
            events.write(json.dumps(line) + "\n")
            events.flush()
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step} world {world} loss {loss.item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # The process ends here, without the interpreter's teardown: gloo's run-loop thread can still be releasing the last
    # gradient all-reduce, which holds a Python object captured during backward, and a thread that takes the GIL while
    # the interpreter finalizes aborts the process ("terminate called without an active exception", SIGABRT; PyTorch
    # issue 117762). Everything this script writes is flushed or closed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
