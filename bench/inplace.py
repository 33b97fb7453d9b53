"""In-place rescale with a large model: the survivors' pause when a node joins, in place vs the restart path.

One process per node, two nodes on this machine, examples/train_elastic.py (DDP, SGD with momentum) at a width that
makes model + optimizer state >= 1 GB. Per mode: node a trains alone; node b joins; the survivors' pause is the longest
gap between two of rank 0's steps around the join, minus the median step time of the new world (so it still holds
the new world's slower first step); and the gap across the world change alone (rank 0's last step at world 1 to its
first at world 2, minus the same), without the world-1 steps that the newcomer's start on the same two cores slows
(building 1 GB of model and optimizer state took one such step from 0.5 s to 5.4 s). ``in-place`` runs without a
checkpoint directory (pliant broadcasts the parameters and the optimizer state over the new process group; DDP's own
broadcast at wrap time is off); ``restart`` checkpoints at the step boundary (sync DCP save), exits and restores in
new processes. The bandwidth comes from the survivor's own log line (the bytes broadcast over the re-formation's
seconds, set-up included).

Then the cost of ZeRO's buddy copies (pliant.worker.inplace.buddy) at the default snapshot interval (``auto``: the
workers choose K from the copies' measured cost, pliant.worker.inplace.cadence; the K in force is their
``pliant_worker_snapshot_every`` gauge): one node with 2 ZeRO ranks trains the same model under ``--rescale in-place``
with snapshots (copied and sent to the buddy in the background) and without copies in the window (``--snapshot-every``
10**6: the one snapshot after the first step comes before it), steady-state steps/s over the same step window,
in ``--pairs`` alternating pairs of runs (the spread between two runs of the same job on a small machine exceeds the
copies' cost: the median of the pairs' costs is reported). Inside each run the cost is also estimated from rank 0's
step durations by their place after a snapshot (``in_run_cost``; the snapshots' steps follow from the K changes the
workers logged, ``snapshot_steps``; a run without copies, given the same steps, gives the estimate's noise); the
workers' own ``pliant_worker_snapshot_stall_seconds`` gives the time the snapshots held the training thread. Last, a
kill -9 of one ZeRO rank under in-place: the survivors roll back to the last snapshot, rebuilt from the buddies'
copies (time to all ranks stepping, steps redone).

Usage: ``.venv/bin/python bench/inplace.py [--width 11600] [--timeout 300] [--only join|buddy] [--pairs 3]
[--snapshot-every auto|K]``
"""

from __future__ import annotations

import argparse
import itertools
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil
from common import (
    PLIANT,
    change_gap,
    elastic_args,
    in_run_cost,
    join_flags,
    longest_pause,
    read_jsonl,
    sample,
    scrape,
    snapshot_steps,
    stop_tree,
)

from pliant.net import free_port
from pliant.worker.inplace.cadence import FIRST_SNAPSHOT_EVERY

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_elastic.py"
_REFORM = re.compile(r"rescale in place \(boundary\).* ([0-9.]+)s, (\d+) state bytes")
_EVERY = re.compile(r"^\[0\]:.*buddy snapshots every (\d+) steps from step (\d+)", re.M)  # rank 0's changes of K


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
    script = [str(SCRIPT), *elastic_args(1000000, 4096, 8, micro_batch=4, events=events, extra=("--width", str(width)))]
    common = [
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "1",
        "--job",
        "big",
        "--heartbeat-ttl",
        "5",
        "--join-grace",
        "1",
        "--rescale",
        mode,
        "--rescale-grace",
        "300",
        "--start-timeout",
        "600",
    ]
    if mode == "restart":
        common += ["--checkpoint-dir", str(work / "ckpt")]
    procs = []
    try:
        with open(work / "a.log", "wb") as log_a:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "pliant", "run", "--listen", f"127.0.0.1:{port}", *common, *script],
                    stdout=log_a,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        _wait(lambda: len([e for e in read_jsonl(events) if e["world"] == 1]) >= 5, timeout_s, "5 steps at world 1")
        joined = time.time()
        with open(work / "b.log", "wb") as log_b:
            procs.append(
                subprocess.Popen(
                    [
                        *PLIANT,
                        "run",
                        "--coordinator",
                        f"127.0.0.1:{port}",
                        *join_flags(work / "a.log"),
                        *common,
                        *script,
                    ],
                    stdout=log_b,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        _wait(
            lambda: len([e for e in read_jsonl(events) if e["world"] == 2 and e["rank"] == 0]) >= 6,
            timeout_s,
            "6 steps at world 2",
        )
        steps = read_jsonl(events)
        times = sorted(e["time"] for e in steps if e["rank"] == 0 and e["world"] == 2)
        step_s = statistics.median(b - a for a, b in itertools.pairwise(times))  # a step of the new world
        out = {
            "pause": longest_pause(steps, joined) - step_s,
            "step": step_s,
            "join": 0.0,
            "change": change_gap(steps, 1, 2) - step_s,
        }
        out["join"] = min(e["time"] for e in steps if e["world"] == 2 and e["rank"] == 1) - joined
        found = _REFORM.search((work / "a.log").read_text(errors="replace"))
        if found:
            out["reform_s"], out["sync_bytes"] = float(found[1]), float(found[2])
        return out
    finally:
        for proc in procs:
            stop_tree(proc)
        shutil.rmtree(work / "ckpt", ignore_errors=True)  # the restart path's checkpoints: a GB each
        print(f"{mode}: logs in {work}", flush=True)


WARM, WINDOW = 40, 64  # steady-state steps/s over steps WARM..WARM+WINDOW (the automatic K is set by step 34)


def steady(
    width: int, timeout_s: float, every: str = "auto", kill: bool = False, schedule: list[int] | None = None
) -> dict:
    """Steady-state steps/s of 2 ZeRO ranks on one node under ``--rescale in-place``, with a buddy snapshot every
    ``every`` steps (``auto``: the workers' choice; the result's ``every`` is the K in force at the end and
    ``schedule`` the committed steps at each snapshot); the in-run estimate uses ``schedule`` if given (a run without
    copies: its noise); with ``kill``, then a kill -9 of rank 1 and the in-place recovery."""
    work = Path(tempfile.mkdtemp(prefix=f"bench-buddy-every{every}-"))
    events, metrics_port = work / "events.jsonl", free_port()
    warm, window = WARM, WINDOW
    script = [
        str(SCRIPT),
        *elastic_args(1000000, 4096, 8, micro_batch=4, engine="zero", events=events, extra=("--width", str(width))),
    ]
    cmd = [
        *PLIANT,
        "run",
        "--nproc-per-node",
        "2",
        "--rescale",
        "in-place",
        "--max-restarts",
        "3",
        "--metrics-port",
        str(metrics_port),
        "--start-timeout",
        "600",
        "--snapshot-every",
        every,
        *script,
    ]
    with open(work / "a.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:

        def rank0() -> list[dict]:
            return [e for e in read_jsonl(events) if e["rank"] == 0]

        _wait(lambda: len(rank0()) > warm + window, timeout_s, f"{warm + window} steps")
        times = {e["step"]: e["time"] for e in rank0()}
        m = scrape(f"http://127.0.0.1:{metrics_port}/metrics")
        changes = [(int(k), int(step)) for k, step in _EVERY.findall((work / "a.log").read_text(errors="replace"))]
        fixed = int(every) if every.isdigit() else 0
        mine = snapshot_steps(changes, warm + window + 1, fixed or FIRST_SNAPSHOT_EVERY)
        out = {
            "steps_s": window / (times[warm + window] - times[warm]),
            "schedule": mine,
            "every": int(sample(m, "pliant_worker_snapshot_every") or 0) or fixed,
            "in_run": in_run_cost(times, range(warm + 1, warm + window + 1), schedule or mine),
        }
        count = sample(m, "pliant_worker_snapshot_stall_seconds_count") or 0.0
        out["stall"] = (sample(m, "pliant_worker_snapshot_stall_seconds_sum") or 0.0) / count if count else 0.0
        out["snap_bytes"] = (sample(m, "pliant_worker_snapshot_bytes_total") or 0.0) / count if count else 0.0
        if kill:
            pids = {e["rank"]: e["pid"] for e in read_jsonl(events)}
            last = max(times)
            killed = time.time()
            psutil.Process(pids[1]).kill()
            _wait(
                lambda: (
                    len({e["rank"] for e in read_jsonl(events) if e["time"] > killed + 0.01 and e["pid"] != pids[1]})
                    == 2
                ),
                timeout_s,
                "both ranks stepping after the kill",
            )
            after = [e for e in read_jsonl(events) if e["time"] > killed]
            resumed = min(e["step"] for e in after if e["rank"] == 0)
            out["recover_s"] = max(min(e["time"] for e in after if e["rank"] == r) for r in (0, 1)) - killed
            out["redone"] = max(0, last + 1 - resumed)
            log = (work / "a.log").read_text(errors="replace")
            out["rolled_back"] = float("rolled back to the snapshot" in log)
        return out
    finally:
        stop_tree(proc)
        print(f"buddy copies (every {every} steps): logs in {work}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=11600, help="hidden width (11600: 1.08 GB model + momentum)")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--only", choices=["join", "buddy"], default="", help="run one part")
    parser.add_argument("--pairs", type=int, default=3, help="alternating runs without and with buddy copies")
    parser.add_argument("--snapshot-every", default="auto", help="K of the runs with copies (default auto)")
    args = parser.parse_args()
    w = args.width
    params = 16 * w + w + w * w + w + w + 1
    state_gb = 2 * params * 4 / 1e9  # parameters and SGD momentum, fp32
    print(f"model + optimizer state: {state_gb:.2f} GB ({params / 1e6:.0f}M parameters)", flush=True)
    if args.only != "join":
        buddy(w, args.timeout, args.pairs, args.snapshot_every)
    if args.only == "buddy":
        return
    results = {mode: measure(mode, w, args.timeout) for mode in ("in-place", "restart")}
    inp, rst = results["in-place"], results["restart"]
    print(f"\n{'':<44}{'in-place':>12}{'restart':>12}{'ratio':>10}")
    print(
        f"{'survivors pause on a join (minus a step)':<44}{inp['pause']:>11.2f}s{rst['pause']:>11.2f}s"
        f"{inp['pause'] / rst['pause']:>9.2f}x"
    )
    print(
        f"{'  the gap across the world change alone':<44}{inp['change']:>11.2f}s{rst['change']:>11.2f}s"
        f"{inp['change'] / rst['change']:>9.2f}x"
    )
    print(
        f"{'join -> the newcomer stepping':<44}{inp['join']:>11.2f}s{rst['join']:>11.2f}s"
        f"{inp['join'] / rst['join']:>9.2f}x"
    )
    print(f"{'median step at world 2':<44}{inp['step']:>11.2f}s{rst['step']:>11.2f}s")
    if "reform_s" in inp:
        moved = inp["sync_bytes"]  # pliant's broadcasts of the parameters and the optimizer state
        print(
            f"re-formation in place: {inp['reform_s']:.2f}s for {moved / 1e9:.2f} GB of state "
            f"({moved / 1e9 / inp['reform_s']:.2f} GB/s, process group set-up included)"
        )


def buddy(width: int, timeout_s: float, pairs: int, every: str = "auto") -> None:
    costs, stalls, in_run = [], [], []
    print(
        f"\nZeRO, 2 ranks on one node, steady state over steps {WARM}..{WARM + WINDOW}, snapshot every "
        f"{every} steps, {pairs} alternating pairs of runs:"
    )
    for i in range(pairs):
        run = steady(width, timeout_s, every, kill=i == pairs - 1)
        without = steady(width, timeout_s, str(10**6), schedule=run["schedule"])
        costs.append(1 - run["steps_s"] / without["steps_s"])
        in_window = [s for s in run["schedule"] if WARM < s <= WARM + WINDOW]
        stalls.append(run["stall"] * len(in_window) / WINDOW * run["steps_s"])
        in_run.append(run["in_run"])
        print(
            f"  pair {i + 1}: K = {run['every']} at the end, snapshots after steps {in_window}; with copies "
            f"{run['steps_s']:.3f} steps/s, without {without['steps_s']:.3f}: cost {100 * costs[-1]:.1f} %; "
            f"inside the run with copies "
            f"{100 * run['in_run']:.1f} % (the same estimate without copies: {100 * without['in_run']:.1f} %); each "
            f"snapshot copied {run['snap_bytes'] / 1e6:.0f} MB per rank and held the training thread "
            f"{run['stall']:.3f}s ({100 * stalls[-1]:.2f} % of the time)"
        )
    print(
        f"  median throughput cost {100 * statistics.median(costs):.1f} % between runs, "
        f"{100 * statistics.median(in_run):.1f} % inside the runs (goal <= 2 %), median stall "
        f"{100 * statistics.median(stalls):.2f} % of the time"
    )
    if "recover_s" in run:
        print(
            f"  kill -9 of rank 1: both ranks stepping {run['recover_s']:.2f}s later, {run['redone']:.0f} committed "
            f"steps redone, rolled back from the buddy copies: {bool(run['rolled_back'])}"
        )


if __name__ == "__main__":
    main()
