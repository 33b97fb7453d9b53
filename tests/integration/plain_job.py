"""A plain DDP script (nothing of pliant) for the tests of how failures are blamed and how stops are ordered.

Each rank appends JSON lines to ``--events``: ``{"rank", "world", "step", "node"}`` per completed step, and
``{"rank", "node", "sigterm": STEP}`` when its SIGTERM handler ran. Knobs:

- ``--fail-at-world W``: every rank of a world of W raises the same ValueError after the process group formed (a
  script that cannot train at that size);
- ``--fail-on-node NODE``: the ranks on node NODE (``PLIANT_NODE_ID``) raise a RuntimeError at their third step
  (a node's own fault, which breaks the other ranks' collectives: they die of gloo's error that a peer went away);
- ``--ckpt FILE``: save-on-SIGTERM. The handler only sets a flag; every step all-reduces it, so every rank stops at
  the same step boundary, rank 0 saves that step, and the world resumes from it (no step redone).
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
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--events", required=True)
    parser.add_argument("--fail-at-world", type=int, default=0)
    parser.add_argument("--fail-on-node", default="")
    parser.add_argument("--ckpt", default="")
    args = parser.parse_args()
    node = os.environ.get("PLIANT_NODE_ID", "")

    def record(**fields: object) -> None:
        with open(args.events, "a") as out:
            out.write(json.dumps({"rank": int(os.environ.get("RANK", "0")), "node": node, **fields}) + "\n")

    stop = torch.zeros(1)
    signal.signal(signal.SIGTERM, lambda _signum, _frame: stop.fill_(1.0))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == args.fail_at_world:
        raise ValueError(f"the global batch of 6 does not divide among {world} ranks")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    if args.ckpt and os.path.exists(args.ckpt):
        state = torch.load(args.ckpt, weights_only=True)
        model.module.load_state_dict(state["model"])
        step = int(state["step"])
    while step < args.steps:
        flag = stop.clone()
        dist.all_reduce(flag)
        if flag.item() > 0:
            if stop.item() > 0:
                record(sigterm=step)
            if rank == 0 and args.ckpt:
                torch.save({"model": model.module.state_dict(), "step": step}, args.ckpt + ".tmp")
                os.replace(args.ckpt + ".tmp", args.ckpt)
            dist.barrier()  # every rank waits for the save before any leaves
            dist.destroy_process_group()
            sys.exit(0 if stop.item() > 0 else 143)
        if args.fail_on_node and node == args.fail_on_node and step == 3:
            raise RuntimeError(f"the disk of {node} is full")
        optimizer.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        step += 1
        record(world=world, step=step)
        time.sleep(args.step_time)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
