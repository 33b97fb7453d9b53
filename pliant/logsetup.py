"""Process-wide logging set-up, called once at process entry by the CLI."""

from __future__ import annotations

import logging
import os

__all__ = ["setup_library_logging", "setup_logging"]

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str | None = None) -> None:
    """Configure the root logger once.

    Args:
        level: a logging level name; defaults to ``$PLIANT_LOG_LEVEL`` or INFO.
    """
    name = (level or os.environ.get("PLIANT_LOG_LEVEL") or "INFO").upper()
    logging.basicConfig(level=getattr(logging, name, logging.INFO), format=_FORMAT)
    # gRPC's and etcd3's own chatter is rarely useful at INFO.
    logging.getLogger("etcd3").setLevel(logging.WARNING)


def setup_library_logging(level: str | None = None) -> None:
    """Send pliant's own log records (``pliant.*``) to stderr in a worker under an agent, without touching the root
    logger: a training script's own ``logging.basicConfig`` still works. The agent writes the line to the worker's
    log. Called once by the worker session."""
    log = logging.getLogger("pliant")
    if log.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(_FORMAT))
    log.addHandler(handler)
    name = (level or os.environ.get("PLIANT_LOG_LEVEL") or "INFO").upper()
    log.setLevel(getattr(logging, name, logging.INFO))
    log.propagate = False
