"""Known mistakes of training scripts, recognised in their workers' output, and the one line the agent says about each.

A worker's traceback names what failed in the framework's words; what to change under pliant is not in it. The agent
reads each output line through :func:`hint_for` and logs a hint once per agent (:class:`Hints`).
"""

from __future__ import annotations

import re
import threading

__all__ = ["HINTS", "Hints", "hint_for"]

# (pattern in a worker's output line, what to say)
HINTS: tuple[tuple[re.Pattern[bytes], str], ...] = (
    (
        re.compile(
            rb"You set `devices=\d+` and `num_nodes=\d+` in Lightning, but the product .* does not match the "
            rb"world size"
        ),
        "Lightning counts a fixed num_nodes, and this job's world changes as nodes come and go: pass "
        "strategy=pliant.lightning.DDP() (or pliant.lightning.FSDP()) to the Trainer, with devices equal to "
        "--nproc-per-node",
    ),
)


def hint_for(line: bytes) -> str | None:
    """The hint for one line of a worker's output, or None."""
    for pattern, hint in HINTS:
        if pattern.search(line):
            return hint
    return None


class Hints:
    """The hints an agent has said (each once). Threads: every worker's output pump calls :meth:`first`; ``_said`` is
    under ``_lock``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._said: set[str] = set()

    def first(self, line: bytes) -> str | None:
        """The hint for ``line`` if it was not said yet, else None."""
        hint = hint_for(line)
        if hint is None:
            return None
        with self._lock:
            if hint in self._said:
                return None
            self._said.add(hint)
        return hint
