"""examples/train_elastic.py with fault hooks for the tests, set through the environment (workers inherit the
agent's):

- ``TEST_SLOW_SAVE_S``: every synchronous checkpoint save (the rescale's) takes that many seconds longer, as a save of
  a big model would.
- ``TEST_BARRIER_AFTER_INIT``: the script runs a ``dist.barrier()`` of its own right after ``pliant.worker.init()``,
  which breaks a rule of a pliant.worker script.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import time
from pathlib import Path

import torch.distributed as dist

import pliant.worker
from pliant.worker.checkpoint import CheckpointManager

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_elastic.py"

_slow = float(os.environ.get("TEST_SLOW_SAVE_S", "0") or 0)
if _slow:
    _save = CheckpointManager.save

    def _slow_save(self: CheckpointManager, step: int, sync: bool | None = None) -> float:
        if sync:
            with self.metrics.progress.saving() if self.metrics else contextlib.nullcontext():
                time.sleep(_slow)
        return _save(self, step, sync)

    CheckpointManager.save = _slow_save  # type: ignore[method-assign]

if os.environ.get("TEST_BARRIER_AFTER_INIT"):
    _init = pliant.worker.init

    def _init_then_barrier(**kwargs: object) -> pliant.worker.Session:
        session = _init(**kwargs)
        dist.barrier()
        return session

    pliant.worker.init = _init_then_barrier  # type: ignore[assignment]


runpy.run_path(str(EXAMPLE), run_name="__main__")
