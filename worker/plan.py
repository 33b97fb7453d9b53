"""Pure planning of global steps: which samples a global batch holds and which rank runs which micro-batch.

The user fixes the global batch and the micro-batch size; the world size only changes who does the work. A global
batch is the next ``global_batch`` positions of the epoch's order from the cursor (fewer at the epoch's tail). It is
cut into micro-batches of ``micro_batch`` samples (the last may be smaller), dealt round-robin to the ranks: micro-batch
``j`` goes to rank ``j % world_size``. Ranks may get different counts, or none; every rank computes the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from pliant.worker.contract import DataError

__all__ = ["StepPlan", "plan_step"]


@dataclass(frozen=True)
class StepPlan:
    """One global step.

    Attributes:
        epoch: the epoch the samples come from.
        start: position (in the epoch's order) of the step's first sample.
        size: real samples in the global batch.
        micro_sizes: sizes of the step's micro-batches, in order.
        world_size: ranks the micro-batches are dealt to.
    """

    epoch: int
    start: int
    size: int
    micro_sizes: tuple[int, ...]
    world_size: int

    def owner(self, micro: int) -> int:
        return micro % self.world_size

    def counts(self) -> tuple[int, ...]:
        """Micro-batches per rank."""
        m, w = len(self.micro_sizes), self.world_size
        return tuple((m - r + w - 1) // w if r < m else 0 for r in range(w))

    def rank_slices(self, rank: int) -> list[tuple[int, int]]:
        """(position, size) of each micro-batch of ``rank``, positions in the epoch's order."""
        out, offset = [], self.start
        for j, size in enumerate(self.micro_sizes):
            if self.owner(j) == rank:
                out.append((offset, size))
            offset += size
        return out

    @property
    def uneven(self) -> bool:
        """True when ranks run different numbers of micro-batches this step."""
        counts = self.counts()
        return min(counts) != max(counts)

    @property
    def some_rank_idle(self) -> bool:
        """True when some rank has no micro-batch this step (and another has)."""
        counts = self.counts()
        return min(counts) == 0 < max(counts)


def plan_step(
    epoch: int, cursor: int, epoch_len: int, global_batch: int, micro_batch: int, world_size: int, drop_last: bool
) -> StepPlan | None:
    """Plan the global step that starts at ``cursor``; None when the epoch has no (complete, with drop_last) batch left.

    Raises:
        DataError: a size is not positive, or the cursor is outside the epoch.
    """
    if global_batch < 1 or micro_batch < 1 or world_size < 1:
        raise DataError(f"global_batch={global_batch}, micro_batch={micro_batch}, world_size={world_size} must be >= 1")
    if not 0 <= cursor <= epoch_len:
        raise DataError(f"cursor {cursor} is outside the epoch of {epoch_len} samples")
    size = min(global_batch, epoch_len - cursor)
    if size == 0 or (drop_last and size < global_batch):
        return None
    micro = tuple(min(micro_batch, size - i) for i in range(0, size, micro_batch))
    return StepPlan(epoch, cursor, size, micro, world_size)
