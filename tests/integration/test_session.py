"""A plain script on pliant.worker runs under torchrun, under pliant run and as a single process, with every engine;
CUDA/NCCL paths run only where a GPU exists."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.common import PLIANT

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_elastic.py"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _final(out: Path) -> dict:
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "launcher",
    [
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
        ["-m", "pliant", "run", "--nproc-per-node", "2"],
    ],
    ids=["torchrun", "pliant run"],
)
@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_the_session_script_runs_under_a_launcher(launcher: list[str], engine: str, tmp_path: Path) -> None:
    out = tmp_path / "final.json"
    result = subprocess.run(
        [
            sys.executable,
            *launcher,
            str(SCRIPT),
            "--engine",
            engine,
            "--steps",
            "12",
            "--micro-batch",
            "24",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=160,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    final = _final(out)
    assert final["world"] == 2 and final["steps"] == 12 and final["loss"] < 100


def test_a_single_plain_process_gives_the_same_loss(tmp_path: Path) -> None:
    single, torchrun = tmp_path / "single.json", tmp_path / "torchrun.json"
    args = [str(SCRIPT), "--engine", "zero", "--steps", "12", "--micro-batch", "24"]
    result = subprocess.run([sys.executable, *args, "--out", str(single)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "3",
            *args,
            "--out",
            str(torchrun),
        ],
        capture_output=True,
        text=True,
        timeout=160,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert _final(single)["world"] == 1 and _final(torchrun)["world"] == 3
    assert abs(_final(single)["loss"] - _final(torchrun)["loss"]) < 1e-5, "same global batches, same training"


def test_a_collective_of_the_scripts_own_before_its_loop_is_refused_with_the_fix(tmp_path: Path) -> None:
    """In place, a worker joining a running world runs the set-up alone: a collective there is refused in every
    generation, so the script's author meets the rule on the first run, not on the first join."""
    hooks = Path(__file__).with_name("train_hooks.py")
    result = subprocess.run(
        [
            *PLIANT,
            "run",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "0",
            str(hooks),
            "--steps",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=160,
        env={**os.environ, "TEST_BARRIER_AFTER_INIT": "1"},
    )
    assert result.returncode != 0
    out = result.stdout + result.stderr
    assert "SetupCollectiveError: torch.distributed.barrier at " in out and "train_hooks.py:" in out, out[-4000:]
    assert "runs between pliant.worker.init() and the first engine.step" in out
    assert "session.all_reduce_sum" in out, "the fix"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL)")
@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_nccl_on_the_gpus_there_are(engine: str, tmp_path: Path) -> None:
    out = tmp_path / "final.json"
    nproc = str(torch.cuda.device_count())
    result = subprocess.run(
        [
            *PLIANT,
            "run",
            "--nproc-per-node",
            nproc,
            str(SCRIPT),
            "--engine",
            engine,
            "--steps",
            "12",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=160,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert _final(out)["world"] == int(nproc)
