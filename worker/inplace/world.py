"""One generation's membership in this worker process: the :class:`World`.

A worker process is in one world at a time: a generation's env (its rank, the world size, the store its ranks meet
at), the default process group formed on it, and the sockets that group and the groups made alongside it opened. The
world owns all of it:

- **The env.** :attr:`World.env` is the generation's :class:`~pliant.env.WorkerEnv`, replaced whole when the world
  moves to a newer generation (:meth:`World.adopt`), which also writes its variables into ``os.environ``: a script or a
  library that reads ``RANK`` or ``WORLD_SIZE`` after a rescale in place reads the new world's.
- **The directive.** The world is the only reader of the directive the agent writes next to the progress file
  (:mod:`pliant.progress`): the protocol at a step boundary, the step guard and a rendezvous watch all ask
  :meth:`World.newer` whether a newer generation waits.
- **Forming.** :meth:`World.meet` initialises the default group on the generation's store and notes its sockets;
  :meth:`World.form` does it while watching for a newer generation, which it follows when one is handed over before
  the ranks met (:class:`~pliant.worker.inplace.groups.RendezvousWatch`).
- **Retiring.** :meth:`World.retire` leaves the old group without running its destructor
  (:func:`~pliant.worker.inplace.groups.retire_groups`); :meth:`World.sever` shuts its sockets so that peers blocked
  with this rank fail at once.

Threads: the script's thread owns every field and is the only caller of every method but :meth:`World.newer`, which
the step guard's and a rendezvous watch's threads call too: it reads the directive file and ``env.progress_file``,
the same in every generation (``env`` is replaced whole, never changed in place).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from pliant.env import WorkerEnv, install
from pliant.progress import Directive, ProgressFile, read_directive
from pliant.worker.contract import WorkerError
from pliant.worker.inplace import nccl
from pliant.worker.inplace.groups import (
    RendezvousWatch,
    announce_arrival,
    connect_store,
    keepalive,
    new_world,
    retire_groups,
    sever,
    socket_fds,
)

__all__ = ["DIRECTIVE_WAIT_S", "MEET_S", "DirectiveTimeout", "World", "newer_directive"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

DIRECTIVE_WAIT_S = 600.0  # the agent's start timeout watches a worker waiting in the "wait" phase
MEET_S = 30.0  # survivors re-forming in place meet within this; see World.form


def newer_directive(progress_file: str, than: int) -> Directive | None:
    """The directive an agent wrote next to ``progress_file`` if it is for a generation newer than ``than``, else None
    (none yet, or an old one). Any thread."""
    directive = read_directive(progress_file) if progress_file else None
    return directive if directive is not None and directive.generation > than else None


class DirectiveTimeout(WorkerError):
    """No directive for a newer generation came from the agent within :data:`DIRECTIVE_WAIT_S`."""


class World:
    """One generation's membership in this process (see the module docstring).

    Args:
        env: the generation this process starts in.
        backend: the session's backend (``gloo`` or ``nccl``; :func:`pliant.worker.inplace.nccl.plan_device`).
        timeout: the collective timeout.
        progress: the worker's progress file, where waiting for the next generation is written (``wait``).

    Attributes:
        env: the current generation's env.
        in_place: this world re-forms in place under an agent (``--rescale in-place``, with a store to meet at).
        group_fds: the sockets (descriptor, inode) of this world's process groups, which :meth:`sever` and the step
            guard shut down.
    """

    def __init__(self, env: WorkerEnv, backend: str, timeout: timedelta, progress: ProgressFile) -> None:
        self.env = env
        self.backend = backend
        self.timeout = timeout
        self.in_place = env.under_agent and env.rescale == "in-place" and bool(env.master_port)
        self.group_fds: set[tuple[int, int]] = set()
        self._progress = progress

    # -- the directive -------------------------------------------------------------------------------------------------

    def newer(self, than: int | None = None) -> Directive | None:
        """The agent's directive for a generation newer than ``than`` (default: this world's), or None. Any thread."""
        env = self.env
        return newer_directive(env.progress_file, env.generation if than is None else than)

    def await_newer(self) -> Directive:
        """The directive for a generation newer than this world's, once the agent wrote it (maybe after this rank got
        here).

        Raises:
            DirectiveTimeout: none came within :data:`DIRECTIVE_WAIT_S`.
        """
        deadline = time.monotonic() + DIRECTIVE_WAIT_S
        while time.monotonic() < deadline:
            directive = self.newer()
            if directive is not None:
                return directive
            time.sleep(0.005)
        raise DirectiveTimeout(
            f"no directive for a generation after {self.env.generation} within {DIRECTIVE_WAIT_S:g}s "
            f"(from the agent, in {self.env.progress_file}.next)"
        )

    def wait_for_next(self, step: int) -> None:
        """Tell the agent that this rank waits for the next generation at ``step`` (the ``wait`` phase: its agent
        reports the failure that brought it here, so the coordinator publishes the next generation at once)."""
        self._progress.write(step, "wait", self.env.generation)

    def moving_state(self, step: int) -> None:
        """Tell the agent that this rank moves the state into this world after ``step`` (the ``transfer`` phase, until
        its first step here completes: its agent shows a long one, and gives it the start timeout)."""
        self._progress.write(step, "transfer", self.env.generation)

    # -- forming and retiring ------------------------------------------------------------------------------------------

    def adopt(self, directive: Directive) -> None:
        """Move to ``directive``'s generation: its env becomes this world's and its variables go into ``os.environ``.
        The group is formed by :meth:`form`, after the old one was retired."""
        install(directive.env)
        self.env = WorkerEnv.from_env()

    def meet(self, superseded: Callable[[], bool] = lambda: False, meet_s: float | None = None) -> None:
        """Initialise the default process group of this world's generation, noting the sockets it opened
        (:attr:`group_fds`). In place, those sockets also get TCP keepalive
        (:func:`~pliant.worker.inplace.groups.keepalive`): a peer cut off by a partition fails the collectives waiting
        on it within seconds instead of the collective timeout.

        Under an agent the generation's store is reached by :func:`~pliant.worker.inplace.groups.connect_store`,
        which gives up once ``superseded()``; under torchrun, by torch's env:// rendezvous. ``meet_s`` bounds the
        meeting (reaching the store and every rank's connections) instead of the collective timeout, which the group
        then takes (the shorter of the two bounds it)."""
        meet = min(timedelta(seconds=meet_s), self.timeout) if meet_s else self.timeout
        before = socket_fds()
        env = self.env
        if env.master_port:
            backend = nccl.backend_for(self.backend, under_agent=env.under_agent)
            store = connect_store(env, meet, superseded) if env.under_agent else None
            new_world()  # an earlier attempt in this process may have failed
            dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=meet)
            if meet != self.timeout:
                dist.distributed_c10d._set_pg_timeout(self.timeout)
                if store is not None:
                    store.set_timeout(self.timeout)
        else:  # a plain single process: no store to meet at
            dist.init_process_group(self.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=self.timeout)
        self.group_fds = socket_fds() - before
        if self.in_place:
            keepalive(self.group_fds)

    def tracked(self, make: Callable[[], T]) -> T:
        """Run ``make``, which opens a process group of this world (a checkpoint manager's, the buddy copies'), noting
        the sockets it opens among :attr:`group_fds`, which a peer failure severs and the step guard shuts down: a
        collective blocked on that group (an async save's, on a peer gone) is released with the others."""
        before = socket_fds()
        made = make()
        fds = socket_fds() - before
        if self.in_place:
            keepalive(fds)
        self.group_fds |= fds
        return made

    def form(self, survivor: bool = False, step: int = 0) -> Directive | None:
        """Meet this world's generation. If the agent hands over a newer generation while its ranks are still meeting
        (one of them died or was evicted before the others met it, and would be waited for until the timeout),
        abandon it: the sockets the rendezvous opened are shut down, which fails its wait, and the newer generation is
        formed instead. A ``survivor`` (re-forming in place, at committed ``step``) meets within :data:`MEET_S`; if
        its generation's ranks do not all meet by then, it waits in place, like a survivor of a failed step, for the
        next generation that its agent's failure report brings.

        Returns:
            None once a generation's group formed; the newer generation's directive when it is not ``in-place``
            (this rank leaves, or takes the restart path; the group is retired).
        """
        while True:
            env = self.env
            watch = RendezvousWatch(self.newer, env.generation)
            try:
                self.meet(watch.superseded, MEET_S if survivor else None)
            except Exception as exc:
                directive = watch.finish()
                if directive is None:
                    if not survivor:
                        raise
                    logger.warning(
                        "rank %d: generation %d's ranks did not all meet (%s: %s); waiting in place for the "
                        "next generation",
                        env.rank,
                        env.generation,
                        type(exc).__name__,
                        str(exc).splitlines()[0][:200],
                    )
                    self.wait_for_next(step)
                    directive = self.await_newer()
            else:
                directive = watch.finish()
                if directive is None:
                    return None
            logger.warning(
                "rank %d: generation %d gave way to generation %d before its ranks met; forming that one",
                env.rank,
                env.generation,
                directive.generation,
            )
            self.retire()
            if directive.mode != "in-place":
                return directive
            self.adopt(directive)
            if not survivor:  # the survivors' agents wait for the newcomers to count themselves in this one too
                try:
                    self.announce_arrival(timeout_s=5.0)
                except RuntimeError as exc:  # they then wait their rescale grace instead
                    logger.warning(
                        "rank %d: could not count in generation %d: %s",
                        self.env.rank,
                        self.env.generation,
                        str(exc).splitlines()[0][:200],
                    )

    def announce_arrival(self, timeout_s: float = 30.0) -> None:
        """A fresh worker counts itself in the generation's store before it meets the world
        (:func:`~pliant.worker.inplace.groups.announce_arrival`)."""
        announce_arrival(self.env, timeout_s)

    def retire(self) -> None:
        """Leave the default group without running its destructor
        (:func:`~pliant.worker.inplace.groups.retire_groups`)."""
        retire_groups()

    def sever(self) -> None:
        """Shut down this world's sockets (without closing them), so every peer blocked in a collective with this
        rank fails at once (:func:`~pliant.worker.inplace.groups.sever`)."""
        sever(self.group_fds)
