"""What workers tell their agent through files: progress (for hang detection) and the checkpoint fence.

**The progress file** says, cheaply, that a worker is alive and where it is.

One small file per worker, rewritten in place (one ``pwrite`` of a fixed-width record, no fsync) at each phase change
and after every step; the agent reads it on its own clock and never needs an RPC. The record is
``"<step> <phase>\\n"`` padded to :data:`RECORD_BYTES`. Phases: ``start`` (the session opened; imports, the first
step's compilation and a checkpoint restore follow), ``step`` (a step completed), ``save`` (a checkpoint save is
blocking the loop), ``done`` (the session closed).

**The fence file** ``pliant-fence.json`` in the checkpoint directory holds the (job epoch, generation) of the newest
world that opened it (written by :mod:`pliant.worker.checkpoint`); an agent whose running world is older stops it.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["FENCE", "PHASES", "RECORD_BYTES", "ProgressFile", "read_fence", "read_progress"]

FENCE = "pliant-fence.json"
RECORD_BYTES = 32
PHASES = ("start", "step", "save", "done")


class ProgressFile:
    """The worker's side: ``write(step, phase)``. A path of "" makes every write a no-op (no agent watches)."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600) if path else -1
        self.step, self.phase = 0, ""

    def write(self, step: int, phase: str) -> None:
        if self._fd < 0 or (step, phase) == (self.step, self.phase):
            return
        self.step, self.phase = step, phase
        record = f"{step} {phase}".ljust(RECORD_BYTES - 1).encode()[: RECORD_BYTES - 1] + b"\n"
        with contextlib.suppress(OSError):  # the agent removed its directory: it no longer watches
            os.pwrite(self._fd, record, 0)

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """The ``save`` phase for the duration of a blocking checkpoint save, then back to the phase before."""
        step, phase = self.step, self.phase
        self.write(step, "save")
        try:
            yield
        finally:
            self.write(step, phase or "start")

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1


def read_progress(path: str) -> tuple[int, str] | None:
    """The agent's side: (step, phase) last written to ``path``, or None if the worker wrote none (yet)."""
    try:
        with open(path, "rb") as f:
            text = f.read(RECORD_BYTES).decode(errors="replace").split()
    except OSError:
        return None
    if len(text) != 2 or text[1] not in PHASES or not text[0].isdigit():
        return None
    return int(text[0]), text[1]


def read_fence(directory: str | os.PathLike[str]) -> tuple[int, int]:
    """(epoch, generation) recorded in ``directory``'s fence file; (0, 0) when there is none (or it is unreadable)."""
    try:
        data = json.loads((Path(directory) / FENCE).read_text())
        return int(data["epoch"]), int(data["generation"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0, 0
