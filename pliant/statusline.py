"""The console's one updating line for a long wait (nodes below the minimum, newcomers' workers, a joiner held back).

On a terminal the line is rewritten in place (a carriage return and an erase to the end of the line), at most once a
second, and anything else written to the console erases it first, under the same lock: the workers' output
(:func:`write_output`) and the log handlers :mod:`pliant.logsetup` installs (:class:`ConsoleHandler`); the next update
draws it again. Off a terminal (a file, a pipe, ``kubectl logs``) it is a whole line when what is awaited changes and
every :data:`OFF_TERMINAL_EVERY_S` seconds while it stays the same, so a log records a long wait without a stream.

Thread ownership: every method takes :data:`LOCK`; any thread may call them (the agent's loop thread shows and clears
the line, the output pumps and the log handlers erase it).
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import IO

__all__ = ["LOCK", "OFF_TERMINAL_EVERY_S", "ConsoleHandler", "StatusLine", "status_line", "write_output"]

LOCK = threading.Lock()
"""The console's lock: one writer at a time, status line included."""
OFF_TERMINAL_EVERY_S = 30.0
"""Off a terminal, how often an unchanged wait is written again."""
_REDRAW_EVERY_S = 1.0
_ERASE = "\r\x1b[K"


class StatusLine:
    """An updating line on ``stream`` (see the module's docstring).

    Args:
        stream: where the line goes (stderr, like the log records).
        terminal: whether ``stream`` is a terminal (default: asked of the stream).
    """

    def __init__(self, stream: IO[str], terminal: bool | None = None) -> None:
        self.stream = stream
        self.terminal = stream.isatty() if terminal is None else terminal
        self._drawn = False  # a terminal: the line is on the screen now
        self._what = ""  # what is awaited, as last shown
        self._shown_at = float("-inf")

    def show(self, what: str, detail: str, now: float) -> None:
        """Show that ``what`` is awaited, with ``detail`` (a count, the time so far) that may change at every call."""
        with LOCK:
            if self.terminal:
                if what == self._what and self._drawn and now - self._shown_at < _REDRAW_EVERY_S:
                    return
                self.stream.write(f"{_ERASE}pliant: {what} ({detail})")
                self._drawn = True
            else:
                if what == self._what and now - self._shown_at < OFF_TERMINAL_EVERY_S:
                    return
                self.stream.write(f"pliant: {what} ({detail})\n")
            self.stream.flush()
            self._what, self._shown_at = what, now

    def clear(self) -> None:
        """The wait is over: erase the line (a terminal), and show the next wait at once."""
        with LOCK:
            self._erase()
            self._what = ""

    def erase_for_output(self) -> None:
        """Erase the line before other output is written; the caller holds :data:`LOCK`."""
        if self._drawn:
            self._erase()
            self._shown_at = float("-inf")  # drawn again at the next update

    def _erase(self) -> None:
        if self._drawn:
            self.stream.write(_ERASE)
            self.stream.flush()
            self._drawn = False


_line: StatusLine | None = None


def status_line() -> StatusLine:
    """The process's status line, on stderr."""
    global _line
    with LOCK:
        if _line is None:
            _line = StatusLine(sys.stderr)
        return _line


def write_output(data: bytes) -> None:
    """Write a worker's output line to stdout, the status line erased first."""
    line = status_line()
    with LOCK:
        line.erase_for_output()
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()


class ConsoleHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A log handler that erases the status line before it writes a record."""

    def emit(self, record: logging.LogRecord) -> None:
        line = status_line()
        with LOCK:
            line.erase_for_output()
            super().emit(record)
