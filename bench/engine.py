"""Engine benchmark (2 ranks forked on gloo, CPU): the pliant DDP engine against plain torch DDP on the same model and
data, and the cost of a shadow step (a rank with no micro-batch) relative to a real step, for DDP and FSDP2.

- throughput: global batch 2 x 64, one micro-batch of 64 per rank per step; plain DDP uses the same DataLoader batches
  and a mean loss. Reported as the median step and the ratio pliant / plain (goal >= 0.99), without and with the
  rescale protocol's commit vote (three int32 all-reduced, spaced as under ``pliant run``: about every 0.1 s). On a
  2-core host the ratio of one chunk of 25 steps moves by 20 % and that of a run of 600 steps by a few percent: use
  ``--steps 2000`` or more for a figure to 1-2 %. The quartiles of the ratios of adjacent chunks show that spread.
  ``--no-shadow`` times these three runs only.
- shadow: global batch 64 (one micro-batch: rank 1 is idle every step, so it shadows) against global batch 128 (both
  ranks real). Reported as the idle rank's step time / a real step time.
- ``--tiny``: the same runs on a model of one 8 x 8 layer, whose step is little more than the gradient all-reduce's
  latency: the difference between the engine's median step and plain DDP's is pliant's fixed cost per step, in
  microseconds, which the ratios on the real model cannot resolve on a 2-core host.

Usage: ``.venv/bin/python bench/engine.py [--steps 200] [--tiny] [--no-shadow]``
"""

from __future__ import annotations

import argparse
import itertools
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import pliant.worker as pw
from pliant.env import WorkerEnv
from pliant.worker.inplace.protocol import Protocol

MICRO = 64
CHUNK = 25  # steps of one run timed before the next run's


TINY = 8  # --tiny: features and classes of the one-layer model


def make_model(tiny: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    if tiny:
        return torch.nn.Sequential(torch.nn.Linear(TINY, TINY))
    return torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    )


def dataset(n: int = 40000, tiny: bool = False) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    features, classes = (TINY, TINY) if tiny else (256, 10)
    return TensorDataset(torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g))


def loss_fn(model: torch.nn.Module, micro: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(micro[0]), micro[1])


def timed(steps: int, warmup: int, step) -> list[float]:
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        step(i)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def plain_ddp_step(rank: int, world: int, tiny: bool = False):  # type: ignore[no-untyped-def]
    """One step of plain torch DDP (a function of the step index)."""
    model = DistributedDataParallel(make_model(tiny))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = dataset(tiny=tiny)
    sampler = torch.utils.data.distributed.DistributedSampler(data, world, rank, seed=0)

    def epochs():  # as many epochs as --steps needs, like the pliant loader
        for epoch in itertools.count():
            sampler.set_epoch(epoch)
            yield from DataLoader(data, batch_size=MICRO, sampler=sampler)

    batches = epochs()

    def step(_i: int) -> None:
        x, y = next(batches)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def pliant_engine_step(
    rank: int,
    world: int,
    kind: str,
    global_batch: int,
    vote: bool = False,  # type: ignore[no-untyped-def]
    tiny: bool = False,
):
    """One step of the pliant engine (a function of the step index); ``vote``: under the rescale protocol, as under an
    agent (the commit vote before every optimizer step)."""
    session = pw.Session(
        env=WorkerEnv(
            rank=rank,
            local_rank=rank,
            world_size=world,
            local_world_size=world,
            master_port=int(os.environ["MASTER_PORT"]),
        )
    )
    engine = session.engine(make_model(tiny), kind, torch.optim.SGD, lr=0.01)
    if vote:  # the runner a session under an agent gives its engines
        engine.runner = Protocol(session.world, session.device, session.metrics, rescale_in_place=True)
        engine.runner.add_engine(engine)
    batches = iter(session.loader(dataset(tiny=tiny), global_batch, MICRO))
    return lambda _i: engine.step(next(batches), loss_fn)


def interleaved(steps: int, runs: dict[str, object], chunk: int = CHUNK) -> dict[str, list[list[float]]]:
    """Time the step functions in alternating chunks (A B A B ...), so that drift on a busy machine hits all alike.
    Returns each one's step times, chunk by chunk."""
    times: dict[str, list[list[float]]] = {name: [] for name in runs}
    for step in runs.values():
        timed(0, 10, step)  # warm-up
    for start in range(0, steps, chunk):
        for name, step in runs.items():
            times[name].append(timed(min(chunk, steps - start), 0, step))
    return times


def paired(plain: list[float], ours: list[float]) -> tuple[float, float, float]:
    """Quartiles (25 %, 50 %, 75 %) of the throughput ratio plain / ours over the pairs of adjacent chunks (one chunk's
    median step each): the spread a single figure hides."""
    ratios = sorted(p / o for p, o in zip(plain, ours, strict=True))
    q1, q2, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return q1, q2, q3


def rank_main(
    rank: int, world: int, port: int, steps: int, queue: mp.Queue, tiny: bool = False, shadow: bool = True
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    runs = {
        "plain ddp": plain_ddp_step(rank, world, tiny),
        "pliant ddp": pliant_engine_step(rank, world, "ddp", MICRO * world, tiny=tiny),
        "pliant ddp, commit vote": pliant_engine_step(rank, world, "ddp", MICRO * world, vote=True, tiny=tiny),
    }
    if shadow:
        runs |= {
            "pliant ddp, one micro-batch": pliant_engine_step(rank, world, "ddp", MICRO, tiny=tiny),
            "pliant fsdp": pliant_engine_step(rank, world, "fsdp", MICRO * world, tiny=tiny),
            "pliant fsdp, one micro-batch": pliant_engine_step(rank, world, "fsdp", MICRO, tiny=tiny),
        }
    dist.barrier()
    times = interleaved(steps, runs)
    results = {name: statistics.median(t for chunk in chunks for t in chunk) for name, chunks in times.items()}
    results |= {f"{name} chunks": [statistics.median(chunk) for chunk in chunks] for name, chunks in times.items()}
    queue.put((rank, results))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tiny", action="store_true", help="a one-layer 8 x 8 model: pliant's fixed cost per step")
    parser.add_argument(
        "--no-shadow", action="store_true", help="the throughput ratios only (no shadow steps, no FSDP2)"
    )
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    mp.start_processes(
        rank_main, args=(2, port, args.steps, queue, args.tiny, not args.no_shadow), nprocs=2, start_method="fork"
    )
    results = dict(queue.get() for _ in range(2))
    plain, ours = results[0]["plain ddp"], results[0]["pliant ddp"]
    model = f"one {TINY} x {TINY} layer" if args.tiny else "256-512-512-10 MLP"
    print(f"\nmedian step time, 2 ranks, {model}, {args.steps} steps each, interleaved in chunks of {CHUNK} (rank 0)")
    print(f"  plain torch DDP            {plain * 1e3:8.2f} ms")
    voted = results[0]["pliant ddp, commit vote"]
    print(f"  pliant DDP engine          {ours * 1e3:8.2f} ms   throughput ratio pliant/plain = {plain / ours:.3f}")
    print(
        f"  ... with the commit vote   {voted * 1e3:8.2f} ms   throughput ratio pliant/plain = {plain / voted:.3f} "
        f"(as under pliant run)"
    )
    for name in ("pliant ddp", "pliant ddp, commit vote"):
        q1, q2, q3 = paired(results[0]["plain ddp chunks"], results[0][f"{name} chunks"])
        print(f"  {name}: ratio per pair of adjacent chunks, median {q2:.3f}, middle half {q1:.3f}-{q3:.3f}")
    print(
        f"  pliant's fixed cost per step: {(ours - plain) * 1e6:+.0f} us, {(voted - plain) * 1e6:+.0f} us with the "
        f"vote (medians; meaningful with --tiny)"
    )
    for kind in ("ddp", "fsdp") if not args.no_shadow else ():
        real = results[1][f"pliant {kind}"]
        shadow = results[1][f"pliant {kind}, one micro-batch"]
        busy = results[0][f"pliant {kind}, one micro-batch"]
        print(
            f"  {kind:4s} real step (rank 1)     {real * 1e3:8.2f} ms   shadow step (rank 1 idle) "
            f"{shadow * 1e3:8.2f} ms = {shadow / real:.2f}x a real step (rank 0 meanwhile {busy * 1e3:.2f} ms)"
        )


if __name__ == "__main__":
    main()
