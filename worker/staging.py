"""How an async checkpoint's state gets to host memory and to disk without holding up the training.

Two routes, both ending in DCP's files (any world size loads them):

- **DCP's stager** (:func:`stager`): DCP's ``DefaultStager`` with async staging, kept from save to save so its host
  copies (cached by source storage; on CUDA pinned) are reused: each save copies into memory it already touched.
- **The buddy snapshot** (:func:`from_snapshot`): a sharded engine under the in-place protocol already copies its
  shard to host memory every K steps (:mod:`pliant.worker.inplace.buddy`). A save of a step that has such a copy (the
  protocol takes one for it if the cadence did not, half an interval or more after the last) writes from that copy: no
  second copy of the state, no second host buffer. ZeRO's state is plain tensors, which the copy's tensors replace.
  FSDP2's is DTensors: they stay in the state, for DCP to plan their layout from (global shape, this rank's rows), and
  :class:`SnapshotPlanner` hands DCP's writer the copy of their local shards instead of the live ones. No DTensor is
  built on the host, so a CUDA mesh's state is written from host memory as a CPU one's.

Either way each rank copies and writes only its share of the state that every rank holds alike
(:func:`split_replicas`, by the engine's :attr:`~pliant.worker.contract.Engine.replicated` sections and
:meth:`~pliant.worker.contract.Engine.saved_by`; DCP's own deduplication would choose the writer only after every
rank copied everything), and the write runs on idle CPU time and around the page cache (:class:`BackgroundWriter`).
"""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.stateful import Stateful

from pliant.worker.background import in_background
from pliant.worker.directio import DirectWriter
from pliant.worker.inplace.buddy import BACKGROUND_NICE

__all__ = [
    "BackgroundWriter",
    "SnapshotPlanner",
    "from_snapshot",
    "idle_priority",
    "resolve",
    "split_replicas",
    "stager",
    "write_in_background",
]

Path = tuple[str, ...]
Lookup = Callable[[torch.Tensor], torch.Tensor | None]


class BackgroundWriter(DirectWriter):
    """DCP's file writer around the page cache (:class:`pliant.worker.directio.DirectWriter`) whose thread (an async
    save's) writes only on CPU time the training leaves idle (:func:`idle_priority`)."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        idle_priority()
        return super().write_data(plan, planner)


def idle_priority() -> None:
    """Run the calling thread only on CPU time the host's other threads leave idle: Linux's ``SCHED_IDLE``, which
    any thread may take for itself. Any normal thread that wakes (a training thread, from a collective's wait) takes
    the core from it; a thread at nice 10 keeps about a tenth of a busy core, and a waking thread need not preempt it.
    Where the policy is refused (not Linux), nice :data:`pliant.worker.inplace.buddy.BACKGROUND_NICE`.

    Nothing that waits for the write starves: the waiter blocks and leaves its core idle. The buddy copies' sends keep
    nice 10: lowered this way, they made the cadence (:mod:`pliant.worker.inplace.cadence`) take a snapshot every 6-7
    steps in two of three benchmark runs, at a 12 % throughput cost (docs/architecture.md)."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, tid, BACKGROUND_NICE)


def stager(cuda: bool) -> Any:
    """DCP's stager for async saves (copies in the background; on CUDA pinned, by non-blocking copies)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=cuda
        )
    )


# -- who saves what (pure) -------------------------------------------------------------------------------------------


def split_replicas(
    state: dict[str, Any], sections: Sequence[str], rank: int, world: int, saved_by: Mapping[Path, int] | None = None
) -> dict[str, Any]:
    """``state`` with only rank ``rank``'s share of the tensors under ``sections``, which every rank holds alike.
    A tensor whose path (its keys from the top of ``state``) is in ``saved_by`` goes to that rank; the others are
    dealt largest first, each to the rank with the fewest bytes so far (ties: the lower rank). Every rank computes
    the same split, and each tensor is saved by one rank. Other tensors (DTensors included) and non-tensor values
    stay (DCP drops duplicate non-tensor values itself). Pure: no collective."""
    saved_by = saved_by or {}
    leaves = [
        (path, t.numel() * t.element_size())
        for name in sections
        if name in state
        for path, t in _plain_tensors(state[name], (name,))
    ]
    loads, owner = [0] * world, {}
    for path, nbytes in leaves:
        if 0 <= saved_by.get(path, -1) < world:
            owner[path] = saved_by[path]
            loads[owner[path]] += nbytes
    for path, nbytes in sorted((x for x in leaves if x[0] not in owner), key=lambda x: (-x[1], x[0])):
        chosen = min(range(world), key=lambda r: (loads[r], r))
        owner[path] = chosen
        loads[chosen] += nbytes
    return _keep(state, (), lambda path: owner.get(path, rank) == rank)


def _plain_tensors(tree: Any, path: Path) -> list[tuple[Path, torch.Tensor]]:
    """(path, tensor) of the tensors that are values of ``tree``'s nested dicts, DTensors excepted."""
    out = []
    for key, value in tree.items() if isinstance(tree, dict) else ():
        if isinstance(value, dict):
            out += _plain_tensors(value, (*path, str(key)))
        elif isinstance(value, torch.Tensor) and not hasattr(value, "to_local"):
            out.append(((*path, str(key)), value))
    return out


def _keep(tree: Any, path: Path, keep: Callable[[Path], bool]) -> Any:
    """``tree``'s nested dicts without the tensors whose path ``keep`` refuses."""
    if not isinstance(tree, dict):
        return tree
    return {
        k: _keep(v, (*path, str(k)), keep)
        for k, v in tree.items()
        if not isinstance(v, torch.Tensor) or keep((*path, str(k)))
    }


# -- the buddy snapshot's route ---------------------------------------------------------------------------------------


def resolve(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with its Stateful values replaced by their state dicts (as DCP would ask for them at save time)."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}


def from_snapshot(state: dict[str, Any], lookup: Lookup) -> tuple[dict[str, Any], dict[int, torch.Tensor]]:
    """``state`` (:func:`resolve`-d) as a snapshot (``lookup``) has it, and the host copies of its DTensors' local
    shards by the DTensor's id (for :class:`SnapshotPlanner`; empty without DTensors). A plain tensor is replaced by
    its copy in the snapshot; a DTensor stays (its layout), and its shard's copy is the snapshot's. The rest is
    copied at once: the tensors the snapshot lacks (the module buffers, cloned before the snapshot's copy; anything
    else) and every non-tensor value (deep-copied), so nothing the training changes afterwards reaches the file."""
    found, shards = {}, {}
    for tensor in _tensors(state):
        if hasattr(tensor, "to_local"):  # a DTensor
            local = tensor.to_local()
            view = lookup(local)
            shards[id(tensor)] = view if view is not None else local.detach().to("cpu", copy=True)
            found[id(tensor)] = tensor
        elif (view := lookup(tensor)) is not None:
            found[id(tensor)] = view
    return _rebuild(state, found), shards


class SnapshotPlanner(DefaultSavePlanner):
    """DCP's save planner, with the bytes of given DTensors' local shards taken from host copies (``shards``: by the
    id of the DTensor in the saved state; :func:`from_snapshot`). DCP plans from the DTensors themselves (their
    global shape and this rank's rows, which the training does not change) and writes the copies."""

    def __init__(self, shards: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.shards = shards

    def lookup_object(self, index: MetadataIndex) -> Any:
        shard = self.shards.get(id(self.state_dict.get(index.fqn)))
        return shard if shard is not None else super().lookup_object(index)


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, list):
        return [t for v in tree for t in _tensors(v)]
    return [tree] if isinstance(tree, torch.Tensor) else []


def _rebuild(tree: Any, found: dict[int, torch.Tensor]) -> Any:
    if isinstance(tree, dict):
        return {k: _rebuild(v, found) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_rebuild(v, found) for v in tree]
    if isinstance(tree, torch.Tensor):
        return found[id(tree)] if id(tree) in found else tree.detach().to("cpu", copy=True)
    return copy.deepcopy(tree)


def write_in_background(
    state: dict[str, Any],
    path: str,
    group: dist.ProcessGroup,
    ready: Callable[[], None],
    shards: dict[int, torch.Tensor] | None = None,
    direct: bool = True,
) -> Future[Any]:
    """``dcp.save`` of ``state`` (host tensors; DTensors whose shards' copies are ``shards``, see
    :func:`from_snapshot`) on a thread of its own, its files written on idle CPU time, once ``ready()`` returned (the
    snapshot's copy is complete); ``direct``: around the page cache (:class:`BackgroundWriter`). Returns the write's
    future."""
    planner = SnapshotPlanner(shards) if shards else None

    def write() -> Any:
        ready()
        return dcp.save(state, storage_writer=BackgroundWriter(path, direct), planner=planner, process_group=group)

    return in_background(write, "pliant-checkpoint-write")
