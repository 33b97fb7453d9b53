"""examples/train_elastic.py with fault hooks for the tests, set through the environment (workers inherit the
agent's):

- ``TEST_SLOW_SAVE_S``: every synchronous checkpoint save (the rescale's) takes that many seconds longer, as a save of
  a big model would.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import time
from pathlib import Path

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


runpy.run_path(str(EXAMPLE), run_name="__main__")
