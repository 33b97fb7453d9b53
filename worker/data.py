"""Elastic, exactly-once data: a deterministic global order per (seed, epoch) and a global cursor of samples consumed.

Each rank's micro-batches are cut from the cursor for the current world size (see :mod:`pliant.worker.plan`), so a
rescale re-partitions what remains of the epoch. The cursor is the whole state (``state_dict``): restored at any world
size, every sample of an epoch is seen exactly once. Micro-batches are fetched through a ``torch.utils.data.DataLoader``
(workers, pinning and collation as usual) whose batch sampler yields this rank's index lists for the rest of the epoch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from pliant.worker.contract import LOCAL, DataError, GlobalBatch, Runner
from pliant.worker.plan import StepPlan, plan_step

__all__ = ["ElasticLoader", "ElasticSampler"]

logger = logging.getLogger(__name__)


class ElasticSampler:
    """The global order and cursor.

    Args:
        num_samples: samples in the dataset.
        global_batch: samples per global step (fixed whatever the world size).
        micro_batch: samples per micro-batch.
        seed: the order of epoch e is a permutation seeded with ``seed + e``.
        shuffle: False keeps the dataset order.
        drop_last: drop an epoch's last, incomplete global batch.
    """

    def __init__(
        self,
        num_samples: int,
        global_batch: int,
        micro_batch: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        if num_samples < 1:
            raise DataError(f"the dataset has {num_samples} samples; it needs at least one")
        if global_batch < 1 or micro_batch < 1:
            raise DataError(f"global_batch={global_batch} and micro_batch={micro_batch} must be >= 1")
        if micro_batch > global_batch:
            raise DataError(f"micro_batch={micro_batch} is larger than global_batch={global_batch}; lower it")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.micro_batch = micro_batch
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.cursor = 0
        self.step = 0
        self._order: tuple[int, torch.Tensor] | None = None

    def order(self, epoch: int) -> torch.Tensor:
        """Dataset indices in epoch ``epoch``'s order."""
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                perm = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))
            else:
                perm = torch.arange(self.num_samples)
            self._order = (epoch, perm)
        return self._order[1]

    def advance(self, plan: StepPlan) -> None:
        """Mark ``plan``'s samples consumed."""
        self.epoch, self.cursor, self.step = plan.epoch, plan.start + plan.size, self.step + 1

    def rank_indices(self, plan: StepPlan, rank: int) -> list[list[int]]:
        """Dataset indices of each of ``rank``'s micro-batches in ``plan``."""
        order = self.order(plan.epoch)
        return [order[pos : pos + size].tolist() for pos, size in plan.rank_slices(rank)]

    def state_dict(self) -> dict[str, int | bool]:
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "step": self.step,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "global_batch": self.global_batch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the cursor (at any world size).

        Raises:
            DataError: the state belongs to another dataset, seed or global batch.
        """
        for key in ("seed", "num_samples", "global_batch"):
            if key in state and state[key] != getattr(self, key):
                raise DataError(
                    f"data state has {key}={state[key]} but this loader has {getattr(self, key)}; "
                    f"restore it with the same dataset, seed and global batch"
                )
        self.epoch, self.cursor, self.step = int(state["epoch"]), int(state["cursor"]), int(state.get("step", 0))
        self._order = None


class _EpochSampler:
    """Batch sampler over one rank's micro-batch index lists for the rest of an epoch."""

    def __init__(self, lists: list[list[int]]) -> None:
        self.lists = lists

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.lists)

    def __len__(self) -> int:
        return len(self.lists)


class ElasticLoader:
    """Iterate global steps: each item is a :class:`GlobalBatch` with this rank's micro-batches.

    Args:
        dataset: a map-style dataset.
        sampler: the order and cursor.
        rank, world_size: this rank in the current world.
        max_steps: stop after this many global steps in total (None: go on epoch after epoch).
        collate_fn, num_workers, pin_memory: passed to the DataLoader.
        runner: the engines' runner (default: the plain local step); under an agent, a newcomer's iteration starts
            where the state its peers send puts it (:meth:`pliant.worker.contract.Runner.state_from_peers`).
    """

    def __init__(
        self,
        dataset: Dataset,
        sampler: ElasticSampler,
        rank: int,
        world_size: int,
        max_steps: int | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        runner: Runner = LOCAL,
    ) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.rank = rank
        self.world_size = world_size
        self.max_steps = max_steps
        self._loader_args = {"collate_fn": collate_fn, "num_workers": num_workers, "pin_memory": pin_memory}
        self._shadow: Any = None
        self._version = 0  # bumped when the world or the cursor changes under a running iteration
        self.runner = runner

    def state_dict(self) -> dict[str, int | bool]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)

    def shadow_batch(self) -> Any:
        """A valid one-sample micro-batch for shadow passes (the dataset's first sample), fetched once."""
        if self._shadow is None:
            collate = self._loader_args["collate_fn"] or torch.utils.data.default_collate
            self._shadow = collate([self.dataset[0]])
        return self._shadow

    def moved(self, rank: int, world_size: int) -> None:
        """The world changed in place: cut the rest of the epoch for ``rank`` of ``world_size``."""
        self.rank, self.world_size = rank, world_size
        self._version += 1

    def position(self) -> tuple[int, int, int]:
        """(epoch, cursor, step) of the next step."""
        s = self.sampler
        return s.epoch, s.cursor, s.step

    def rewind(self, batch: GlobalBatch) -> None:
        """Put the cursor back to where ``batch`` (already yielded, never committed) starts."""
        self.load_position(batch.plan.epoch, batch.plan.start, batch.step)

    def load_position(self, epoch: int, cursor: int, step: int) -> None:
        """Set the cursor (from a peer); the running iteration continues from it."""
        s = self.sampler
        s.epoch, s.cursor, s.step = epoch, cursor, step
        self._version += 1

    def _next_plan(self) -> StepPlan:
        s = self.sampler
        while True:
            plan = plan_step(
                s.epoch, s.cursor, s.num_samples, s.global_batch, s.micro_batch, self.world_size, s.drop_last
            )
            if plan is not None:
                return plan
            self._next_epoch()

    def _next_epoch(self) -> None:
        """Move the cursor to the next epoch's start (the cursor's epoch has no step left).

        Raises:
            DataError: not even the epoch's first step fits (``drop_last`` with too large a global batch).
        """
        s = self.sampler
        if s.cursor == 0:
            raise DataError(
                f"global_batch={s.global_batch} does not fit the dataset ({s.num_samples} samples) "
                f"with drop_last; lower global_batch or set drop_last=False"
            )
        s.epoch, s.cursor = s.epoch + 1, 0

    def refetch(self, batch: GlobalBatch) -> None:
        """Re-cut ``batch`` in place as the step at the cursor for the current world (after :meth:`rewind` and an
        in-place rescale): its plan, this rank's micro-batches and sizes; the cursor moves past it."""
        s = self.sampler
        plan = self._next_plan()
        collate = self._loader_args["collate_fn"] or torch.utils.data.default_collate
        sizes = [size for _pos, size in plan.rank_slices(self.rank)]
        batch.plan, batch.step, batch.micro_sizes = plan, s.step, sizes
        batch.micro_batches = [collate([self.dataset[i] for i in idx]) for idx in s.rank_indices(plan, self.rank)]
        s.advance(plan)
        self._version += 1

    def _epoch_plans(self) -> list[StepPlan]:
        """Plans from the cursor to the end of the cursor's epoch (the sampler is not advanced)."""
        s = self.sampler
        plans, cursor = [], s.cursor
        while True:
            plan = plan_step(
                s.epoch, cursor, s.num_samples, s.global_batch, s.micro_batch, self.world_size, s.drop_last
            )
            if plan is None:
                return plans
            plans.append(plan)
            cursor = plan.start + plan.size

    def __iter__(self) -> Iterator[GlobalBatch]:
        s = self.sampler
        self.runner.state_from_peers()  # a newcomer in place: its position comes with the state from its peers
        while self.max_steps is None or s.step < self.max_steps:
            version = self._version
            plans = self._epoch_plans()
            if not plans:  # the cursor's epoch is done
                self._next_epoch()
                continue
            lists = [idx for plan in plans for idx in s.rank_indices(plan, self.rank)]
            fetched = iter(DataLoader(self.dataset, batch_sampler=_EpochSampler(lists), **self._loader_args))
            for plan in plans:
                if self.max_steps is not None and s.step >= self.max_steps:
                    return
                sizes = [size for _pos, size in plan.rank_slices(self.rank)]
                micro = [next(fetched) for _ in sizes]
                batch = GlobalBatch(plan, s.step, micro, sizes, self.shadow_batch, self)
                s.advance(plan)
                yield batch
                if self._version != version:  # re-formed in place (or rewound): plan again from the cursor
                    break
