"""The one way the worker library runs work in the background: :func:`in_background`, a daemon thread whose outcome
is a :class:`concurrent.futures.Future`.

Every thread the library starts is one of these: the buddy copies' snapshot copies, their group's creation and the
wait for their arrival (:mod:`pliant.worker.inplace.buddy`), an async checkpoint's write
(:mod:`pliant.worker.staging`), the step guard (:mod:`pliant.worker.inplace.guard`) and a rendezvous watch
(:mod:`pliant.worker.inplace.groups`). The future holds what the work returned or what it raised, ``BaseException``
included; any thread may wait for it (``result``), any number of times, and a callback added to it runs on the
work's thread as it ends (or at once on the adding thread, when it already ended). A watcher that runs until its
process ends (the step guard) is one too: its future records why it stopped, if it ever does.

Threads are daemons: a process that exits does not wait for them (a worker's last act is its exit, which its agent
counts; a copy or a write still running then is abandoned, never committed).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

__all__ = ["in_background"]

T = TypeVar("T")


def in_background(work: Callable[[], T], name: str) -> Future[T]:
    """Run ``work`` on a daemon thread named ``name``; returns the future of its result (or of what it raised)."""
    future: Future[T] = Future()
    future.set_running_or_notify_cancel()

    def run() -> None:
        try:
            result = work()
        except BaseException as exc:  # reported to whoever waits: a failed copy, a DCP CheckpointException
            future.set_exception(exc)
        else:
            future.set_result(result)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
