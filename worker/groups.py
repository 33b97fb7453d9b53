"""Process groups' sockets and lifecycle, for the rescale protocol (:mod:`pliant.worker.rescale`): which sockets a
group opened, shutting them down so that peers blocked with this rank fail at once (``sever``), TCP keepalive so that a
silent peer fails them within seconds (``keepalive``), and retiring a group without running its destructor
(``retire_groups``); and watching a rendezvous for a newer generation (``RendezvousWatch``)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import threading

import torch.distributed as dist

from pliant.progress import Directive, read_directive
from pliant.worker.nccl import has_nccl

__all__ = ["KEEPALIVE_IDLE_S", "USER_TIMEOUT_S", "RendezvousWatch", "keepalive", "retire_groups", "sever", "socket_fds"]

_RETIRED_GROUPS: list[object] = []  # groups whose destructor must never run; see retire_groups


def socket_fds() -> set[int]:
    """This process's open socket file descriptors (Linux /proc; empty elsewhere)."""
    out = set()
    try:
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                    out.add(int(name))
    except OSError:
        pass
    return out


def sever(fds: set[int]) -> None:
    """Shut down (without closing) the sockets the old process group opened, so every peer still blocked in a
    collective with this rank sees the connection close and fails at once: gloo reports a failure only on a
    connection that closed, its abort closes none, and the group itself is never destroyed (:func:`retire_groups`)."""
    for fd in fds:
        with contextlib.suppress(OSError, ValueError):
            sock = socket.socket(fileno=fd)
            try:
                sock.shutdown(socket.SHUT_WR)  # a FIN to the peer; gloo aborts the process on a local SHUT_RD
            finally:
                sock.detach()


KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 2, 1, 3  # a silent peer is declared gone after ~5 s
USER_TIMEOUT_S = 10  # data unacknowledged this long aborts the connection (a live peer's kernel acknowledges it,
# and since Linux 5.11 also answers zero-window probes for a receiver too busy to read, which then never counts)


def keepalive(fds: set[int]) -> None:
    """Turn on TCP keepalive (and a user timeout for unacknowledged data) on a process group's sockets, so that a
    peer that went silent without closing its connections (a network partition, a frozen machine) makes the
    collectives waiting on it fail after about ``KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_PROBES``
    seconds (:data:`USER_TIMEOUT_S` when this rank was sending to it), with a transport error, instead of after the
    collective timeout. A busy peer's kernel still answers
    the probes: a slow step is never mistaken for a dead peer."""
    for fd in fds:
        with contextlib.suppress(OSError, ValueError):
            sock = socket.socket(fileno=fd)
            try:
                if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 1000 * USER_TIMEOUT_S)
            finally:
                sock.detach()


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
        dist.distributed_c10d._abort_process_group()  # which sleeps a minute after an error (seen on an H100)
    else:
        dist.destroy_process_group()


class RendezvousWatch:
    """While a process group's ranks meet, watch for a newer generation's directive; when one comes, shut down the
    sockets opened since (the store client's, gloo's), so the blocked rendezvous fails
    (:meth:`pliant.worker.rescale.Protocol.form_group`)."""

    def __init__(self, progress_file: str, generation: int) -> None:
        self.progress_file, self.generation = progress_file, generation
        self.before = socket_fds()
        self.newer: Directive | None = None
        self._lock = threading.Lock()
        self._done = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="pliant-rendezvous-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            directive = read_directive(self.progress_file) if self.progress_file else None
            if directive is not None and directive.generation > self.generation:
                with self._lock:
                    if not self._done:  # the group formed meanwhile: it stays, and the boundary moves it on
                        self.newer = directive
                        sever(socket_fds() - self.before)
                return

    def finish(self) -> Directive | None:
        """The rendezvous returned (or raised): stop watching; returns the directive that superseded it, or None."""
        with self._lock:
            self._done = True
        self._stop.set()
        self._thread.join()
        return self.newer
