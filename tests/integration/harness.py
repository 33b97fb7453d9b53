"""Helpers for multi-process tests: start agents running the example DDP script and read what their workers saw."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

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


def read_jsonl(path: Path) -> list[dict]:
    """The JSON lines of ``path`` (none if it does not exist), skipping a line still being written."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def read_steps(path: Path) -> list[Step]:
    return [Step(**item) for item in read_jsonl(path)]


def agent_args(coordinator: str, job: str, node: str, workdir: Path, nnodes: str = "1:2", steps: int = 100000,
               extra: tuple[str, ...] = ()) -> list[str]:  # fmt: skip
    """``pliant agent`` running 2 workers of the example script, with events and checkpoint under ``workdir``."""
    return [
        sys.executable, "-m", "pliant", "agent", "--coordinator", coordinator, "--job", job, "--node-id", node,
        "--nnodes", nnodes, "--nproc-per-node", "2", "--heartbeat-ttl", "3", "--join-grace", "0.5",
        "--stop-grace", "2", "--finish-grace", "1", "--log-dir", str(workdir / "logs"), *extra,
        str(SCRIPT), "--steps", str(steps), "--step-time", "0.05", "--ckpt", str(workdir / "ckpt.pt"),
        "--events", str(workdir / "events.jsonl"), "--log-every", "50",
    ]  # fmt: skip


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


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_all_gone(pids: list[int], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    alive: list[int] = []
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return
        time.sleep(0.1)
    pytest.fail(f"processes left behind: {alive}")
