"""What a framework integration (:mod:`pliant.lightning`, :mod:`pliant.transformers`) shares: the rescale request.

Under a pliant agent a rescale is asked of a worker with :data:`pliant.env.RESCALE_SIGNAL` once the worker announced
that it handles it (:func:`pliant.progress.announce_signal`); a worker that did not is stopped as torchrun stops one.
A framework's training loop cannot act in a signal handler, so the handler only sets a flag, and at step boundaries
the ranks vote on their flags with one all-reduce: every rank sees the request at the same step, saves there with the
framework's own checkpointing and exits with :data:`pliant.env.RESCALE_EXIT_CODE`, which the agent takes for "saved
for the rescale", not a failure.

A vote costs a collective and, on a GPU, a synchronisation with the device, so the ranks do not vote at every step:
each vote also agrees on how many steps pass until the next one, the fewest any rank proposes, each proposing the
steps that take about :data:`VOTE_EVERY_S` at its own pace (1 to :data:`MAX_STEPS_BETWEEN`). Every rank counts the
same steps, so they vote at the same boundaries, and a rescale waits about :data:`VOTE_EVERY_S` plus a step.
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

__all__ = ["MAX_STEPS_BETWEEN", "VOTE_EVERY_S", "RescaleRequest", "steps_between"]

VOTE_EVERY_S = 0.1  # the ranks vote on a rescale about this often ...
MAX_STEPS_BETWEEN = 100  # ... and at least every this many steps


def steps_between(seconds_per_step: float) -> int:
    """The steps that take about :data:`VOTE_EVERY_S` at ``seconds_per_step`` (1 when unknown), at most
    :data:`MAX_STEPS_BETWEEN`."""
    if seconds_per_step <= 0:
        return 1
    return max(1, min(MAX_STEPS_BETWEEN, int(VOTE_EVERY_S / seconds_per_step)))


class RescaleRequest:
    """A worker's rescale request: the signal's flag and the ranks' agreement on it.

    Threads: the signal handler (main thread, between bytecodes) sets ``_asked``; the training loop (main thread)
    reads it and owns the vote's counters. ``env`` is read once, at construction.

    Attributes:
        env: the worker's environment (a default one outside a pliant agent).
    """

    def __init__(self) -> None:
        self.env = WorkerEnv.from_env()
        self._asked = False
        self._until_vote = 1  # steps until the next vote (the first boundary votes)
        self._between = 1  # the steps the last vote agreed on
        self._voted_at: float | None = None  # when this rank last voted (monotonic)
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
        self._until_vote -= 1
        if self._until_vote > 0:
            return False
        now = time.monotonic() if now is None else now
        pace = (now - self._voted_at) / self._between if self._voted_at is not None else 0.0
        # MAX over [flag, -proposal]: any rank's request, and the fewest steps any rank proposes.
        vote = torch.tensor([int(self._asked), -steps_between(pace)], dtype=torch.int64, device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(vote, op=dist.ReduceOp.MAX)
        asked, between = vote.tolist()
        self._between = self._until_vote = -between
        self._voted_at = now
        return bool(asked)
