"""Helpers for the framework integrations' tests (Lightning, Hugging Face): an agent running an example script under a
real coordinator, and what its ranks wrote per trained step (one JSON line each: rank, world, step, generation)."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.integration.harness import ROOT, read_jsonl

__all__ = ["EXAMPLES", "agent_argv", "events", "generation", "stepping", "trained_twice"]

EXAMPLES = ROOT / "examples"


def agent_argv(address: str, node: str, tmp: Path, script: Path, extra: tuple[str, ...] = ()) -> list[str]:
    """A ``pliant agent`` of job "job" on node ``node``: 1:2 nodes, one worker, short graces, three restarts."""
    return [
        sys.executable,
        "-m",
        "pliant",
        "agent",
        "--coordinator",
        address,
        "--job",
        "job",
        "--node-id",
        node,
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "1",
        "--heartbeat-ttl",
        "3",
        "--join-grace",
        "0.5",
        "--stop-grace",
        "2",
        "--rescale-grace",
        "30",
        "--finish-grace",
        "10",
        "--max-restarts",
        "3",
        "--checkpoint-dir",
        str(tmp / "ckpt"),
        "--log-dir",
        str(tmp / "logs"),
        str(script),
        *extra,
    ]


def events(tmp: Path) -> list[dict]:
    """Every step line the ranks wrote to ``tmp/events.jsonl`` so far."""
    return read_jsonl(tmp / "events.jsonl")


def stepping(tmp: Path, world: int, steps: int = 3, after: int = 0) -> bool:
    """Rank 0 trained ``steps`` steps in a world of ``world`` in a generation after ``after``."""
    return sum(1 for e in events(tmp) if e["rank"] == 0 and e["world"] == world and e["generation"] > after) >= steps


def generation(tmp: Path) -> int:
    """The newest generation a step was trained in."""
    return max((e["generation"] for e in events(tmp)), default=0)


def trained_twice(tmp: Path, steps: int) -> dict[int, list[int]]:
    """The steps rank 0 trained more than once, with the generations that trained each; asserts that every step in
    ``range(steps)`` was trained."""
    trained: dict[int, list[int]] = {}
    for event in events(tmp):
        if event["rank"] == 0:
            trained.setdefault(event["step"], []).append(event["generation"])
    assert set(trained) == set(range(steps)), f"steps never trained: {sorted(set(range(steps)) - set(trained))[:20]}"
    return {step: gens for step, gens in trained.items() if len(gens) > 1}
