"""The step guard of an in-place worker: a step that a dead or cut-off peer blocks is broken, never left to hang.

Most failures need no guard: on gloo a peer's death closes its connections, and every collective waiting on it raises
at once; TCP keepalive (:func:`pliant.worker.inplace.groups.keepalive`) fails a connection to a peer that went silent.
Two cases remain, and a guard thread (one per protocol) watches every step for them:

- **NCCL** does not raise: its kernels wait on the GPU for data that never comes, and the CPU blocks at its next
  synchronisation. The guard aborts the default group's NCCL communicator when NCCL reports an error (a peer's
  connection closed: within about a second of a kill -9 on an H100), which releases the kernels and the blocked CPU.
- **A step blocked while the agent already handed over a newer generation**, on either backend. Gloo waits on one
  peer's connection at a time, and wakes only when that connection fails. A rank waiting on a peer cut off by a
  partition, whose process is then stopped while the link is down (its agent, cut off from the control plane, fenced
  itself), is released neither by that close, nor by the other survivor's severed sockets, nor by keepalive: it would
  sit in DDP's gradient all-reduce until the agent's hang detection replaced it, long after the survivors re-formed
  without it. So when a newer generation's
  directive waits (:mod:`pliant.progress`) and the step has run for :data:`STALL_S` or three times the last step's
  time, whichever is longer, in a world of more than one rank (:func:`stalled`), the guard breaks the step: on NCCL
  it aborts the communicator; on gloo it shuts down the group's connections
  (:func:`pliant.worker.inplace.groups.shut_down`), which fails the collective waiting on any of them (and the peers'
  waiting on this rank). A healthy step that merely outlasts the rule is redone in the new world (DDP: that step; ZeRO
  and FSDP2: the steps since their last buddy snapshot); no sample is lost or repeated.

After a break, :meth:`Guard.check` (before the optimizer step) raises a peer failure, so this rank never applies the
step; :func:`pliant.worker.inplace.protocol.is_peer_failure` takes the error as one, and the failure path re-forms the
world in the same process.

**A break that releases nothing.** gloo never wakes a send whose bytes were still queued on its connection when the
connection failed: its TCP transport's error wakes the queued sends of bound buffers only, not those of unbound
buffers (every ``send`` and the ring all-reduce's), so such a send waits out the collective timeout, and shutting the
sockets down does not reach it (the failed connection's socket is closed already; ``bench/gloo_queued_send.py``
shows it with two plain gloo processes). ``ProcessGroupGloo.abort`` does nothing. So a step still blocked
:data:`GIVE_UP_S` or three times the last step's time (whichever is longer) after its break (:func:`wedged`) ends the
process: the guard writes every thread's Python stack to stderr (the agent logs it) and exits with
:data:`pliant.env.GUARD_EXIT_CODE`. Its agent reports the failure like any dead worker's, the survivors re-form in
place without it, and a fresh worker takes its rank with its state from them. The step was never applied here, so
nothing is lost or applied twice; the cost is one process and the steps a worker's death costs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from pliant.progress import Directive
from pliant.worker.background import in_background
from pliant.worker.contract import WorkerError
from pliant.worker.inplace.groups import give_up, shut_down
from pliant.worker.inplace.nccl import abort_nccl, nccl_backend, nccl_error

__all__ = ["GIVE_UP_S", "POLL_S", "STALL_S", "Guard", "GuardError", "NoGuard", "stalled", "wedged"]

logger = logging.getLogger(__name__)

POLL_S = 0.05  # how often the guard looks at the step's time and the communicator's error state
STALL_S = 2.0  # a step blocked this long (at least) while a newer generation is waiting is taken as broken
GIVE_UP_S = 10.0  # a broken step still blocked this long (at least) after its break ends the process; see wedged


class GuardError(WorkerError):
    """The step guard itself failed: the worker exits with it rather than train unguarded."""


def stalled(started: float | None, last_step_s: float, now: float, peers: bool = True) -> bool:
    """Whether a step that began at ``started`` (monotonic; None: no step running) has run long enough, at ``now``, to
    be broken if a newer generation waits: :data:`STALL_S` or three times the last step's time, whichever is longer.
    Never without ``peers`` (a world of one rank): no peer can block that step, so it is only slow (a newcomer
    starting on its machine), and breaking it would only make it run again."""
    return peers and started is not None and now - started > max(STALL_S, 3 * last_step_s)


def wedged(broken: float | None, last_step_s: float, now: float) -> bool:
    """Whether a step broken at ``broken`` (monotonic; None: not broken) that is still running at ``now`` is beyond
    release: :data:`GIVE_UP_S` or three times the last step's time after its break, whichever is longer (a slow
    step's compute runs on until its next collective, which then fails)."""
    return broken is not None and now - broken > max(GIVE_UP_S, 3 * last_step_s)


class NoGuard:
    """The guard of a worker that does not re-form in place (the restart path takes every failure): watches nothing."""

    def begin(self, generation: int | None, peers: bool = True) -> None:
        """See :meth:`Guard.begin`."""

    def end(self, committed: bool = True) -> None:
        """See :meth:`Guard.end`."""

    def check(self) -> None:
        """See :meth:`Guard.check`."""


class Guard:
    """Watches an in-place worker's steps (see the module docstring). A daemon thread.

    Args:
        newer: the world's directive reader (:meth:`pliant.worker.inplace.world.World.newer`): the directive of a
            generation newer than the one given, or None. Called from the guard's thread.
        nccl: the default group runs its collectives on NCCL (else gloo).
        sockets: the process groups' socket descriptors (``World.group_fds``), which a break shuts down on gloo.

    Threads: the step's thread calls :meth:`begin`, :meth:`end` and :meth:`check`; the guard's thread watches. Every
    field they share (the running step's start, generation and peers, the last step's time, the break) is read and
    written under the lock.
    """

    def __init__(
        self, newer: Callable[[int], Directive | None], nccl: bool, sockets: Callable[[], set[tuple[int, int]]]
    ) -> None:
        self._newer = newer
        self.nccl = nccl
        self._sockets = sockets
        self.generation: int | None = 0
        self._step_started: float | None = None
        self._peers = True  # the running step's world has other ranks
        self._last_step_s = 0.0
        self._why = ""
        self._broken: float | None = None  # when the running step was broken (monotonic)
        self._lock = threading.Lock()
        self._task = in_background(self._watch, "pliant-step-guard")  # runs until the process ends

    def begin(self, generation: int | None, peers: bool = True) -> None:
        """A step (or a collective between steps) starts in ``generation``; None: only NCCL's own errors count (the
        step boundary, during which the next generation's directive is expected). ``peers``: the world has other
        ranks (see :func:`stalled`)."""
        with self._lock:
            self.generation = generation
            self._peers = peers
            self._step_started = time.monotonic()
            self._why = ""
            self._broken = None

    def end(self, committed: bool = True) -> None:
        """The step ended: ``committed``, or failed (its time, which includes the wait for the failure, is not the
        step's)."""
        with self._lock:
            if self._step_started is not None and committed:
                self._last_step_s = time.monotonic() - self._step_started
            self._step_started = None

    def check(self) -> None:
        """Before the optimizer step: on NCCL wait for the step's GPU work; raise a peer failure if the guard broke
        the step or the communicator failed.

        Raises:
            RuntimeError: naming the backend (:func:`pliant.worker.inplace.protocol.is_peer_failure` takes it as a peer
                failure).
            GuardError: the guard's own loop stopped.
        """
        if self._task.done():  # the guard's loop stopped: it raised (a bug), and steps are no longer guarded
            raise GuardError(f"the step guard stopped: {self._task.exception()!r}")
        if self.nccl:
            torch.cuda.current_stream().synchronize()
            backend = nccl_backend()
            why = self._why or (nccl_error(backend) if backend is not None else "")
            if why:
                raise RuntimeError(f"NCCL: a peer failed during the step ({why}); the communicator was aborted")
        elif self._why:
            raise RuntimeError(f"gloo: the step guard broke the step ({self._why}); its connections were shut down")

    def _watch(self) -> None:
        while True:
            time.sleep(POLL_S)
            with self._lock:
                started, last, generation, peers = self._step_started, self._last_step_s, self.generation, self._peers
                broken, why = self._broken, self._why
                if started is None:
                    continue
            if why:
                if wedged(broken, last, time.monotonic()):
                    self._give_up(generation, broken)
                continue
            backend = nccl_backend() if self.nccl else None
            if self.nccl and backend is None:
                continue
            why = nccl_error(backend) if backend is not None else ""
            now = time.monotonic()
            if not why and generation is not None and stalled(started, last, now, peers):
                directive = self._newer(generation)
                if directive is not None:
                    why = f"the step has run {now - started:.1f}s while generation {directive.generation} waits"
            if why:
                self._break(generation, why)

    def _break(self, generation: int | None, why: str) -> None:
        with self._lock:
            if self._step_started is None:  # the step ended meanwhile: the next one starts afresh
                return
            self._why = why
            self._broken = time.monotonic()
        if self.nccl:
            logger.warning("step guard: aborting the NCCL communicator of generation %s (%s)", generation, why)
            abort_nccl()
        else:
            logger.warning("step guard: shutting down the gloo connections of generation %s (%s)", generation, why)
            shut_down(self._sockets())

    def _give_up(self, generation: int | None, broken: float | None) -> None:
        """The broken step is still blocked (:func:`wedged`): write every thread's stack and end the process with
        :data:`pliant.env.GUARD_EXIT_CODE`; the agent replaces this worker, the survivors re-form without it."""
        with self._lock:
            if self._step_started is None or self._broken != broken:  # released meanwhile
                return
        give_up(
            f"step guard: the step of generation {generation} is still blocked "
            f"{time.monotonic() - (broken or 0.0):.1f}s after its break"
        )
