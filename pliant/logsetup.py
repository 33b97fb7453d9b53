"""Process-wide logging set-up, called once at process entry by the CLI.

Quiet by default: what a person running a job needs (the join command, each world change, restarts and why, and a
summary at the end) goes to the console logger (:data:`CONSOLE`, printed as ``pliant: ...``), and every other record
only from WARNING up (``pliant: warning: ...``). ``--log-level info`` (or ``PLIANT_LOG_LEVEL=INFO``) shows the
components' own INFO records, with times and names, as ``debug`` shows more. A worker's pliant records follow the same
level (its agent passes the environment on). Every handler erases the status line of a long wait before it writes
(:mod:`pliant.statusline`).
"""

from __future__ import annotations

import logging

from pliant import settings
from pliant.statusline import ConsoleHandler

__all__ = ["CONSOLE", "setup_library_logging", "setup_logging"]

CONSOLE = "pliant.console"
"""The logger of the lines meant for the person running the job."""
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_QUIET = "WARNING"


def _level(level: str | None) -> int:
    name = (level or settings.LOG_LEVEL.read() or _QUIET).upper()
    return getattr(logging, name, logging.WARNING)


class _PersonFormatter(logging.Formatter):
    """A quiet console's warnings and errors: ``pliant: warning: ...``, without the time and the logger's name."""

    def format(self, record: logging.LogRecord) -> str:
        text = f"pliant: {record.levelname.lower()}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def setup_logging(level: str | None = None) -> None:
    """Configure the root logger once, and the console logger's plain ``pliant: ...`` lines.

    Args:
        level: a logging level name; defaults to ``$PLIANT_LOG_LEVEL`` or WARNING (the console's lines always show).
    """
    chosen = _level(level)
    handler = ConsoleHandler()  # erases the status line of a long wait first (pliant.statusline)
    handler.setFormatter(logging.Formatter(_FORMAT) if chosen < logging.WARNING else _PersonFormatter())
    logging.basicConfig(level=chosen, handlers=[handler])
    # gRPC's and etcd3's own chatter is rarely useful at INFO.
    logging.getLogger("etcd3").setLevel(logging.WARNING)
    console = logging.getLogger(CONSOLE)
    if not console.handlers:
        handler = ConsoleHandler()
        handler.setFormatter(logging.Formatter("pliant: %(message)s"))
        console.addHandler(handler)
        console.setLevel(logging.INFO)
        console.propagate = False


def setup_library_logging(level: str | None = None) -> None:
    """Send pliant's own log records (``pliant.*``) to stderr in a worker under an agent, without touching the root
    logger: a training script's own ``logging.basicConfig`` still works. The agent writes the line to the worker's
    log. Called once by the worker session; quiet (WARNING) unless ``PLIANT_LOG_LEVEL`` says otherwise."""
    log = logging.getLogger("pliant")
    if log.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_FORMAT))
    log.addHandler(handler)
    log.setLevel(_level(level))
    log.propagate = False
