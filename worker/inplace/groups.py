"""Process groups' sockets and lifecycle, for the in-place world (:mod:`pliant.worker.inplace.world`): which sockets a
group opened, shutting them down so that peers blocked with this rank fail at once (``sever``) or so that this rank's
own blocked collective fails too (``shut_down``), TCP keepalive so that a silent peer fails them within seconds
(``keepalive``), and retiring a group without running its destructor
(``retire_groups``); connecting to a generation's store in short attempts that a newer generation can end
(``connect_store``); and watching a rendezvous for a newer generation (``RendezvousWatch``)."""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import NoReturn

import torch.distributed as dist

from pliant.env import GUARD_EXIT_CODE, WorkerEnv
from pliant.progress import Directive
from pliant.worker.background import in_background
from pliant.worker.contract import WorkerError
from pliant.worker.inplace.nccl import has_nccl

__all__ = [
    "ARRIVED_KEY",
    "CONNECT_ATTEMPT_S",
    "KEEPALIVE_IDLE_S",
    "MEET_GIVE_UP_S",
    "PROBE_S",
    "USER_TIMEOUT_S",
    "RendezvousError",
    "RendezvousWatch",
    "Superseded",
    "announce_arrival",
    "connect_store",
    "give_up",
    "keepalive",
    "new_world",
    "retire_groups",
    "sever",
    "shut_down",
    "socket_fds",
]

logger = logging.getLogger(__name__)

CONNECT_ATTEMPT_S = 2.0  # one TCPStore attempt to reach a generation's store that listens; see connect_store
PROBE_S = 0.2  # between probes of a generation store's port that does not listen yet

MEET_GIVE_UP_S = 10.0  # a superseded meeting still blocked this long after its sockets were shut down ends the process

_RETIRED_GROUPS: list[object] = []  # groups whose destructor must never run; see retire_groups


def give_up(why: str) -> NoReturn:
    """End this worker at once, for a thread blocked in C++ that nothing else releases: ``why`` and every thread's
    Python stack to stderr (its agent logs them), then exit with :data:`pliant.env.GUARD_EXIT_CODE`, which the agent
    reports as a dead worker's: the survivors re-form without it, and a fresh worker takes its rank with its state
    from them."""
    logger.error(
        "%s; writing every thread's stack and exiting with code %d (the agent replaces this worker, its "
        "peers re-form without it)",
        why,
        GUARD_EXIT_CODE,
    )
    for handler in logging.getLogger().handlers:
        handler.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(GUARD_EXIT_CODE)


def socket_fds() -> set[tuple[int, int]]:
    """This process's open sockets as (file descriptor, inode) pairs (Linux /proc; empty elsewhere).

    A socket is known by both: a process group's sockets are found as those opened since a snapshot, while the old
    groups' sockets close in gloo's own threads, and the kernel gives a new socket the lowest free descriptor. By
    number alone a new group's socket that reuses a number closed after the snapshot would be missed, and never
    severed, shut down or given keepalive, and a step blocked on it would wait out the rescale grace."""
    out = set()
    try:
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                link = os.readlink(f"/proc/self/fd/{name}")
                if link.startswith("socket:["):
                    out.add((int(name), int(link[8:-1])))
    except OSError:
        pass
    return out


def _still_open(sockets: Iterable[tuple[int, int]]) -> Iterator[socket.socket]:
    """The sockets of ``sockets`` still open under the same descriptor, each as a socket object that does not own it
    (a descriptor since closed, or reused by another socket, is skipped)."""
    for fd, inode in sockets:
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != f"socket:[{inode}]":
                continue
            sock = socket.socket(fileno=fd)
        except (OSError, ValueError):
            continue
        try:
            yield sock
        finally:
            sock.detach()


def sever(sockets: Iterable[tuple[int, int]]) -> None:
    """Shut down (without closing) the sockets the old process group opened, so every peer still blocked in a
    collective with this rank sees the connection close and fails at once: gloo reports a failure only on a
    connection that closed, its abort closes none, and the group itself is never destroyed (:func:`retire_groups`)."""
    for sock in _still_open(sockets):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)  # a FIN to the peer (a failed accept on its listener aborts gloo)


def shut_down(sockets: Iterable[tuple[int, int]]) -> None:
    """Shut down both directions of the process groups' connections, so that a collective this rank is blocked in
    fails at once ("Connection closed"), whichever peer it waits on, and so do the peers' waiting on this rank (the
    step guard's break, :mod:`pliant.worker.inplace.guard`). Listening sockets are left alone: gloo aborts the process
    when its listener's ``accept`` fails."""
    for sock in _still_open(sockets):
        with contextlib.suppress(OSError):
            if sock.type == socket.SOCK_STREAM and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                sock.shutdown(socket.SHUT_RDWR)


KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 2, 1, 3  # a silent peer is declared gone after ~5 s
USER_TIMEOUT_S = 10  # data unacknowledged this long aborts the connection (a live peer's kernel acknowledges it,
# and since Linux 5.11 also answers zero-window probes for a receiver too busy to read, which then never counts)


def keepalive(sockets: Iterable[tuple[int, int]]) -> None:
    """Turn on TCP keepalive (and a user timeout for unacknowledged data) on a process group's sockets, so that a
    peer that went silent without closing its connections (a network partition, a frozen machine) makes the
    collectives waiting on it fail after about ``KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_PROBES``
    seconds (:data:`USER_TIMEOUT_S` when this rank was sending to it), with a transport error, instead of after the
    collective timeout. A busy peer's kernel still answers
    the probes: a slow step is never mistaken for a dead peer."""
    for sock in _still_open(sockets):
        with contextlib.suppress(OSError):
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 1000 * USER_TIMEOUT_S)


def retire_groups() -> None:
    """Destroy the default process group without ever running a group's destructor.

    A gloo group's destructor joins its worker threads, and a thread that needs the GIL as it exits either deadlocks
    with the destroying thread or, during interpreter shutdown, aborts the process. One reference per group is leaked
    on purpose; the threads stay parked until the process exits (a few per re-formation).
    """
    if not dist.is_initialized():
        return
    for group in dist.distributed_c10d._world.pg_map:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
        _RETIRED_GROUPS.append(group)
    if has_nccl():  # aborting frees the communicators at once; destroying would wait for NCCL's watchdog thread,
        dist.distributed_c10d._abort_process_group()  # which would sleep a minute after an error
    else:
        dist.destroy_process_group()


def new_world() -> None:
    """Before initialising the default process group again in this process: restart torch's process group names at
    0, as a fresh process has them.

    The default group's store keys are prefixed with its name, the count of groups this process named so far;
    ``destroy_process_group`` resets the count, but an ``init_process_group`` that failed (abandoned for a newer
    generation, or timed out) names a group and creates none, so the next attempt's keys would go under "1/" while a
    fresh newcomer's go under "0/", and the ranks would wait for each other's keys forever."""
    if not dist.is_initialized():
        dist.distributed_c10d._world.group_count = 0


class RendezvousError(WorkerError):
    """This rank could not meet its generation's ranks."""


class Superseded(RendezvousError):
    """A newer generation was handed over while this rank was still reaching the store of the one it meets in."""


ARRIVED_KEY = "/pliant/arrived"  # pliant.agent.stores.ARRIVED_KEY: fresh workers count themselves in


def announce_arrival(env: WorkerEnv, timeout_s: float = 30.0) -> None:
    """A fresh worker counts itself in the generation's store before it joins the world, so the survivors' agents
    hand the generation over only once the newcomers are about to meet them: the survivors train on meanwhile."""
    store = dist.TCPStore(env.master_addr, env.master_port, is_master=False, timeout=timedelta(seconds=timeout_s))
    store.add(ARRIVED_KEY, 1)


def connect_store(env: WorkerEnv, timeout: timedelta, superseded: Callable[[], bool]) -> dist.TCPStore:
    """A client of ``env``'s generation store (run by an agent, as torch's env:// rendezvous reaches it when
    TORCHELASTIC_USE_AGENT_STORE is set), reached within ``timeout`` unless ``superseded()`` first.

    torch's own connect loop backs off up to a minute between attempts and runs until the whole timeout (600 s by
    default). That stalled a whole job in the chaos soak: a survivor handed generation N, then N+1 and N+2 before it
    reached N's store, kept connecting to that store, already closed by its agent, while the other ranks waited for it
    in N+2's rendezvous. Here the port is probed with plain connections every :data:`PROBE_S` (quiet, and checked
    against ``superseded()`` each time) until it listens; then TCPStore connects in attempts of
    :data:`CONNECT_ATTEMPT_S`.

    Raises:
        Superseded: ``superseded()`` became true before the store was reached.
        RendezvousError: the store was not reached within ``timeout``.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    where = f"the store of generation {env.generation} at {env.master_addr}:{env.master_port}"
    warned = False
    while True:
        if superseded():
            raise Superseded(f"generation {env.generation} was superseded while {where} was being reached")
        if time.monotonic() >= deadline:
            raise RendezvousError(
                f"{where} was not reachable within {timeout.total_seconds():.0f}s: its node-rank-0 "
                "agent serves it; check that agent and the route to it (the collective timeout "
                "bounds this wait)"
            )
        try:
            socket.create_connection((env.master_addr, env.master_port), timeout=PROBE_S).close()
        except OSError:
            if not warned:
                logger.warning(
                    "rank %d: %s is not listening yet; waiting up to %.0fs", env.rank, where, timeout.total_seconds()
                )
                warned = True
            time.sleep(PROBE_S)
            continue
        try:
            store = dist.TCPStore(
                env.master_addr,
                env.master_port,
                env.world_size,
                is_master=False,
                timeout=timedelta(seconds=CONNECT_ATTEMPT_S),
            )
        except RuntimeError as exc:  # DistNetworkError, DistStoreError: it closed since the probe, or is slow
            logger.warning("rank %d: %s: %s", env.rank, where, str(exc).splitlines()[0][:200])
            continue
        store.set_timeout(timeout)
        return store


class RendezvousWatch:
    """While a process group's ranks meet, watch for a newer generation's directive; from when one comes until the
    rendezvous returns, shut down every socket opened since the watch began (the store client's, gloo's; again every
    tenth of a second, so a socket connected meanwhile fails too), so the blocked rendezvous fails
    (:meth:`pliant.worker.inplace.world.World.form`).

    A meeting still blocked :data:`MEET_GIVE_UP_S` after that ends the process (:func:`give_up`): gloo's listening
    side of a pair whose peer never connects (cut off, or dead, before it did) waits past the group's timeout, and
    shutting down sockets does not wake it (pytorch/gloo #520). A fresh worker then takes this rank, as after any
    worker's death.

    Args:
        newer: the world's directive reader (:meth:`pliant.worker.inplace.world.World.newer`): the directive of a
            generation newer than the one given, or None. Called from the watch's thread.
        generation: the generation whose ranks meet.

    Threads: the watch's thread sets :attr:`newer` once, under the lock; :meth:`finish` (the meeting's thread) ends
    the watch under the same lock, so a group that formed is never severed.
    """

    def __init__(self, newer: Callable[[int], Directive | None], generation: int) -> None:
        self._newer, self.generation = newer, generation
        self.before = socket_fds()
        self.newer: Directive | None = None
        self._lock = threading.Lock()
        self._done = False
        self._stop = threading.Event()
        self._task = in_background(self._watch, "pliant-rendezvous-watch")

    def superseded(self) -> bool:
        """A newer generation's directive came while the ranks met."""
        return self.newer is not None

    def _watch(self) -> None:
        severed: float | None = None
        while not self._stop.wait(0.1):
            if self.newer is None:
                directive = self._newer(self.generation)
                if directive is None:
                    continue
            with self._lock:
                if self._done:  # the group formed meanwhile: it stays, and the boundary moves it on
                    return
                self.newer = self.newer or directive
                sever(socket_fds() - self.before)
                severed = severed or time.monotonic()
                if time.monotonic() - severed > MEET_GIVE_UP_S:  # under the lock: finish() cannot race it
                    give_up(
                        f"generation {self.generation}'s meeting, superseded by generation "
                        f"{self.newer.generation}, is still blocked {time.monotonic() - severed:.1f}s after its "
                        f"sockets were shut down"
                    )

    def finish(self) -> Directive | None:
        """The rendezvous returned (or raised): stop watching; returns the directive that superseded it, or None."""
        with self._lock:
            self._done = True
        self._stop.set()
        self._task.result()  # the watch's own error, if it failed
        return self.newer
