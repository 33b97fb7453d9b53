"""Chaos soak: one training job on network namespaces (bench/netns.py) through a seeded schedule of faults.

The job: ``examples/train_elastic.py`` (DDP on pliant.worker, in place, with a checkpoint directory) on ``--nodes``
agents of one worker each, each agent in its own namespace; etcd and two coordinator replicas on the host's bridge
address. Faults, drawn with ``random.Random(seed)`` (so ``--seed`` replays a run):

- ``kill-worker``: kill -9 one worker (its agent replaces it in place);
- ``kill-node``: kill -9 a whole node (agent and workers), then start it again at the same address;
- ``partition``: a node's link down for a few seconds (no reset: its peers go silent), then up;
- ``control-cut``: a node cannot reach the control plane for a few seconds (blackhole route), then can;
- ``hang``: SIGSTOP a worker for 1 s, then SIGCONT;
- ``kill-coordinator``: kill -9 one coordinator replica, started again 2 s later;
- ``kill-etcd``: kill etcd for 3 s.

After each fault the soak waits until every node's worker has stepped again in one generation, and records the time
to recover: from the end of the fault (the kill; the heal; the SIGCONT; the restart) to that moment. Then the job
runs to its last step and the table is printed: faults and recoveries by kind, p50/p99 time to recover, committed
steps redone, samples duplicated or missed among the updates that count (per-step sample ids), checkpoints loaded that
were partial (must be 0), the final parameters against a static run on the same global batches (both in float64:
over thousands of steps float32 rounding alone drifts by about 1e-4 between world sizes, which would hide a lost or
doubled update), and the effective training time (useful steps x median step time / wall time).

Usage (root): ``.venv/bin/python bench/chaos.py [--faults 100] [--seed 1] [--nodes 3]``
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import psutil
import torch
from common import counted_samples, max_param_diff, read_jsonl
from netns import Fabric, Node, unavailable

from pliant.coordinator.etcd_server import EtcdServer
from pliant.net import free_port
from pliant.tls import LocalCA, Role

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_elastic.py"
KINDS = ("kill-worker", "kill-node", "partition", "control-cut", "hang", "kill-coordinator", "kill-etcd")
SAMPLES, GLOBAL_BATCH, STEP_S = 1000, 48, 0.05
TOKEN = "chaos-join-token"


class Soak:
    """The job, its processes, and the faults (see the module docstring)."""

    def __init__(self, work: Path, nodes: int, steps: int) -> None:
        self.work, self.steps = work, steps
        self.events = work / "events.jsonl"
        self.fabric = Fabric(prefix="plc", net=9)
        ca = LocalCA(work / "pki")
        host = self.fabric.host
        self.coord_tls = ca.issue("coordinator", Role.COORDINATOR, "chaos-coordinator", (host, "127.0.0.1"))
        self.admin_tls = ca.issue("admin", Role.ADMIN, "chaos-admin")
        self.etcd = EtcdServer(data_dir=str(work / "etcd")).start()
        self.replicas: dict[str, tuple[str, subprocess.Popen | None]] = {}
        for name in ("r1", "r2"):
            self.replicas[name] = (f"{host}:{free_port()}", None)
            self.start_replica(name)
        self.coordinator = ",".join(address for address, _ in self.replicas.values())
        self.spec = ["--nnodes", f"1:{nodes}", "--nproc-per-node", "1", "--max-restarts", "1000",
                     "--heartbeat-ttl", "3", "--join-grace", "0.5"]  # fmt: skip
        subprocess.run([sys.executable, "-m", "pliant", "job", "create", "chaos", "--coordinator", self.coordinator,
                        "--tls-dir", str(Path(self.admin_tls.cert).parent), *self.spec, "--join-token-file",
                        str(self._token())], check=True, capture_output=True, timeout=60)  # fmt: skip
        self.nodes = [self.fabric.node(f"n{i}") for i in range(nodes)]
        self.agent_tls = {n.name: ca.issue(f"agent-{n.name}", Role.AGENT, n.name) for n in self.nodes}
        self.agents: dict[str, subprocess.Popen] = {}
        for node in self.nodes:
            self.start_agent(node)

    def _token(self) -> Path:
        path = self.work / "token"
        path.write_text(TOKEN)
        return path

    def start_replica(self, name: str) -> None:
        address, _ = self.replicas[name]
        with open(self.work / f"coordinator-{name}.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "pliant", "coordinator", "--etcd", self.etcd.endpoint,
                                     "--listen", address, "--tls-dir", str(Path(self.coord_tls.cert).parent),
                                     "--leader-ttl", "2", "--replica-id", name], stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.replicas[name] = (address, proc)

    def start_agent(self, node: Node) -> None:
        argv = [sys.executable, "-m", "pliant", "agent", "--coordinator", self.coordinator, "--job", "chaos",
                *self.spec, "--node-id", node.name, "--host", node.address, "--tls-dir",
                str(Path(self.agent_tls[node.name].cert).parent), "--join-token-file", str(self.work / "token"),
                "--checkpoint-dir", str(self.work / "ckpt"), "--stop-grace", "2", "--rescale-grace", "30",
                "--log-dir", str(self.work / "logs"), str(SCRIPT), "--steps", str(self.steps), "--samples",
                str(SAMPLES), "--global-batch", str(GLOBAL_BATCH), "--micro-batch", "8", "--step-time", str(STEP_S),
                "--save-every", "50", "--float64", "--events", str(self.events), "--params-out",
                str(self.work / "final.pt")]  # fmt: skip
        self.agents[node.name] = node.spawn(argv, self.work / f"agent-{node.name}.log")

    # -- what the job is doing ---------------------------------------------------------------------------------------

    def recovered_at(self, since: float, ranks: int) -> float | None:
        """When every rank of a world of ``ranks`` had stepped in one generation after ``since`` (wall time), or
        None if none has yet."""
        first: dict[int, dict[int, float]] = defaultdict(dict)
        for e in read_jsonl(self.events):
            if e["time"] > since and e["world"] == ranks:
                first[e["generation"]].setdefault(e["rank"], e["time"])
        done = [max(times.values()) for times in first.values() if len(times) == ranks]
        return min(done) if done else None

    def stepping(self, since: float, ranks: int) -> bool:
        return self.recovered_at(since, ranks) is not None

    def last_step(self) -> int:
        return max((e["step"] for e in read_jsonl(self.events)), default=-1)

    def workers(self) -> dict[str, list[int]]:
        """node -> the pids of its workers that stepped in the last seconds (the agent's descendants among them)."""
        recent = {e["pid"] for e in read_jsonl(self.events) if e["time"] > time.time() - 3}
        out: dict[str, list[int]] = {}
        for name, agent in self.agents.items():
            try:
                kids = {p.pid for p in psutil.Process(agent.pid).children(recursive=True)}
            except psutil.NoSuchProcess:
                continue
            out[name] = sorted(recent & kids)
        return out

    def finished(self) -> bool:
        return all(a.poll() is not None for a in self.agents.values())

    # -- faults ------------------------------------------------------------------------------------------------------

    def inject(self, kind: str, rng: random.Random) -> tuple[float, int]:
        """Inject one fault of ``kind``; returns (when its effect ended, the world size to recover to)."""
        full = len(self.nodes)
        node = rng.choice(self.nodes)
        if kind == "kill-worker":
            pids = self.workers().get(node.name, [])
            if pids:
                os.kill(rng.choice(pids), signal.SIGKILL)
            return time.time(), full
        if kind == "kill-node":
            node.kill_all()
            self.agents[node.name].wait(10)
            time.sleep(1.0)
            self.start_agent(node)
            return time.time(), full
        if kind == "partition":
            self.fabric.isolate(node)
            time.sleep(4.0)
            self.fabric.heal(node)
            return time.time(), full
        if kind == "control-cut":
            self.fabric.block(node, self.fabric.host)
            time.sleep(4.0)
            self.fabric.unblock(node, self.fabric.host)
            return time.time(), full
        if kind == "hang":
            pids = self.workers().get(node.name, [])
            if pids:
                pid = rng.choice(pids)
                os.kill(pid, signal.SIGSTOP)
                time.sleep(1.0)
                os.kill(pid, signal.SIGCONT)
            return time.time(), full
        if kind == "kill-coordinator":
            name = rng.choice(sorted(self.replicas))
            proc = self.replicas[name][1]
            if proc is not None:
                proc.kill()
                proc.wait(10)
            time.sleep(2.0)
            self.start_replica(name)
            return time.time(), full
        if kind == "kill-etcd":
            self.etcd.kill()
            time.sleep(3.0)
            self.etcd.start()
            return time.time(), full
        raise ValueError(kind)

    def close(self) -> None:
        for agent in self.agents.values():
            if agent.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(agent.pid, signal.SIGKILL)
        for _, proc in self.replicas.values():
            if proc is not None and proc.poll() is None:
                proc.kill()
        self.fabric.close()
        self.etcd.stop()


def static_params(work: Path, steps: int) -> dict:
    out = work / "static.pt"
    subprocess.run([sys.executable, str(SCRIPT), "--steps", str(steps), "--samples", str(SAMPLES), "--global-batch",
                    str(GLOBAL_BATCH), "--micro-batch", "8", "--float64", "--params-out", str(out)], check=True,
                   capture_output=True, timeout=1800)  # fmt: skip
    return torch.load(out)


def partial_loads(work: Path) -> tuple[int, int]:
    """(checkpoints restored, of which the directory had no commit marker) from the agents' logs."""
    restored = partial = 0
    for log in work.glob("agent-*.log"):
        for found in re.finditer(r"restored step \d+ from (\S+)", log.read_text(errors="replace")):
            restored += 1
            partial += not (Path(found[1]) / "pliant-commit.json").exists()
    return restored, partial


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--recover-timeout", type=float, default=120.0)
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated fault kinds to draw from")
    args = parser.parse_args()
    why = unavailable()
    if why:
        raise SystemExit(f"chaos soak: {why} (run it as root on Linux)")
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise SystemExit(f"--kinds: unknown {sorted(unknown)}; choose from {', '.join(KINDS)}")
    rng = random.Random(args.seed)
    schedule = [rng.choice(kinds) for _ in range(args.faults)]
    steps = 400 + 100 * args.faults
    work = Path(tempfile.mkdtemp(prefix="pliant-chaos-"))
    print(f"chaos soak: seed {args.seed}, {args.faults} faults, {args.nodes} nodes, {steps} steps; work in {work}",
          flush=True)  # fmt: skip
    started = time.time()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still cleans up (finally below)
    soak = Soak(work, args.nodes, steps)
    recoveries: dict[str, list[float]] = defaultdict(list)
    failed: Counter[str] = Counter()
    try:
        deadline = time.time() + 180
        while not soak.stepping(0, args.nodes):
            if time.time() > deadline:
                raise SystemExit(f"the job never reached {args.nodes} ranks; see {work}")
            time.sleep(0.2)
        for index, kind in enumerate(schedule, 1):
            if soak.finished() or soak.last_step() > steps - 100:
                print(f"the job is about to finish after {index - 1} faults: stopping the schedule", flush=True)
                break
            ended, ranks = soak.inject(kind, rng)
            deadline = ended + args.recover_timeout
            while not soak.stepping(ended, ranks) and time.time() < deadline and not soak.finished():
                time.sleep(0.05)
            at = soak.recovered_at(ended, ranks)
            if at is not None:
                recovered = at - ended
                recoveries[kind].append(recovered)
                print(f"[{index:3d}] {kind:17s} recovered in {recovered:6.2f}s (step {soak.last_step()})", flush=True)
            else:
                failed[kind] += 1
                print(f"[{index:3d}] {kind:17s} NOT recovered within {args.recover_timeout:g}s", flush=True)
            time.sleep(rng.uniform(0.5, 2.0))
        while not soak.finished():
            time.sleep(0.5)
            if time.time() - started > 7200:
                raise SystemExit(f"the job did not finish; see {work}")
        wall = time.time() - started
        codes = {name: agent.returncode for name, agent in soak.agents.items()}
    finally:
        soak.close()
    report(work, steps, schedule, recoveries, failed, codes, wall, args.seed)


def report(work: Path, steps: int, schedule: list[str], recoveries: dict[str, list[float]], failed: Counter[str],
           codes: dict[str, int | None], wall: float, seed: int) -> None:  # fmt: skip
    events = read_jsonl(work / "events.jsonl")
    steps_run, per_epoch = counted_samples(events)
    complete = [ep for ep in per_epoch if ep < max(per_epoch)]
    duplicated = sum(len(per_epoch[ep]) - len(set(per_epoch[ep])) for ep in complete)
    missed = sum(SAMPLES - len(set(per_epoch[ep])) for ep in complete)
    runs = Counter(e["step"] for e in events if e["rank"] == 0)
    redone = sum(n - 1 for n in runs.values())
    restored, partial = partial_loads(work)
    times = sorted(e["time"] for e in events if e["rank"] == 0)
    step_s = statistics.median(b - a for a, b in itertools.pairwise(times)) if len(times) > 1 else 0.0
    diff = max_param_diff(torch.load(work / "final.pt"), static_params(work, steps))
    print(f"\nchaos soak, seed {seed}: {sum(len(v) for v in recoveries.values()) + sum(failed.values())} faults, "
          f"wall {wall:.0f}s, agents' exit codes {codes}")  # fmt: skip
    print(f"{'kind':18s}{'faults':>8s}{'recovered':>11s}{'p50 s':>9s}{'p99 s':>9s}")
    for kind in KINDS:
        done = recoveries.get(kind, [])
        total = len(done) + failed.get(kind, 0)
        if total:
            print(f"{kind:18s}{total:8d}{len(done):11d}{percentile(done, 0.5):9.2f}{percentile(done, 0.99):9.2f}")
    print(f"steps: {len(steps_run)} of {steps} run; committed steps run again (rank 0): {redone}")
    print(f"samples among the updates that count: {duplicated} duplicated, {missed} missed (complete epochs "
          f"{len(complete)})")  # fmt: skip
    print(f"checkpoints restored: {restored}, of which partial: {partial}")
    print(f"final parameters vs a static run: max |diff| {diff:.2e}")
    print(f"effective training time: {len(steps_run)} useful steps x {step_s * 1e3:.0f} ms / {wall:.0f} s = "
          f"{len(steps_run) * step_s / wall:.0%}")  # fmt: skip


if __name__ == "__main__":
    main()
