"""The state transfer of an in-place re-formation: every rank of a new world ends with the same training state.

Run by every rank of the new world together, after each engine was wrapped again for it
(:class:`~pliant.worker.inplace.protocol.Protocol`):

1. **Who holds state** (:func:`exchange`): one all-reduce; a newcomer (a fresh process) holds none.
2. **Roll back** (:func:`roll_back`), when a survivor of a sharded engine's failure asks for it: the old world's
   shards are gone with the dead rank, so every rank takes the sharded engine's state at the newest buddy snapshot
   step that every old shard's holder has (:func:`pliant.worker.inplace.buddy.choose_rollback`); survivors also take
   that step's loader positions, learning rates and RNG state.
3. **The newest committed step** (:func:`transfer`): the ranks agree on it (all-reduce of the steps done); the lowest
   rank that has it is the source, which broadcasts each loader's position, each engine's model and optimizer state
   (:meth:`~pliant.worker.contract.Engine.sync_state`), its scheduler's state and its RNG state. Only tensors cross
   ranks. Survivors keep their own RNG streams; a newcomer continues the source's.

Anything that fails raises; the protocol turns it into a :class:`~pliant.worker.inplace.protocol.RescaleError`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pliant.worker.contract import Engine, WorkerError
from pliant.worker.engines import sync_scheduler
from pliant.worker.inplace.buddy import BuddyCopies, choose_rollback, decode, encode

if TYPE_CHECKING:
    from pliant.worker.data import ElasticLoader

__all__ = ["TransferError", "Transferred", "exchange", "roll_back", "transfer"]

logger = logging.getLogger(__name__)


class TransferError(WorkerError):
    """The new world cannot take its state in place (no rank holds any, or no snapshot covers every shard)."""


@dataclass(frozen=True)
class Transferred:
    """What a transfer left on this rank.

    Attributes:
        step: the newest committed step, now every rank's.
        positions: each of the source's loaders' (epoch, cursor, step) at that step, in the order the script made
            them (a loader this rank makes later takes its own from here).
        nbytes: tensor bytes this rank sent or received.
        behind: this rank held an older step (its own step was committed by peers).
        ahead: some other rank was behind this one (this rank's next step is skipped once, so every rank's loop
            stays in step with the others' collectives).
    """

    step: int
    positions: list[tuple[int, int, int]]
    nbytes: int
    behind: bool
    ahead: bool


def exchange(holds_state: bool, device: torch.device) -> bool:
    """Every rank of the new world says whether it holds training state (collective). True if any does."""
    flag = torch.tensor([int(holds_state)], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def transfer(
    holds_state: bool,
    steps_done: int,
    engines: Sequence[Engine],
    loaders: Sequence[ElasticLoader],
    copies: BuddyCopies,
    sharded: Engine | None,
    rolling_back: bool,
) -> Transferred:
    """Agree on the newest committed step and send the state of the lowest rank that has it to every rank, rolling
    the ``sharded`` engine back first when any rank asks (``rolling_back``) (collective; see the module docstring).

    Raises:
        TransferError: no rank of the new world holds state, or the roll back has no snapshot to go to.
    """
    world = dist.get_world_size()
    old_world = copies.world if holds_state else 0
    wanted = torch.tensor([int(rolling_back), old_world], dtype=torch.int64)
    dist.all_reduce(wanted, op=dist.ReduceOp.MAX)  # a survivor of a sharded engine's failure asks to roll back
    received = 0
    if wanted[0]:
        if sharded is None:
            raise TransferError("a roll back was asked, but this rank has no single sharded engine")
        received, rolled_to = roll_back(sharded, loaders, copies, holds_state, int(wanted[1]))
        if rolled_to is not None:
            steps_done = rolled_to
    mine = steps_done if holds_state else -1
    span = torch.tensor([mine, -mine if holds_state else -(2**62)], dtype=torch.int64)
    dist.all_reduce(span, op=dist.ReduceOp.MAX)
    newest, oldest = int(span[0]), -int(span[1])
    if newest < 0:
        raise TransferError("no rank of the new world holds training state; the restart path applies")
    candidate = torch.tensor([dist.get_rank() if mine == newest else world], dtype=torch.int64)
    dist.all_reduce(candidate, op=dist.ReduceOp.MIN)
    src = int(candidate.item())
    position = torch.tensor([[*loader.position()] for loader in loaders] or [[0, 0, 0]], dtype=torch.int64)
    dist.broadcast(position, src)
    nbytes = received + sum(engine.sync_state(src) + sync_scheduler(engine, src) for engine in engines)
    rng = torch.get_rng_state()
    dist.broadcast(rng, src)
    if not holds_state:  # survivors keep their own streams; a newcomer continues the source's
        torch.set_rng_state(rng)
    behind = holds_state and mine < newest
    positions = [(int(epoch), int(cursor), int(step)) for epoch, cursor, step in position.tolist()]
    return Transferred(
        step=newest,
        positions=positions,
        nbytes=nbytes,
        behind=behind,
        ahead=holds_state and oldest < newest and not behind,
    )


def roll_back(
    engine: Engine, loaders: Sequence[ElasticLoader], copies: BuddyCopies, holds_state: bool, old_world: int
) -> tuple[int, int | None]:
    """Every rank of the new world takes the sharded ``engine``'s state at the newest snapshot step that every old
    shard's holder has; survivors also take that step's loader positions, scheduler state and RNG state. Collective.

    Returns:
        (bytes received, the step rolled back to on a survivor; None on a newcomer, whose step comes with the
        transfer).

    Raises:
        TransferError: a held copy has the wrong size.
    """
    held = copies.held() if holds_state else copies.adopt()  # a fresh worker: what its predecessor kept
    mine = encode(held, old_world)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    plan = choose_rollback([decode(row, old_world) for row in rows], old_world)
    survivor = min(plan.holders.values())
    partition = torch.tensor(
        copies.partition if dist.get_rank() == survivor else [0] * len(list(engine.module.parameters())),
        dtype=torch.int64,
    )
    dist.broadcast(partition, survivor)
    me = dist.get_rank()

    def receive(old: int, nbytes: int) -> torch.Tensor:
        holder = plan.holders[old]
        buffer = copies.buffer(old, plan.step) if me == holder else torch.empty(nbytes, dtype=torch.uint8)
        if buffer.numel() != nbytes:
            raise TransferError(f"the copy of old rank {old}'s shard has {buffer.numel()} bytes, not {nbytes}")
        if nbytes:
            dist.broadcast(buffer, holder)
        return buffer

    slot = copies.slot(plan.step) if holds_state else None
    nbytes = engine.rebuild(partition.tolist(), receive, slot.hyper if slot else None)
    rolled_to = None
    if slot is not None:
        if slot.scheduler is not None:  # the learning rates of the redone steps
            engine.scheduler.load_state_dict(slot.scheduler)
        for loader, position in zip(loaders, slot.positions, strict=False):
            loader.load_position(*position)
        assert slot.rng is not None
        torch.set_rng_state(slot.rng)
        rolled_to = plan.step
    logger.info(
        "rank %d: rolled back to the snapshot of step %d (the old ranks' shards from new ranks %s)",
        me,
        plan.step,
        sorted(set(plan.holders.values())),
    )
    return nbytes, rolled_to
