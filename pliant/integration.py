"""What a framework integration (:mod:`pliant.lightning`, :mod:`pliant.transformers`) shares: the rescale request.

Under a pliant agent a rescale is asked of a worker with :data:`pliant.env.RESCALE_SIGNAL` once the worker announced
that it handles it (:func:`pliant.progress.announce_signal`); a worker that did not is stopped as torchrun stops one.
A framework's training loop cannot act in a signal handler, so the handler only sets a flag, and at step boundaries
the ranks vote on their flags with one all-reduce, on :mod:`pliant.rescale_vote`'s schedule (the one pliant.worker's
rescale protocol votes on): every rank sees the request at the same step, saves there with the framework's own
checkpointing and exits with :data:`pliant.env.RESCALE_EXIT_CODE`, which the agent takes for "saved for the
rescale", not a failure.
"""

from __future__ import annotations

import signal
import threading
import time

import torch
import torch.distributed as dist

from pliant.env import RESCALE_SIGNAL, WorkerEnv
from pliant.logsetup import setup_library_logging
from pliant.progress import announce_signal
from pliant.rescale_vote import VoteSchedule, ballot_us

__all__ = ["RescaleRequest"]


class RescaleRequest:
    """A worker's rescale request: the signal's flag and the ranks' vote on it.

    Threads: the signal handler (main thread, between bytecodes) sets ``_asked``; the training loop (main thread)
    reads it and owns the step count, the last boundary's time and the vote's schedule. ``env`` is read once, at
    construction.

    Attributes:
        env: the worker's environment (a default one outside a pliant agent).
    """

    def __init__(self) -> None:
        self.env = WorkerEnv.from_env()
        self._asked = False
        self._steps = 0  # the step boundaries seen
        self._last: float | None = None  # when the last boundary was (monotonic)
        self._last_step_s = 0.0  # the last step's time: from one boundary to the next
        self._votes = VoteSchedule()
        if self.under_agent:
            setup_library_logging()  # what the integration does goes to the worker's log, as pliant.worker's does

    @property
    def under_agent(self) -> bool:
        """True in a worker of a pliant agent; outside one (torchrun, a plain process) nothing is asked."""
        return self.env.under_agent

    def listen(self) -> None:
        """Take the rescale signal and tell the agent so; a no-op outside an agent or off the main thread (where
        Python cannot install a handler: the agent then stops the worker as torchrun would)."""
        if self.under_agent and threading.current_thread() is threading.main_thread():
            signal.signal(RESCALE_SIGNAL, self._on_signal)
            announce_signal(self.env.progress_file)

    def _on_signal(self, signum: int, frame: object) -> None:
        self._asked = True

    def agreed(self, device: torch.device | str, now: float | None = None) -> bool:
        """Whether any rank was asked to rescale, as of the last vote: called by every rank at every step boundary;
        at the boundaries where the ranks vote it is a collective (see the module docstring).

        Args:
            device: where the vote's tensor lives (the process group's device: ``cuda:i`` for NCCL).
            now: the monotonic clock (default: read here).
        """
        if not self.under_agent:
            return False
        now = time.monotonic() if now is None else now
        step, self._steps = self._steps, self._steps + 1
        if self._last is not None:
            self._last_step_s = now - self._last
        self._last = now
        if not self._votes.due(step):
            return False
        vote = torch.tensor([int(self._asked), ballot_us(self._last_step_s)], dtype=torch.int64, device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(vote, op=dist.ReduceOp.MAX)  # any rank's request, and the slowest rank's step
        asked, slowest_us = vote.tolist()
        self._votes.agreed(step, slowest_us)
        return bool(asked)
