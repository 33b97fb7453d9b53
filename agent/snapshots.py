"""The node's snapshot directory: where its workers keep their buddy copies so that they outlive a worker's death
(:mod:`pliant.worker.inplace.kept`).

One directory per agent, made at its start in node-local memory (``/dev/shm`` unless ``--snapshot-dir`` names another
folder; ``--snapshot-dir ''`` turns it off), handed to the workers as ``PLIANT_SNAPSHOT_DIR`` and removed when the
agent exits. Its files are memory: an agent killed with ``kill -9`` cannot remove them, so every agent first removes
the directories whose agent is gone (a scratch directory, :mod:`pliant.scratch`).
"""

from __future__ import annotations

import logging
import os

from pliant import scratch
from pliant.errors import ConfigError

__all__ = ["DEFAULT_PARENT", "PREFIX", "make", "remove", "sweep", "usable"]

logger = logging.getLogger(__name__)

DEFAULT_PARENT = "/dev/shm"
PREFIX = "pliant-snapshots-"


def usable(parent: str | None) -> str:
    """The folder the directory goes in: ``parent``, or :data:`DEFAULT_PARENT` when None and it is a writable folder
    ("" otherwise, and for ``parent`` "": no directory).

    Raises:
        ConfigError: ``parent`` is named but is not a writable folder.
    """
    if parent is None:
        return DEFAULT_PARENT if os.path.isdir(DEFAULT_PARENT) and os.access(DEFAULT_PARENT, os.W_OK) else ""
    if parent and not (os.path.isdir(parent) and os.access(parent, os.W_OK)):
        raise ConfigError(
            f"--snapshot-dir {parent!r} is not a writable folder: name one in node-local memory "
            f"(tmpfs, such as /dev/shm), or pass --snapshot-dir '' to keep the buddy copies in the "
            f"workers' memory only"
        )
    return parent


def make(parent: str, node_id: str) -> str:
    """A new snapshot directory for this agent in ``parent`` ("" when ``parent`` is "" or refuses it, logged), after
    removing those of dead agents there."""
    if not parent:
        return ""
    try:
        directory = scratch.make(PREFIX, node_id, parent)
    except OSError as exc:
        logger.warning("no snapshot directory in %s (%s): a dead worker's buddy copies die with it", parent, exc)
        return ""
    logger.info("a sharded engine's buddy copies (ZeRO, FSDP2) go in %s", directory)
    return directory


def remove(*directories: str) -> None:
    """Remove the directories :func:`make` made (nothing for "")."""
    scratch.remove(*directories)


def sweep(parent: str) -> list[str]:
    """Remove the snapshot directories in ``parent`` whose agent is gone; returns them."""
    return scratch.sweep(parent, PREFIX)
