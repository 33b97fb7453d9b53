"""Sharded checkpoints: saved at one world size and loaded at another for every engine; partial and corrupt
checkpoints are never loaded; another job's checkpoint is refused with a clear error."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.common import elastic_args
from tests.conftest import wait_for
from tests.integration.harness import (
    ELASTIC,
    EXACT,
    GLOBAL_BATCH,
    SAMPLES,
    TOLERANCE,
    elastic_agent,
    max_param_diff,
    static_params,
)

JOB = Path(__file__).with_name("engine_job.py")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _job(*args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, str(JOB), *args], capture_output=True, text=True, timeout=200)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def _max_diff(a: Path, b: Path) -> float:
    pa, pb = torch.load(a)["params"], torch.load(b)["params"]
    return max((pa[k] - pb[k]).abs().max().item() for k in pa)


@pytest.mark.parametrize("engine", ["ddp", "zero", "fsdp"])
def test_saved_at_world_2_resumed_at_world_3_matches_a_static_run(engine: str, tmp_path: Path) -> None:
    ckpt, static, resumed = tmp_path / "ckpt", tmp_path / "static", tmp_path / "resumed"
    static.mkdir()
    resumed.mkdir()
    _job("--engine", engine, "--worlds", "1", "--out", str(static))
    # The async save of step 3 copies the state in the background while steps 3 and 4 train on: it must hold step 3.
    _job(
        "--engine",
        engine,
        "--worlds",
        "2",
        "--ckpt",
        str(ckpt),
        "--stop-after",
        "3",
        "--async-save",
        "--train-after-save",
        "2",
        "--out",
        str(tmp_path),
    )
    assert sorted(p.name for p in ckpt.iterdir()) == ["pliant-fence.json", "step-000000000003"]
    files = {p.name for p in (ckpt / "step-000000000003").iterdir()}
    assert {".metadata", "pliant-commit.json"} <= files, files
    _job("--engine", engine, "--worlds", "3", "--ckpt", str(ckpt), "--resume", "3", "--out", str(resumed))
    diff = _max_diff(static / "world1.pt", resumed / "world3.pt")
    print(f"{engine}: saved at world 2, resumed at world 3: max |param diff| vs static = {diff:.2e}")
    assert diff <= 1e-5
    seen = torch.load(resumed / "world3.pt")["seen"]
    assert sum(len(s) for s in seen) == 37 - 30 + 37, "the resumed run saw the rest of the data, not all of it"


def test_an_hsdp_checkpoint_loads_at_another_mesh_and_in_another_engine(tmp_path: Path) -> None:
    """Saved by hsdp at world 4 (two replicas of 2 ranks; async, while two more steps train), resumed by hsdp at world
    2 (one replica of 2) and by fsdp at world 3: both end as a static run does."""
    ckpt, static = tmp_path / "ckpt", tmp_path / "static"
    static.mkdir()
    _job("--engine", "hsdp", "--shard-group", "2", "--worlds", "1", "--out", str(static))
    saved = ("--ckpt", str(ckpt), "--stop-after", "3", "--async-save", "--train-after-save", "2")
    _job("--engine", "hsdp", "--shard-group", "2", "--worlds", "4", *saved, "--out", str(tmp_path))
    for engine, world, grouped in (("hsdp", "2", ("--shard-group", "2")), ("fsdp", "3", ())):
        out = tmp_path / f"resumed-{engine}"
        out.mkdir()
        _job("--engine", engine, *grouped, "--worlds", world, "--ckpt", str(ckpt), "--resume", "3", "--out", str(out))
        diff = _max_diff(static / "world1.pt", out / f"world{world}.pt")
        print(f"hsdp at world 4 -> {engine} at world {world}: max |param diff| vs static = {diff:.2e}")
        assert diff <= 1e-5


def test_partial_and_corrupt_checkpoints_are_skipped(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _job("--engine", "ddp", "--worlds", "2", "--ckpt", str(ckpt), "--stop-after", "3", "--out", str(tmp_path))
    good = ckpt / "step-000000000003"
    # A newer save that was killed before its commit marker: ignored.
    shutil.copytree(good, ckpt / "step-000000000005")
    (ckpt / "step-000000000005" / "pliant-commit.json").unlink()
    # A newer committed checkpoint whose shard is truncated: skipped with a warning naming it.
    corrupt = ckpt / "step-000000000004"
    shutil.copytree(good, corrupt)
    text = (corrupt / "pliant-commit.json").read_text().replace('"step": 3', '"step": 4')
    (corrupt / "pliant-commit.json").write_text(text.replace("step-000000000003", "step-000000000004"))
    shard = next(corrupt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:20])
    result = _job("--engine", "ddp", "--worlds", "3", "--ckpt", str(ckpt), "--resume", "3", "--out", str(tmp_path))
    assert f"checkpoint {corrupt} is unusable" in result.stderr
    assert (ckpt / "step-000000000005").exists(), "nothing is deleted before a newer checkpoint supersedes it"
    # The corrupt one is moved aside (kept for inspection; never tried or pruned again).
    assert not corrupt.exists() and len(list(ckpt.glob("corrupt-step-4-*"))) == 1


def test_all_checkpoints_corrupt_is_a_clear_failure_and_nothing_is_deleted(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _job("--engine", "ddp", "--worlds", "2", "--ckpt", str(ckpt), "--stop-after", "3", "--out", str(tmp_path))
    shard = next((ckpt / "step-000000000003").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:20])
    before = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*"))
    result = _job(
        "--engine",
        "ddp",
        "--worlds",
        "2",
        "--ckpt",
        str(ckpt),
        "--resume",
        "3",
        "--expect-error",
        "--out",
        str(tmp_path),
    )
    assert f"checkpoints exist in {ckpt} but none can be loaded" in result.stderr, result.stderr[-3000:]
    assert "--allow-fresh-start" in result.stderr and "allow_fresh_start=True" in result.stderr
    assert sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*")) == before


def test_a_superseded_generation_cannot_commit(tmp_path: Path) -> None:
    """A zombie world (generation 1, evicted) saving after generation 2 opened the directory is refused."""
    ckpt = tmp_path / "ckpt"
    _job(
        "--engine",
        "ddp",
        "--worlds",
        "2",
        "--ckpt",
        str(ckpt),
        "--stop-after",
        "3",
        "--generation",
        "2",
        "--out",
        str(tmp_path),
    )
    result = _job(
        "--engine",
        "ddp",
        "--worlds",
        "2",
        "--ckpt",
        str(ckpt),
        "--stop-after",
        "5",
        "--generation",
        "1",
        "--expect-error",
        "--out",
        str(tmp_path),
    )
    assert "commit of" in result.stderr and "refused: generation 2 of job equivalence owns" in result.stderr
    assert sorted(p.name for p in ckpt.glob("step-*/pliant-commit.json")) == ["pliant-commit.json"]
    assert not (ckpt / "step-000000000005" / "pliant-commit.json").exists()


def test_a_failed_async_save_fails_the_step_that_reaps_it(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    result = _job(
        "--engine",
        "ddp",
        "--worlds",
        "1",
        "--ckpt",
        str(ckpt),
        "--every",
        "2",
        "--async-save",
        "--fail-async-save",
        "--expect-error",
        "--out",
        str(tmp_path),
    )
    assert f"checkpoint save to {ckpt / 'step-000000000002'} failed [errno 28" in result.stderr, result.stderr[-3000:]


def test_partial_checkpoints_are_removed_once_superseded(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "step-000000000001").mkdir()  # a save killed long ago
    _job("--engine", "ddp", "--worlds", "2", "--ckpt", str(ckpt), "--stop-after", "3", "--out", str(tmp_path))
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-000000000003"]


def test_a_checkpoint_saved_before_the_script_had_a_scheduler_loads_with_a_warning(tmp_path: Path) -> None:
    """A scheduler adds ``initial_lr`` to the optimizer's groups and its own state to the checkpoint; one saved without
    them loads, the scheduler starting afresh, and the next checkpoint holds it."""
    import torch.distributed.checkpoint as dcp

    env = {**os.environ, "PLIANT_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "PLIANT_JOB_ID": "job"}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [sys.executable, str(ELASTIC), "--save-every", "5", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert result.returncode == 0, result.stderr[-4000:]
        return result

    run("--steps", "5", "--lr-period", "0")
    result = run("--steps", "10")
    assert "holds no learning-rate scheduler state (saved without scheduler=); the scheduler starts" in result.stderr
    keys = dcp.FileSystemReader(str(tmp_path / "ckpt" / "step-000000000010")).read_metadata().state_dict_metadata
    assert {"train.scheduler.last_epoch", "train.scheduler.T_cur"} <= set(keys)
    assert "holds no learning-rate" not in run("--steps", "15").stderr


@pytest.mark.parametrize("engine", ["zero", "fsdp"])
def test_a_sharded_job_in_place_writes_its_checkpoints_from_the_buddy_snapshots(
    make_coordinator, spawn_agent, tmp_path: Path, engine: str
) -> None:
    """A sharded job in place (an agent, 2 workers, a snapshot every 5 steps) saves every 5 steps: each async save
    writes from the buddy snapshot of its step, not from a second copy (the first save's is taken for it, 4 steps
    after the one of the first step; from then on the cadence's fall on the saves). ZeRO's tensors are the
    snapshot's; FSDP2's DTensors are written from the snapshot's copies of their shards
    (:class:`pliant.worker.staging.SnapshotPlanner`). A plain process resumes the newest at world 1 and ends where a
    static run of all the steps does."""
    steps, resumed_steps = 20, 26
    server = make_coordinator()
    script = ("--engine", engine, "--save-every", "5")
    agent = spawn_agent(
        server,
        elastic_agent(server.address, "node-a", 2, tmp_path, steps, script=script, extra=("--snapshot-every", "5")),
        name="agent-a",
    )
    wait_for(lambda: agent.proc.poll() is not None, 180, "the job to finish")
    assert agent.proc.returncode == 0, agent.output()[-3000:]
    for step in (5, 10, 15, 20):
        for rank in (0, 1):
            line = f"rank {rank}: checkpoint of step {step} is written from the buddy snapshot"
            assert line in agent.output(), line
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.glob("step-*")) == [f"step-{s:012d}" for s in (10, 15, 20)]

    env = {**os.environ, "PLIANT_CHECKPOINT_DIR": str(ckpt), "PLIANT_JOB_ID": "job"}
    out = tmp_path / "resumed.pt"
    result = subprocess.run(
        [
            sys.executable,
            str(ELASTIC),
            *elastic_args(resumed_steps, SAMPLES, GLOBAL_BATCH, engine=engine, params_out=out, extra=EXACT),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.startswith("step 20 world 1"), result.stdout  # it resumed at step 20 (it prints every 10th)
    diff = max_param_diff(torch.load(out), static_params(tmp_path, resumed_steps, engine))
    print(f"{engine}: checkpoints saved in place at world 2, resumed at world 1: max |param diff| {diff:.2e}")
    assert diff <= TOLERANCE


_ABANDON = r"""
import os, sys
from concurrent.futures import Future
import torch, torch.distributed as dist
from pliant.net import free_port
from pliant.worker.checkpoint import CheckpointError, CheckpointManager
import pliant.worker as pw
from pliant.env import WorkerEnv

port = free_port()
os.environ["MASTER_PORT"] = str(port)
session = pw.Session(env=WorkerEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, master_port=port))
engine = session.engine(torch.nn.Linear(4, 2), "ddp", torch.optim.SGD, lr=0.1)
seen = []


class InPlace(pw.contract.Runner):  # the rescale protocol's answer: a peer's failure is recovered from
    def peer_failed(self, exc, started=None):
        seen.append(str(exc))
        return "Connection reset" in str(exc)


manager = CheckpointManager(sys.argv[1], engine, runner=InPlace())
for message in ("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer", "disk on fire"):
    future = Future()
    future.set_exception(RuntimeError(message))
    manager._in_flight, manager._in_flight_path = future, manager.directory / "step-000000000002"
    manager._committed.set()
    try:
        manager.wait()
        print("abandoned:", message)
    except CheckpointError as exc:
        print("raised:", str(exc)[:80])
print("seen", len(seen), "committed", sorted(p.name for p in manager.directory.glob("*/pliant-commit.json")))
"""


def test_a_save_a_peer_failed_during_is_abandoned_in_place_and_any_other_failure_still_raises(tmp_path: Path) -> None:
    """The manager's hook from the rescale protocol (a peer failed; the next step re-forms in place) turns a save
    that failed on a peer's death into an abandoned, uncommitted one; a failure of this rank's own still raises."""
    result = subprocess.run(
        [sys.executable, "-c", _ABANDON, str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MASTER_ADDR": "127.0.0.1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("abandoned: [gloo"), result.stdout
    assert lines[1].startswith("raised: checkpoint save to"), result.stdout
    assert lines[2] == "seen 2 committed []", result.stdout
