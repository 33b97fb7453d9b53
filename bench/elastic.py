"""Elasticity benchmark: the same scripts under pliant and torchrun, two nodes x 2 workers on this machine, in one run.
Prints one table with every column and the ratios to torchrun.

Scenarios, in order, per column: start (node a, --nnodes 1:2) -> first step of every rank; node b joins -> all 4
ranks stepping, of which node b's warm-up (its start to its zygote's imports done, from its log: what no launcher
can skip for a node that never ran the script), and the survivors' longest pause between two steps around it; kill
-9 of one worker -> all ranks stepping again; kill -9 of node b (launcher and workers) -> the survivors stepping;
committed steps redone per failure; steady-state throughput at world 4. Before the table: the plain script's imports
in a fresh process (torch, ``torch._dynamo`` that DDP's constructor imports, ``pliant.worker``), the floor under any
start.

Columns (``--launchers``), each a launcher and a script:

- ``in-place``, ``restart``, ``torchrun``, ``torchrun-default``: examples/train_elastic.py (DDP on pliant.worker) under
  ``pliant run --rescale in-place`` (no checkpoint directory: the survivors keep their processes and state),
  ``--rescale restart`` (checkpoints every 5 steps: every change checkpoints and starts new processes), torchrun (c10d
  rendezvous with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, needed for its scale-up to work; the script saves every 5
  steps into PLIANT_CHECKPOINT_DIR) and torchrun in its default configuration, where a scale-up that never completes
  is reported as a deadlock.
- ``in-place+imports``, ``torchrun+imports``: the same script behind a framework's imports (bench/heavy_imports.py:
  transformers' Trainer, Accelerate, Lightning), which pliant's zygote preloads from the script's text and torchrun's
  fresh workers import each time.
- ``trainer``, ``torchrun+trainer``: examples/train_hf_trainer.py (a Hugging Face Trainer with pliant's one-line
  callback, Trainer checkpoints every 5 steps) under ``pliant run`` (its defaults: the restart path) and under torchrun
  (the script resumes from its newest checkpoint itself, ``--resume``).
- ``in-place+fsdp``, ``in-place+hsdp``: the plain script with ``--engine fsdp`` (FSDP2 over the world: a join
  gathers the whole state and reshards it) and ``--engine hsdp`` (a replica per node: a join sends the newcomer's
  node one replica's shards, shard for shard), at ``--width 512`` (2.2 MB of parameters and momentum), with two
  more rows: the state bytes node b's ranks received at the join (their "received from peers" log lines) and the
  bytes node a's ranks sent or received (their "rescale in place" lines).
- ``lightning``, ``torchrun+lightning``: examples/train_lightning_elastic.py (pliant's one-line strategy, the script's
  own ``last.ckpt`` every 5 steps) under ``pliant run`` and under torchrun (devices and num_nodes from torchrun's
  environment and ``ckpt_path="last"``, ``--world-from-env``: what a Lightning script sets itself to change size
  under torchrun).

A new world is recognised by every rank stepping as a new (process, generation) pair: in place the processes stay and
the generation moves; the restart path and torchrun start new processes.

Usage: ``.venv/bin/python bench/elastic.py [--launchers COLUMN ...] [--timeout 120]`` (default: every column, about
20 minutes)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import psutil
from common import PLIANT, join_flags, longest_pause, read_jsonl, stop_tree

from pliant.net import free_port

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {
    "plain": ROOT / "examples" / "train_elastic.py",
    "imports": ROOT / "bench" / "heavy_imports.py",  # the plain script behind a framework's imports
    "trainer": ROOT / "examples" / "train_hf_trainer.py",
    "lightning": ROOT / "examples" / "train_lightning_elastic.py",
}
# column -> (launcher, script): pliant's in-place or restart path, or its default (a framework script's workers
# announce no in-place support, so it takes the restart path), torchrun with or without its rendezvous fix.
LAUNCHERS = {
    "in-place": ("in-place", "plain"),
    "restart": ("restart", "plain"),
    "torchrun": ("torchrun", "plain"),
    "torchrun-default": ("torchrun-default", "plain"),
    "in-place+imports": ("in-place", "imports"),
    "torchrun+imports": ("torchrun", "imports"),
    "trainer": ("pliant", "trainer"),
    "torchrun+trainer": ("torchrun", "trainer"),
    "lightning": ("pliant", "lightning"),
    "torchrun+lightning": ("torchrun", "lightning"),
    "in-place+fsdp": ("in-place", "plain"),
    "in-place+hsdp": ("in-place", "plain"),
}
ENGINES = {"in-place+fsdp": "fsdp", "in-place+hsdp": "hsdp"}  # columns whose plain script runs another engine than DDP
WIDTH = {"in-place+fsdp": 512, "in-place+hsdp": 512}  # hidden width of those columns' model (2.2 MB with momentum)
STEP_TIME = 0.05
SAVE_EVERY = 5  # the restart, framework and torchrun columns checkpoint this often


@dataclass
class Result:
    start: float | None = None
    join: float | None = None
    warm_up: float | None = None
    join_pause: float | None = None
    worker_kill: float | None = None
    node_kill: float | None = None
    lost_worker_kill: int | None = None
    lost_node_kill: int | None = None
    throughput: float | None = None
    join_received: int | None = None
    join_survivors: int | None = None
    notes: list[str] = field(default_factory=list)


class Timeout(Exception):
    pass


def _key(step: dict) -> tuple[int, int]:
    return step["pid"], step["generation"]


def wait_new_world(events: Path, world: int, old: set[tuple[int, int]], timeout_s: float) -> tuple[float, list[dict]]:
    """Wait until every rank of a world of ``world`` stepped as a (process, generation) not in ``old``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        fresh = [s for s in read_jsonl(events) if s["world"] == world and _key(s) not in old]
        if {s["rank"] for s in fresh} == set(range(world)):
            return time.monotonic(), fresh
        time.sleep(0.02)
    raise Timeout(f"no world of {world} with new workers within {timeout_s:g}s")


def kill_tree(proc: subprocess.Popen) -> None:
    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    proc.wait(10)


class Launcher:
    """How to start node a and node b for one column."""

    def __init__(self, name: str, workdir: Path) -> None:
        self.name = name
        self.launcher, self.kind = LAUNCHERS[name]
        self.script = SCRIPTS[self.kind]
        self.workdir = workdir
        self.port = free_port()
        self.events = workdir / "events.jsonl"

    def script_args(self) -> list[str]:
        """The script and its arguments: steps without end, each at least STEP_TIME, checkpoints every SAVE_EVERY
        steps where the column restarts workers (the framework scripts in their own formats)."""
        events = ["--step-time", str(STEP_TIME), "--events", str(self.events)]
        ckpt = str(self.workdir / "ckpt")
        torchrun = self.launcher.startswith("torchrun")
        if (
            self.kind == "trainer"
        ):  # resumes from its own checkpoints (the callback under pliant, --resume under torchrun)
            args = ["--output-dir", ckpt, "--max-steps", "1000000", "--save-steps", str(SAVE_EVERY), *events]
            return [str(self.script), *args, *(["--resume"] if torchrun else [])]
        if self.kind == "lightning":  # the strategy under pliant; what a torchrun script sets itself under torchrun
            args = ["--max-steps", "1000000", "--save-every", str(SAVE_EVERY), "--save-dir", ckpt, *events]
            return [str(self.script), *args, *(["--world-from-env"] if torchrun else [])]
        args = [str(self.script), "--steps", "1000000", *events]
        if self.name in ENGINES:
            args += ["--engine", ENGINES[self.name], "--width", str(WIDTH[self.name])]
        return args + (["--save-every", str(SAVE_EVERY)] if self.launcher != "in-place" else [])

    def command(self, node: str) -> tuple[list[str], dict[str, str]]:
        script = self.script_args()
        ckpt = str(self.workdir / "ckpt")
        env = dict(os.environ)
        if not self.launcher.startswith("torchrun"):
            common = ["--nnodes", "1:2", "--nproc-per-node", "2", "--job", "bench", "--heartbeat-ttl", "3"]
            common += ["--join-grace", "1", "--max-restarts", "3"]
            if self.launcher != "pliant":
                common += ["--rescale", self.launcher]
            if self.launcher != "in-place":
                common += ["--checkpoint-dir", ckpt]
            if node == "a":
                return [*PLIANT, "run", "--listen", f"127.0.0.1:{self.port}", *common, *script], env
            coordinator = ["--coordinator", f"127.0.0.1:{self.port}", *join_flags(self.workdir / "a.log")]
            return [*PLIANT, "run", *coordinator, *common, *script], env
        if self.launcher == "torchrun":
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        env["PLIANT_CHECKPOINT_DIR"] = ckpt  # the plain script checkpoints and resumes under torchrun too
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", "bench"]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2", *rdzv]
        return [*torchrun, "--max-restarts", "3", *script], env

    def start(self, node: str) -> subprocess.Popen:
        cmd, env = self.command(node)
        log = open(self.workdir / f"{node}.log", "wb")  # noqa: SIM115
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


_ZYGOTE_READY = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*worker zygote .*ready to fork workers", re.M)


def warmed_up(log: Path, started: float) -> float | None:
    """Seconds from a pliant node's start (wall time ``started``) to its zygote's imports done (its log's line), the
    warm-up a join cannot skip; None for torchrun, whose workers import after the rendezvous."""
    found = _ZYGOTE_READY.search(log.read_text(errors="replace")) if log.exists() else None
    if found is None:
        return None
    return datetime.strptime(found[1], "%Y-%m-%d %H:%M:%S,%f").timestamp() - started


_RECEIVED = re.compile(r"state of step \d+ received from peers in [\d.]+s \((\d+) bytes\)")
_RESCALED = re.compile(r"rescale in place \(boundary\): .* (\d+) state bytes sent or received")


def moved_bytes(log: Path, pattern: re.Pattern[str]) -> int | None:
    """The state bytes of the in-place log lines ``pattern`` finds in a node's log (one line per rank), summed; None
    when it has none (the restart path, torchrun)."""
    found = pattern.findall(log.read_text(errors="replace")) if log.exists() else []
    return sum(int(n) for n in found) if found else None


def lost_steps(before: list[dict], after: list[dict]) -> int:
    """Steps done before the event that the new world did again."""
    last = max(s["step"] for s in before if s["rank"] == 0)
    first = min(s["step"] for s in after if s["rank"] == 0)
    return max(0, last + 1 - first)


def measure(name: str, timeout_s: float) -> Result:
    result = Result()
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
    launcher = Launcher(name, workdir)
    procs: list[subprocess.Popen] = []
    try:
        t0 = time.monotonic()
        node_a = launcher.start("a")
        procs.append(node_a)
        t, _ = wait_new_world(launcher.events, 2, set(), timeout_s)
        result.start = t - t0

        pids = {_key(s) for s in read_jsonl(launcher.events)}
        t0, wall0 = time.monotonic(), time.time()
        node_b = launcher.start("b")
        procs.append(node_b)
        try:
            t, fresh = wait_new_world(launcher.events, 4, pids, timeout_s)
        except Timeout as exc:
            result.notes.append(f"scale-up deadlocked: {exc}")
            return result
        result.join = t - t0
        result.warm_up = warmed_up(workdir / "b.log", wall0)
        time.sleep(1.0)
        result.join_pause = longest_pause(read_jsonl(launcher.events), wall0)
        result.join_received = moved_bytes(workdir / "b.log", _RECEIVED)  # the newcomer's ranks, from peers
        result.join_survivors = moved_bytes(workdir / "a.log", _RESCALED)  # node a's ranks, sent or received

        time.sleep(3)  # steady state at world 4
        window = 5.0
        begin = time.time()
        time.sleep(window)
        steps = [s for s in read_jsonl(launcher.events) if s["rank"] == 0 and begin <= s["time"] < begin + window]
        result.throughput = len(steps) / window

        before = read_jsonl(launcher.events)
        pids = {_key(s) for s in before}
        victim = max((s for s in before if s["world"] == 4), key=lambda s: (s["time"], s["rank"]))
        t0 = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        t, fresh = wait_new_world(launcher.events, 4, pids, timeout_s)
        result.worker_kill = t - t0
        result.lost_worker_kill = lost_steps(before, fresh)

        time.sleep(2)
        before = read_jsonl(launcher.events)
        pids = {_key(s) for s in before}
        t0 = time.monotonic()
        kill_tree(node_b)
        t, fresh = wait_new_world(launcher.events, 2, pids, timeout_s)
        result.node_kill = t - t0
        result.lost_node_kill = lost_steps(before, fresh)
    except Timeout as exc:
        result.notes.append(str(exc))
    finally:
        for proc in procs:
            stop_tree(proc)
        result.notes.append(f"logs in {workdir}")
    return result


RATIOS = (
    ("in-place+hsdp", "in-place+fsdp"),
    ("in-place", "torchrun"),
    ("restart", "torchrun"),
    ("in-place+imports", "torchrun+imports"),
    ("trainer", "torchrun+trainer"),
    ("lightning", "torchrun+lightning"),
)


IMPORTS = {
    "plain": "import torch, torch.distributed, torch._dynamo, pliant.worker",
    "framework": "import accelerate, lightning; from transformers import GPT2Config, GPT2LMHeadModel, Trainer",
}


def import_s(what: str) -> float:
    """Seconds a fresh interpreter takes for the plain script's imports (torch, ``torch._dynamo`` that DDP's constructor
    imports, ``pliant.worker``: the floor of any start), or for a framework's beyond them (what a torchrun worker pays
    at every start)."""
    code = "import time; t = time.perf_counter(); " + IMPORTS["plain"] + "; u = time.perf_counter(); "
    if what == "framework":
        code += IMPORTS["framework"] + "; print(time.perf_counter() - u)"
    else:
        code += "print(u - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    return float(out.stdout.split()[-1])


def _fmt(value: float | int | None, unit: str) -> str:
    if value is None:
        return "-"
    return f"{value:.2f} {unit}" if isinstance(value, float) else f"{value} {unit}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launchers", nargs="+", choices=list(LAUNCHERS), default=list(LAUNCHERS))
    parser.add_argument("--timeout", type=float, default=120.0, help="longest wait for one scenario, s")
    args = parser.parse_args()
    floor = min(import_s("plain") for _ in range(3))  # a floor: the fastest of three (the first may read cold files)
    print(f"the plain script's imports in a fresh process (the floor of a start, fastest of 3): {floor:.2f} s")
    if any(LAUNCHERS[name][1] != "plain" for name in args.launchers):
        print(f"a framework's imports beyond them, in a fresh process: {import_s('framework'):.2f} s", flush=True)
    results = {}
    for name in args.launchers:
        print(f"measuring {name} ...", flush=True)
        results[name] = measure(name, args.timeout)
    rows = [
        ("start -> first step", "start", "s"),
        ("node joins -> all ranks stepping", "join", "s"),
        ("  of which its warm-up (imports)", "warm_up", "s"),
        ("survivors' longest pause (join)", "join_pause", "s"),
        ("kill -9 worker -> resumed", "worker_kill", "s"),
        ("kill -9 node -> survivors stepping", "node_kill", "s"),
        ("steps redone after worker kill", "lost_worker_kill", "steps"),
        ("steps redone after node kill", "lost_node_kill", "steps"),
        ("throughput at world 4", "throughput", "steps/s"),
        ("join: state node b's ranks received", "join_received", "B"),
        ("join: state node a's ranks moved", "join_survivors", "B"),
    ]
    names = list(results)
    pairs = [(n, base) for n, base in RATIOS if n in results and base in results]
    header = f"{'scenario':<36}" + "".join(f"{n:>18}" for n in names)
    header += "".join(
        f"{n + '/' + (base.partition('+')[0] if base.startswith('torchrun') else base):>28}" for n, base in pairs
    )
    print("\n" + header)
    for label, attr, unit in rows:
        line = f"{label:<36}" + "".join(f"{_fmt(getattr(results[n], attr), unit):>18}" for n in names)
        for name, base in pairs:
            p, t = getattr(results[name], attr), getattr(results[base], attr)
            line += f"{p / t:>27.2f}x" if p is not None and t else f"{'-':>28}"
        print(line)
    for name in names:
        for note in results[name].notes:
            print(f"{name}: {note}")


if __name__ == "__main__":
    main()
