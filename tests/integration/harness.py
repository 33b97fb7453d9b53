"""Helpers for multi-process tests: start agents running the example DDP script and read what their workers saw."""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from bench import common
from bench.common import (
    ELASTIC,
    PLIANT,
    batches_counted,
    counted_samples,
    elastic_args,
    longest_pause,
    max_param_diff,
    read_jsonl,
    sample,
    scrape,
)
from pliant.spawn import alive as process_alive

__all__ = [  # longest_pause and read_jsonl are the benchmarks' own, shared with the tests
    "ELASTIC",
    "GAVE_UP",
    "GLOBAL_BATCH",
    "ROOT",
    "SAMPLES",
    "SCRIPT",
    "TOLERANCE",
    "Step",
    "agent_args",
    "assert_all_gone",
    "assert_kept",
    "batches_counted",
    "counted_samples",
    "descendants",
    "elastic_agent",
    "elastic_script",
    "end_soon",
    "longest_pause",
    "max_param_diff",
    "pliant_agent",
    "read_jsonl",
    "read_steps",
    "sample",
    "scrape",
    "static_params",
    "wait_world",
]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_ddp.py"


@dataclass
class Step:
    rank: int
    world: int
    step: int
    restart: int
    time: float
    pid: int


def first_node(nnodes: str, certs: Path, events: Path) -> list[str]:
    """``pliant run``'s command for the first node of a job of ``nnodes`` nodes (its embedded control plane, its
    certificates in ``certs``), training the DDP example for good, one worker, logging steps to ``events``."""
    return [
        *PLIANT,
        "run",
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        "1",
        "--certs-dir",
        str(certs),
        "--heartbeat-ttl",
        "3",
        "--join-grace",
        "0.3",
        str(SCRIPT),
        "--steps",
        "100000",
        "--step-time",
        "0.03",
        "--events",
        str(events),
    ]


def read_steps(path: Path) -> list[Step]:
    return [Step(**item) for item in read_jsonl(path)]


def pliant_agent(
    coordinator: str, node: str, *flags: str, job: str = "job", nnodes: str = "1:2", nproc: int = 2
) -> list[str]:
    """``python -m pliant agent`` joining ``coordinator`` as ``node`` with the tests' short timings (heartbeat TTL
    3 s, join grace 0.5 s, stop grace 2 s), then ``flags``: more flags, the script and its arguments."""
    return [
        *PLIANT,
        "agent",
        "--coordinator",
        coordinator,
        "--job",
        job,
        "--node-id",
        node,
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        str(nproc),
        "--heartbeat-ttl",
        "3",
        "--join-grace",
        "0.5",
        "--stop-grace",
        "2",
        *flags,
    ]


def agent_args(
    coordinator: str,
    job: str,
    node: str,
    workdir: Path,
    nnodes: str = "1:2",
    steps: int = 100000,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """``pliant agent`` running 2 workers of the example script, with events and checkpoint under ``workdir``."""
    script = [str(SCRIPT), "--steps", str(steps), "--step-time", "0.05", "--ckpt", str(workdir / "ckpt.pt")]
    script += ["--events", str(workdir / "events.jsonl"), "--log-every", "50"]
    flags = ["--finish-grace", "1", "--log-dir", str(workdir / "logs"), *extra]
    return pliant_agent(coordinator, node, *flags, *script, job=job, nnodes=nnodes)


def wait_world(events: Path, restart: int, world: int, timeout_s: float, after_step: int = -1) -> list[Step]:
    """Wait until every rank of a world of ``world`` in restart count ``restart`` has stepped past ``after_step``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        steps = [s for s in read_steps(events) if s.restart == restart and s.world == world and s.step > after_step]
        if {s.rank for s in steps} == set(range(world)):
            return steps
        time.sleep(0.05)
    seen = sorted({(s.restart, s.world) for s in read_steps(events)})
    pytest.fail(
        f"no world of {world} with restart {restart} stepping within {timeout_s}s; seen (restart, world): {seen}"
    )


def descendants(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def is_store_host(proc: psutil.Process) -> bool:
    """Whether ``proc`` is a node's store host (forked by the zygote, as the workers are)."""
    from pliant.agent.storehost import PROCESS_NAME

    try:
        return proc.name() == PROCESS_NAME
    except psutil.NoSuchProcess:
        return False


def worker_processes(agent_pid: int) -> list[psutil.Process]:
    """The workers the zygote of the agent ``agent_pid`` forked (not its store host), oldest first."""
    try:
        zygotes = [c for c in psutil.Process(agent_pid).children() if "pliant.agent.zygote" in " ".join(c.cmdline())]
        return [w for z in zygotes for w in z.children() if not is_store_host(w)]
    except psutil.NoSuchProcess:
        return []


def assert_all_gone(pids: list[int], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    alive: list[int] = []
    while time.monotonic() < deadline:
        alive = [p for p in pids if process_alive(p)]
        if not alive:
            return
        time.sleep(0.1)
    pytest.fail(f"processes left behind: {alive}")


SAMPLES, GLOBAL_BATCH = 1000, 64  # 16 steps per epoch of examples/train_elastic.py (15 of 64, a tail of 40)
# The exactness checks train in float64. In float32, a world of another size sums gradients in another order, and
# the parameters differ from a static run's by rounding (about 1e-7); where a sample's ReLU input is as close to 0,
# the two runs can take opposite sides of the kink, and the rounding becomes a real difference by the last step.
EXACT = ("--float64",)
TOLERANCE = 1e-9  # the largest |parameter difference| from a static run that counts as equal (float64 runs: ~1e-15)


GAVE_UP = "the agent replaces this worker"  # the log line of a worker the step guard gave up on (groups.give_up)


def assert_kept(before: Iterable[int], after: Iterable[int], output: str) -> set[int]:
    """Assert that the worker processes ``before`` (pids) are among ``after``, save those the step guard gave up on: a
    rank still blocked in gloo past its break exits with its stacks, and its agent replaces it (the known limit in
    docs/operations.md, seen under a loaded suite). Each such process must have its give-up line in ``output``, the
    output of their agents. Returns the pids replaced."""
    replaced = set(before) - set(after)
    assert len(replaced) <= output.count(GAVE_UP), ("kept their processes", sorted(before), sorted(after))
    if replaced:
        print(f"workers {sorted(replaced)} were replaced after the step guard gave up on them")
    return replaced


def elastic_agent(
    coordinator: str,
    node: str,
    nproc: int,
    tmp: Path,
    steps: int,
    extra: tuple[str, ...] = (),
    script: tuple[str, ...] = (),
    checkpoints: bool = True,
    step_time: float = 0.1,
) -> list[str]:
    """``pliant agent`` running examples/train_elastic.py (``step_time`` s steps) with its events and final parameters
    under ``tmp``; ``checkpoints`` adds ``--checkpoint-dir tmp/ckpt``."""
    ckpt = ("--checkpoint-dir", str(tmp / "ckpt")) if checkpoints else ()
    flags = [
        "--rescale-grace",
        "30",
        "--finish-grace",
        "10",
        "--max-restarts",
        "0",
        *ckpt,
        "--log-dir",
        str(tmp / "logs"),
    ]
    return pliant_agent(
        coordinator, node, *flags, *extra, *elastic_script(tmp, steps, step_time), *script, nnodes="1:3", nproc=nproc
    )


def elastic_script(tmp: Path, steps: int, step_time: float = 0.1) -> list[str]:
    """examples/train_elastic.py and its arguments: ``steps`` steps of ``step_time`` s, events, final parameters and
    the stop file under ``tmp`` (what :func:`static_params` runs statically)."""
    events, final, stop = tmp / "events.jsonl", tmp / "final.pt", str(tmp / "stop")
    args = elastic_args(steps, SAMPLES, GLOBAL_BATCH, step_time=step_time, events=events, params_out=final)
    return [str(ELASTIC), *args, "--stop-file", stop, *EXACT]


def end_soon(tmp: Path, steps: int, margin: int = 10) -> int:
    """Have the job of :func:`elastic_agent` under ``tmp`` end ``margin`` steps after its newest logged step, once a
    test has seen what it waits for; returns its step count now (the static run's): :func:`bench.common.end_soon`."""
    return common.end_soon(tmp / "events.jsonl", tmp / "stop", steps, margin)


def static_params(tmp: Path, steps: int, engine: str = "ddp") -> dict:
    """The final parameters of examples/train_elastic.py run as one plain process on the same global batches."""
    return common.static_params(tmp / f"static-{engine}.pt", steps, SAMPLES, GLOBAL_BATCH, engine, timeout_s=120)


HSDP_RECEIVED = re.compile(r"hsdp: rank (\d+) received shard (\d+) of (\d+) \((\d+) bytes\) from rank (\d+)")


def hsdp_transfers(output: str) -> list[tuple[int, int, int, int]]:
    """(rank, shard index, bytes, source rank) of each shard transfer an agent's workers logged."""
    return [(int(m[1]), int(m[2]), int(m[4]), int(m[5])) for m in HSDP_RECEIVED.finditer(output)]


def replica_bytes(width: int = 32) -> int:
    """The bytes of one replica's shards of examples/train_elastic.py's model (float64, its parameters and SGD's
    momentum), without the packing's alignment."""
    params = (16 * width + width) + (width * width + width) + (width + 1)
    return 2 * params * 8
