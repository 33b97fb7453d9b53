"""Train a small model for K global steps with a pliant engine at several world sizes (ranks forked on gloo, CPU,
fp32). For each world size rank 0 saves the full final parameters and every sample index each rank consumed.

    python tests/integration/engine_job.py --engine ddp --worlds 1 2 3 4 --out DIR
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import Dataset

import pliant.worker as pw
from pliant.env import WorkerEnv


class Regression(Dataset):
    """x ~ N(0, 1)^8, y = x . w + noise; items are (x, y, index)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def loss_fn(model: torch.nn.Module, micro: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(micro[0]), micro[1])


def full_params(engine: pw.Engine) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in engine.module.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = full.detach().cpu().clone()
    return out


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    env = WorkerEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world, master_port=port)
    session = pw.Session(env=env)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    grouped = {"shard_group": min(args.shard_group, world)} if args.shard_group else {}
    engine = session.engine(model, args.engine, torch.optim.SGD, lr=0.05, momentum=0.9, **grouped)
    loader = session.loader(Regression(args.samples), args.global_batch, args.micro_batch, seed=1, max_steps=args.steps)
    ckpt = None
    try:
        if args.ckpt:
            from pliant.worker.checkpoint import CheckpointManager

            if args.fail_async_save:
                _fail_async_saves()
            ckpt = CheckpointManager(
                args.ckpt,
                engine,
                loader,
                job_id="equivalence",
                async_save=args.async_save,
                generation=args.generation,
                every_steps=args.every,
                incarnation="equivalence-1",
            )
            if args.resume:
                assert ckpt.restore() == args.resume, "resumed from the expected step"
        seen: list[int] = []
        for batch in loader:
            engine.step(batch, loss_fn)
            seen += [int(i) for micro in batch.micro_batches for i in micro[2]]
            if ckpt is not None:
                ckpt.after_step(batch.step + 1)
            if ckpt is not None and args.stop_after and batch.step + 1 == args.stop_after:
                ckpt.save(batch.step + 1)  # an async save copies the state while the next steps train
            if ckpt is not None and args.stop_after and batch.step + 1 == args.stop_after + args.train_after_save:
                ckpt.wait()
                break
        params = full_params(engine)
        everyone: list[list[int]] = [[] for _ in range(world)]
        dist.all_gather_object(everyone, seen)
    except Exception as exc:  # with --expect-error: a WorkerError, or on other ranks the peer's exit it causes
        if not args.expect_error:
            raise
        print(f"rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        session.close()
        return
    if rank == 0:
        torch.save({"params": params, "seen": everyone}, os.path.join(args.out, f"world{world}.pt"))
    session.close()


def _fail_async_saves() -> None:
    """Every async save fails as a full disk would (the test of how the error surfaces)."""
    from concurrent.futures import Future

    import torch.distributed.checkpoint as dcp

    def async_save(*args: object, **kwargs: object) -> Future[None]:
        future: Future[None] = Future()
        future.set_exception(OSError(28, "No space left on device"))
        return future

    dcp.async_save = async_save


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", default="ddp")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--samples", type=int, default=37)
    parser.add_argument("--global-batch", type=int, default=10)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shard-group", type=int, default=0, help="hsdp: ranks per shard group (at most the world)")
    parser.add_argument("--ckpt", default="", help="checkpoint directory")
    parser.add_argument("--stop-after", type=int, default=0, help="checkpoint after this many steps and stop")
    parser.add_argument("--resume", type=int, default=0, help="restore (expecting this step) before training")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--train-after-save", type=int, default=0, help="steps to train on before --stop-after stops")
    parser.add_argument("--every", type=int, default=0, help="periodic saves every this many steps")
    parser.add_argument("--generation", type=int, default=1, help="the generation the checkpoint manager runs")
    parser.add_argument("--expect-error", action="store_true", help="print a WorkerError and exit 0")
    parser.add_argument("--fail-async-save", action="store_true", help="async saves fail with ENOSPC")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for world in args.worlds:
        mp.start_processes(rank_main, args=(world, free_port(), args), nprocs=world, start_method="fork")
    sys.exit(0)


if __name__ == "__main__":
    main()
