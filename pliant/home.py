"""Where a node keeps what outlives one process: the user's state directory."""

from __future__ import annotations

from pathlib import Path

from pliant import settings

__all__ = ["state_home"]


def state_home() -> Path:
    """Where a node keeps what outlives its agent (``pliant run``'s sealing root, a control-plane seat, its view of its
    job for ``pliant status``): the user's state directory (``XDG_STATE_HOME``, else ``~/.local/state``), under
    ``pliant``."""
    return Path(settings.STATE_HOME.read() or Path.home() / ".local" / "state") / "pliant"
