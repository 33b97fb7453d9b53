"""Process-wide logging set-up, called once at process entry by the CLI."""

from __future__ import annotations

import logging
import os

__all__ = ["setup_logging"]

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
