"""Checkpoint benchmark, in one run on this machine's disk:

- save and load throughput of a pliant (DCP) checkpoint of a DDP model + SGD momentum, 2 ranks forked on gloo,
  against ``dd`` write (fdatasync) and read bandwidth of the same directory; pliant writes its files around the page
  cache (``O_DIRECT``, pliant.worker.directio), and the same saves through it (DCP's own files) are measured too;
- the training stall of an async save against a sync save: what ``save()`` blocks for, plus how much longer than
  typical the steps take until the save is on disk, 6 at least (an async save copies the state to host memory in the
  background, the next optimizer step waits for that copy, and the write then runs beside the following steps), plus
  any wait for it after 30 steps, minus how much longer than typical as many steps right after with no save take
  (the pair shares the drift, and a sum of steps minus as many medians is not zero by itself); median of 5 saves.
  Each rank trains with one thread, as ``pliant run`` gives two workers on two cores.
  With ``--engine zero`` or ``fsdp``, also async saves written from a buddy snapshot of the step
  (pliant.worker.staging), taken as the rescale protocol takes one for a save, and sent to the buddy rank as every
  snapshot is (also through the page cache); and such snapshots alone, so that the difference is what a save costs at
  a step whose snapshot the cadence took anyway;
- the rescale pause: last step of generation n -> every rank stepping in generation n+1, when a second node joins a
  ``pliant run`` job (examples/train_elastic.py with --checkpoint-dir).

Usage: ``.venv/bin/python bench/checkpoint.py [--dir DIR] [--mb 512] [--ranks 2] [--engine ddp|zero|fsdp]
[--no-rescale]``
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import PLIANT, join_flags, read_jsonl
from torch.utils.data import TensorDataset

import pliant.worker as pw
from pliant.env import WorkerEnv
from pliant.worker.checkpoint import CheckpointManager
from pliant.worker.contract import LOCAL, Engine, Runner, Staged
from pliant.worker.inplace.buddy import BuddyCopies

ROOT = Path(__file__).resolve().parent.parent
WINDOW = 6  # steps after a save whose excess time counts, at least (more while the save is still being written)
REPEATS = 5  # saves per mode; the figures are their medians
# "-buffered": the files written through the page cache, as DCP's own writer does (CheckpointManager(direct_io=False))
MODES = ("sync", "sync-buffered", "async", "snapshot", "snapshot-buffered", "exchange")


def dd(directory: Path, mb: int) -> tuple[float, float]:
    """(write MB/s with fdatasync, read MB/s) of a file of ``mb`` MB in ``directory``."""
    path = directory / "dd.bin"
    out = subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mb}", "conv=fdatasync"],
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    write = mb / float(re.search(r"copied, ([\d.]+) s", out).group(1))  # type: ignore[union-attr]
    subprocess.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"], capture_output=True)
    out = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=1M"], capture_output=True, text=True, check=True)
    read = mb / float(re.search(r"copied, ([\d.]+) s", out.stderr).group(1))  # type: ignore[union-attr]
    path.unlink()
    return write, read


def rank_main(rank: int, world: int, port: int, directory: str, mb: int, kind: str, queue: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    torch.set_num_threads(1)
    session = pw.Session(
        env=WorkerEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world, master_port=port)
    )
    width = int((mb * 2**20 / 4 / 4) ** 0.5)  # two square layers: parameters = mb / 2, momentum the other half
    model = torch.nn.Sequential(torch.nn.Linear(width, width, bias=False), torch.nn.Linear(width, width, bias=False))
    engine = session.engine(model, kind, torch.optim.SGD, lr=0.01, momentum=0.9)
    data = TensorDataset(torch.randn(4096, width))
    loader = session.loader(data, global_batch=16, micro_batch=8)
    batches = iter(loader)

    def loss_fn(model: torch.nn.Module, micro: list[torch.Tensor]) -> torch.Tensor:
        return model(micro[0]).pow(2).mean()

    def step() -> float:
        t0 = time.perf_counter()
        engine.step(next(batches), loss_fn)
        return time.perf_counter() - t0

    def pending(ckpt: CheckpointManager) -> bool:
        flag = torch.tensor([int(ckpt.pending)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank runs the same steps
        return bool(flag.item())

    settled: list[float] = []

    def settle() -> None:
        started = time.perf_counter()
        copies.settle()
        settled.append(time.perf_counter() - started)

    def snapshot_of(engine: Engine, step: int) -> Staged | None:
        """What the rescale protocol does for a sharded engine's save when its cadence took no snapshot then."""
        copies.snapshot(engine, 1, rank, step, [])  # each rank a node of its own: the buddy is the other rank
        engine.staging = settle  # the next optimizer step waits for the copy
        return copies.staged(step)

    class Snapshots(Runner):
        """The rescale protocol's part in a save: the buddy snapshot of the step."""

        def snapshot_for_save(self, engine: Engine, step: int) -> Staged | None:
            return snapshot_of(engine, step)

    copies = BuddyCopies(lambda make: make())
    results: dict[str, float] = {}
    done = 0
    for _ in range(2 if kind != "ddp" else 0):  # the snapshots' two buffers, touched once (a job's first K steps)
        step()  # the first creates the optimizer state, which a snapshot holds
        snapshot_of(engine, done)
    for mode in MODES if kind != "ddp" else MODES[:3]:
        ckpt = CheckpointManager(
            Path(directory) / mode,
            engine,
            async_save=not mode.startswith("sync"),
            keep=1,
            direct_io=not mode.endswith("-buffered"),
            runner=Snapshots() if mode.startswith("snapshot") else LOCAL,
        )
        plain, stalls, totals, spans = [], [], [], []
        for _ in range(REPEATS):
            for _ in range(4):
                dist.barrier()
                plain.append(step())
            done += 1
            t0 = time.perf_counter()
            settled.clear()
            if mode == "exchange":  # a snapshot alone, as the cadence takes them
                snapshot_of(engine, done)
                launched = time.perf_counter() - t0
            else:
                ckpt.save(done)  # save() times itself (a snapshot it takes included): ckpt.stalled_s
            during = [step()]  # the optimizer step waits for an async save's copy of the state
            blocked = (launched if mode == "exchange" else ckpt.stalled_s) + sum(settled)
            while (pending(ckpt) or len(during) < WINDOW) and len(during) < 30:
                during.append(step())  # the write (and a snapshot's exchange) goes on beside these
            waited = time.perf_counter()
            ckpt.wait()
            waited = time.perf_counter() - waited
            dist.barrier()
            totals.append(time.perf_counter() - t0 - sum(during))
            control = []  # as many steps again with no save, paired with the save's (the same drift and skew)
            while len(control) < len(during):
                pending(ckpt)
                control.append(step())
            stalls.append((blocked, during, waited, control))
            spans.append(len(during))
        typical = statistics.median(plain)
        # The stall: what save() blocked, plus the time the steps until the save was on disk (at least WINDOW) took
        # beyond typical ones, plus any wait for it after them, minus what as many steps with no save took beyond
        # typical ones right after (a sum of steps minus as many medians is not zero by itself: -0.25 to +0.39 s here).
        results[f"{mode} stall"] = statistics.median(b + sum(d) - sum(c) + w for b, d, w, c in stalls)
        results[f"{mode} blocked"] = statistics.median(b for b, _, _, _ in stalls)
        results[f"{mode} noise"] = statistics.median(sum(c) - typical * len(c) for _, _, _, c in stalls)
        results[f"{mode} total"] = statistics.median(totals)
        results[f"{mode} steps"] = statistics.median(spans)
        results["step"] = typical
    subprocess.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"], capture_output=True)
    loads = []
    for _ in range(3):
        ckpt = CheckpointManager(Path(directory) / "sync", engine, keep=1)
        dist.barrier()
        t0 = time.perf_counter()
        ckpt.restore()
        dist.barrier()
        loads.append(time.perf_counter() - t0)
    results["load"] = statistics.median(loads)
    results["bytes"] = sum(f.stat().st_size for f in (Path(directory) / "sync").rglob("*.distcp"))
    if rank == 0:
        queue.put(results)
    session.close()


def rescale_pause(workdir: Path) -> float:
    """Seconds from generation n's last step to every rank stepping in generation n+1 when a node joins."""
    port = _free_port()
    events, ckpt = workdir / "events.jsonl", workdir / "ckpt"
    script = [
        str(ROOT / "examples" / "train_elastic.py"),
        "--steps",
        "100000",
        "--step-time",
        "0.05",
        "--events",
        str(events),
    ]
    common = [
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "2",
        "--job",
        "bench",
        "--checkpoint-dir",
        str(ckpt),
        "--rescale",
        "restart",
    ]
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / "a.log", "wb") as log:
        a = subprocess.Popen(
            [sys.executable, "-m", "pliant", "run", "--listen", f"127.0.0.1:{port}", *common, *script],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    b = None
    try:
        _wait(lambda: any(e["world"] == 2 for e in read_jsonl(events)), 120)
        time.sleep(2)
        b = subprocess.Popen(
            [
                *PLIANT,
                "run",
                "--coordinator",
                f"127.0.0.1:{port}",
                *join_flags(workdir / "a.log"),
                *common,
                *script,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        _wait(lambda: {e["rank"] for e in read_jsonl(events) if e["world"] == 4} == {0, 1, 2, 3}, 120)
        evs = read_jsonl(events)
        last_old = max(e["time"] for e in evs if e["world"] == 2)
        first_new = {}
        for e in evs:
            if e["world"] == 4:
                first_new.setdefault(e["rank"], e["time"])
        return max(first_new.values()) - last_old
    finally:
        for proc in (b, a):
            if proc is not None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in (b, a):
            if proc is not None:
                proc.wait(60)


def _wait(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit("benchmark scenario timed out")
        time.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="", help="directory on the disk to measure (default: a temporary one)")
    parser.add_argument("--mb", type=int, default=512, help="checkpoint size (parameters + momentum), MB")
    parser.add_argument("--ranks", type=int, default=2, help="training processes (one thread each)")
    parser.add_argument("--no-rescale", action="store_true", help="skip the rescale pause")
    parser.add_argument(
        "--engine",
        choices=["ddp", "zero", "fsdp"],
        default="ddp",
        help="zero, fsdp: also async saves written from a buddy snapshot (pliant.worker.staging)",
    )
    args = parser.parse_args()
    directory = Path(args.dir or tempfile.mkdtemp(prefix="pliant-ckpt-bench-"))
    directory.mkdir(parents=True, exist_ok=True)
    write_bw, read_bw = dd(directory, args.mb)
    queue = mp.get_context("fork").Queue()
    mp.start_processes(
        rank_main,
        args=(args.ranks, _free_port(), str(directory), args.mb, args.engine, queue),
        nprocs=args.ranks,
        start_method="fork",
    )
    r = queue.get()
    mb = r["bytes"] / 2**20
    pause = 0.0 if args.no_rescale else rescale_pause(directory / "rescale")
    print(f"\ncheckpoint of {mb:.0f} MB ({args.engine}, {args.ranks} ranks, gloo) in {directory}")
    print(f"  dd write (fdatasync)   {write_bw:8.0f} MB/s")
    print(
        f"  pliant sync save       {mb / r['sync total']:8.0f} MB/s   ({r['sync total']:.2f} s; "
        f"{mb / r['sync total'] / write_bw:.2f}x dd; O_DIRECT)"
    )
    print(
        f"    through the page cache {mb / r['sync-buffered total']:6.0f} MB/s   ({r['sync-buffered total']:.2f} s; "
        f"{mb / r['sync-buffered total'] / write_bw:.2f}x dd; DCP's own files)"
    )
    print(f"  dd read                {read_bw:8.0f} MB/s")
    print(
        f"  pliant load            {mb / r['load']:8.0f} MB/s   ({r['load']:.2f} s; {mb / r['load'] / read_bw:.2f}x dd)"
    )
    noise = [r[f"{mode} noise"] for mode in MODES if f"{mode} noise" in r]
    print(
        f"  a step {r['step']:.3f} s; the same steps with no save took {min(noise):+.3f} to {max(noise):+.3f} s "
        f"longer than typical ones (medians per mode: the noise that the stalls below subtract)"
    )
    print(
        f"  training stall of a sync save {r['sync stall']:.3f} s, of which the training "
        f"thread waited {r['sync blocked']:.3f} s; through the page cache {r['sync-buffered stall']:.3f} s and "
        f"{r['sync-buffered blocked']:.3f} s"
    )
    for mode, what in (
        ("async", "async save"),
        ("snapshot", "async save from a buddy snapshot taken for it"),
        ("snapshot-buffered", "the same, its files through the page cache"),
        ("exchange", "that buddy snapshot alone (copy, and exchange with the buddy)"),
    ):
        if f"{mode} stall" in r:
            print(
                f"  {what}: stall {r[f'{mode} stall']:.3f} s ({r[f'{mode} stall'] / r['sync stall']:.2f}x; "
                f"{r[f'{mode} stall'] / r['sync blocked']:.2f}x of the sync save's wait), "
                f"counting the steps slowed until it was on disk ({r[f'{mode} steps']:.0f} steps); the training "
                f"thread waited {r[f'{mode} blocked']:.3f} s ({r[f'{mode} blocked'] / r['sync blocked']:.2f}x: "
                f"save(), and the optimizer step for the copy)"
            )
    if "exchange stall" in r:
        extra, buffered = (r[f"{mode} stall"] - r["exchange stall"] for mode in ("snapshot", "snapshot-buffered"))
        print(
            f"  so a save at a step whose snapshot the cadence took anyway stalls {extra:.3f} s "
            f"({extra / r['sync stall']:.2f}x; {buffered:.3f} s through the page cache), against "
            f"{r['async stall']:.3f} s through DCP's own copy"
        )
    if not args.no_rescale:
        print(
            f"  rescale pause by the restart path (node joins, 2 -> 4 ranks, checkpoint + restart + restore): "
            f"{pause:.2f} s"
        )
    shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
