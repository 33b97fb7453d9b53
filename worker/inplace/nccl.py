"""NCCL under the in-place protocol: a failed peer must fail the survivors' step, never hang it or corrupt it.

Gloo raises as soon as a peer's connection closes (:mod:`pliant.worker.inplace.protocol`). NCCL does not: its kernels
wait on the GPU for data that never comes, the CPU blocks at its next synchronisation (``loss.item()``), and when the
communicator is finally torn down the step's buffers hold partial sums. So, in place on NCCL:

- the default process group is ``cpu:gloo,cuda:nccl`` (:func:`backend_for`): the protocol's small control tensors
  (the boundary flag, the commit vote, the state sync's step numbers) go over gloo, the gradients over NCCL;
- torch's own handling of NCCL errors is off (``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``, and no debug dump on an error:
  ``TORCH_NCCL_DUMP_ON_TIMEOUT=0``; :func:`prepare`, where a value the user set wins). Its default tears the process
  down on the first error, and a survivor must live on;
- the step guard (:mod:`pliant.worker.inplace.guard`) aborts the default group's NCCL communicator (:func:`abort_nccl`),
  which releases the kernels and the blocked CPU, when NCCL reports an error (:func:`nccl_error`) or a newer
  generation waits for a blocked step; before the optimizer step the step synchronises with the GPU and the guard
  raises a peer failure when the communicator failed or was aborted: no survivor applies a step the others did not.
  The failure path then re-forms the world on a fresh communicator in the same process.

Checked on one H100 with two ranks that NCCL takes for two hosts (``NCCL_HOSTID``; NCCL 2.28.9, torch 2.11): a peer's
kill -9 is reported by NCCL within about a second (not timed more closely); without the abort the survivor stays
blocked until the collective timeout (60 s there); aborting releases it at once, and a new communicator forms in the
same process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch
import torch.distributed as dist

from pliant.worker.contract import WorkerError

__all__ = [
    "DevicePlan",
    "abort_nccl",
    "backend_for",
    "has_nccl",
    "nccl_backend",
    "nccl_error",
    "plan_device",
    "prepare",
]


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """Where one worker process trains.

    Attributes:
        backend: ``nccl`` or ``gloo``.
        cuda_index: the GPU this process owns, or None (the CPU).
        warning: one line for the user when the default could not be NCCL on a host that has GPUs, else "".
    """

    backend: str
    cuda_index: int | None
    warning: str = ""


def plan_device(requested: str | None, local_rank: int, local_world_size: int, gpus: int) -> DevicePlan:
    """Choose the backend and device of local rank ``local_rank`` of ``local_world_size`` on a host with ``gpus``
    GPUs visible.

    NCCL needs one GPU per process: two ranks of a communicator on one GPU fail at its first collective ("Duplicate
    GPU detected"). By default a process trains on GPU ``local_rank`` over NCCL when every local process has a GPU of
    its own, and on the CPU over gloo otherwise, with a warning when that leaves GPUs unused. An explicit ``nccl``
    with too few GPUs is refused.

    Raises:
        WorkerError: ``requested`` is ``nccl`` and the host has fewer GPUs than processes; the message names both
            numbers and the fix.
    """
    fits = 0 < local_world_size <= gpus
    if requested == "nccl" or (requested is None and fits):
        if not fits:
            raise WorkerError(
                f"backend='nccl' needs one GPU per process: this node runs {local_world_size} processes and sees "
                f"{gpus} GPU(s); run --nproc-per-node {gpus} or fewer (CUDA_VISIBLE_DEVICES decides which GPUs a "
                f"node sees), or leave the backend to pliant (gloo on the CPU)"
            )
        return DevicePlan("nccl", local_rank)
    if requested is None and gpus:
        return DevicePlan(
            "gloo",
            None,
            f"this node runs {local_world_size} processes on {gpus} GPU(s) and NCCL needs one GPU per process: "
            f"training on the CPU with gloo; run --nproc-per-node {gpus} to train on the GPUs",
        )
    return DevicePlan(requested or "gloo", None)


def backend_for(backend: str, under_agent: bool) -> str:
    """The default group's backend string: NCCL under an agent also gets gloo for CPU tensors (the protocol's)."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" and under_agent else backend


def prepare(backend: str, in_place_world: bool) -> None:
    """Before the first NCCL group of a worker whose world re-forms in place: keep torch's watchdog from tearing the
    process down on an NCCL error (the guard aborts the communicator instead). A value set by the user is left
    alone."""
    if backend == "nccl" and in_place_world:
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
        # On an error the watchdog would first dump debug info and wait a minute for the other ranks' dumps, holding
        # up the re-formation that long.
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")


def nccl_backend() -> object | None:
    """The default group's NCCL backend, or None (no group, or no NCCL in it)."""
    if not dist.is_initialized():
        return None
    try:
        backend = dist.group.WORLD._get_backend(torch.device("cuda"))  # type: ignore[union-attr]
    except RuntimeError:
        return None
    return backend if type(backend).__name__ == "ProcessGroupNCCL" else None


def nccl_error(backend: object) -> str:
    """The backend's error state as text ("" while healthy; torch without ``get_error`` reports none)."""
    get_error = getattr(backend, "get_error", None)
    if get_error is None:
        return ""
    error = get_error()
    return "" if str(error).endswith("SUCCESS") else str(error)


def has_nccl() -> bool:
    """The default group has an NCCL backend."""
    return nccl_backend() is not None


def abort_nccl() -> bool:
    """Abort the default group's NCCL communicator (local: frees it and releases its kernels). False if none."""
    backend = nccl_backend()
    if backend is None:
        return False
    with contextlib.suppress(RuntimeError):
        backend.abort()  # type: ignore[attr-defined]
    return True
