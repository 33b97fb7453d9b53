"""Honest outcomes, through real agents, a real coordinator and gloo workers of a plain DDP script
(tests/integration/plain_job.py): a failure of every node of a world refuses that world size and charges nobody; a
node's own failures exclude it, and it says why, and the peers whose collectives they broke are not charged; the
job's end says how it ended; and a graceful leave stops every node's workers with SIGTERM before any peer's exit can
break their collectives."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pliant.agent.contract import left_on
from pliant.coordinator.contract import JobState, Outcome
from tests.conftest import wait_for
from tests.integration.harness import pliant_agent, read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PLAIN = Path(__file__).resolve().parent / "plain_job.py"
WORLD_4 = "ValueError: the global batch of 6 does not divide among 4 ranks"


def _agent(server: object, node: str, tmp: Path, *script: str, restarts: int = 3) -> list[str]:
    flags = ("--max-restarts", str(restarts), "--finish-grace", "5", "--log-dir", str(tmp / "logs"))
    events = str(tmp / "events.jsonl")
    address = server.address  # type: ignore[attr-defined]
    return pliant_agent(address, node, *flags, str(PLAIN), "--events", events, *script)


def _lines(output: str, text: str) -> list[str]:
    return [line for line in output.splitlines() if text in line]


def test_a_world_size_that_fails_on_every_node_is_refused_and_nobody_is_excluded(
    make_coordinator, spawn_agent, fleet, tmp_path: Path
) -> None:
    server = make_coordinator()
    script = ("--steps", "80", "--step-time", "0.05", "--fail-at-world", "4")
    a = spawn_agent(server, _agent(server, "node-a", tmp_path, *script), name="agent-a")
    b = spawn_agent(server, _agent(server, "node-b", tmp_path, *script), name="agent-b")
    wait_for(lambda: a.proc.poll() is not None and b.proc.poll() is not None, 180, "the job to end")
    out_a, out_b = a.output(), b.output()
    print(out_a[-2500:], "\n----\n", out_b[-2500:])
    assert (a.proc.returncode, b.proc.returncode) == (0, 0), out_a[-3000:] + out_b[-3000:]
    for out in (out_a, out_b):
        refused = _lines(out, "world size 4 fails on every node with")
        assert len(refused) == 1 and WORLD_4 in refused[0], refused  # once, with the script's error
        assert not _lines(out, "excluded after"), "nobody is excluded for the world's failure"
    left_out = [out for out in (out_a, out_b) if _lines(out, "left out: the job no longer takes world size 4")]
    assert len(left_out) == 1, "the node that trains not says it is left out of world 4; the other one does"
    steps = [e for e in read_jsonl(tmp_path / "events.jsonl") if "step" in e]
    assert {e["world"] for e in steps} == {2} and max(e["step"] for e in steps) == 80, "it trained at world 2"
    with fleet(server) as client:
        info = client.get_job("job")
    assert info.status.state is JobState.SUCCEEDED and info.status.outcome is Outcome.REDUCED
    assert "with world size 4 refused (it fails on every node with " + WORLD_4 in info.status.reason
    assert info.generation is not None and info.generation.refused == ((4, WORLD_4),)
    assert info.generation.charged == ()
    for out in (out_a, out_b):
        assert _lines(out, "succeeded with a reduced world"), out[-2000:]
        assert _lines(out, "job job succeeded: finished at world 2 (1 node), with world size 4 refused"), out[-2000:]


def test_a_nodes_own_failures_exclude_it_and_it_says_so(make_coordinator, spawn_agent, fleet, tmp_path: Path) -> None:
    server = make_coordinator()
    script = ("--steps", "60", "--step-time", "0.05", "--fail-on-node", "node-b")
    a = spawn_agent(server, _agent(server, "node-a", tmp_path, *script, restarts=1), name="agent-a")
    b = spawn_agent(server, _agent(server, "node-b", tmp_path, *script, restarts=1), name="agent-b")
    wait_for(lambda: a.proc.poll() is not None and b.proc.poll() is not None, 180, "the job to end")
    out_a, out_b = a.output(), b.output()
    print(out_a[-2500:], "\n----\n", out_b[-2500:])
    assert (a.proc.returncode, b.proc.returncode) == (0, 0), out_a[-3000:] + out_b[-3000:]
    excluded = _lines(out_b, "excluded after 2 worker failures on this node: RuntimeError: the disk of node-b is full")
    assert excluded, out_b[-3000:]
    assert not _lines(out_b, "spare"), "an excluded node is no spare"
    assert not _lines(out_a, "failures on this node") and not _lines(out_a, "fails on every node")
    with fleet(server) as client:
        info = client.get_job("job")
    assert info.status.outcome is Outcome.REDUCED
    assert "node node-b excluded after 2 worker failures (RuntimeError: the disk of node-b is full)" in (
        info.status.reason
    )


def test_a_graceful_leave_sigterms_every_rank_before_any_exits(make_coordinator, spawn_agent, tmp_path: Path) -> None:
    """A plain script that saves on SIGTERM (its ranks agree on the step with an all-reduce of the flag): when node b
    leaves on Ctrl-C, every rank of both nodes runs its handler, they save at one step, and the world of node a
    resumes from it, redoing no step."""
    server = make_coordinator()
    script = ("--steps", "100000", "--step-time", "0.3", "--ckpt", str(tmp_path / "ckpt.pt"))
    a = spawn_agent(server, _agent(server, "node-a", tmp_path, *script), name="agent-a")
    b = spawn_agent(server, _agent(server, "node-b", tmp_path, *script), name="agent-b")

    def events() -> list[dict]:
        return read_jsonl(tmp_path / "events.jsonl")

    wait_for(lambda: [e for e in events() if e.get("world") == 4 and e["step"] >= 3], 90, "world 4 stepping")
    b.kill(signal.SIGINT)
    wait_for(lambda: b.proc.poll() is not None, 60, "node b to leave")
    assert b.proc.returncode == left_on(signal.SIGINT), b.output()[-3000:]
    wait_for(lambda: [e for e in events() if e.get("world") == 2], 60, "world 2 stepping")
    # `pliant status` with no flags on a node of the job: the node's agent's view of it
    status = subprocess.run(
        [sys.executable, "-m", "pliant", "status", "--job", "job", "--json"], capture_output=True, text=True, timeout=60
    )
    assert status.returncode == 0, status.stderr
    (job,) = json.loads(status.stdout)["jobs"]
    assert job["state"] == "running" and job["world_size"] == 2, job
    assert [m["node_id"] for m in job["members"] if m["in_generation"]] == ["node-a"], job
    a.kill(signal.SIGTERM)
    wait_for(lambda: a.proc.poll() is not None, 60, "node a to leave")
    seen = events()
    last_4 = max(e["step"] for e in seen if e.get("world") == 4)
    first_2 = min(e["step"] for e in seen if e.get("world") == 2)
    handled = sorted((e["node"], e["rank"]) for e in seen if e.get("sigterm") == last_4)
    print(f"world 4 stopped after step {last_4}; handlers ran on {handled}; world 2 started at step {first_2}")
    assert sorted(rank for _node, rank in handled) == [0, 1, 2, 3], seen[-12:]  # every rank's handler ran
    assert {node for node, _rank in handled} == {"node-a", "node-b"}
    assert first_2 == last_4 + 1, "no step redone, none skipped"
    assert "Connection closed by peer" not in a.output() + b.output()
