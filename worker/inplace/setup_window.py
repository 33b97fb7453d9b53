"""The rule of a ``pliant.worker`` script's set-up: no collectives of its own between ``init()`` and its loop.

In place, the survivors of a rescale never run that stretch of the script again: a worker joining a running world
runs it alone, meets the survivors at ``session.engine()`` (its process group does not exist before) and takes its
state from them at the first step. A collective the script runs there would, in a newcomer, find no process group,
or no peer running the same collective, and hang or fail long after the mistake. So under an agent that rescales in
place the rule is checked from the start, in every generation: from ``init()`` to the first ``engine.step`` a
``torch.distributed`` collective called by the script's own code raises :class:`SetupCollectiveError`, naming the
call, where it was made and what to do instead. Collectives that pliant or torch make (an engine's first broadcast, a
checkpoint restore) are theirs, not the script's; so are calls from a library that runs on torch's or pliant's behalf.
After the first step the script may run collectives of its own between steps (:meth:`Session.all_reduce_sum` is the
one a peer's failure cannot break).

Under torchrun, a plain process or ``--rescale restart`` nothing is checked: every worker starts afresh there.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d

from pliant.worker.contract import WorkerError

__all__ = ["COLLECTIVES", "SetupCollectiveError", "SetupWindow", "scripts_own"]

# What torch.distributed offers a script for talking to its peers (the point-to-point calls too).
COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
)

_LIBRARY = ("torch", "pliant")  # top-level packages whose collectives are never the script's own


class SetupCollectiveError(WorkerError):
    """The script ran a collective of its own between ``pliant.worker.init()`` and its first ``engine.step``."""


def scripts_own(module: str) -> bool:
    """Whether code in ``module`` (a frame's ``__name__``) is the script's: anything but torch's and pliant's."""
    return module.partition(".")[0] not in _LIBRARY


def _caller(frame: FrameType | None) -> tuple[str, str]:
    """The module and ``file:line`` of the first frame outside torch.distributed's own wrappers."""
    while frame is not None and frame.f_globals.get("__name__", "").startswith("torch.distributed"):
        frame = frame.f_back
    if frame is None:
        return "", "?"
    return frame.f_globals.get("__name__", ""), f"{frame.f_code.co_filename}:{frame.f_lineno}"


class SetupWindow:
    """The stretch from ``init()`` to the first ``engine.step`` of one worker, and the check of its rule.

    Threads: the main thread opens and closes it; the check runs in whichever thread calls a collective (the flag is
    only read there).
    """

    def __init__(self) -> None:
        self.open = False
        self._originals: dict[str, Callable[..., Any]] = {}

    def start(self) -> None:
        """Open the window: the script's own collectives are refused until :meth:`close`."""
        if self.open:
            return
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._originals[name] = original
            checked = self._checked(name, original)
            setattr(dist, name, checked)
            if getattr(distributed_c10d, name, None) is original:
                setattr(distributed_c10d, name, checked)
        self.open = True

    def close(self) -> None:
        """Close the window (the loop has begun): torch.distributed's functions are its own again."""
        if not self.open:
            return
        self.open = False
        for name, original in self._originals.items():
            if getattr(distributed_c10d, name, None) is getattr(dist, name):
                setattr(distributed_c10d, name, original)
            setattr(dist, name, original)
        self._originals.clear()

    def _checked(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def checked(*args: Any, **kwargs: Any) -> Any:
            if self.open:
                module, where = _caller(sys._getframe(1))
                if scripts_own(module):
                    raise SetupCollectiveError(
                        f"torch.distributed.{name} at {where} runs between pliant.worker.init() and the first "
                        f"engine.step: a worker joining a running world runs this part of the script alone (the "
                        f"survivors are already training), so no peer would answer it. Compute it before any "
                        f"collective (each rank on its own), or in the loop after engine.step "
                        f"(session.all_reduce_sum for a sum)"
                    )
            return original(*args, **kwargs)

        return checked
