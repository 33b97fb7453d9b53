"""NCCL under the in-place protocol: a failed peer must fail the survivors' step, never hang it or corrupt it.

Gloo raises as soon as a peer's connection closes (:mod:`pliant.worker.rescale`). NCCL does not: its kernels wait on
the GPU for data that never comes, the CPU blocks at its next synchronisation (``loss.item()``), and when the
communicator is finally torn down the step's buffers hold partial sums. So, in place on NCCL:

- the default process group is ``cpu:gloo,cuda:nccl`` (:func:`backend_for`): the protocol's small control tensors
  (the boundary flag, the commit vote, the state sync's step numbers) go over gloo, the gradients over NCCL;
- torch's own handling of NCCL errors is off (``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``, and no debug dump on an error:
  ``TORCH_NCCL_DUMP_ON_TIMEOUT=0``; :func:`prepare`, where a value the user set wins). Its default tears the process
  down on the first error, and a survivor must live on;
- a :class:`Guard` thread watches every step. It aborts the default group's NCCL communicator, which releases the
  kernels and the blocked CPU, when NCCL reports an error (a peer's connection closed: within a fraction of a second
  of a kill -9), or when the agent handed over a newer generation and the step has been running for
  :data:`STALL_S` or three times the last step's time, whichever is longer (a peer cut off without a reset);
- before the optimizer step the step synchronises with the GPU and :meth:`Guard.check` raises a peer failure when the
  communicator failed or was aborted: no survivor applies a step the others did not. The failure path then re-forms
  the world on a fresh communicator in the same process.

Checked on one H100 with two ranks that NCCL takes for two hosts (``NCCL_HOSTID``; NCCL 2.28.9, torch 2.11): a peer's
kill -9 is reported by NCCL within about a second (not timed more closely); without the abort the survivor stays
blocked until the collective timeout (60 s there); aborting releases it at once, and a new communicator forms in the
same process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

import torch
import torch.distributed as dist

from pliant.progress import read_directive

__all__ = ["POLL_S", "STALL_S", "Guard", "NoGuard", "abort_nccl", "backend_for", "has_nccl", "prepare"]

logger = logging.getLogger(__name__)

POLL_S = 0.05  # how often the guard looks at the communicator's error state and the agent's directive
STALL_S = 2.0  # a step blocked this long (at least) while a newer generation is waiting is taken as broken


def backend_for(backend: str, under_agent: bool) -> str:
    """The default group's backend string: NCCL under an agent also gets gloo for CPU tensors (the protocol's)."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" and under_agent else backend


def prepare(backend: str, in_place: bool) -> None:
    """Before the first NCCL group of an in-place worker: keep torch's watchdog from tearing the process down on an
    NCCL error (the guard aborts the communicator instead). A value set by the user is left alone."""
    if backend == "nccl" and in_place:
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
        # On an error the watchdog would first dump debug info and wait a minute for the other ranks' dumps, holding
        # up the re-formation that long (seen on an H100: 60 s).
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")


def _nccl_backend() -> object | None:
    """The default group's NCCL backend, or None (no group, or no NCCL in it)."""
    if not dist.is_initialized():
        return None
    try:
        backend = dist.group.WORLD._get_backend(torch.device("cuda"))  # type: ignore[union-attr]
    except RuntimeError:
        return None
    return backend if type(backend).__name__ == "ProcessGroupNCCL" else None


def _failed(backend: object) -> str:
    """The backend's error state as text ("" while healthy; torch without ``get_error`` reports none)."""
    get_error = getattr(backend, "get_error", None)
    if get_error is None:
        return ""
    error = get_error()
    return "" if str(error).endswith("SUCCESS") else str(error)


def has_nccl() -> bool:
    """The default group has an NCCL backend."""
    return _nccl_backend() is not None


def abort_nccl() -> bool:
    """Abort the default group's NCCL communicator (local: frees it and releases its kernels). False if none."""
    backend = _nccl_backend()
    if backend is None:
        return False
    with contextlib.suppress(RuntimeError):
        backend.abort()  # type: ignore[attr-defined]
    return True


class NoGuard:
    """The guard of a worker that is not on NCCL in place (gloo raises on a peer's failure by itself): watches
    nothing."""

    def begin(self, generation: int | None) -> None:
        """See :meth:`Guard.begin`."""

    def end(self) -> None:
        """See :meth:`Guard.end`."""

    def check(self) -> None:
        """See :meth:`Guard.check`."""


class Guard:
    """Watches an in-place NCCL worker's steps (see the module docstring). One per protocol; a daemon thread.

    Args:
        progress_file: the worker's progress file (its agent's directives are read next to it).
    """

    def __init__(self, progress_file: str) -> None:
        self.progress_file = progress_file
        self.generation: int | None = 0
        self._step_started: float | None = None
        self._last_step_s = 0.0
        self._why = ""
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="pliant-nccl-guard", daemon=True)
        self._thread.start()

    def begin(self, generation: int | None) -> None:
        """A step (or a re-formation) starts in ``generation``; None: only NCCL's own error counts (the step
        boundary, during which the next generation's directive is expected)."""
        with self._lock:
            self.generation = generation
            self._step_started = time.monotonic()
            self._why = ""

    def end(self) -> None:
        """The step ended (committed, or failed and handled)."""
        with self._lock:
            if self._step_started is not None:
                self._last_step_s = time.monotonic() - self._step_started
            self._step_started = None

    def check(self) -> None:
        """Wait for the step's GPU work, then raise a peer failure if the communicator failed or was aborted.

        Raises:
            RuntimeError: naming NCCL (:func:`pliant.worker.rescale.is_peer_failure` takes it as a peer failure).
        """
        torch.cuda.current_stream().synchronize()
        backend = _nccl_backend()
        why = self._why or (_failed(backend) if backend is not None else "")
        if why:
            raise RuntimeError(f"NCCL: a peer failed during the step ({why}); the communicator was aborted")

    def _watch(self) -> None:
        while True:
            time.sleep(POLL_S)
            with self._lock:
                started, last, generation = self._step_started, self._last_step_s, self.generation
                if started is None or self._why:
                    continue
            backend = _nccl_backend()
            if backend is None:
                continue
            why = _failed(backend)
            if not why and generation is not None and time.monotonic() - started > max(STALL_S, 3 * last):
                directive = read_directive(self.progress_file) if self.progress_file else None
                if directive is not None and directive.generation > generation:
                    why = (f"the step has run {time.monotonic() - started:.1f}s while generation "
                           f"{directive.generation} waits")  # fmt: skip
            if why:
                with self._lock:
                    self._why = why
                logger.warning("NCCL guard: aborting the communicator of generation %d (%s)", generation, why)
                abort_nccl()
