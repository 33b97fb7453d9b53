"""A writer of the checkpoint volume cannot run code in a worker, delete files through pliant, or stop training: forged
checkpoints, markers and fences are refused with a message and leave every real checkpoint loadable."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.common import PLIANT
from tests.conftest import wait_for
from tests.integration.harness import elastic_script, read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

# One worker process (a world of 1 on gloo) saves steps 1 and 2 with a checkpoint manager, as under an agent when
# argv[2] is "key" (the job's key and an incarnation); the test then forges files and a second process restores.
_WORKER = r"""
import json, os, sys
import torch
import pliant.worker as pw
from pliant.env import WorkerEnv
from pliant.net import free_port
from pliant.security.seal import job_key
from pliant.worker.checkpoint import CheckpointManager

directory, mode, incarnation, action = sys.argv[1:5]
key = job_key(b"k" * 32, "job") if mode == "key" else None
port = free_port()
os.environ["MASTER_PORT"] = str(port)
session = pw.Session(env=WorkerEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, master_port=port))
torch.manual_seed(0)
engine = session.engine(torch.nn.Linear(4, 2), "ddp", torch.optim.SGD, lr=0.1)
manager = CheckpointManager(directory, engine, job_id="job", keep=2, async_save=False, key=key,
                            incarnation=incarnation if mode == "key" else "")
if action == "save":
    for step in (1, 2):
        manager.save(step)
elif action == "restore":
    print(json.dumps({"restored": manager.restore()}))
    manager.save(3)
    manager.save(4)
print(json.dumps({"committed": [i.step for i in manager.committed()]}))
"""


class _Payload:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.path}",)


def _worker(directory: Path, mode: str, incarnation: str, action: str) -> tuple[list[dict], str]:
    result = subprocess.run(
        [sys.executable, "-c", _WORKER, str(directory), mode, incarnation, action],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MASTER_ADDR": "127.0.0.1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")], result.stderr


def _forge(directory: Path, tmp: Path) -> dict[str, Path]:
    """What an attacker with write access to the volume plants (and what must not happen because of it)."""
    import hashlib
    import pickle

    sentinel, victim = tmp / "payload-ran", tmp / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    metadata = pickle.dumps(_Payload(str(sentinel)))
    # A newer step with a copied (sealed) marker and a pickle that runs code.
    forged = directory / "step-000000000090"
    forged.mkdir()
    (forged / ".metadata").write_bytes(metadata)
    (forged / "pliant-commit.json").write_text((directory / "step-000000000002" / "pliant-commit.json").read_text())
    # An edited marker: its step, and the digest of the forged metadata (its seal no longer holds).
    edited = directory / "step-000000000091"
    edited.mkdir()
    (edited / ".metadata").write_bytes(metadata)
    record = json.loads((directory / "step-000000000002" / "pliant-commit.json").read_text())
    record.update(step=91, metadata_sha256=hashlib.sha256(metadata).hexdigest())
    (edited / "pliant-commit.json").write_text(json.dumps(record))
    # A marker naming another path, with a step that would push the real checkpoints out of `keep`.
    huge = directory / "step-999999999999"
    huge.mkdir()
    (huge / "pliant-commit.json").write_text(json.dumps({**record, "step": 999999999999, "path": str(victim)}))
    # A link named like a checkpoint, to a directory outside.
    (directory / "step-000000000095").symlink_to(victim)
    return {"sentinel": sentinel, "victim": victim}


@pytest.mark.parametrize("mode", ["key", "no-key"], ids=["under-an-agent", "plain-script"])
def test_forged_checkpoints_run_no_code_delete_nothing_and_the_real_ones_load(tmp_path: Path, mode: str) -> None:
    directory = tmp_path / "ckpt"
    _worker(directory, mode, "u1", "save")
    shard = next((directory / "step-000000000002").glob("*.distcp"))
    assert stat.S_IMODE(shard.stat().st_mode) == 0o640, "shards are not world-readable"
    assert stat.S_IMODE((directory / "step-000000000002").stat().st_mode) == 0o750
    planted = _forge(directory, tmp_path)

    out, log = _worker(directory, mode, "u2", "restore")  # a new incarnation (started again) takes the directory over
    assert not planted["sentinel"].exists(), "the forged pickle ran"
    assert (planted["victim"] / "precious").read_text() == "keep me", "a marker's path was deleted"
    if mode == "key":
        # Forged markers do not count: the real step 2 is the newest; the forged ones are ignored, said once each.
        assert out[0] == {"restored": 2}, (out, log[-3000:])
        assert "step-000000000090 is ignored: its commit marker is not this job's (it names step 2)" in log
        assert "step-000000000091 is ignored: its commit marker is not this job's (its seal does not match" in log
        assert "step-999999999999 is ignored" in log
    else:
        # Without a key markers are taken as they are: the forged metadata is refused before and while unpickling.
        assert out[0] == {"restored": 2}, (out, log[-3000:])
        assert "posix.system is not data that a checkpoint may hold; refused" in log
    assert out[1]["committed"][:2] == [4, 3], "the real checkpoints are the newest two kept"
    assert (directory / "step-000000000004").is_dir() and (directory / "step-000000000003").is_dir()
    assert not (directory / "step-000000000001").exists(), "pruned past keep=2"


def test_an_altered_metadata_file_is_never_unpickled(tmp_path: Path) -> None:
    import pickle

    directory = tmp_path / "ckpt"
    _worker(directory, "key", "u1", "save")
    sentinel = tmp_path / "payload-ran"
    (directory / "step-000000000002" / ".metadata").write_bytes(pickle.dumps(_Payload(str(sentinel))))
    out, log = _worker(directory, "key", "u1", "restore")
    assert not sentinel.exists()
    assert out[0] == {"restored": 1}, (out, log[-3000:])
    assert "is not the metadata its sealed commit marker names (altered or replaced)" in log
    assert list(directory.glob("corrupt-step-2-*")), "the altered checkpoint is moved aside, not deleted"


def test_a_forged_fence_does_not_stop_training(spawn, state_home: Path, tmp_path: Path) -> None:
    """A fence forged with every key a member and its workers hold (the checkpoint key, the agent key: this test
    derives both from the run's sealing root) is ignored: only the control plane's warrant makes a fence."""
    from pliant.security.seal import agent_key, job_key, load_or_create_root, seal, tag

    events, ckpt = tmp_path / "events.jsonl", tmp_path / "ckpt"
    run = spawn(
        [
            *PLIANT,
            "run",
            "--nproc-per-node",
            "1",
            "--checkpoint-dir",
            str(ckpt),
            *elastic_script(tmp_path, 100000, 0.03),
        ],
        name="run",
    )
    wait_for(lambda: (ckpt / "pliant-fence.json").exists() and read_jsonl(events), 90, "training with a fence")
    fence = json.loads((ckpt / "pliant-fence.json").read_text())
    root = load_or_create_root(state_home / "pliant" / "seal-root")
    owner = {**fence["owner"], "generation": 999}  # the real owner at a generation never published
    owner["warrant"] = tag(agent_key(root, "default"), *owner.values()) * 4  # a "warrant" from the agent key
    forged = json.loads(seal(job_key(root, "default"), {**fence, "owner": owner}))  # sealed with the workers' key
    (ckpt / "pliant-fence.json").write_text(json.dumps(forged))
    forged_at = time.time()
    wait_for(lambda: "ignoring the fence file" in run.output(), 30, "the agent to say it ignores the fence")
    wait_for(lambda: [e for e in read_jsonl(events) if e["time"] > forged_at + 5], 60, "steps 5 s after the forgery")
    assert re.search(
        r"ignoring the fence file in \S+: its owner's warrant is not the control plane's signature", run.output()
    )
    assert "fenced" not in run.output()
    run.kill(15)
    wait_for(lambda: run.proc.poll() is not None, 30, "the run to stop")
