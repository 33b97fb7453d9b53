"""The FSDP2 engine (``fully_shard``) and pliant's Join hook for it.

FSDP2 is not Joinable in torch: every forward all-gathers parameters and every synced backward reduce-scatters
gradients, so ranks must run the same number of passes or the collectives hang. When ranks have different numbers of
micro-batches this step, the step runs inside torch's ``Join`` context with :class:`FSDPJoinable`: a rank that ran out
of micro-batches runs, for each further iteration of the others, a *shadow* forward/backward on a valid one-sample
batch with its loss multiplied by zero. It replays the same all-gathers and reduce-scatters, contributes zero gradient,
and receives its shard of the summed gradient like everyone else.

Limits of the shadow pass: the model's forward must issue the same FSDP collectives whatever the input (no
data-dependent choice of sub-modules, e.g. token-routed experts); modules with running statistics (BatchNorm) see the
shadow sample in training mode; a loss that is NaN/inf on the shadow sample poisons the step (0 * inf = NaN).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.distributed.fsdp import FSDPModule, fully_shard

from pliant.worker.contract import Engine, EngineError, GlobalBatch, LossFn
from pliant.worker.engines import loss_sum, to_device, weighted_backward

__all__ = ["FSDPEngine", "FSDPJoinable"]


class _ShadowHook(JoinHook):
    def __init__(self, joinable: FSDPJoinable) -> None:
        self.joinable = joinable

    def main_hook(self) -> None:
        """One shadow iteration: the same forward/backward collectives as the others' next micro-batch."""
        self.joinable.shadow_iteration()


class FSDPJoinable(Joinable):
    """Makes an FSDP2 model joinable for one step at a time (see the module docstring)."""

    def __init__(self, engine: FSDPEngine) -> None:
        super().__init__()
        self.engine = engine
        self.iteration = 0
        self.iterations = 0
        self.loss_fn: LossFn | None = None
        self.shadow: Callable[[], Any] = lambda: None

    def begin(self, batch: GlobalBatch, loss_fn: LossFn) -> None:
        self.iteration, self.iterations = 0, max(batch.plan.counts())
        self.loss_fn, self.shadow = loss_fn, batch.shadow

    def sync_now(self) -> bool:
        """Gradients are reduce-scattered on the step's last iteration only (accumulated before)."""
        return self.iteration == self.iterations - 1

    def shadow_iteration(self) -> None:
        assert self.loss_fn is not None
        self.engine.model.set_requires_gradient_sync(self.sync_now())
        loss = self.loss_fn(self.engine.model, to_device(self.shadow(), self.engine.device))
        (loss * 0.0).backward()
        self.iteration += 1

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _ShadowHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.engine.device

    @property
    def join_process_group(self) -> Any:
        return self.engine.group or dist.group.WORLD


def _default_shard(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Shard each direct child that holds parameters, then the root (FSDP2's usual recipe)."""
    return [m for m in model.children() if any(True for _ in m.parameters())]


class FSDPEngine(Engine):
    """FSDP2 with summed gradients and shadow passes for ranks with fewer micro-batches.

    Args:
        model: the module (moved to ``device``, then sharded in place).
        optimizer_class, optimizer_kwargs: the optimizer, built over the sharded parameters.
        device: where the model lives.
        group: unused with FSDP2 (the world mesh is used); must be None.
        shard: returns the sub-modules to ``fully_shard`` before the root (default: its direct children).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        shard: Callable[[torch.nn.Module], list[torch.nn.Module]] = _default_shard,
    ) -> None:
        if group is not None:
            raise EngineError("the fsdp engine shards over the whole world; drop the group argument")
        self.device, self.group = device, group
        model = model.to(device)
        for module in shard(model):
            fully_shard(module)
        fully_shard(model)
        self.model = model
        # FSDP2 averages reduce-scattered gradients over the world (a premultiplied sum gloo cannot do otherwise);
        # losses are weighted by the world size to undo it, so gradients are sums as in the DDP engines.
        self.world_size = dist.get_world_size()
        self.optimizer = optimizer_class(model.parameters(), **optimizer_kwargs)
        self.joinable = FSDPJoinable(self)

    @property
    def fsdp(self) -> FSDPModule:
        assert isinstance(self.model, FSDPModule)
        return self.model

    def forward_backward(self, batch: GlobalBatch, loss_fn: LossFn) -> float:
        micros = list(zip(batch.micro_batches, batch.micro_sizes, strict=True))
        total = batch.num_samples
        losses = []  # stay on the device: one sync per step, in loss_sum() below
        joinable = self.joinable
        joinable.begin(batch, loss_fn)
        with Join([joinable]) if batch.plan.uneven else nullcontext():
            for micro, n in micros:
                if batch.plan.uneven:
                    Join.notify_join_context(joinable)
                self.fsdp.set_requires_gradient_sync(joinable.sync_now())
                micro = to_device(micro, self.device)
                losses.append(weighted_backward(self.model, loss_fn, micro, n, total, self.world_size))
                joinable.iteration += 1
        self.fsdp.set_requires_gradient_sync(True)
        self.shadowed = len(micros) < joinable.iterations
        return loss_sum(losses)
