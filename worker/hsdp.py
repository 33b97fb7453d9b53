"""The HSDP engine: FSDP2 over a two-dimensional mesh, replicas of a sharded model, elastic along the replicas in place.

**Layout.** The world is cut into shard groups of ``S`` consecutive ranks (by default one node's ranks, which pliant's
generations number consecutively); FSDP2 shards each parameter's rows over a group (``torch.chunk`` of dim 0, as the
``"fsdp"`` engine does over the whole world) and the ``R = world / S`` groups hold the same shards: the mesh is
``(R, S)``, replicate x shard. Each rank's shard is decided by its place in its group alone (its *shard index*, rank
mod ``S``) and by ``S``, never by ``R``. Gradients are reduce-scattered within a group and all-reduced across the
groups; FSDP2 averages them over all ``R x S`` ranks, which the world-size loss weight undoes, so the update equals
the mean gradient over the global batch at any ``R`` (the same micro-batch plan as every engine: the global batch is
the user's).

**In place.** A move that keeps ``S`` keeps every surviving rank's shard (its index within its node does not change):

- :meth:`HSDPEngine.rewrap` takes this rank's shards off the old DTensors (parameters and optimizer state, copied),
  releases FSDP2 from the script's module (:func:`pliant.worker.fsdp_release.release`: the module stays the model) and
  shards it over the new world's mesh;
- :meth:`HSDPEngine.sync_state` finds, for each shard index, one rank of the new world that holds that shard at the
  newest update (:func:`shard_sources`), puts each current holder's own shard back, and sends each shard index's
  from its holder to the ranks that lack it (newcomers, or a survivor behind by a step), point to point: the rows of
  every parameter and its optimizer state, step counts included (a rank whose rows of a parameter are empty keeps no
  state for it, so the state differs between shard indices). A join thus moves one replica's shards per new
  replica; the other ranks move nothing but the module's buffers and the hyperparameters, broadcast from the lowest
  current holder.

A node's death leaves the other replicas whole, so the survivors step on from their own state
(:attr:`HSDPEngine.survives_peer_loss` while ``R >= 2``); with one replica left a death loses shards, and the restart
path applies. A shard index no rank of the new world holds (every replica lost, or a world whose groups cannot be
``S`` ranks) fails the move with :class:`HSDPMoveError`, and the restart path reshards the last checkpoint.

Checkpoints are DCP (the engine's :meth:`~pliant.worker.contract.Engine.state_dict` holds DTensors on the 2-D mesh),
loadable at any mesh shape and by any engine.

Threads: the script's thread owns every field.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule

from pliant.worker.contract import LOCAL, EngineError, Runner
from pliant.worker.engines import _materialize, broadcast_hyper, broadcast_tree
from pliant.worker.fsdp import FSDPEngine, _default_shard
from pliant.worker.fsdp_release import release
from pliant.worker.inplace.packing import pack, packed_size, unpack

__all__ = ["HSDPEngine", "HSDPMoveError", "shard_sources"]

logger = logging.getLogger(__name__)

_MESHES = itertools.count()  # the number in each mesh's dimension names: see FSDPEngine._build


class HSDPMoveError(EngineError):
    """The new world cannot take the HSDP engine's state shard for shard (the restart path applies)."""


def shard_sources(holds: list[bool], indices: list[int], updates: list[int], shard_size: int) -> tuple[list[int], int]:
    """Who sends each rank of the new world its shards. Pure.

    Args:
        holds: per rank of the new world, whether it kept shards from its previous world (of ``shard_size`` ranks
            per group).
        indices: per rank, the shard index of the shards it kept (meaningless where it holds none).
        updates: per rank, the optimizer updates its kept state has seen.
        shard_size: ranks per shard group, the same in the old and the new world.

    Returns:
        (per rank, the rank it takes its shards from: itself when its own kept shards are current and of its new
        index; the newest update count).

    Raises:
        HSDPMoveError: no rank holds a current copy of some shard index.
    """
    world = len(holds)
    newest = max((u for h, u in zip(holds, updates, strict=True) if h), default=-1)
    if newest < 0:
        raise HSDPMoveError("no rank of the new world holds HSDP shards; the restart path applies")
    holder: dict[int, int] = {}
    for rank in range(world):
        if holds[rank] and updates[rank] == newest:
            holder.setdefault(indices[rank], rank)
    sources = []
    for rank in range(world):
        index = rank % shard_size
        if index not in holder:
            raise HSDPMoveError(
                f"no rank of the new world holds shard {index} of {shard_size} at update {newest} (every replica "
                f"that held it is gone); the restart path applies"
            )
        current = holds[rank] and updates[rank] == newest and indices[rank] == index
        sources.append(rank if current else holder[index])
    return sources, newest


class _Kept(NamedTuple):
    """What a rank keeps of its state across a move: its shard index in the world it leaves, which parameters had
    optimizer state (:meth:`HSDPEngine._mask`) and its shard's tensors (as :meth:`HSDPEngine._shards` orders them)."""

    index: int
    mask: list[int]
    shards: list[torch.Tensor]


class HSDPEngine(FSDPEngine):
    """FSDP2 over a (replicas x shard group) mesh; see the module docstring.

    Args:
        model: the module (moved to ``device``, then sharded in place).
        optimizer_class, optimizer_kwargs: the optimizer, built over the sharded parameters.
        device: where the model lives.
        shard_group: ranks per shard group; the world size must be a multiple of it, in every world of the job.
        shard: returns the sub-modules to ``fully_shard`` before the root (default: its direct children).
        runner: what runs each step (:attr:`Engine.runner`; default: the plain local step).
        track: opens the mesh's process groups, noting their sockets (:meth:`pliant.worker.inplace.world.World.tracked`:
            a peer's failure severs them, so a collective blocked on a group of the mesh fails with the others);
            default: opens them.

    Raises:
        EngineError: ``shard_group`` is not a positive divisor of the world size.
    """

    sharded = False  # another replica holds each shard: no buddy copies
    partial_collectives = True  # a shard's gradient all-reduce joins its replicas only
    MEMORY_SHARE = 0.8  # a rank's shards are copied once while it moves: they must fit in this share of free memory

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
        device: torch.device,
        shard_group: int,
        shard: Callable[[torch.nn.Module], list[torch.nn.Module]] = _default_shard,
        runner: Runner = LOCAL,
        track: Callable[[Callable[[], DeviceMesh]], DeviceMesh] | None = None,
    ) -> None:
        if shard_group < 1:
            raise EngineError(f"shard_group={shard_group} must be a positive number of ranks (a node's, by default)")
        self.shard_size = shard_group
        self.index = 0  # this rank's shard index in the world its shards were cut in (set by _build)
        self.updates = 0  # optimizer updates this rank's state has seen (equal on every rank after a transfer)
        self.received_shard_bytes = 0  # bytes of shards this rank received in its last transfer (0: it kept its own)
        self._kept: _Kept | None = None  # between rewrap and sync_state
        self._track = track or (lambda make: make())
        super().__init__(model, optimizer_class, optimizer_kwargs, device, shard=shard, runner=runner)

    @property
    def replicas(self) -> int:
        """Shard groups in the current world (``R``)."""
        return self.world_size // self.shard_size

    @property
    def survives_peer_loss(self) -> bool:  # type: ignore[override]
        """Another replica holds every shard while there are two or more."""
        return self.replicas >= 2

    def _mesh(self) -> DeviceMesh:
        """The current world's (R, S) mesh, named anew for every world (as the ``"fsdp"`` engine's are), its groups
        opened through ``track``; notes this rank's shard index.

        Raises:
            HSDPMoveError: the world size is not a multiple of S.
        """
        world = dist.get_world_size()
        if world % self.shard_size:
            raise HSDPMoveError(
                f"a world of {world} ranks cannot be cut into shard groups of {self.shard_size}: every node of an "
                f"hsdp job needs the same --nproc-per-node (or pass shard_group= a divisor of every world size)"
            )
        self.index = dist.get_rank() % self.shard_size
        n = next(_MESHES)
        return self._track(
            lambda: init_device_mesh(
                self.device.type,
                (world // self.shard_size, self.shard_size),
                mesh_dim_names=(f"pliant-hsdp-replicate-{n}", f"pliant-hsdp-shard-{n}"),
            )
        )

    def apply_update(self) -> None:
        super().apply_update()
        self.updates += 1

    def can_move(self) -> bool:
        """A copy of this rank's shards must fit in free host memory (and FSDP2 must be releasable)."""
        import psutil

        if not self.movable:
            return False
        need = sum(t.numel() * t.element_size() for t in self._shards())
        return need <= self.MEMORY_SHARE * psutil.virtual_memory().available

    def before_move(self) -> None:
        """Nothing is gathered: each survivor keeps its own shards (:meth:`rewrap`)."""

    def _shards(self) -> list[torch.Tensor]:
        """This rank's part of the state, in a fixed order: for each parameter, its rows (a view of FSDP2's storage),
        then its optimizer state's tensors by key (the state's rows, and its step count, which differs between shard
        indices: a rank whose rows of a parameter are empty gets no gradient for it and keeps no state)."""
        out: list[torch.Tensor] = []
        for param in self.model.parameters():
            out.append(_local(param))
            state = self.optimizer.state.get(param, {})
            out += [_local(state[k]) for k in sorted(state) if isinstance(state[k], torch.Tensor)]
        return out

    def _reshard(self) -> None:
        """Register every module's sharded parameters again: a step a peer's death broke off mid-forward or
        mid-backward leaves FSDP2's gathered (full) parameters registered, while the shards themselves are intact (no
        update ran). Local."""
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def _mask(self) -> list[int]:
        """Per parameter, 1 when the optimizer holds state for it on this rank."""
        return [int(bool(self.optimizer.state.get(param))) for param in self.model.parameters()]

    def _take_mask(self, mask: list[int]) -> None:
        """Give this rank's fresh optimizer state exactly for the parameters ``mask`` names (a zero-learning-rate step
        makes it, then the others' is dropped), so its :meth:`_shards` line up with a holder's of that mask."""
        if any(mask) and not any(self.optimizer.state.values()):
            _materialize(self.optimizer)
        for param, has in zip(self.model.parameters(), mask, strict=True):
            if not has:
                self.optimizer.state.pop(param, None)

    def rewrap(self) -> None:
        """Keep a copy of this rank's shard (its rows and optimizer state), release FSDP2 from the script's module and
        shard it over the new world's mesh (the same objects); the state comes back, or from a peer, in
        :meth:`sync_state`."""
        if self._kept is None:  # not a second try at forming a world (the first's mesh holds nothing yet)
            self._reshard()
            self._kept = _Kept(self.index, self._mask(), [t.detach().clone() for t in self._shards()])
        release(self.model, self.device)
        self._build(self.model)
        self.rebind_scheduler()

    def sync_state(self, src: int) -> int:
        """Every rank's shard at the newest update: a current holder's kept one put back, the others' sent from a
        current holder of the same shard index, point to point (which parameters have optimizer state, then the
        tensors); buffers and hyperparameters from the lowest current holder. Returns the tensor bytes this rank sent
        or received."""
        world, rank = dist.get_world_size(), dist.get_rank()
        kept, self._kept = self._kept, None
        row = [int(kept is not None), kept.index if kept is not None else -1, self.updates, self.shard_size]
        table = [torch.empty(len(row), dtype=torch.int64) for _ in range(world)]
        dist.all_gather(table, torch.tensor(row, dtype=torch.int64))
        rows = [[int(x) for x in t.tolist()] for t in table]
        if any(r[3] != self.shard_size for r in rows):
            raise HSDPMoveError("ranks of the new world disagree on the shard group size; the restart path applies")
        sources, newest = shard_sources(
            [bool(r[0]) for r in rows], [r[1] for r in rows], [r[2] for r in rows], self.shard_size
        )
        sent = received = 0
        with torch.no_grad():
            if sources[rank] == rank:
                assert kept is not None
                self._take_mask(kept.mask)
                slots = self._shards()
                for slot, value in zip(slots, kept.shards, strict=True):
                    slot.copy_(value)
            else:
                mask = torch.empty(len(list(self.model.parameters())), dtype=torch.int64)
                dist.recv(mask, sources[rank])
                self._take_mask(mask.tolist())
                slots = self._shards()
                buffer = torch.empty(packed_size(slots), dtype=torch.uint8)
                dist.recv(buffer, sources[rank])
                unpack(buffer, slots)
                received = buffer.numel()
            outgoing = [dst for dst in range(world) if dst != rank and sources[dst] == rank]
            if outgoing:
                mask, buffer = torch.tensor(self._mask(), dtype=torch.int64), pack(slots)
                for dst in outgoing:
                    dist.send(mask, dst)
                    dist.send(buffer, dst)
                    sent += buffer.numel()
        first = min(r for r in range(world) if sources[r] == r)  # a current holder
        buffers = {name: b.data for name, b in self.model.named_buffers()}
        nbytes = broadcast_tree(buffers, first)
        broadcast_hyper(self.optimizer, first)
        self.updates = newest
        self.received_shard_bytes = received
        if received:
            logger.info(
                "hsdp: rank %d received shard %d of %d (%d bytes) from rank %d",
                rank,
                rank % self.shard_size,
                self.shard_size,
                received,
                sources[rank],
            )
        return sent + received + nbytes


def _local(value: Any) -> torch.Tensor:
    """A DTensor's local shard (this rank's rows; a view of FSDP2's storage), else the tensor itself."""
    with torch.no_grad():
        return value.to_local() if hasattr(value, "to_local") else value
