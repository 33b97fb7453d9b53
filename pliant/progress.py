"""What workers and their agent tell each other through files: progress (for hang detection) and directives.

**The progress file** says, cheaply, that a worker is alive and where it is.

One small file per worker, rewritten in place (one ``pwrite`` of a fixed-width record, no fsync) at each phase change
and after every step; the agent reads it on its own clock and never needs an RPC. The record is
``"<step> <phase>\\n"`` padded to :data:`RECORD_BYTES`. Phases: ``start`` (the session opened; imports, the first
step's compilation and a checkpoint restore follow), ``step`` (a step completed; the record ends with the generation
it completed in: every member of that generation arrived, which the agent's failure reports say), ``save`` (a
checkpoint save is blocking the loop), ``wait`` (a collective failed: a peer died, or a survivor's new generation did
not all meet; the worker waits for its agent's next directive; the record ends with the generation it failed in, so an
agent that already handed it a newer one does not report the failure again, and a wait in a newer generation at the
same step is a new one), ``transfer`` (the state moves into a new world in place, until the first step there
completes; the record ends with that world's generation), ``done`` (the session closed).

**The directive file** ``<progress file>.next`` is how an agent hands a running worker its next generation (the
in-place rescale, :mod:`pliant.worker.inplace.protocol`): a JSON object ``{"generation": N, "mode": M, "env": {...}}``
written through a temporary file and a rename, then the rescale signal. Modes: ``in-place`` (re-form in generation N
with ``env``, the worker's new :class:`pliant.env.WorkerEnv` variables), ``leave`` (hand over and exit: this node is not
in generation N), ``restart`` (checkpoint and exit for a fresh start). The worker announces that it handles the rescale
signal by creating ``<progress file>.signal`` (a worker that did not is stopped as torchrun stops one: SIGTERM, then
SIGKILL after the stop grace), and that it can take in-place directives by creating ``<progress file>.inplace``.

The checkpoint directory's fence file, which an agent also reads, is :mod:`pliant.fence`'s.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "DIRECTIVE_MODES",
    "PHASES",
    "RECORD_BYTES",
    "Directive",
    "ProgressFile",
    "announce_in_place",
    "announce_signal",
    "in_place_ready",
    "read_directive",
    "read_progress",
    "read_record",
    "takes_signal",
    "write_directive",
]

RECORD_BYTES = 32
PHASES = ("start", "step", "save", "wait", "done")
DIRECTIVE_MODES = ("in-place", "leave", "restart")


class ProgressFile:
    """The worker's side: ``write(step, phase)``. A path of "" makes every write a no-op (no agent watches)."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600) if path else -1
        self.step, self.phase, self.generation = 0, "", 0

    def write(self, step: int, phase: str, generation: int = 0) -> None:
        if self._fd < 0 or (step, phase, generation) == (self.step, self.phase, self.generation):
            return
        self.step, self.phase, self.generation = step, phase, generation
        text = f"{step} {phase} {generation}" if generation else f"{step} {phase}"
        record = text.ljust(RECORD_BYTES - 1).encode()[: RECORD_BYTES - 1] + b"\n"
        with contextlib.suppress(OSError):  # the agent removed its directory: it no longer watches
            os.pwrite(self._fd, record, 0)

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """The ``save`` phase for the duration of a blocking checkpoint save, then back to the phase before."""
        step, phase, generation = self.step, self.phase, self.generation
        self.write(step, "save")
        try:
            yield
        finally:
            self.write(step, phase or "start", generation)

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1


def read_progress(path: str) -> tuple[int, str] | None:
    """The agent's side: (step, phase) last written to ``path``, or None if the worker wrote none (yet)."""
    record = read_record(path)
    return None if record is None else (record[0], record[1])


def read_record(path: str) -> tuple[int, str, int] | None:
    """(step, phase, generation) last written to ``path`` (generation: 0 unless the phase names one), or None."""
    try:
        with open(path, "rb") as f:
            text = f.read(RECORD_BYTES).decode(errors="replace").split()
    except OSError:
        return None
    if len(text) not in (2, 3) or text[1] not in PHASES or not all(t.isdigit() for t in text[:1] + text[2:]):
        return None
    return int(text[0]), text[1], int(text[2]) if len(text) == 3 else 0


@dataclass(frozen=True)
class Directive:
    """An agent's instruction to one running worker (see the module docstring)."""

    generation: int
    mode: str
    env: Mapping[str, str] = field(default_factory=dict)


def write_directive(progress_file: str, directive: Directive) -> None:
    """The agent's side: publish ``directive`` next to ``progress_file`` (atomically: temporary file, rename)."""
    path = Path(progress_file + ".next")
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"generation": directive.generation, "mode": directive.mode, "env": dict(directive.env)}))
    os.replace(tmp, path)


def read_directive(progress_file: str) -> Directive | None:
    """The worker's side: the directive last written for it, or None (none yet, or unreadable)."""
    try:
        data = json.loads(Path(progress_file + ".next").read_text())
        env = {str(k): str(v) for k, v in data["env"].items()}
        directive = Directive(int(data["generation"]), str(data["mode"]), env)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return directive if directive.mode in DIRECTIVE_MODES else None


def announce_in_place(progress_file: str) -> None:
    """The worker's side: say that it takes directives (its session re-forms in place)."""
    if progress_file:
        with contextlib.suppress(OSError):
            Path(progress_file + ".inplace").touch()


def announce_signal(progress_file: str) -> None:
    """The worker's side: say that it handles the rescale signal (its session runs the rescale protocol)."""
    if progress_file:
        with contextlib.suppress(OSError):
            Path(progress_file + ".signal").touch()


def takes_signal(progress_file: str) -> bool:
    """The agent's side: True once the worker announced that it handles the rescale signal."""
    return bool(progress_file) and os.path.exists(progress_file + ".signal")


def in_place_ready(progress_file: str) -> bool:
    """The agent's side: True once the worker announced that it takes directives."""
    return bool(progress_file) and os.path.exists(progress_file + ".inplace")
