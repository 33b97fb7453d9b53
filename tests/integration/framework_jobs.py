"""Helpers for the framework integrations' tests (Lightning, Hugging Face): an agent running an example script under a
real coordinator, and what its ranks wrote per trained step (one JSON line each: rank, world, step, generation)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.conftest import wait_for
from tests.integration.harness import ROOT, pliant_agent, read_jsonl

__all__ = [
    "EXAMPLES",
    "Run",
    "agent_argv",
    "assert_like_a_static_run",
    "assert_static_steps",
    "committed_samples",
    "events",
    "generation",
    "join_kill_join_leave",
    "join_kill_worker_leave",
    "script_flags",
    "stepping",
    "trained_twice",
]

EXAMPLES = ROOT / "examples"


def agent_argv(address: str, node: str, tmp: Path, script: Path, extra: tuple[str, ...] = ()) -> list[str]:
    """A ``pliant agent`` of job "job" on node ``node``: 1:2 nodes, one worker, short graces, three restarts."""
    flags = ["--rescale-grace", "30", "--finish-grace", "10", "--max-restarts", "3"]
    flags += ["--checkpoint-dir", str(tmp / "ckpt"), "--log-dir", str(tmp / "logs")]
    return pliant_agent(address, node, *flags, str(script), *extra, nproc=1)


def script_flags(tmp: Path, steps: int, *flags: str, step_time_s: float = 0.03) -> tuple[str, ...]:
    """The flags every example script takes in these tests: ``--max-steps``, a simulated step time, and where its
    ranks write their steps (``events``) and rank 0 its final state (``final.json``); then ``flags``.

    The step time keeps ``steps`` longer than the run's four world changes: a newcomer's warm-up (its imports, and on
    a GPU host CUDA's start) takes 10-35 s, during which the others train on."""
    common = ("--max-steps", str(steps), "--step-time", str(step_time_s))
    return (*common, "--events", str(tmp / "events.jsonl"), "--out", str(tmp / "final.json"), *flags)


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


def committed_samples(tmp: Path, steps: int) -> dict[int, list[int]]:
    """The samples each step trained in the world that committed it (the last world that trained it), all ranks
    together; asserts that every step in ``range(steps)`` was trained, each rank's lines of one world once, and that a
    step trained again (after a kill) trained the same samples as before: the earlier world's lines hold no sample
    the committed training lacks (a world a kill ended may lack the lines of the ranks that died before writing
    theirs)."""
    by_step: dict[int, dict[int, list[int]]] = {}
    for event in events(tmp):
        worlds = by_step.setdefault(event["step"], {})
        worlds.setdefault(event["generation"], []).extend(event["samples"])
    assert set(by_step) == set(range(steps)), f"steps never trained: {sorted(set(range(steps)) - set(by_step))[:20]}"
    committed = {}
    for step, worlds in by_step.items():
        committed[step] = worlds[max(worlds)]
        redone = [Counter(samples) for gen, samples in worlds.items() if gen != max(worlds)]
        assert all(earlier <= Counter(committed[step]) for earlier in redone), (
            f"step {step} trained other samples when redone"
        )
    return committed


def assert_static_steps(elastic: dict[int, list[int]], static: dict[int, list[int]], dataset: int) -> None:
    """Each step trained the static run's samples; together the steps see every sample of each pass over the
    ``dataset`` samples once: of T samples trained, each sample T // dataset times, and T % dataset of them (the pass
    in progress) once more. (A step that crosses from one pass to the next may hold a sample of each.)"""
    assert sorted(elastic) == sorted(static), "the elastic and the static run trained other steps"
    for step in sorted(static):
        assert sorted(elastic[step]) == sorted(static[step]), f"step {step} trained other samples than the static run"
    seen = Counter(i for samples in elastic.values() for i in samples)
    passes, rest = divmod(sum(seen.values()), dataset)
    assert set(seen) <= set(range(dataset)) and all(seen[i] in (passes, passes + 1) for i in range(dataset)), seen
    assert sum(1 for i in range(dataset) if seen[i] == passes + 1) == rest


def assert_like_a_static_run(
    tmp: Path, script: Path, flags: tuple[str, ...], steps: int, dataset: int, launcher: tuple[str, ...] = ()
) -> float:
    """Run ``script`` with ``flags`` once more, statically (one process, or ``launcher`` such as torchrun at one
    rank; no step time), in ``tmp/static``, and assert that the elastic run in ``tmp`` trained its steps on its
    samples (:func:`assert_static_steps`) to ``steps``; returns the largest difference of their final parameters (0.0
    when the script writes none), asserting it is at most 1e-4."""
    static = tmp / "static"
    static.mkdir()
    argv = [*(launcher or (sys.executable,)), str(script), *script_flags(static, steps, *flags, step_time_s=0.0)]
    done = subprocess.run(argv, cwd=static, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_static_steps(committed_samples(tmp, steps), committed_samples(static, steps), dataset)
    final, reference = (json.loads((where / "final.json").read_text()) for where in (tmp, static))
    assert final["global_step"] == reference["global_step"] == steps, (final["global_step"], reference["global_step"])
    if "params" not in final:
        return 0.0
    diff = (torch.tensor(final["params"]) - torch.tensor(reference["params"])).abs().max().item()
    assert diff <= 1e-4, f"the elastic run's parameters are {diff:.2e} from the static run's"
    return diff


@dataclass(frozen=True)
class Run:
    """What :func:`join_kill_join_leave` or :func:`join_kill_worker_leave` went through: node a's agent (running until
    the job ends), the generation of the first join, the generation the kill -9 ended, and node b's agent that
    left."""

    agent: Any
    joined: int
    killed_in: int
    rejoined: Any


def _alone_then_joined(
    server: Any, spawn_agent: Callable[..., Any], tmp: Path, script: Path, extra: tuple[str, ...], wait_s: float
) -> tuple[Any, Any, int]:
    """Node a trains alone, then node b joins: (node a's agent, node b's, the generation of the join)."""
    a = spawn_agent(server, agent_argv(server.address, "node-a", tmp, script, extra), name="agent-a")
    wait_for(lambda: stepping(tmp, 1, 10), wait_s, "node a stepping alone")
    b = spawn_agent(server, agent_argv(server.address, "node-b", tmp, script, extra), name="agent-b")
    wait_for(lambda: stepping(tmp, 2, 10), wait_s, "world 2 stepping (join)")
    return a, b, generation(tmp)


def _leave_then_finish(a: Any, b: Any, tmp: Path, wait_s: float) -> None:
    """Node b leaves (SIGTERM), node a trains alone, and the job runs to its end (node a's agent exits 0)."""
    left_after = generation(tmp)
    b.kill(signal.SIGTERM)  # a graceful leave
    wait_for(lambda: b.proc.poll() is not None, 60, "node b to leave")
    wait_for(lambda: stepping(tmp, 1, 3, after=left_after), wait_s, "node a stepping alone (leave)")
    wait_for(lambda: a.proc.poll() is not None, 180, "the job to finish")
    assert a.proc.returncode == 0, a.output()[-4000:]


def join_kill_worker_leave(
    server: Any, spawn_agent: Callable[..., Any], tmp: Path, script: Path, extra: tuple[str, ...], wait_s: float
) -> Run:
    """Node a trains alone; node b joins; one of node b's workers is killed (kill -9; its agent stays, and the next
    world has both nodes); node b leaves (SIGTERM); then the job runs to its end. Each change is waited for as rank 0
    stepping in the new world (at most ``wait_s`` each)."""
    a, b, joined = _alone_then_joined(server, spawn_agent, tmp, script, extra, wait_s)
    killed_in = joined
    wait_for(lambda: any(e["rank"] == 1 and e["generation"] == joined for e in events(tmp)), 30, "node b's worker")
    worker = next(e["pid"] for e in reversed(events(tmp)) if e["rank"] == 1 and e["generation"] == joined)
    os.kill(worker, signal.SIGKILL)  # node b's worker dies: the world fails, the next resumes from a checkpoint
    wait_for(lambda: stepping(tmp, 2, 10, after=killed_in), wait_s, "world 2 stepping again (kill -9 of a worker)")

    _leave_then_finish(a, b, tmp, wait_s)
    return Run(a, joined, killed_in, b)


def join_kill_join_leave(
    server: Any, spawn_agent: Callable[..., Any], tmp: Path, script: Path, extra: tuple[str, ...], wait_s: float
) -> Run:
    """Node a trains alone; node b joins; node b's agent is killed (kill -9); node b joins again; node b leaves
    (SIGTERM); then the job runs to its end. Each change is waited for as rank 0 stepping in the new world (at most
    ``wait_s`` each)."""
    a, b, joined = _alone_then_joined(server, spawn_agent, tmp, script, extra, wait_s)
    killed_in = joined

    b.kill(signal.SIGKILL)  # node b is lost: a's worker fails, the next world resumes from the last checkpoint
    wait_for(lambda: stepping(tmp, 1, 10, after=killed_in), wait_s, "node a stepping alone again (kill -9)")

    b2 = spawn_agent(server, agent_argv(server.address, "node-b", tmp, script, extra), name="agent-b2")
    rejoined_after = generation(tmp)
    wait_for(lambda: stepping(tmp, 2, 10, after=rejoined_after), wait_s, "world 2 stepping (join again)")

    _leave_then_finish(a, b2, tmp, wait_s)
    return Run(a, joined, killed_in, b2)
