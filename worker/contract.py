"""The worker library's contract: engine kinds, the Engine interface, a global batch as a rank sees it, what runs a
step (:class:`Runner`), what the rescale protocol moves at a boundary (:class:`WorldPart`), the one way out of a worker
(:class:`RescaleExit`), and errors."""

from __future__ import annotations

import abc
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pliant.env import RESCALE_EXIT_CODE
from pliant.errors import PliantError

if TYPE_CHECKING:
    from concurrent.futures import Future

    import torch

    from pliant.worker.inplace.world import World
    from pliant.worker.metrics import WorkerMetrics
    from pliant.worker.plan import StepPlan

__all__ = [
    "LOCAL",
    "DataError",
    "Engine",
    "EngineError",
    "EngineKind",
    "ExitReason",
    "GlobalBatch",
    "LossFn",
    "RescaleExit",
    "Runner",
    "Staged",
    "WorkerError",
    "WorldPart",
]


class WorkerError(PliantError):
    """Base of the worker library's errors."""


class DataError(WorkerError, ValueError):
    """A bad data-loader setting or state."""


class EngineError(WorkerError, ValueError):
    """A bad engine setting, or a model the engine cannot wrap."""


class ExitReason(enum.Enum):
    """Why :class:`RescaleExit` ends a rank's part in the job (the directive's mode, :mod:`pliant.progress`)."""

    LEAVE = "leave"
    """This rank's node is not in the next generation (a graceful leave, a scale-down)."""
    RESTART = "restart"
    """The restart path: the checkpoint of the step boundary is saved; fresh workers restore from it."""


class RescaleExit(SystemExit):
    """Raised by ``engine.step`` at a step boundary when this rank leaves the job (its node is not in the next
    generation) or its agent asked for the restart path (after the checkpoint was saved). It is the one way
    pliant.worker ends a script: let it propagate; the process exits with :data:`pliant.env.RESCALE_EXIT_CODE`,
    which the agent expects. (A worker whose step is wedged in C++ beyond release ends itself differently, with
    :data:`pliant.env.GUARD_EXIT_CODE`, which its agent treats as a dead worker's:
    :func:`pliant.worker.inplace.groups.give_up`.)

    Attributes:
        reason: why.
    """

    def __init__(self, reason: ExitReason) -> None:
        super().__init__(RESCALE_EXIT_CODE)
        self.reason = reason


class EngineKind(enum.Enum):
    """``ddp``: torch DDP. ``zero``: DDP with ZeroRedundancyOptimizer. ``fsdp``: FSDP2 ``fully_shard`` over the world.
    ``hsdp``: FSDP2 over a (replicas x shard group) mesh, elastic along the replicas
    (:mod:`pliant.worker.hsdp`)."""

    DDP = "ddp"
    ZERO = "zero"
    FSDP = "fsdp"
    HSDP = "hsdp"


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
        source: the loader that made it (re-cuts it for a new world after an in-place rescale), if any.
    """

    plan: StepPlan
    step: int
    micro_batches: list[Any]
    micro_sizes: list[int]
    shadow: Callable[[], Any] = field(repr=False, default=lambda: None)
    source: Any = field(repr=False, default=None)

    @property
    def num_samples(self) -> int:
        """Real samples in the whole global batch (every rank)."""
        return self.plan.size

    def __iter__(self):
        return iter(self.micro_batches)

    def __len__(self) -> int:
        return len(self.micro_batches)


@dataclass(frozen=True)
class Staged:
    """A host copy of this rank's state at a step (a buddy snapshot, :mod:`pliant.worker.inplace.buddy`) that an async
    checkpoint of that step writes from (:mod:`pliant.worker.staging`).

    Attributes:
        lookup: a tensor of the live state -> its copy (sharing the host buffer's memory), or None when the copy
            lacks it.
        ready: waits until the copy is complete (raises what failed); any thread may call it.
        pin: keeps the copy from being overwritten until the given write is done.
    """

    lookup: Callable[[torch.Tensor], torch.Tensor | None]
    ready: Callable[[], None]
    pin: Callable[[Future[Any]], None]


class Runner:
    """What runs an engine's steps, and what a run's other parts ask of it. This class is the plain local step (no
    agent, torchrun, a single process); under an agent, the session gives every engine, loader and checkpoint manager
    it makes the rescale protocol instead (:class:`pliant.worker.inplace.protocol.Protocol`), at construction."""

    def step(self, engine: Engine, batch: GlobalBatch, loss_fn: LossFn) -> float:
        """Run one step of ``engine`` (see :meth:`Engine.step`)."""
        started = time.perf_counter()
        loss = engine.forward_backward(batch, loss_fn)
        engine.settle()
        engine.apply_update()
        engine.observe(batch, started)
        return loss

    def state_from_peers(self) -> int | None:
        """A newcomer's training state from the ranks already training, once: the step it resumes at, or None when
        nothing came from peers (always, here). Called where a run starts: a loader's iteration, a checkpoint
        manager's restore."""
        return None

    def snapshot_for_save(self, engine: Engine, step: int) -> Staged | None:
        """A host copy of ``engine``'s state at the committed ``step`` that a checkpoint of it may write from; None
        (always, here): the checkpoint copies the state itself."""
        return None

    def peer_failed(self, exc: BaseException, started: float | None = None) -> bool:
        """A collective between steps, begun at ``started`` (``time.perf_counter``; None: not known), failed with
        ``exc``: True when the next step recovers from it (a peer went away, in place); False (always, here): the
        caller raises."""
        return False


LOCAL = Runner()
"""The plain local step."""


class WorldPart(abc.ABC):  # noqa: B024 - every method has a default: a part overrides the ones it needs
    """What the rescale protocol moves from one world to the next at a step boundary: an engine or a checkpoint
    manager. The protocol calls each method on every part, in the order the script made them; each default does
    nothing."""

    def can_move(self) -> bool:
        """Whether moving in place fits now (e.g. the memory a gathered state needs); False takes the restart path."""
        return True

    def before_restart(self, step: int) -> None:  # noqa: B027
        """The restart path, on the old world still whole (collective): save what fresh workers restore, the step
        ``step`` not yet run."""

    def quiesce(self) -> None:  # noqa: B027
        """Before the old world's groups are retired: finish what runs on them in the background."""

    def before_move(self) -> None:  # noqa: B027
        """On the old world still whole (collective, leaving ranks included): gather what only some ranks hold, so
        the survivors can rebuild it in the next world."""

    def after_move(self, world: World) -> None:  # noqa: B027
        """The new world's group is formed (collective): take it (wrap again, open groups of its own, noted by
        ``world.tracked``)."""

    def abandon(self) -> None:  # noqa: B027
        """A peer failed mid-step: drop the work in flight on the old world; it is never committed."""


class Engine(WorldPart):
    """A parallel wrapper of a model and its optimizer that runs one global step at a time.

    The update of a step does not depend on the world size: each micro-batch's mean loss is weighted by its share of
    the global batch, gradients are summed across ranks, so they equal the mean gradient over the global batch.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    metrics: WorkerMetrics | None = None
    """Set by the session: where step times, samples and shadow steps are reported."""
    runner: Runner = LOCAL
    """What runs each step (given at construction): the plain local step, or under a pliant agent the rescale protocol
    (:class:`pliant.worker.inplace.protocol.Protocol`), which votes to commit, re-forms the engine in place and
    recovers from a peer's failure."""
    movable: bool = False
    """True when :meth:`rewrap` and :meth:`sync_state` can move this engine to a new world without a restart."""
    survives_peer_loss: bool = False
    """True when the survivors alone hold all of the state (replicas), so a peer that dies mid-step costs only that
    step; False: a peer's death takes the restart path (its shards are only on disk)."""
    partial_collectives: bool = False
    """True when a step's gradient collectives do not each join every rank (HSDP: a shard's all-reduce joins its
    replicas only), so a rank whose collectives completed cannot tell that every rank's did: under the in-place
    protocol such a step is committed only after one more all-reduce that every rank reaches after its collectives."""
    sharded: bool = False
    """True when each rank holds a shard of the state that no other rank has (ZeRO's optimizer state, FSDP2's rows).
    Under the in-place protocol such an engine survives a peer's death through buddy copies
    (:mod:`pliant.worker.inplace.buddy`): :meth:`shard` and :meth:`rebuild`."""
    replicated: tuple[str, ...] = ()
    """The sections of :meth:`state_dict` that every rank holds alike (DDP's model and optimizer; ZeRO's model). A
    checkpoint copies and writes each of their tensors on one rank only (by size, or as :meth:`saved_by` says),
    where DCP's async save would copy everything on every rank and then drop the duplicates."""
    staging: Callable[[], None] | None = None
    """Set by an async checkpoint save whose copy of the state to host memory runs in the background: waits for it
    (:meth:`settle`, before the next optimizer step changes the state)."""
    shadowed: bool = False
    """Set by :meth:`forward_backward`: this rank only shadowed the others' collectives in the last step."""
    scheduler: Any = None
    """The learning-rate scheduler (``session.engine(..., scheduler=)``, :meth:`use_scheduler`), stepped once after
    every committed optimizer step. Its state goes with the optimizer's: into checkpoints, to newcomers, and back to
    a buddy snapshot's step when a sharded engine rolls back. None: the learning rate is the script's business."""
    _scheduler_factory: Callable[[Any], Any] | None = None

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

    def saved_by(self) -> dict[tuple[str, ...], int]:
        """Which rank saves given tensors of the :attr:`replicated` sections (path: the keys from the top of
        :meth:`state_dict`); the rest are dealt by size (:func:`pliant.worker.staging.split_replicas`). A sharded
        engine names its shard's, so that what a rank saves is what its buddy snapshot holds. Local."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (as DCP filled it in, at this world size)."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def observe(self, batch: GlobalBatch, started: float) -> None:
        """Report one step that began at ``started`` (perf_counter) to the metrics, if any."""
        if self.metrics is not None:
            self.metrics.observe_step(batch.step, sum(batch.micro_sizes), time.perf_counter() - started, self.shadowed)

    def step(self, batch: GlobalBatch, loss_fn: LossFn) -> float:
        """Run forward/backward on this rank's micro-batches (shadowing for missing ones), then the optimizer step.

        Under a pliant agent the step goes through the rescale protocol: a commit vote before the optimizer step,
        re-forming in place at a step boundary when the agent hands over a new generation, and redoing the step in
        the new world when a peer dies mid-step. A rank that leaves the job there raises
        :class:`RescaleExit` (a ``SystemExit``): let it end the script.

        Returns:
            This rank's sum of ``loss * samples`` over its micro-batches (divide by ``batch.num_samples`` after a sum
            across ranks for the global mean).
        """
        return self.runner.step(self, batch, loss_fn)

    @abc.abstractmethod
    def forward_backward(self, batch: GlobalBatch, loss_fn: LossFn) -> float:
        """Forward and backward of this rank's micro-batches, with every gradient collective, but no optimizer step.
        Sets :attr:`shadowed`. Returns what :meth:`step` returns."""

    def settle(self) -> None:
        """Wait for an async checkpoint's copy of the state, if one is running (see :attr:`staging`)."""
        if self.staging is not None:
            staging, self.staging = self.staging, None
            staging()

    def apply_update(self) -> None:
        """The optimizer step of the gradients :meth:`forward_backward` left, then clear them; then the scheduler's
        step, if there is one."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()

    def use_scheduler(self, factory: Callable[[torch.optim.Optimizer], Any]) -> None:
        """Build the learning-rate scheduler over this engine's optimizer, as ``factory(optimizer)``; the engine calls
        it again whenever it builds a new optimizer (ZeRO and FSDP2 re-forming in place), keeping its state.

        Raises:
            EngineError: a scheduler stepped on a metric (``ReduceLROnPlateau``): pliant steps schedulers once per
                committed step, with no argument.
        """
        scheduler = factory(self.optimizer)
        if type(scheduler).__name__ == "ReduceLROnPlateau" or not hasattr(scheduler, "state_dict"):
            raise EngineError(
                f"scheduler {type(scheduler).__name__} cannot be stepped once per step by the engine; "
                "pass a step-based LRScheduler, or step this one yourself and leave scheduler= out"
            )
        self.scheduler, self._scheduler_factory = scheduler, factory

    def rebind_scheduler(self) -> None:
        """After the optimizer was built again: the scheduler again over the new one, with the state it had, and the
        learning rates it last set (a fresh scheduler resets them to the first step's)."""
        if self.scheduler is None or self.scheduler.optimizer is self.optimizer:
            return
        assert self._scheduler_factory is not None
        state = self.scheduler.state_dict()
        self.scheduler = self._scheduler_factory(self.optimizer)
        self.scheduler.load_state_dict(state)
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True):
            group["lr"] = lr

    def discard_update(self) -> None:
        """Drop the gradients of a step that will not be committed."""
        self.optimizer.zero_grad(set_to_none=True)

    @classmethod
    def prepare(
        cls,
        model: torch.nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
        device: torch.device,
    ) -> torch.optim.Optimizer | None:
        """Before a fresh worker of a later generation meets its world (it is most likely joining survivors, who
        wait for it from that moment): build the optimizer over ``model`` (moved to ``device``) and create its state
        tensors, so the memory the survivors' state arrives in is allocated and touched while they still train.
        The engine is then built with it (``prepared=``). Local. None (the default): the engine builds its
        optimizer over its process group, after the meeting."""
        return None

    def can_move(self) -> bool:
        """Whether moving in place fits now (e.g. the memory a gathered state needs); False takes the restart path."""
        return self.movable

    def after_move(self, world: World) -> None:
        """Wrapped again for the new world (:meth:`rewrap`)."""
        self.rewrap()

    def rewrap(self) -> None:
        """Wrap :attr:`module` again for the process group now initialised (a new world). Collective.

        Raises:
            EngineError: this engine cannot move in place (:attr:`movable` is False).
        """
        raise EngineError(f"the {type(self).__name__} cannot re-form in place; the restart path applies")

    def sync_state(self, src: int) -> int:
        """Make every rank's model and optimizer state equal to rank ``src``'s, over the new world (collective).
        Returns the tensor bytes this rank sent or received.

        Raises:
            EngineError: this engine cannot move in place.
        """
        raise EngineError(f"the {type(self).__name__} cannot re-form in place; the restart path applies")

    def shard(self) -> tuple[list[int], list[torch.Tensor]]:
        """(one integer per parameter saying how the state is cut, which :meth:`rebuild` gets back: ZeRO, the rank
        that owns it; FSDP2, the world size; this rank's shard: what only it holds, then on rank 0 the module's
        buffers, in a fixed order). Local.

        Raises:
            EngineError: the engine is not :attr:`sharded`.
        """
        raise EngineError(f"the {type(self).__name__} holds no shards")

    def rebuild(
        self, partition: list[int], receive: Callable[[int, int], torch.Tensor], hyper: list[dict[str, Any]] | None
    ) -> int:
        """Rebuild the whole state of an old world from its shards, after :meth:`rewrap` (collective): for each old
        rank (in order), ``receive(old rank, nbytes)`` returns that shard packed as :meth:`shard` made it
        (:func:`pliant.worker.inplace.packing.pack`); ``hyper`` (None on a newcomer) are the optimizer's hyperparameters
        of the same step. :meth:`sync_state` then cuts the state for the new world. Returns the bytes received.

        Raises:
            EngineError: the engine is not :attr:`sharded`.
        """
        raise EngineError(f"the {type(self).__name__} holds no shards")
