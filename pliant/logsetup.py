"""Process-wide logging set-up, called once at process entry by the CLI.

Quiet by default: what a person running a job needs (the join command, each world change, restarts and why, and a
summary at the end) goes to the console logger (:data:`CONSOLE`, printed as ``pliant: ...``), and every other record
only from WARNING up. ``--log-level info`` (or ``PLIANT_LOG_LEVEL=INFO``) shows the components' own INFO records, with
times and names, as ``debug`` shows more. A worker's pliant records follow the same level (its agent passes the
environment on).
"""

from __future__ import annotations

import logging
import os

__all__ = ["CONSOLE", "setup_library_logging", "setup_logging"]

CONSOLE = "pliant.console"
"""The logger of the lines meant for the person running the job."""
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_QUIET = "WARNING"


def _level(level: str | None) -> int:
    name = (level or os.environ.get("PLIANT_LOG_LEVEL") or _QUIET).upper()
    return getattr(logging, name, logging.WARNING)


def setup_logging(level: str | None = None) -> None:
    """Configure the root logger once, and the console logger's plain ``pliant: ...`` lines.

    Args:
        level: a logging level name; defaults to ``$PLIANT_LOG_LEVEL`` or WARNING (the console's lines always show).
    """
    logging.basicConfig(level=_level(level), format=_FORMAT)
    # gRPC's and etcd3's own chatter is rarely useful at INFO.
    logging.getLogger("etcd3").setLevel(logging.WARNING)
    console = logging.getLogger(CONSOLE)
    if not console.handlers:
        handler = logging.StreamHandler()
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
