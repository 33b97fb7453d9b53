"""In-memory redundancy for sharded state: each rank keeps host copies of its own shard and of a buddy's.

A sharded engine (ZeRO) holds state that only one rank has: its shard of the optimizer state (and, for the rollback
below, its shard of the parameters). Every K committed steps (``pliant run --snapshot-every``; by default K comes
from the snapshots' measured cost, :mod:`pliant.worker.inplace.cadence`), once after the first step and once right after
each (re-)formation of the world, every rank:

1. copies its shard (the parameters it owns, their optimizer state, and on rank 0 the module's buffers) into a host
   buffer it reuses (on CUDA a pinned one, by non-blocking copies; on CPU a memcpy on a thread), with the step, its
   loaders' positions and its RNG state. The copy runs while the next step computes, and that step waits for it only
   before its optimizer step (:meth:`BuddyCopies.settle`), the first moment the state changes;
2. sends that buffer to its *buddy* (:func:`buddies`: the next rank on another node) as soon as it is copied, and
   receives its wards' buffers, on a process group of its own, in the background: the training collectives never
   queue behind a snapshot, and the sends are waited for only at the next snapshot.

The module buffers in a shard are cloned at once (the next forward may write them). An async checkpoint of a step
with a snapshot writes from that snapshot's own copy (:meth:`BuddyCopies.staged`, :mod:`pliant.worker.staging`),
which is then not overwritten until the write is done.

Two generations of copies are kept (the newest may still be in flight when a peer dies). When a peer dies, the
survivors roll back together to the newest snapshot step at which every old rank's shard is held by a survivor,
its owner's own copy or a buddy's (:func:`choose_rollback`, pure); each shard is broadcast from its holder, every
rank rebuilds the whole state from them, the new world is cut from it, and the steps since that snapshot run again
on the same global batches (at most K, plus the steps of an exchange still in flight). The buffers are files in the
node's memory (:mod:`pliant.worker.inplace.kept`), so a dead rank's copies outlive it: the fresh worker that replaces it
on the same node offers them too (:meth:`BuddyCopies.adopt`). When a shard and every copy of it are gone (its rank's
node died with its buddy, or a rank and its buddy died where nothing was kept), re-forming fails and the restart path
takes over, from the last disk checkpoint.

The cost: host memory of two copies of the own shard and of each ward's, a memcpy of the own shard every K steps,
and the background sends, which on a machine whose collectives are CPU-bound (gloo) compete with the step's own
traffic: the automatic K keeps it within a budget, and ``bench/inplace.py`` measures it. Only tensors cross ranks.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pliant.worker.background import in_background
from pliant.worker.contract import Engine, Staged, WorkerError
from pliant.worker.inplace.kept import KeptSlot, KeptSlots, SlotHeader
from pliant.worker.inplace.packing import pack_later, packed_size, spans

__all__ = [
    "BACKGROUND_NICE",
    "BuddyCopies",
    "Held",
    "Rollback",
    "RollbackError",
    "buddies",
    "choose_rollback",
    "decode",
    "encode",
]

logger = logging.getLogger(__name__)

RECEIVE_WAIT_S = 1.0  # at a failure, how long a ward's copy still in flight may take to arrive
BACKGROUND_NICE = 10  # the threads that send the copies (gloo's, for their group) yield the CPU to the training's


class RollbackError(WorkerError):
    """No snapshot step covers every shard (a shard and its buddy died together): the restart path applies."""


# -- pure decisions --------------------------------------------------------------------------------------------------


def buddies(nodes: Sequence[int]) -> list[int]:
    """Rank -> the rank that keeps its copy: ranks on other nodes are dealt round-robin (the ``i``-th rank of a node
    gets the ``i``-th rank, cyclically, of the ranks on other nodes); with one node, the next rank.

    Args:
        nodes: each rank's node (by rank).
    """
    world = len(nodes)
    out = []
    for rank, node in enumerate(nodes):
        others = [r for r in range(world) if nodes[r] != node]
        if not others:
            out.append((rank + 1) % world)
            continue
        index = sum(1 for r in range(rank) if nodes[r] == node)
        start = next((i for i, r in enumerate(others) if r > rank), 0)  # begin after this rank, cyclically
        out.append(others[(start + index) % len(others)])
    return out


@dataclass(frozen=True)
class Held:
    """What one rank of the new world holds from the old one.

    Attributes:
        old_rank: its rank in the old world (-1: a newcomer, holding nothing).
        own: the steps of its complete own copies.
        wards: old rank -> the steps of its complete copies of that rank's shard.
        generation: the world its copies were taken in (-1: none).
        kept: the copies are a dead predecessor's, read back from node-local memory (:mod:`pliant.worker.inplace.kept`);
            they count only when they are of the survivors' world.
    """

    old_rank: int
    own: tuple[int, ...] = ()
    wards: dict[int, tuple[int, ...]] = field(default_factory=dict)
    generation: int = -1
    kept: bool = False


@dataclass(frozen=True)
class Rollback:
    """The survivors' plan: every shard's state at ``step``, sent by ``holders[old rank]`` (a rank of the new world)."""

    step: int
    holders: dict[int, int]


def choose_rollback(held: Sequence[Held], old_world: int) -> Rollback:
    """The newest step at which every old rank's shard is held by some rank of the new world (its owner's own copy
    first, else a buddy's). Copies a dead rank left behind (``kept``) count only when they are of the world whose
    survivors hold copies in memory (the newest such world).

    Raises:
        RollbackError: no step covers every shard.
    """
    live = [h.generation for h in held if h.old_rank >= 0 and not h.kept]
    held = [h if not h.kept or (live and h.generation == max(live)) else Held(-1) for h in held]
    steps = sorted({s for h in held for s in (*h.own, *(s for ss in h.wards.values() for s in ss))}, reverse=True)
    for step in steps:
        holders: dict[int, int] = {}
        for old in range(old_world):
            owner = [i for i, h in enumerate(held) if h.old_rank == old and step in h.own]
            buddy = [i for i, h in enumerate(held) if step in h.wards.get(old, ())]
            if owner or buddy:
                holders[old] = (owner or buddy)[0]
        if len(holders) == old_world:
            return Rollback(step, holders)
    lost = sorted(set(range(old_world)) - {h.old_rank for h in held})
    raise RollbackError(
        f"no snapshot step covers every shard of the old world of {old_world}: ranks {lost} are "
        f"gone, and no survivor holds a complete copy of their shards at a step the others also "
        f"hold; the restart path applies"
    )


def _on_lowered_thread(make: Callable[[], Any]) -> Any:
    """``make()`` on a thread at :data:`BACKGROUND_NICE`, waited for: a gloo group made there runs its threads at
    that priority (they inherit it), so on a host whose cores the training keeps busy (gloo on CPU) the sends and
    receives of the copies take its idle time instead of slowing its steps. (The copy itself keeps the normal
    priority: the next optimizer step waits for it.)"""

    def lowered() -> Any:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
        return make()

    return in_background(lowered, "pliant-buddy-group").result()


# -- the copies ------------------------------------------------------------------------------------------------------


class _Arrival:
    """Waits for a slot's receives, once, in the background (:func:`~pliant.worker.background.in_background`): a gloo
    receive's ``wait`` consumes its completion, so a second ``wait`` of the same receive never returns. Everything
    that waits for them waits here.

    Args:
        receives: the wards' receives.
        then: called once every one arrived: on the arrival's thread, or at once on this one when they all had
            already.

    Threads: the arrival's thread completes the future; any thread waits for it.
    """

    def __init__(self, receives: Sequence[dist.Work], then: Callable[[], object]) -> None:
        def arrive() -> None:
            for work in receives:
                work.wait()  # raises when a peer failed

        self._task = in_background(arrive, "pliant-snapshot-arrivals")
        self._task.add_done_callback(lambda task: then() if task.exception() is None else None)

    @property
    def failed(self) -> BaseException | None:
        """What failed a receive (a peer went away), once the arrival ended; None: none failed, or not ended yet."""
        return self._task.exception() if self._task.done() else None

    def wait(self, timeout_s: float | None = None) -> bool:
        """True once every receive arrived; False when one failed or ``timeout_s`` ran out first."""
        done, _ = wait_all([self._task], timeout_s)
        return bool(done) and self._task.exception() is None


@dataclass
class _Slot:
    """One generation of copies: this rank's shard and its wards' at ``step``."""

    step: int = -1
    positions: list[tuple[int, int, int]] = field(default_factory=list)
    rng: torch.Tensor | None = None
    hyper: list[dict[str, object]] = field(default_factory=list)
    scheduler: dict[str, object] | None = None  # the learning-rate scheduler's state at ``step``, if any
    own: torch.Tensor | None = None
    wards: dict[int, torch.Tensor] = field(default_factory=dict)
    sends: list[dist.Work] = field(default_factory=list)
    receives: list[dist.Work] = field(default_factory=list)
    received: bool = False
    arrival: _Arrival | None = None  # waits for ``receives`` (the only thing that may)
    take: int = 0  # counts the takes into this slot
    arrived: int = -1  # the take whose wards' copies all arrived (recorded beside the kept files)
    send_failed: BaseException | None = None  # starting the send to the buddy failed (a peer went away)
    index: dict[tuple[object, ...], int] = field(default_factory=dict)  # a shard tensor -> its offset in ``own``
    copy_wait: Callable[[], None] | None = None  # waits for the copy into ``own`` (any thread, any number of times)
    readers: list[Future[Any]] = field(default_factory=list)  # checkpoint writes from ``own``, not to be overwritten

    def ward_complete(self) -> bool:
        """Every ward's copy arrived (a failed receive counts as not). gloo reports a receive done only to
        ``wait``: one in flight from a live peer gets :data:`RECEIVE_WAIT_S` to finish (one from a dead peer fails
        at once)."""
        if not self.received:
            if self.arrival is not None and not self.arrival.wait(RECEIVE_WAIT_S):
                return False
            self.received = True
        return self.received


class BuddyCopies:
    """This rank's snapshots and its wards' (see the module docstring). Made by the rescale protocol.

    Args:
        track_fds: called around the creation of the copies' process group, to note the sockets it opens
            (``World.tracked``: into ``World.group_fds``, which a failure severs).
        metrics: the worker's metrics (the snapshots' stall and bytes), if any.
        kept_dir: where this rank's buffers live as files that outlive the process
            (:mod:`pliant.worker.inplace.kept`; its local rank's folder of the agent's snapshot directory); "" keeps
            them in process memory only.

    Threads: the training thread owns every field and makes every exchange. Two kinds of background task write to
    a slot: a snapshot's copy (which starts the send to the buddy, sets the slot's ``sends``, ``send_failed`` and,
    while the take is still current, its ``step``) and a slot's arrival (which sets its ``arrived``). ``_lock`` (an
    RLock) guards each slot's ``step``, ``take`` and ``arrived`` and every call into :attr:`kept` (a
    :class:`~pliant.worker.inplace.kept.KeptSlots`, which has no lock of its own), so a header written from a
    background task never describes a slot the training thread is taking again. The training thread reads what the
    copy's task wrote only after waiting for that task (:meth:`finish`, :meth:`settle`).
    """

    def __init__(
        self, track_fds: Callable[[Callable[[], object]], object], metrics: Any = None, kept_dir: str = ""
    ) -> None:
        self._track = track_fds
        self._metrics = metrics
        self.kept = KeptSlots(kept_dir)
        self._lock = threading.RLock()  # the kept headers: written by the training, copy and arrival threads
        self._adopted: dict[int, KeptSlot] = {}  # a fresh worker's: its dead predecessor's copies, by step
        self._launched_s = 0.0  # the training thread's time in snapshot() for the copy not yet settled
        self.generation = -1
        self.world = 0
        self.rank = -1
        self.group: dist.ProcessGroup | None = None
        self.buddy = -1
        self.wards: list[int] = []
        self.sizes: list[int] = []
        self.partition: list[int] = []
        self.slots = [_Slot(), _Slot()]
        self.newest = 1
        self.retired: list[object] = []  # exchanges a failure interrupted: never waited for, never freed
        self._copying: tuple[_Slot, int, Callable[[], None]] | None = None  # take()'s copy, until finish()
        self.fresh = False  # the last snapshot allocated a buffer (the first two of a world do)

    def reset(self) -> None:
        """Forget every copy (the world changed: its shards are cut differently)."""
        self.finish(check=False)
        for slot in self.slots:
            if slot.sends or slot.receives:
                self.retired.append(slot)  # an exchange may be in flight: its buffers must outlive it
        self.slots, self.newest, self.generation = [_Slot(), _Slot()], 1, -1

    @property
    def taken(self) -> bool:
        return self.generation >= 0

    def snapshot(
        self, engine: Engine, generation: int, node: int, step: int, positions: list[tuple[int, int, int]]
    ) -> None:
        """Snapshot ``engine``'s shard at the committed ``step`` (see :meth:`take`); :meth:`settle` before anything
        writes the state again."""
        started = time.perf_counter()
        partition, tensors = engine.shard()
        buffers = {b.data_ptr() for b in engine.module.buffers() if b.numel()}  # the next forward may write them:
        tensors = [t.clone() if t.numel() and t.data_ptr() in buffers else t for t in tensors]  # copied at once
        hyper = [{k: v for k, v in group.items() if k != "params"} for group in engine.optimizer.param_groups]
        nbytes = self.take(
            generation,
            node,
            step,
            partition,
            tensors,
            positions,
            hyper,
            engine.scheduler and engine.scheduler.state_dict(),
        )
        self._launched_s = time.perf_counter() - started
        if self._metrics is not None:
            self._metrics.snapshot_bytes.inc(nbytes)

    def settle(self) -> None:
        """Wait for the last :meth:`snapshot`'s copy, if it is still running (raises if its send to the buddy could
        not start: a peer failed), and report how long the snapshot held the training thread in all."""
        if self._copying is None:
            return
        started = time.perf_counter()
        self.finish()
        if self._metrics is not None:
            self._metrics.snapshot_seconds.observe(self._launched_s + time.perf_counter() - started)

    def take(
        self,
        generation: int,
        node: int,
        step: int,
        partition: list[int],
        tensors: Sequence[torch.Tensor],
        positions: list[tuple[int, int, int]],
        hyper: list[dict[str, object]],
        scheduler: dict[str, object] | None = None,
    ) -> int:
        """Snapshot this rank's shard at ``step`` (committed) and start the exchange with the buddies (collective on
        the first snapshot of a world; raises when a peer failed during the previous exchange). The copy and the send
        run in the background until :meth:`finish`, which must come before anything writes ``tensors``. Returns the
        bytes copied."""
        self.finish()
        if generation != self.generation:
            self._meet(generation, node, packed_size(tensors))
        previous = self.slots[self.newest]
        for work in previous.sends:
            work.wait()  # sent a while ago; a failed peer raises here
        if previous.arrival is not None and not previous.arrival.wait():
            raise previous.arrival.failed or RuntimeError("a ward's copy did not arrive")
        previous.sends, previous.receives, previous.arrival = [], [], None
        recorded, previous.received, previous.arrived = previous.arrived == previous.take, True, previous.take
        if not recorded:  # its wards' copies are whole (their arrival's thread records them, as a rule)
            self._record(previous)
        slot = self.slots[1 - self.newest]
        wait_all(slot.readers)  # a checkpoint still writing from this copy (written long ago, as a rule)
        slot.readers = []
        with self._lock:
            slot.step, slot.take = -1, slot.take + 1  # until its new copy is whole
            self.kept.record(1 - self.newest, None)  # its files are about to change
        slot.positions, slot.rng, slot.hyper = positions, torch.get_rng_state(), hyper
        slot.scheduler = copy.deepcopy(scheduler)
        self.partition = partition
        self.fresh = slot.own is None or slot.own.numel() != packed_size(tensors)  # its first touch costs more
        if self.fresh and not any(t.is_cuda for t in tensors):  # (on CUDA, pack_later pins one: not kept)
            self.kept.release(slot.own)
            slot.own = self.kept.buffer(packed_size(tensors))
        for ward, size in ((w, self.sizes[w]) for w in self.wards):
            if slot.wards.get(ward) is None or slot.wards[ward].numel() != size:
                self.kept.release(slot.wards.get(ward))
                slot.wards[ward] = self.kept.buffer(size)
                self.fresh = True
        slot.received, slot.sends, slot.send_failed = False, [], None
        slot.receives = [dist.irecv(slot.wards[w], w, group=self.group) for w in self.wards]
        slot.arrival = _Arrival(slot.receives, self._arrived(slot)) if slot.receives else None

        take = slot.take

        def send(own: torch.Tensor) -> None:  # on the copy's thread, once the copy is done
            try:
                slot.sends = [dist.isend(own, self.buddy, group=self.group)] if self.buddy != self.rank else []
            except RuntimeError as exc:
                slot.send_failed = exc
            with self._lock:
                if slot.take == take:
                    slot.step = step  # whole: its header is written here, off the training thread
            self._record(slot)

        slot.own, wait = pack_later(tensors, slot.own, send)
        slot.index = {_key(t): offset for t, (offset, _n) in zip(tensors, spans(tensors), strict=True)}
        slot.copy_wait = wait
        self._copying = (slot, step, wait)
        self.newest = 1 - self.newest
        return slot.own.numel()

    def finish(self, check: bool = True) -> None:
        """Wait for the copy :meth:`take` started (its send to the buddy is then under way). ``check``: raise if
        that send could not start (a peer failed); False on the failure paths, where the copy still counts as this
        rank's own."""
        if self._copying is None:
            return
        slot, step, wait = self._copying
        self._copying = None
        wait()
        slot.step = step
        if check and slot.send_failed is not None:
            raise slot.send_failed

    def _arrived(self, slot: _Slot) -> Callable[[], None]:
        """What runs once ``slot``'s wards' copies arrived: they are recorded beside its kept files at once (the
        training waits for them only at the next snapshot), so a successor can offer the newest exchange too."""
        take = slot.take

        def record() -> None:
            with self._lock:
                if slot.take == take:  # not taken again since
                    slot.arrived = take
            self._record(slot)

        return record

    def _record(self, slot: _Slot) -> None:
        """Write ``slot``'s header beside its kept files: its own copy once whole, its wards' once they arrived."""
        with self._lock:
            index = next((i for i, s in enumerate(self.slots) if s is slot), None)
            if slot.step < 0 or index is None or not self.kept.enabled:
                return
            whole = slot.arrived == slot.take
            wards = {w: named for w in self.wards if whole and (named := self.kept.name(slot.wards.get(w)))}
            self.kept.record(
                index,
                SlotHeader(
                    self.generation,
                    self.world,
                    self.rank,
                    slot.step,
                    tuple(self.partition),
                    self.kept.name(slot.own),
                    wards,
                ),
            )

    def staged(self, step: int) -> Staged | None:
        """This rank's own copy of ``step`` (being made or whole) as a checkpoint's source
        (:func:`pliant.worker.staging.from_snapshot`), or None when there is none."""
        if self._copying is not None and self._copying[1] == step:
            slot: _Slot | None = self._copying[0]
        else:
            slot = next((s for s in self.slots if s.step == step), None)
        if slot is None or slot.own is None or slot.copy_wait is None:
            return None
        host, index = slot.own.numpy(), slot.index  # the array keeps the buffer alive

        def lookup(tensor: torch.Tensor) -> torch.Tensor | None:
            offset = index.get(_key(tensor))
            if offset is None:
                return None
            # A tensor whose storage is its own bytes of the buffer (shared): DCP's writer copies a tensor whose
            # storage is larger than it (torch.save would write all of it), which a view of the buffer would be.
            mine = torch.from_numpy(host[offset : offset + tensor.numel() * tensor.element_size()])
            return mine.view(tensor.dtype).view(tensor.shape)

        return Staged(lookup, slot.copy_wait, slot.readers.append)

    def _meet(self, generation: int, node: int, size: int) -> None:
        """The first snapshot of a world: open the copies' group and learn every rank's node and shard size."""
        with self._lock:  # no arrival watcher of the old world records a header in between
            self.reset()
            self.kept.sweep()  # a predecessor's files (read by a roll back before this) and this rank's older ones
            self._adopted = {}
            self.generation, self.rank, self.world = generation, dist.get_rank(), dist.get_world_size()
        self.group = self._track(lambda: _on_lowered_thread(lambda: dist.new_group(backend="gloo")))  # type: ignore[assignment]
        mine = torch.tensor([node, size], dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(rows, mine, group=self.group)
        nodes, self.sizes = [int(r[0]) for r in rows], [int(r[1]) for r in rows]
        plan = buddies(nodes)
        self.buddy = plan[self.rank]
        self.wards = [r for r in range(self.world) if plan[r] == self.rank and r != self.rank]
        logger.info(
            "buddy copies: rank %d keeps its shard (%d bytes) on rank %d and holds ranks %s",
            self.rank,
            size,
            self.buddy,
            self.wards,
        )

    def held(self) -> Held:
        """What this rank holds (for :func:`choose_rollback`)."""
        self.finish(check=False)
        if not self.taken:
            return Held(-1)
        own = tuple(s.step for s in self.slots if s.step >= 0)
        complete = [s for s in self.slots if s.step >= 0 and s.ward_complete()]
        return Held(self.rank, own, {w: tuple(s.step for s in complete) for w in self.wards}, self.generation)

    def adopt(self) -> Held:
        """What a fresh worker holds from the dead worker it replaces: the copies that one kept in node-local memory
        (:mod:`pliant.worker.inplace.kept`), if any. Its buffers then serve :meth:`buffer` until this rank's own first
        snapshot."""
        slots = [s for s in self.kept.load() if s.header.step >= 0]
        if not slots:
            return Held(-1)
        self._adopted = {s.header.step: s for s in slots}
        first = slots[0].header
        self.partition = list(first.partition)
        wards: dict[int, tuple[int, ...]] = {}
        for s in slots:
            for old in s.wards:
                wards[old] = (*wards.get(old, ()), s.header.step)
        own = tuple(s.header.step for s in slots if s.own is not None)
        logger.info(
            "rank %d holds the copies its predecessor (rank %d of generation %d) kept: its own of steps %s, "
            "its wards' %s",
            dist.get_rank(),
            first.rank,
            first.generation,
            list(own),
            wards,
        )
        return Held(first.rank, own, wards, first.generation, kept=True)

    def slot(self, step: int) -> _Slot:
        """This rank's copies of ``step``.

        Raises:
            RollbackError: it has none.
        """
        self.finish(check=False)
        for slot in self.slots:
            if slot.step == step:
                return slot
        raise RollbackError(f"rank {self.rank} holds no copy of step {step}")

    def buffer(self, old: int, step: int) -> torch.Tensor:
        """This rank's copy of old rank ``old``'s shard at ``step`` (its own, or a ward's; a fresh worker's: its
        predecessor's, :meth:`adopt`)."""
        if not self.taken and step in self._adopted:
            kept = self._adopted[step]
            out = kept.own if old == kept.header.rank else kept.wards.get(old)
            if out is None:
                raise RollbackError(f"rank {dist.get_rank()} kept no copy of old rank {old}'s shard at step {step}")
            return out
        slot = self.slot(step)
        buf = slot.own if old == self.rank else slot.wards[old]
        assert buf is not None
        return buf


def _key(tensor: torch.Tensor) -> tuple[object, ...]:
    """What identifies a tensor of the live state: its memory, type and layout."""
    return (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.device)


def encode(held: Held, old_world: int) -> torch.Tensor:
    """``held`` as one int64 row: generation, kept (0/1), old rank, 2 own steps, then 2 steps per old rank as a ward
    (-1: none)."""
    row = [held.generation, int(held.kept), held.old_rank, *_two(held.own)]
    for old in range(old_world):
        row += _two(held.wards.get(old, ()))
    return torch.tensor(row, dtype=torch.int64)


def decode(row: torch.Tensor, old_world: int) -> Held:
    values = [int(v) for v in row]
    wards = {old: _steps(values[5 + 2 * old : 7 + 2 * old]) for old in range(old_world)}
    return Held(values[2], _steps(values[3:5]), {k: v for k, v in wards.items() if v}, values[0], bool(values[1]))


def _two(steps: Sequence[int]) -> list[int]:
    return [*sorted(steps, reverse=True)[:2], -1, -1][:2]


def _steps(values: Sequence[int]) -> tuple[int, ...]:
    return tuple(v for v in values if v >= 0)
