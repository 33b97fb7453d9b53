"""In-place rescale with a large model: the survivors' pause when a node joins, in place vs the restart path.

One process per node, two nodes on this machine, examples/train_elastic.py (DDP, SGD with momentum) at a width that
makes model + optimizer state >= 1 GB. Per mode: node a trains alone; node b joins; the survivors' pause is the longest
gap between two of rank 0's steps around the join, minus the median step time of the new world (so it still holds
the new world's slower first step). ``in-place`` runs without a checkpoint directory (the state moves over the new
process group: DDP's broadcast of the parameters, pliant's of the optimizer state); ``restart`` checkpoints at the step
boundary (sync DCP save), exits and restores in new processes. The bandwidth comes from the survivor's own log line
(bytes moved by pliant plus the parameters DDP broadcast, over the re-formation's seconds, set-up included).

Usage: ``.venv/bin/python bench/inplace.py [--width 11600] [--timeout 300]``
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil
from common import join_flags, longest_pause, read_jsonl

from pliant.net import free_port

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_elastic.py"
_REFORM = re.compile(r"rescale in place \(boundary\).* ([0-9.]+)s, (\d+) state bytes")


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    proc.wait(10)


def _wait(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:g}s")
        time.sleep(0.1)


def measure(mode: str, width: int, timeout_s: float) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix=f"bench-inplace-{mode}-"))
    events = work / "events.jsonl"
    port = free_port()
    script = [str(SCRIPT), "--width", str(width), "--samples", "4096", "--global-batch", "8", "--micro-batch", "4",
              "--steps", "1000000", "--events", str(events)]  # fmt: skip
    common = ["--nnodes", "1:2", "--nproc-per-node", "1", "--job", "big", "--heartbeat-ttl", "5", "--join-grace", "1",
              "--rescale", mode, "--rescale-grace", "300", "--start-timeout", "600"]  # fmt: skip
    if mode == "restart":
        common += ["--checkpoint-dir", str(work / "ckpt")]
    procs = []
    try:
        with open(work / "a.log", "wb") as log_a:
            procs.append(subprocess.Popen([sys.executable, "-m", "pliant", "run", "--listen", f"127.0.0.1:{port}",
                                           *common, *script], stdout=log_a,
                                          stderr=subprocess.STDOUT, start_new_session=True))  # fmt: skip
        _wait(lambda: len([e for e in read_jsonl(events) if e["world"] == 1]) >= 5, timeout_s, "5 steps at world 1")
        joined = time.time()
        with open(work / "b.log", "wb") as log_b:
            procs.append(subprocess.Popen([sys.executable, "-m", "pliant", "run", "--coordinator",
                                           f"127.0.0.1:{port}", *join_flags(work / "a.log"), *common, *script],
                                          stdout=log_b,
                                          stderr=subprocess.STDOUT, start_new_session=True))  # fmt: skip
        _wait(lambda: len([e for e in read_jsonl(events) if e["world"] == 2 and e["rank"] == 0]) >= 6, timeout_s,
              "6 steps at world 2")  # fmt: skip
        steps = read_jsonl(events)
        times = sorted(e["time"] for e in steps if e["rank"] == 0 and e["world"] == 2)
        step_s = statistics.median(b - a for a, b in itertools.pairwise(times))  # a step of the new world
        out = {"pause": longest_pause(steps, joined) - step_s, "step": step_s, "join": 0.0}
        out["join"] = min(e["time"] for e in steps if e["world"] == 2 and e["rank"] == 1) - joined
        found = _REFORM.search((work / "a.log").read_text(errors="replace"))
        if found:
            out["reform_s"], out["sync_bytes"] = float(found[1]), float(found[2])
        return out
    finally:
        for proc in procs:
            _kill(proc)
        print(f"{mode}: logs in {work}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=11600, help="hidden width (11600: 1.08 GB model + momentum)")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args()
    w = args.width
    params = 16 * w + w + w * w + w + w + 1
    state_gb = 2 * params * 4 / 1e9  # parameters and SGD momentum, fp32
    print(f"model + optimizer state: {state_gb:.2f} GB ({params / 1e6:.0f}M parameters)", flush=True)
    results = {mode: measure(mode, w, args.timeout) for mode in ("in-place", "restart")}
    inp, rst = results["in-place"], results["restart"]
    print(f"\n{'':<44}{'in-place':>12}{'restart':>12}{'ratio':>10}")
    print(f"{'survivors pause on a join (minus a step)':<44}{inp['pause']:>11.2f}s{rst['pause']:>11.2f}s"
          f"{inp['pause'] / rst['pause']:>9.2f}x")  # fmt: skip
    print(f"{'join -> the newcomer stepping':<44}{inp['join']:>11.2f}s{rst['join']:>11.2f}s"
          f"{inp['join'] / rst['join']:>9.2f}x")  # fmt: skip
    print(f"{'median step at world 2':<44}{inp['step']:>11.2f}s{rst['step']:>11.2f}s")
    if "reform_s" in inp:
        moved = inp["sync_bytes"] + params * 4  # pliant's optimizer broadcast + DDP's parameter broadcast
        print(f"re-formation in place: {inp['reform_s']:.2f}s for {moved / 1e9:.2f} GB of state "
              f"({moved / 1e9 / inp['reform_s']:.2f} GB/s, process group set-up included)")  # fmt: skip


if __name__ == "__main__":
    main()
