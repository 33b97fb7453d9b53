"""Every engine reaches the same parameters at world sizes 1-4 on the same data and global batch (gloo, CPU, fp32),
including worlds that do not divide the global batch, epoch tails, and ranks with fewer or no micro-batches."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

JOB = Path(__file__).with_name("engine_job.py")
SAMPLES, GLOBAL_BATCH, STEPS = 37, 10, 8  # 2 epochs of 4 steps: 10, 10, 10 and a tail of 7


def _assert_equal_at_every_world(
    engine: str, worlds: tuple[int, ...], micro_batch: int, tmp_path: Path, *extra: str
) -> None:
    """Run ``engine`` at each of ``worlds`` (the first is the reference) on the same data and global batch; assert the
    same final parameters and every sample exactly once per epoch."""
    result = subprocess.run(
        [
            sys.executable,
            str(JOB),
            "--engine",
            engine,
            *extra,
            "--worlds",
            *map(str, worlds),
            "--samples",
            str(SAMPLES),
            "--global-batch",
            str(GLOBAL_BATCH),
            "--micro-batch",
            str(micro_batch),
            "--steps",
            str(STEPS),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    reference = torch.load(tmp_path / f"world{worlds[0]}.pt")
    for world in worlds[1:]:
        run = torch.load(tmp_path / f"world{world}.pt")
        diff = max((run["params"][k] - reference["params"][k]).abs().max().item() for k in reference["params"])
        print(f"{engine} {' '.join(extra)} micro={micro_batch} world={world}: max |param diff| = {diff:.2e}")
        assert diff <= 1e-5, f"{engine} at world {world} differs from world {worlds[0]} by {diff}"
        assert len(run["seen"]) == world
        counts = Counter(i for rank_seen in run["seen"] for i in rank_seen)
        assert counts == Counter({i: 2 for i in range(SAMPLES)}), "every sample exactly once per epoch"


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("engine", ["ddp", "zero", "fsdp"])
@pytest.mark.parametrize(
    "micro_batch",
    [2, 4],
    ids=["uneven-counts", "idle-ranks"],  # 5 micro-batches per step / 3 (and 2 in the tail): some ranks get none
)
def test_same_parameters_at_every_world_size(engine: str, micro_batch: int, tmp_path: Path) -> None:
    _assert_equal_at_every_world(engine, (1, 2, 3, 4), micro_batch, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("micro_batch", [2, 4], ids=["uneven-counts", "idle-ranks"])
def test_hsdp_reaches_the_same_parameters_at_every_mesh(micro_batch: int, tmp_path: Path) -> None:
    """The hsdp engine with shard groups of 2 ranks: world 1 (one group of one), 2 (one replica of 2) and 4 (two
    replicas of 2) reach the same parameters."""
    _assert_equal_at_every_world("hsdp", (1, 2, 4), micro_batch, tmp_path, "--shard-group", "2")
