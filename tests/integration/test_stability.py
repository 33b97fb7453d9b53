"""Keep training through anything, with real etcd, real coordinator replicas, real agents and gloo workers:
control-plane outages, a malformed record, a hung worker, a join during a slow checkpoint, an evicted node."""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
import time
import types
from pathlib import Path

import pytest

from bench.netns import unavailable
from pliant.coordinator.contract import JobState
from pliant.coordinator.etcd_server import EtcdServer
from tests.conftest import health_serving, wait_for
from tests.integration.harness import assert_all_gone, end_soon, pliant_agent, read_jsonl, worker_processes
from tests.integration.proxy import Proxy

pytestmark = [pytest.mark.slow]

HOOKS = Path(__file__).with_name("train_hooks.py")
OUTAGE_S = float(os.environ.get("PLIANT_TEST_OUTAGE_S", "60"))  # longer outages: set it (the closing figures)
STEPS = int(OUTAGE_S * 10 + 40)  # 0.1 s steps (fewer than 10 a second): training outlasts the outage


def _args(
    coordinator: str,
    node: str,
    workdir: Path,
    steps: int,
    nnodes: str = "1:2",
    step_time: float = 0.1,
    extra: tuple[str, ...] = (),
    checkpoints: bool = True,
    nproc: int = 2,
) -> list[str]:
    flags = ["--finish-grace", "10", "--log-dir", str(workdir / "logs")]
    flags += ["--checkpoint-dir", str(workdir / "ckpt")] if checkpoints else []
    script = [str(HOOKS), "--steps", str(steps), "--step-time", str(step_time), "--save-every", "20"]
    script += ["--events", str(workdir / "events.jsonl"), "--stop-file", str(workdir / "stop")]
    return pliant_agent(coordinator, node, *flags, *extra, *script, nnodes=nnodes, nproc=nproc)


def _events(workdir: Path) -> list[dict]:
    return read_jsonl(workdir / "events.jsonl")


def _stepping(workdir: Path, generation: int, world: int, after: float = 0.0) -> bool:
    ranks = {
        e["rank"]
        for e in _events(workdir)
        if e["generation"] == generation and e["world"] == world and e["time"] > after
    }
    return ranks == set(range(world))


def _workers(*agents: object) -> set[int]:
    """Worker pids under the agents: the processes their zygotes forked (not their store hosts)."""
    return {w.pid for agent in agents for w in worker_processes(agent.pid)}  # type: ignore[attr-defined]


def _finished(agents: list, timeout_s: float = 60) -> None:
    wait_for(lambda: all(a.proc.poll() is not None for a in agents), timeout_s, "the agents to exit")
    for agent in agents:
        assert agent.proc.returncode == 0, agent.output()[-4000:]


def _assert_steps_through(workdir: Path, start: float, end: float) -> int:
    """Rank 0 kept stepping from ``start`` to ``end`` (no gap longer than 5 s) in generation 1 alone. Returns its
    steps in that window."""
    events = _events(workdir)
    assert {e["generation"] for e in events} == {1}, "no new generation, no restart"
    times = sorted(e["time"] for e in events if e["rank"] == 0 and start <= e["time"] <= end)
    assert times and times[0] - start < 5 and end - times[-1] < 5, (start, end, times[:3], times[-3:])
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert max(gaps) < 5, f"training paused {max(gaps):.1f}s during the outage"
    print(f"{len(times)} steps of rank 0 during the {end - start:.0f}s outage; longest pause {max(gaps):.2f}s")
    return len(times)


def _train_through_an_outage(target: object, spawn_agent, fleet, workdir: Path, down, up) -> None:
    """Two agents x 1 worker train (a minute of two loaded cores for the suite's other tests); ``down()`` starts the
    outage, ``up()`` ends it ``OUTAGE_S`` later. Nothing may change: steps go on throughout, the same workers finish
    the job in generation 1, no restart is spent."""
    address = target.address  # type: ignore[attr-defined]
    a = spawn_agent(target, _args(address, "a", workdir, steps=STEPS, nnodes="2:2", nproc=1), name="agent-a")
    b = spawn_agent(target, _args(address, "b", workdir, steps=STEPS, nnodes="2:2", nproc=1), name="agent-b")
    wait_for(lambda: _stepping(workdir, 1, 2), 90, "the world of 2 stepping")
    workers = _workers(a, b)
    started = time.time()
    down()
    time.sleep(OUTAGE_S)
    ended = time.time()
    up()
    steps = _assert_steps_through(workdir, started, ended)
    assert all(os.path.exists(f"/proc/{p}") for p in workers), "no worker was restarted"
    total = end_soon(workdir, STEPS)  # the rest of the job would only add time
    _finished([a, b], 120)
    with fleet(target) as client:
        info = client.get_job("job")
        assert info.status.state is JobState.SUCCEEDED, info.status
        assert info.generation.number == 1 and info.generation.restarts_used == 0
    assert max(e["step"] for e in _events(workdir)) == total - 1
    assert "exited with code" not in a.output() + b.output()
    return steps


@pytest.mark.long
@pytest.mark.timeout(OUTAGE_S + 240)
def test_a_60s_control_plane_outage_changes_nothing(spawn_coordinator, spawn_agent, fleet, tmp_path) -> None:
    """The whole control plane is unavailable for OUTAGE_S, in both of its ways: etcd goes down (the replicas stay up
    and answer NOT_SERVING), a third of the way in every replica goes down too, two thirds in etcd comes back (no
    replica yet), and at the end the replicas come back. Each part is down for two thirds of the outage."""
    etcd = EtcdServer(data_dir=str(tmp_path / "etcd")).start()
    try:
        (r1, a1), (r2, a2) = (spawn_coordinator(name, etcd_url=etcd.endpoint) for name in ("r1", "r2"))
        both = types.SimpleNamespace(address=f"{a1},{a2}")

        def staged() -> None:
            etcd.kill()
            time.sleep(OUTAGE_S / 3)
            r1.kill()
            r2.kill()
            time.sleep(OUTAGE_S / 3)
            etcd.start()

        steps = _train_through_an_outage(
            both,
            spawn_agent,
            fleet,
            tmp_path,
            down=lambda: threading.Thread(target=staged, daemon=True).start(),
            up=lambda: [
                spawn_coordinator(name, address=address, etcd_url=etcd.endpoint)
                for name, address in (("r1", a1), ("r2", a2))
            ],
        )
        assert steps > OUTAGE_S * 5, "0.1 s steps: about ten a second while the control plane is down"
    finally:
        etcd.stop()


@pytest.mark.timeout(180)
def test_workers_that_finish_during_an_outage_report_success_when_it_ends(
    spawn_coordinator, spawn_agent, fleet, tmp_path
) -> None:
    replica, address = spawn_coordinator("r1")
    target = types.SimpleNamespace(address=address)
    a = spawn_agent(target, _args(address, "a", tmp_path, steps=60, nnodes="1:1", step_time=0.1), name="agent-a")
    wait_for(lambda: _stepping(tmp_path, 1, 2), 90, "node a stepping")
    replica.kill()
    wait_for(lambda: "workers done; waiting for the job to finish" in a.output(), 60, "the workers to finish")
    time.sleep(3)  # the success waits in the agent's queue; the agent neither exits nor gives up
    assert a.proc.poll() is None
    spawn_coordinator("r1", address=address)
    _finished([a], 60)
    with fleet(target) as client:
        info = client.get_job("job")
        assert info.status.state is JobState.SUCCEEDED and info.generation.number == 1, info.status
    assert "reported (accepted" in a.output()


@pytest.mark.timeout(180)
def test_a_malformed_record_of_one_job_leaves_the_others_training(
    make_coordinator, spawn_agent, fleet, tmp_path
) -> None:
    from pliant.coordinator.contract import JobSpec

    server = make_coordinator(health_listen="127.0.0.1:0")
    store = server.store
    with fleet(server) as client:
        client.create_job(JobSpec("bad", 1, 1))
        store.client.put(store.job_key("bad", "state"), '{"since": 1.0}')  # valid JSON, no "state"
        a = spawn_agent(
            server, _args(server.address, "a", tmp_path, steps=40, nnodes="1:1", step_time=0.02), name="agent-a"
        )
        _finished([a], 120)
        assert client.get_job("job").status.state is JobState.SUCCEEDED
        assert "KeyError" in server.reconciler.unreadable["bad"]
        _jobs, unreadable = client.admin.list_jobs_and_errors()
        assert "jobs/bad/state" in unreadable["bad"]
        assert server.election.is_leader and health_serving(f"127.0.0.1:{server.health_port}")


@pytest.mark.timeout(180)
def test_a_stopped_worker_is_a_hang_the_job_recovers_from(make_coordinator, spawn_agent, fleet, tmp_path) -> None:
    server = make_coordinator()
    a = spawn_agent(
        server,
        _args(server.address, "a", tmp_path, steps=150, nnodes="1:1", step_time=0.05, extra=("--hang-timeout", "3")),
        name="agent-a",
    )
    wait_for(lambda: _stepping(tmp_path, 1, 2) and max(e["step"] for e in _events(tmp_path)) > 30, 90, "steps past 30")
    victim = next(iter(sorted(_workers(a))))
    os.kill(victim, signal.SIGSTOP)
    stopped = time.monotonic()
    wait_for(lambda: "hang detected" in a.output(), 30, "the hang to be detected")
    latency = time.monotonic() - stopped
    print(f"hang detected {latency:.1f}s after SIGSTOP (hang timeout 3s)")
    assert latency < 3 + 3, f"detected after {latency:.1f}s"
    wait_for(
        lambda: "Most recent call first" in a.output() or "most recent call first" in a.output(), 10, "the stack dump"
    )
    _finished([a], 120)
    with fleet(server) as client:
        info = client.get_job("job")
        assert info.status.state is JobState.SUCCEEDED
        assert (info.generation.number, info.generation.reason, info.generation.restarts_used) == (2, "restart", 1)


@pytest.mark.timeout(240)
def test_a_join_during_a_slow_checkpoint_spends_no_restart(make_coordinator, spawn_agent, fleet, tmp_path) -> None:
    server = make_coordinator()
    env = {"TEST_SLOW_SAVE_S": "12"}
    a = spawn_agent(
        server,
        _args(server.address, "a", tmp_path, steps=100000, extra=("--max-restarts", "0")),
        name="agent-a",
        env=env,
    )
    wait_for(lambda: _stepping(tmp_path, 1, 2), 90, "node a stepping")
    joined = time.time()
    b = spawn_agent(
        server,
        _args(server.address, "b", tmp_path, steps=100000, extra=("--max-restarts", "0")),
        name="agent-b",
        env=env,
    )
    wait_for(lambda: _stepping(tmp_path, 2, 4), 120, "the world of 4 stepping")
    pause = min(e["time"] for e in _events(tmp_path) if e["generation"] == 2) - joined
    print(f"join -> world of 4 stepping: {pause:.1f}s, with a 12s rescale checkpoint on node a")
    with fleet(server) as client:
        info = client.get_job("job")
        assert info.status.state is JobState.RUNNING
        assert (info.generation.number, info.generation.reason, info.generation.restarts_used) == (2, "join", 0)
        client.finish_job("job", True, "test done")
    _finished([a, b], 60)
    assert "cannot start" not in b.output() and "failure of generation" not in a.output() + b.output()


@pytest.mark.timeout(180)
def test_a_loop_without_checkpoints_never_waits_out_the_rescale_grace(
    make_coordinator, spawn_agent, fleet, tmp_path
) -> None:
    """The README's first loop (pliant.worker, no --checkpoint-dir): a join used to wait the whole 30 s rescale grace
    (the signal was swallowed) and spend a restart; now the old workers stop at once, with a warning at start."""
    server = make_coordinator()
    args = {"steps": 100000, "checkpoints": False, "extra": ("--max-restarts", "0")}
    a = spawn_agent(server, _args(server.address, "a", tmp_path, **args), name="agent-a")  # type: ignore[arg-type]
    wait_for(lambda: _stepping(tmp_path, 1, 2), 90, "node a stepping")
    assert "no --checkpoint-dir" in a.output() and "restarts training from step 0" in a.output()
    joined = time.time()
    b = spawn_agent(server, _args(server.address, "b", tmp_path, **args), name="agent-b")  # type: ignore[arg-type]
    wait_for(lambda: _stepping(tmp_path, 2, 4), 60, "the world of 4 stepping")
    pause = min(e["time"] for e in _events(tmp_path) if e["generation"] == 2) - joined
    print(f"join -> world of 4 stepping without checkpoints: {pause:.1f}s (rescale grace 30s)")
    assert pause < 15, pause
    with fleet(server) as client:
        gen = client.get_job("job").generation
        assert (gen.number, gen.reason, gen.restarts_used) == (2, "join", 0)
        client.finish_job("job", True, "test done")
    _finished([a, b], 60)


@pytest.mark.timeout(240)
@pytest.mark.skipif(not unavailable(), reason="covered on real network namespaces (test_partitions.py)")
def test_an_evicted_node_stops_its_workers_and_commits_nothing_after(
    make_coordinator, spawn_agent, fleet, tmp_path
) -> None:
    server = make_coordinator()
    proxy = Proxy(server.address)
    try:
        a = spawn_agent(server, _args(proxy.address, "a", tmp_path, steps=100000, nnodes="1:1"), name="agent-a")
        wait_for(lambda: _stepping(tmp_path, 1, 2), 90, "node a stepping")
        b = spawn_agent(server, _args(server.address, "b", tmp_path, steps=100000, nnodes="1:1"), name="agent-b")
        with fleet(server) as client:
            wait_for(lambda: len(client.get_job("job").members) == 2, 30, "node b waiting as a spare")
            a_workers = _workers(a)
            proxy.cut()  # node a can reach nothing of the control plane; it trains on alone
            gen = wait_for(lambda: (g := client.get_job("job").generation) and g.number == 2 and g, 30, "gen 2")
            assert gen.node_ids == ("b",) and gen.reason == "failure"
            wait_for(lambda: _stepping(tmp_path, 2, 2), 90, "node b's world stepping")
            fence_at = (tmp_path / "ckpt" / "pliant-fence.json").stat().st_mtime
            wait_for(
                lambda: not any(os.path.exists(f"/proc/{p}") for p in a_workers), 15, "node a's workers to be stopped"
            )
            assert a.proc.poll() is None, "the agent itself keeps trying to reach the coordinator"
            assert "fenced" in a.output()
            for marker in (tmp_path / "ckpt").glob("step-*/pliant-commit.json"):
                info = json.loads(marker.read_text())
                assert info["generation"] >= 2 or info["saved_at"] < fence_at, info
            proxy.heal()
            wait_for(lambda: "joined job job" in a.output().split("fenced", 1)[-1], 30, "node a joining again")
            client.finish_job("job", True, "test done")
        _finished([a, b], 60)
        assert_all_gone(list(a_workers))
    finally:
        proxy.close()
