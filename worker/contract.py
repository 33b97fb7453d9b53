"""The worker library's contract: engine kinds, the Engine interface, a global batch as a rank sees it, and errors."""

from __future__ import annotations

import abc
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pliant.errors import PliantError

if TYPE_CHECKING:
    import torch

    from pliant.worker.metrics import WorkerMetrics
    from pliant.worker.plan import StepPlan

__all__ = ["DataError", "Engine", "EngineError", "EngineKind", "GlobalBatch", "LossFn", "WorkerError"]


class WorkerError(PliantError):
    """Base of the worker library's errors."""


class DataError(WorkerError, ValueError):
    """A bad data-loader setting or state."""


class EngineError(WorkerError, ValueError):
    """A bad engine setting, or a model the engine cannot wrap."""


class EngineKind(enum.Enum):
    """``ddp``: torch DDP. ``zero``: DDP with ZeroRedundancyOptimizer. ``fsdp``: FSDP2 ``fully_shard``."""

    DDP = "ddp"
    ZERO = "zero"
    FSDP = "fsdp"


LossFn = Callable[["torch.nn.Module", Any], "torch.Tensor"]
"""``loss_fn(model, micro_batch) -> loss``: the MEAN loss over the micro-batch's samples."""


@dataclass
class GlobalBatch:
    """One global step as this rank sees it.

    Attributes:
        plan: the step's plan (the same on every rank).
        step: the global step number (counted across epochs by the loader).
        micro_batches: this rank's collated micro-batches (maybe none).
        micro_sizes: their sizes in samples.
        shadow: returns a valid micro-batch for shadow passes (its loss is weighted by zero).
    """

    plan: StepPlan
    step: int
    micro_batches: list[Any]
    micro_sizes: list[int]
    shadow: Callable[[], Any] = field(repr=False, default=lambda: None)

    @property
    def num_samples(self) -> int:
        """Real samples in the whole global batch (every rank)."""
        return self.plan.size

    def __iter__(self):
        return iter(self.micro_batches)

    def __len__(self) -> int:
        return len(self.micro_batches)


class Engine(abc.ABC):
    """A parallel wrapper of a model and its optimizer that runs one global step at a time.

    The update of a step does not depend on the world size: each micro-batch's mean loss is weighted by its share of
    the global batch, gradients are summed across ranks, so they equal the mean gradient over the global batch.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    metrics: WorkerMetrics | None = None
    """Set by the session: where step times, samples and shadow steps are reported."""

    @property
    def module(self) -> torch.nn.Module:
        """The user's model, without the parallel wrapper (DDP's ``.module``; FSDP2 shards the model in place)."""
        return getattr(self.model, "module", self.model)

    def state_dict(self) -> dict[str, Any]:
        """This rank's model and optimizer state for ``torch.distributed.checkpoint``, which reshards it to any world
        size: replicated tensors (DDP) or this rank's shards (FSDP2's DTensors; ZeRO's optimizer by parameter name).
        May run collectives (every rank calls it together)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (as DCP filled it in, at this world size)."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def _observe(self, batch: GlobalBatch, started: float, shadow: bool) -> None:
        """Report one step that began at ``started`` (perf_counter) to the metrics, if any."""
        if self.metrics is not None:
            self.metrics.observe_step(batch.step, sum(batch.micro_sizes), time.perf_counter() - started, shadow)

    @abc.abstractmethod
    def step(self, batch: GlobalBatch, loss_fn: LossFn) -> float:
        """Run forward/backward on this rank's micro-batches (shadowing for missing ones), then the optimizer step.

        Returns:
            This rank's sum of ``loss * samples`` over its micro-batches (divide by ``batch.num_samples`` after a sum
            across ranks for the global mean).
        """
