"""Chaos soak: one training job on network namespaces (bench/netns.py) through a seeded schedule of faults.

The job: ``examples/train_elastic.py`` (DDP on pliant.worker, or ``--engine zero|fsdp``, whose shards the survivors
rebuild from buddy copies; in place, with a checkpoint directory) on ``--nodes`` agents of ``--nproc-per-node``
workers each (1 unless given), each agent in its own namespace; etcd and coordinator replica r1 on the host's bridge
address, replica r2 in the last node's namespace. Faults, drawn with ``random.Random(seed)`` (``--seed`` replays a
run):

- ``kill-worker``: kill -9 one worker (its agent replaces it in place);
- ``kill-agent``: kill -9 a node's agent alone (its zygote and workers die with it), then start it again;
- ``kill-node``: kill -9 a whole node (agent and workers), then start it again at the same address;
- ``new-address``: the same, but the node comes back under a new IP address (same node id);
- ``partition``: a node's link down for a few seconds (no reset: its peers go silent), then up;
- ``peer-cut``: two nodes cannot reach each other for a few seconds (blackhole routes), while both reach everything
  else;
- ``long-peer-cut`` (only when ``--kinds`` names it; not drawn by default, so the default schedules stay as they
  were): the same for :data:`LONG_CUT_S`, longer than the failure detection and the rescale grace, so one node is
  evicted, comes back and is evicted again, and its strikes hold it back (docs/architecture.md, "A cut between two
  nodes"); its recovery counts from the heal, so it includes any hold still running then;
- ``lone-cut`` (only when ``--kinds`` names it): one node cannot reach any other node for :data:`LONG_CUT_S`, while
  it still reaches the control plane. It names them all unreachable; the others name it: it must be the one evicted
  (the smaller side), whoever reports first, and the others must train on without it (the soak's log of generations
  shows the worlds during the cut); its recovery counts from the heal;
- ``split`` (only when ``--kinds`` names it; for 4 nodes or more, with 3 it is a lone-cut): the nodes in two halves
  of equal size (the extra node of an odd count on a random side) that cannot reach each other for
  :data:`LONG_CUT_S`, while every node still reaches the control plane. Equal sides are the case no count decides:
  the first report evicts the other half, whose nodes must be held back as spares until the heal (never a world of
  the two halves' members mixed, never both halves evicted), and the whole world re-forms after it; its recovery
  counts from the heal;
- ``slow-link`` (only when ``--kinds`` names it): a node's outgoing link limited to :data:`SLOW_RATE` (``tc tbf``,
  which drops what waits longer than 400 ms) for :data:`SLOW_S`: a degraded NIC or a congested uplink. Its gradients,
  heartbeats and watch all cross it; the world should slow down and ride it out, not evict a node that is alive (the
  report counts the generations published during these faults);
- ``control-cut``: a node cannot reach the control plane for a few seconds (blackhole route), then can;
- ``hang``: SIGSTOP a worker for 1 s, then SIGCONT;
- ``kill-coordinator``: kill -9 one coordinator replica, started again 2 s later;
- ``kill-etcd``: kill etcd for 3 s;
- ``minority``: the last node runs coordinator replica r2 beside its agent; r2 is made the leader (r1 killed and
  started again), then that node is cut off from everything (etcd, r1, the other nodes) for 6 s, longer than the
  leader and heartbeat TTLs, then healed. The minority side must publish nothing and commit nothing: the report
  counts the generations r2 published during the cuts (from its log; must be 0) beside r1's.

After each fault the soak waits until every node's worker has stepped again in one generation, and records the time
to recover: from the end of the fault (the kill; the heal; the SIGCONT; the restart) to that moment. Once the
schedule is done the job is told to end 30 steps later (``train_elastic.py --stop-file``; ``--steps`` is only its
bound), and the table is printed: faults and recoveries by kind, p50/p99 time to recover, committed
steps redone, samples duplicated or missed among the updates that count (per-step sample ids), checkpoints loaded that
were partial (must be 0), the final parameters against a static run on the same global batches (both in float64:
over thousands of steps float32 rounding alone drifts by about 1e-4 between world sizes, which would hide a lost or
doubled update), and the effective training time (useful steps x median step time / wall time).

Usage (root): ``.venv/bin/python bench/chaos.py [--faults 100] [--seed 1] [--nodes 3] [--nproc-per-node 1]
[--engine ddp|zero|fsdp]``
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
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import psutil
import torch

from pliant.coordinator.etcd_server import EtcdServer
from pliant.net import free_port
from pliant.security.identity import Role
from pliant.security.issuance import LocalCA

if __package__:  # imported as bench.chaos (the suite's short soak, tests/integration/test_chaos.py)
    from bench import common
    from bench.netns import Fabric, Node, unavailable
else:  # python bench/chaos.py
    import common  # type: ignore[no-redef]
    from netns import Fabric, Node, unavailable

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = common.ELASTIC
KINDS = (
    "kill-worker",
    "kill-agent",
    "kill-node",
    "new-address",
    "partition",
    "peer-cut",
    "control-cut",
    "hang",
    "kill-coordinator",
    "kill-etcd",
    "minority",
)
EXTRA_KINDS = ("long-peer-cut", "lone-cut", "split", "slow-link")  # drawn only when --kinds names them
LONG_CUT_S = 45.0
SLOW_RATE, SLOW_S = "256kbit", 10.0
SAMPLES, GLOBAL_BATCH, STEP_S = 1000, 48, 0.05
TOKEN = "chaos-join-token-of-the-soak-0123456789"  # 22 characters or more, as every join token


class Soak:
    """The job, its processes, and the faults (see the module docstring)."""

    def __init__(
        self, work: Path, nodes: int, steps: int, prefix: str = "plc", net: int = 9, engine: str = "ddp", nproc: int = 1
    ) -> None:
        self.work, self.steps, self.engine = work, steps, engine
        self.world, self.nproc = nodes * nproc, nproc  # the full world's ranks, each node's
        self.events = work / "events.jsonl"
        self.fabric = Fabric(prefix=prefix, net=net)
        self.nodes = [self.fabric.node(f"n{i}") for i in range(nodes)]
        self.minority = self.nodes[-1]  # also runs coordinator replica r2: a partition of it has a minority side
        self.cuts: list[tuple[float, float]] = []  # when the minority side was cut off (wall time)
        self.slowed: list[tuple[float, float]] = []  # when a node's link was slow (wall time)
        self.agents: dict[str, subprocess.Popen] = {}
        self.replicas: dict[str, tuple[str, subprocess.Popen | None]] = {}
        self.etcd: EtcdServer | None = None
        try:
            self._start()
        except BaseException:  # whatever started is stopped: a soak that cannot start leaves nothing behind
            self.close()
            raise

    def _start(self) -> None:
        """Start etcd, the two replicas, the job and its agents."""
        ca = LocalCA(self.work / "pki")
        host = self.fabric.host
        self.coord_tls = ca.issue(
            "coordinator", Role.COORDINATOR, "chaos-coordinator", (host, "127.0.0.1", self.minority.address)
        )
        self.admin_tls = ca.issue("admin", Role.ADMIN, "chaos-admin")
        self.etcd = EtcdServer(
            data_dir=str(self.work / "etcd"), host=host, log_path=str(self.work / "etcd.log")
        ).start()
        self.replicas = {
            "r2": (f"{self.minority.address}:{free_port()}", None),
            "r1": (f"{host}:{free_port(host)}", None),  # free on that address (etcd listens there too)
        }
        for name in self.replicas:
            self.start_replica(name, wait=True)
        self.coordinator = ",".join(address for address, _ in self.replicas.values())
        self.spec = [
            "--nnodes",
            f"1:{len(self.nodes)}",
            "--nproc-per-node",
            str(self.nproc),
            "--max-restarts",
            "1000",
            "--heartbeat-ttl",
            "3",
            "--join-grace",
            "0.5",
        ]
        subprocess.run(
            [
                *common.PLIANT,
                "job",
                "create",
                "chaos",
                "--coordinator",
                self.coordinator,
                "--tls-dir",
                str(Path(self.admin_tls.cert).parent),
                *self.spec,
                "--join-token-file",
                str(self._token()),
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        self.agent_tls = {n.name: ca.issue(f"agent-{n.name}", Role.AGENT, n.name) for n in self.nodes}
        for node in self.nodes:
            self.start_agent(node)

    def _token(self) -> Path:
        path = self.work / "token"
        path.write_text(TOKEN)
        return path

    def start_replica(self, name: str, wait: bool = False) -> None:
        """Start coordinator replica ``name``: r1 on the host, r2 in the minority node's namespace; ``wait``: until it
        serves (raises with its log if it does not)."""
        address, _ = self.replicas[name]
        argv = [
            *common.PLIANT,
            "coordinator",
            "--etcd",
            self.etcd.endpoint,
            "--listen",
            address,
            "--tls-dir",
            str(Path(self.coord_tls.cert).parent),
            "--leader-ttl",
            "2",
            "--replica-id",
            name,
        ]
        log = self.work / f"coordinator-{name}.log"
        started = log.read_text(errors="replace").count("serving on") if log.exists() else 0
        if name == "r2":
            proc = self.minority.spawn(argv, log)
        else:
            with open(log, "ab") as out:
                proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.replicas[name] = (address, proc)
        deadline = time.time() + 60
        while wait and log.read_text(errors="replace").count("serving on") == started:  # else the soak proves nothing
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(
                    f"coordinator replica {name} did not start on {address}: {log.read_text(errors='replace')[-2000:]}"
                )
            time.sleep(0.2)

    def leads(self, name: str) -> bool:
        """Replica ``name``'s last election transition made it the leader (its log)."""
        text = (self.work / f"coordinator-{name}.log").read_text(errors="replace")
        moves = re.findall(rf"replica {name}: \S+ -> (\S+)", text)
        return bool(moves) and moves[-1] == "leader"

    def start_agent(self, node: Node) -> None:
        argv = [
            *common.PLIANT,
            "agent",
            "--coordinator",
            self.coordinator,
            "--job",
            "chaos",
            *self.spec,
            "--node-id",
            node.name,
            "--host",
            node.address,
            "--tls-dir",
            str(Path(self.agent_tls[node.name].cert).parent),
            "--join-token-file",
            str(self.work / "token"),
            "--checkpoint-dir",
            str(self.work / "ckpt"),
            "--stop-grace",
            "2",
            "--rescale-grace",
            "30",
            "--log-dir",
            str(self.work / "logs"),
            str(SCRIPT),
            *common.elastic_args(
                self.steps,
                SAMPLES,
                GLOBAL_BATCH,
                step_time=STEP_S,
                engine=self.engine,
                events=self.events,
                params_out=self.work / "final.pt",
                extra=("--save-every", "50", "--float64", "--stop-file", str(self.work / "stop")),
            ),
        ]
        self.agents[node.name] = node.spawn(argv, self.work / f"agent-{node.name}.log")

    # -- what the job is doing ---------------------------------------------------------------------------------------

    def recovered_at(self, since: float, ranks: int) -> float | None:
        """When every rank of a world of ``ranks`` had stepped in one generation after ``since`` (wall time), or
        None if none has yet."""
        first: dict[int, dict[int, float]] = defaultdict(dict)
        for e in common.read_jsonl(self.events):
            if e["time"] > since and e["world"] == ranks:
                first[e["generation"]].setdefault(e["rank"], e["time"])
        done = [max(times.values()) for times in first.values() if len(times) == ranks]
        return min(done) if done else None

    def stepping(self, since: float, ranks: int) -> bool:
        return self.recovered_at(since, ranks) is not None

    def last_step(self) -> int:
        return max((e["step"] for e in common.read_jsonl(self.events)), default=-1)

    def workers(self) -> dict[str, list[int]]:
        """node -> the pids of its workers that stepped in the last seconds (the agent's descendants among them)."""
        recent = {e["pid"] for e in common.read_jsonl(self.events) if e["time"] > time.time() - 3}
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

    def dump_stacks(self) -> None:
        """Ask every worker for its Python stacks (into its agent's log), as an agent does before it stops a hung
        one: the workers are the processes its zygote forked (or that it started itself, other than the zygote)."""
        for agent in self.agents.values():
            common.ask_for_stacks(agent.pid)  # the store host writes its stacks too

    # -- faults ------------------------------------------------------------------------------------------------------

    def inject(self, kind: str, rng: random.Random) -> tuple[float, int]:
        """Inject one fault of ``kind``; returns (when its effect ended, the world size to recover to)."""
        full = self.world
        node = rng.choice(self.nodes)
        if kind == "kill-worker":
            pids = self.workers().get(node.name, [])
            if pids:
                os.kill(rng.choice(pids), signal.SIGKILL)
            return time.time(), full
        if kind in ("kill-node", "new-address"):
            if kind == "new-address":  # the minority node keeps its address: replica r2's certificate names it
                node = rng.choice([n for n in self.nodes if n is not self.minority])
            node.kill_all()
            self.agents[node.name].wait(10)
            if kind == "new-address":
                self.fabric.readdress(node)
            time.sleep(1.0)
            self.start_agent(node)
            if node is self.minority:
                self.start_replica("r2")
            return time.time(), full
        if kind == "kill-agent":
            self.agents[node.name].kill()
            self.agents[node.name].wait(10)
            time.sleep(1.0)
            self.start_agent(node)
            return time.time(), full
        if kind == "minority":
            return self._minority(), full
        if kind in ("peer-cut", "long-peer-cut"):
            other = rng.choice([n for n in self.nodes if n is not node])
            self._cut([node], [other], 4.0 if kind == "peer-cut" else LONG_CUT_S)
            return time.time(), full
        if kind == "lone-cut":
            self._cut([node], [n for n in self.nodes if n is not node], LONG_CUT_S)
            return time.time(), full
        if kind == "split":
            half = rng.sample(self.nodes, len(self.nodes) // 2 + rng.randint(0, len(self.nodes) % 2))
            self._cut(half, [n for n in self.nodes if n not in half], LONG_CUT_S)
            return time.time(), full
        if kind == "slow-link":
            slowed = time.time()
            self.fabric.slow(node, SLOW_RATE)
            time.sleep(SLOW_S)
            self.fabric.fast(node)
            self.slowed.append((slowed, time.time()))
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

    def _cut(self, side: list[Node], others: list[Node], seconds: float) -> None:
        """Nodes of ``side`` and of ``others`` cannot reach each other for ``seconds`` (blackhole routes on both ends);
        every node still reaches the control plane."""
        for a in side:
            for b in others:
                self.fabric.block(a, b.address)
        time.sleep(seconds)
        for a in side:
            for b in others:
                self.fabric.unblock(a, b.address)

    def _minority(self) -> float:
        """Make r2 (on the minority node) the leader, then cut that node, with r2, off from everything else (etcd,
        r1, the other nodes) for longer than the leader and heartbeat TTLs; returns when it healed."""
        if not self.leads("r2"):
            r1 = self.replicas["r1"][1]
            if r1 is not None:
                r1.kill()
                r1.wait(10)
            deadline = time.time() + 15
            while not self.leads("r2") and time.time() < deadline:
                time.sleep(0.1)
            self.start_replica("r1")
        cut = time.time()
        self.fabric.isolate(self.minority)
        time.sleep(6.0)
        self.fabric.heal(self.minority)
        healed = time.time()
        self.cuts.append((cut, healed))
        return healed

    def during_cut(self, when: float) -> bool:
        return any(cut <= when <= healed for cut, healed in self.cuts)

    def slow_generations(self) -> int:
        """Generations published (by either replica) while a link was slow, or within 5 s after."""
        published = {number: when for name in self.replicas for when, number in self.published(name)}
        return sum(any(start <= when <= end + 5 for start, end in self.slowed) for when in published.values())

    def published(self, name: str) -> list[tuple[float, int]]:
        """(when, generation number) of every generation replica ``name`` published (its log)."""
        out = []
        text = (self.work / f"coordinator-{name}.log").read_text(errors="replace")
        for found in re.finditer(
            r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) .*generation (\d+) published", text, re.MULTILINE
        ):
            when = datetime.strptime(found[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append((when, int(found[2])))
        return out

    def close(self) -> None:
        for agent in self.agents.values():
            if agent.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(agent.pid, signal.SIGKILL)
        for _, proc in self.replicas.values():
            if proc is not None and proc.poll() is None:
                proc.kill()
        self.fabric.close()
        if self.etcd is not None:
            self.etcd.stop()


def static_params(work: Path, steps: int, engine: str = "ddp") -> dict:
    return common.static_params(work / "static.pt", steps, SAMPLES, GLOBAL_BATCH, engine)


def partial_loads(work: Path) -> tuple[int, int]:
    """(checkpoints restored, of which the directory still exists without its commit marker) from the agents' logs.
    A restored directory that retention deleted since cannot be checked here; the restore itself loads only a
    directory with its marker (``CheckpointManager``)."""
    restored = partial = 0
    for log in work.glob("agent-*.log"):
        for found in re.finditer(r"restored step \d+ from (\S+)", log.read_text(errors="replace")):
            restored += 1
            partial += Path(found[1]).exists() and not (Path(found[1]) / "pliant-commit.json").exists()
    return restored, partial


@dataclass
class Report:
    """What one soak measured (see the module docstring); :meth:`table` prints it."""

    seed: int
    steps: int
    wall_s: float
    codes: dict[str, int | None]
    recoveries: dict[str, list[float]]
    failed: Counter[str]
    steps_run: int = 0
    redone: int = 0
    duplicated: int = 0
    missed: int = 0
    complete_epochs: int = 0
    restored: int = 0
    partial: int = 0
    param_diff: float = float("nan")
    step_s: float = 0.0
    wrong: int = 0  # samples logged by a step whose global batch does not hold them (must be 0)
    unlogged: int = 0  # steps that lack a rank's line: it was killed between its commit and its log line
    minority_published: int = 0  # generations replica r2 published while its side was cut off (must be 0)
    majority_published: int = 0  # ... and r1, on the majority side, meanwhile
    slow_published: int | None = None  # generations published during slow-link faults (None: none drawn)
    engine: str = "ddp"
    work: str = ""  # the run's directory: logs, events, checkpoints (the suite's short soak removes it if it passed)

    @property
    def faults(self) -> int:
        return sum(len(v) for v in self.recoveries.values()) + sum(self.failed.values())

    @property
    def effective(self) -> float:
        return self.steps_run * self.step_s / self.wall_s if self.wall_s else 0.0

    def table(self) -> str:
        lines = [
            f"chaos soak ({self.engine}), seed {self.seed}: {self.faults} faults, wall {self.wall_s:.0f}s, "
            f"agents' exit codes {self.codes}",
            f"{'kind':18s}{'faults':>8s}{'recovered':>11s}{'p50 s':>9s}{'p99 s':>9s}",
        ]
        for kind in KINDS + EXTRA_KINDS:
            done = self.recoveries.get(kind, [])
            total = len(done) + self.failed.get(kind, 0)
            if total:
                p50, p99 = common.percentile(done, 0.5), common.percentile(done, 0.99)
                lines.append(f"{kind:18s}{total:8d}{len(done):11d}{p50:9.2f}{p99:9.2f}")
        lines += [
            f"steps: {self.steps_run} of {self.steps} run; committed steps run again (rank 0): {self.redone}",
            f"samples among the updates that count: {self.duplicated} duplicated, {self.missed} missed, {self.wrong} "
            f"outside their step's global batch (complete epochs {self.complete_epochs}; {self.unlogged} steps lack "
            f"the line of a rank killed between its commit and its log)",
            f"checkpoints restored: {self.restored}, of which partial: {self.partial}",
            f"generations published while the minority side was cut off: {self.minority_published} by its replica, "
            f"{self.majority_published} by the majority's",
            *(
                [f"generations published while a link was slow (or 5 s after): {self.slow_published}"]
                if self.slow_published is not None
                else []
            ),
            f"final parameters vs a static run: max |diff| {self.param_diff:.2e}",
            f"effective training time: {self.steps_run} useful steps x {self.step_s * 1e3:.0f} ms / "
            f"{self.wall_s:.0f} s = {self.effective:.0%}",
        ]
        return "\n".join(lines)


def run(
    faults: int = 100,
    seed: int = 1,
    nodes: int = 3,
    kinds: tuple[str, ...] = KINDS,
    recover_timeout: float = 120.0,
    steps: int = 0,
    prefix: str = "plc",
    net: int = 9,
    log: Callable[[str], None] = print,
    engine: str = "ddp",
    nproc: int = 1,
) -> Report:
    """Run one soak (see the module docstring). ``steps``: the job's steps at most (0: 400 + 100 per fault); it ends
    30 steps after the schedule does. Needs root (network namespaces)."""
    unknown = set(kinds) - set(KINDS) - set(EXTRA_KINDS)
    if unknown:
        raise ValueError(f"unknown fault kinds {sorted(unknown)}; choose from {', '.join(KINDS + EXTRA_KINDS)}")
    rng = random.Random(seed)
    schedule = [rng.choice(kinds) for _ in range(faults)]
    steps = steps or 400 + 100 * faults
    work = Path(tempfile.mkdtemp(prefix="pliant-chaos-"))
    log(
        f"chaos soak: seed {seed}, {faults} faults, {nodes} nodes x {nproc} workers, {engine}, {steps} steps; work in "
        f"{work}"
    )
    started = time.time()
    soak = Soak(work, nodes, steps, prefix, net, engine, nproc)
    recoveries: dict[str, list[float]] = defaultdict(list)
    failed: Counter[str] = Counter()
    try:
        deadline = time.time() + 180
        while not soak.stepping(0, soak.world):
            if time.time() > deadline:
                raise RuntimeError(f"the job never reached {soak.world} ranks; see {work}")
            time.sleep(0.2)
        for index, kind in enumerate(schedule, 1):
            if soak.finished() or soak.last_step() > steps - 100:
                log(f"the job is about to finish after {index - 1} faults: stopping the schedule")
                break
            ended, ranks = soak.inject(kind, rng)
            deadline, dumped = ended + recover_timeout, False
            while not soak.stepping(ended, ranks) and time.time() < deadline and not soak.finished():
                if not dumped and time.time() > ended + recover_timeout / 2:  # what is it waiting for? (the logs)
                    log(f"[{index:3d}] {kind:17s} not recovered after {recover_timeout / 2:g}s: dumping the stacks")
                    soak.dump_stacks()
                    dumped = True
                time.sleep(0.05)
            at = soak.recovered_at(ended, ranks)
            if at is not None:
                recoveries[kind].append(at - ended)
                log(f"[{index:3d}] {kind:17s} recovered in {at - ended:6.2f}s (step {soak.last_step()})")
            else:
                failed[kind] += 1
                code = soak.etcd.proc.poll() if soak.etcd.proc is not None else None
                log(
                    f"[{index:3d}] {kind:17s} NOT recovered within {recover_timeout:g}s"
                    + (f" (etcd exited with code {code} on its own: see etcd.log)" if code is not None else "")
                )
            time.sleep(rng.uniform(0.5, 2.0))
        steps = common.end_soon(soak.events, work / "stop", steps, margin=30)  # the schedule is done: so is the job
        log(f"the schedule is done: the job ends at step {steps}")
        while not soak.finished():
            time.sleep(0.5)
            if time.time() - started > 7200:
                raise RuntimeError(f"the job did not finish; see {work}")
        wall = time.time() - started
        codes = {name: agent.returncode for name, agent in soak.agents.items()}
    finally:
        soak.close()
    report = Report(seed, steps, wall, codes, dict(recoveries), failed, engine=engine, work=str(work))
    report.minority_published = sum(soak.during_cut(when) for when, _ in soak.published("r2"))
    report.majority_published = sum(soak.during_cut(when) for when, _ in soak.published("r1"))
    report.slow_published = soak.slow_generations() if soak.slowed else None
    measure(work, report)
    return report


def measure(work: Path, report: Report) -> None:
    """Fill ``report`` from the job's per-step events, the agents' logs and a static run."""
    events = common.read_jsonl(work / "events.jsonl")
    steps_run, per_epoch, report.wrong, report.unlogged = common.batches_counted(events, SAMPLES, GLOBAL_BATCH)
    complete = [ep for ep in per_epoch if ep < max(per_epoch)]
    report.steps_run, report.complete_epochs = len(steps_run), len(complete)
    report.duplicated = sum(len(per_epoch[ep]) - len(set(per_epoch[ep])) for ep in complete)
    report.missed = sum(SAMPLES - len(set(per_epoch[ep])) for ep in complete)
    runs = Counter(e["step"] for e in events if e["rank"] == 0)
    report.redone = sum(n - 1 for n in runs.values())
    report.restored, report.partial = partial_loads(work)
    times = sorted(e["time"] for e in events if e["rank"] == 0)
    report.step_s = statistics.median(b - a for a, b in itertools.pairwise(times)) if len(times) > 1 else 0.0
    report.param_diff = common.max_param_diff(
        torch.load(work / "final.pt"), static_params(work, report.steps, report.engine)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        help="workers per node (each node's agent sets OMP_NUM_THREADS=1 for more than one)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=0,
        help="training steps at most (default: 400 + 100 per "
        "fault); the job ends 30 steps after the last fault's recovery",
    )
    parser.add_argument("--recover-timeout", type=float, default=120.0)
    parser.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help=f"comma-separated fault kinds to draw from (default: all but {', '.join(EXTRA_KINDS)})",
    )
    parser.add_argument("--engine", choices=("ddp", "zero", "fsdp"), default="ddp")
    args = parser.parse_args()
    why = unavailable()
    if why:
        raise SystemExit(f"chaos soak: {why} (run it as root on Linux)")
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = set(kinds) - set(KINDS) - set(EXTRA_KINDS)
    if unknown:
        raise SystemExit(f"--kinds: unknown {sorted(unknown)}; choose from {', '.join(KINDS + EXTRA_KINDS)}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still cleans up (run's finally)
    report = run(
        args.faults,
        args.seed,
        args.nodes,
        kinds,
        args.recover_timeout,
        args.steps,
        log=lambda line: print(line, flush=True),
        engine=args.engine,
        nproc=args.nproc_per_node,
    )
    print("\n" + report.table())


if __name__ == "__main__":
    main()
