"""Exactly-once data and a fixed global batch for any training loop: a sample stream whose position is the global
sample index.

**The stream.** Pass ``d`` holds every sample of the dataset once, in the order of a permutation seeded with
``seed + d`` (the dataset's own order without ``shuffle``); the passes follow each other without a gap. Position ``p``
is the sample ``order(p // N)[p % N]`` of a dataset of ``N`` samples.

**A step is the next global batch of the stream.** Optimizer step ``s`` holds the ``G`` positions from
``position(s)`` on, whatever the world size. Each of the ``W`` ranks runs ``A`` micro-batches of ``b`` samples per step
(``G = b * A * W``; ``A`` is the gradient accumulation): micro-batch ``j`` of rank ``r`` holds the positions
``position(s) + (j * W + r) * b`` to ``+ b``. So a step's samples, and the mean gradient over them, are the same at
every world size; a step is never partial: the last step of a pass takes its rest from the next pass, whose samples
are each seen once in their turn (so that step may hold a sample twice, once from each pass).

**The position is a function of the step** (:class:`Cursor`): ``position(s) = base_position + (s - base_step) * G``.
It is the whole state: a checkpoint keeps ``(step, position)`` at its step, and a world of any size, with any global
batch, resumes at the next unseen sample. Deriving the position from the optimizer steps the loop completed, rather
than from what the sampler handed out, keeps it right however far a ``DataLoader``'s workers or a framework's fetcher
read ahead, and after a step cut short by a failure (its samples are the first of the next world).

**An epoch** is ``ceil(N / G)`` steps, as many as cover one pass (:attr:`GlobalBatchSampler.steps_per_epoch`);
epoch ``k`` is the steps from ``k * ceil(N / G)`` on. An iteration of :class:`GlobalBatchSampler` yields this rank's
micro-batches from the current step to the end of its epoch; frameworks that count an epoch's batches themselves may
stop it earlier, and the next iteration starts from the step they reached. Without a fixed global batch (``G`` follows
the world), a world change mid-epoch ends that epoch at the new world's boundary: the steps shift, the samples do not.

Use it directly in a torchrun script (:class:`GlobalBatchLoader`, a ``DataLoader``); :mod:`pliant.lightning` and
:mod:`pliant.transformers` install it in place of the framework's ``DistributedSampler``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from pliant.env import WorkerEnv
from pliant.errors import PliantError

logger = logging.getLogger(__name__)

__all__ = [
    "Cursor",
    "DataError",
    "GlobalBatchLoader",
    "GlobalBatchSampler",
    "SampleOrder",
    "accumulation_for",
    "step_ranges",
]

STATE_VERSION = 1


class DataError(PliantError, ValueError):
    """A global batch the world cannot divide, or a data state that belongs to another dataset or order."""


@dataclass(frozen=True)
class Cursor:
    """Where each optimizer step starts in the stream: ``position(s) = base_position + (s - base_step) * global_batch``.

    Attributes:
        base_step: a step whose position is known (the step a world resumed at).
        base_position: that step's first stream position.
        global_batch: the samples of each step from ``base_step`` on.
    """

    base_step: int
    base_position: int
    global_batch: int

    def position(self, step: int) -> int:
        """The stream position of ``step``'s first sample."""
        return self.base_position + (step - self.base_step) * self.global_batch

    def rebased(self, step: int, global_batch: int) -> Cursor:
        """The cursor of a world that resumes at ``step`` with ``global_batch`` samples a step."""
        return Cursor(step, self.position(step), global_batch)


def accumulation_for(global_batch: int, micro_batch: int, world_size: int) -> int:
    """The micro-batches each rank runs per step so that ``micro_batch * accumulation * world_size == global_batch``.

    Raises:
        DataError: the world cannot divide the global batch; the message names the numbers and the fix.
    """
    if global_batch < 1 or micro_batch < 1 or world_size < 1:
        raise DataError(
            f"global_batch={global_batch}, micro_batch={micro_batch} and world size {world_size} must all be >= 1"
        )
    per_step = micro_batch * world_size
    if global_batch % per_step:
        raise DataError(
            f"global_batch={global_batch} is not a multiple of micro_batch {micro_batch} x world size {world_size} "
            f"= {per_step}: this world cannot keep the global batch. Choose a global batch that every world size "
            f"the job may reach divides (with --nnodes MIN:MAX and --nproc-per-node), or a smaller micro batch"
        )
    return global_batch // per_step


def step_ranges(
    position: int, global_batch: int, micro_batch: int, world_size: int, rank: int
) -> list[tuple[int, int]]:
    """The stream ranges ``(start, stop)`` of ``rank``'s micro-batches in the step that starts at ``position``.

    Raises:
        DataError: the world cannot divide the global batch.
    """
    steps = accumulation_for(global_batch, micro_batch, world_size)
    if not 0 <= rank < world_size:
        raise DataError(f"rank {rank} is outside a world of {world_size}")
    firsts = (position + (j * world_size + rank) * micro_batch for j in range(steps))
    return [(first, first + micro_batch) for first in firsts]


class SampleOrder:
    """The stream's order: pass ``d`` is a permutation of the dataset seeded with ``seed + d`` (or its own order).

    Args:
        num_samples: samples in the dataset.
        seed: the order's seed.
        shuffle: False keeps the dataset's order in every pass.

    Raises:
        DataError: the dataset is empty.
    """

    def __init__(self, num_samples: int, seed: int = 0, shuffle: bool = True) -> None:
        if num_samples < 1:
            raise DataError(f"the dataset has {num_samples} samples; it needs at least one")
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        self._pass: tuple[int, torch.Tensor] | None = None

    def permutation(self, index: int) -> torch.Tensor:
        """Dataset indices in pass ``index``'s order."""
        if self._pass is None or self._pass[0] != index:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + index)
                order = torch.randperm(self.num_samples, generator=generator)
            else:
                order = torch.arange(self.num_samples)
            self._pass = (index, order)
        return self._pass[1]

    def indices(self, start: int, stop: int) -> list[int]:
        """The dataset indices at stream positions ``start`` to ``stop`` (which may span passes)."""
        out: list[int] = []
        while start < stop:
            index, offset = divmod(start, self.num_samples)
            take = min(stop - start, self.num_samples - offset)
            out += self.permutation(index)[offset : offset + take].tolist()
            start += take
        return out


def _world() -> tuple[int, int]:
    """(rank, world size): the default process group's, else torchrun's environment, else (0, 1)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    env = WorkerEnv.from_env()
    return env.rank, env.world_size


class GlobalBatchSampler(Sampler[list[int]]):
    """A batch sampler over the stream: this rank's micro-batches (lists of dataset indices), step after step.

    Pass it as a ``DataLoader``'s ``batch_sampler`` (or use :class:`GlobalBatchLoader`). Its ``state_dict`` /
    ``load_state_dict`` keep the position (see the module docstring); save it with the checkpoint, at the same step.

    Args:
        num_samples: samples in the dataset.
        micro_batch: samples per micro-batch (the ``DataLoader``'s batch size).
        global_batch: samples per optimizer step at every world size; None: ``micro_batch * accumulation * world``.
        accumulation: micro-batches per rank per step when ``global_batch`` is None.
        seed: the order's seed (pass ``d`` is a permutation seeded with ``seed + d``).
        shuffle: False keeps the dataset's order.
        rank: this rank; None: the default process group's, else ``RANK``.
        world_size: the ranks; None: the default process group's, else ``WORLD_SIZE``.
        step_fn: the optimizer steps the loop completed (a framework's global step); None: :attr:`steps_done`,
            which :class:`GlobalBatchLoader` advances and a loop of its own may set.
        from_epoch_start: each iteration starts at its epoch's first step rather than the current step, for loops
            that skip the trained batches of a resumed epoch themselves (the Hugging Face Trainer).

    Raises:
        DataError: the world cannot divide ``global_batch``, or an argument is out of range.

    Threads: the training loop's thread; a ``DataLoader``'s workers never see it (the main process reads it).
    """

    def __init__(
        self,
        num_samples: int,
        micro_batch: int,
        global_batch: int | None = None,
        *,
        accumulation: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        step_fn: Callable[[], int] | None = None,
        from_epoch_start: bool = False,
    ) -> None:
        found_rank, found_world = _world()
        self.rank = found_rank if rank is None else rank
        self.world_size = found_world if world_size is None else world_size
        self.order = SampleOrder(num_samples, seed, shuffle)
        if accumulation < 1:
            raise DataError(f"accumulation={accumulation} must be >= 1")
        self.micro_batch = micro_batch
        self.fixed = global_batch is not None
        if global_batch is None:
            global_batch = micro_batch * accumulation * self.world_size
        self.accumulation = accumulation_for(global_batch, micro_batch, self.world_size)
        self.global_batch = global_batch
        self.step_fn = step_fn
        self.from_epoch_start = from_epoch_start
        self.steps_done = 0
        self.cursor = Cursor(0, 0, global_batch)
        self.resumed_from: dict[str, Any] | None = None  # the state load_state_dict took, as saved

    @property
    def num_samples(self) -> int:
        return self.order.num_samples

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch: those that cover at least one pass."""
        return math.ceil(self.num_samples / self.global_batch)

    def step(self) -> int:
        """The optimizer steps the loop completed."""
        return self.step_fn() if self.step_fn is not None else self.steps_done

    def describe(self) -> str:
        """``global batch 32 = batch size 8 x accumulation 2 x world 2 (fixed)`` (or ``following the world``)."""
        return (
            f"global batch {self.global_batch} = batch size {self.micro_batch} x accumulation {self.accumulation} x "
            f"world {self.world_size} ({'fixed' if self.fixed else 'following the world'})"
        )

    def accumulation_for_framework(self, name: str, configured: int) -> int:
        """The accumulation a framework's loop must use (its setting ``name`` holds ``configured``): this sampler's,
        said when a fixed global batch replaces a setting of the script's own."""
        if self.fixed and configured not in (1, self.accumulation):
            logger.warning(
                "pliant: %s=%d is replaced by %d: global_batch=%d fixes it at this world",
                name,
                configured,
                self.accumulation,
                self.global_batch,
            )
        return self.accumulation if self.fixed else configured

    def set_epoch(self, epoch: int) -> None:
        """Accepted as ``DistributedSampler.set_epoch`` is (frameworks call it); the position alone decides."""

    def __len__(self) -> int:
        return self.steps_per_epoch * self.accumulation

    def __iter__(self) -> Iterator[list[int]]:
        step = self.step()
        first = step - step % self.steps_per_epoch if self.from_epoch_start else step
        for s in range(first, step + self.steps_per_epoch - step % self.steps_per_epoch):
            position = self.cursor.position(s)
            for start, stop in step_ranges(position, self.global_batch, self.micro_batch, self.world_size, self.rank):
                yield self.order.indices(start, stop)

    def state_dict(self) -> dict[str, Any]:
        """The position at the current step, and what it is valid for."""
        step = self.step()
        return {
            "version": STATE_VERSION,
            "step": step,
            "position": self.cursor.position(step),
            "global_batch": self.global_batch,
            "accumulation": self.accumulation,
            "world_size": self.world_size,
            "num_samples": self.num_samples,
            "seed": self.order.seed,
            "shuffle": self.order.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position: steps from the saved one on start at its position, ``global_batch`` apart.

        Raises:
            DataError: the state belongs to another dataset or order, or is not a state of this sampler.
        """
        try:
            version, step, position = int(state["version"]), int(state["step"]), int(state["position"])
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(
                f"not a pliant.data sampler state ({exc!r} in {sorted(state) if isinstance(state, dict) else state!r})"
            ) from exc
        if version != STATE_VERSION:
            raise DataError(f"data state version {version}; this pliant reads version {STATE_VERSION}")
        for key, mine in (
            ("num_samples", self.num_samples),
            ("seed", self.order.seed),
            ("shuffle", self.order.shuffle),
        ):
            if state.get(key, mine) != mine:
                raise DataError(
                    f"the data state has {key}={state[key]!r} but this sampler has {mine!r}: it belongs to another "
                    f"dataset or order; resume with the same dataset, seed and shuffle (or start without the state)"
                )
        if step < 0 or position < 0:
            raise DataError(f"the data state's step {step} and position {position} must be >= 0")
        self.cursor = Cursor(step, position, self.global_batch)
        self.steps_done = step
        self.resumed_from = dict(state)


class GlobalBatchLoader(DataLoader):
    """A ``DataLoader`` of this rank's micro-batches from a :class:`GlobalBatchSampler`, with its position as state.

    It counts the micro-batches it handed to the loop (not those its workers read ahead), so ``state_dict()`` taken
    after an optimizer step holds that step's position: save it with the checkpoint, and ``load_state_dict`` it before
    iterating in the next world. Each ``for batch in loader`` runs to the end of the current epoch.

    Args:
        dataset: a map-style dataset.
        micro_batch, global_batch, accumulation, seed, shuffle, rank, world_size, step_fn: the sampler's.
        **kwargs: ``DataLoader``'s other arguments (``num_workers``, ``collate_fn``, ``pin_memory``, ...);
            ``batch_size``, ``shuffle``, ``sampler``, ``batch_sampler`` and ``drop_last`` are the sampler's.

    Threads: the training loop's thread.
    """

    def __init__(
        self,
        dataset: Dataset,
        micro_batch: int,
        global_batch: int | None = None,
        *,
        accumulation: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        step_fn: Callable[[], int] | None = None,
        **kwargs: Any,
    ) -> None:
        taken = sorted({"batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"} & set(kwargs))
        if taken:
            raise DataError(f"GlobalBatchLoader chooses its own batches: drop {', '.join(taken)}")
        sampler = GlobalBatchSampler(
            len(dataset),  # type: ignore[arg-type]
            micro_batch,
            global_batch,
            accumulation=accumulation,
            seed=seed,
            shuffle=shuffle,
            rank=rank,
            world_size=world_size,
            step_fn=step_fn,
        )
        super().__init__(dataset, batch_sampler=sampler, **kwargs)
        self.global_batch_sampler = sampler

    def __iter__(self) -> Iterator[Any]:
        sampler = self.global_batch_sampler
        first = sampler.step()
        for handed, batch in enumerate(super().__iter__(), start=1):
            if sampler.step_fn is None:
                sampler.steps_done = first + handed // sampler.accumulation
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return self.global_batch_sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.global_batch_sampler.load_state_dict(state)
