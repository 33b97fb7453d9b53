"""DDP and ZeRO engines: a fixed global batch whatever the world size, with Join for ranks that run out of inputs.

Each micro-batch's mean loss is weighted by ``samples / global samples`` and gradients are *summed* across ranks (a
comm hook), so the update equals the mean gradient over the global batch on any world size. A rank accumulates its
micro-batches under ``no_sync`` and syncs on its last one, so every rank with inputs runs exactly one all-reduce per
step. When some rank has no micro-batch this step (the plan tells every rank), the step's synced iteration runs inside
torch's ``Join`` context: the idle rank's DDP join hook shadows the all-reduce, and pliant's comm hook also delivers
the reduced gradients into the idle rank's ``.grad`` (torch's hook discards them), so every rank steps its optimizer
identically. ZeroRedundancyOptimizer then needs no shadowing: every rank calls ``step()``.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from pliant.worker.contract import Engine, GlobalBatch, LossFn
from pliant.worker.metrics import WorkerMetrics

__all__ = ["DDPEngine", "ZeroEngine", "to_device", "weighted_backward"]

logger = logging.getLogger(__name__)


def to_device(batch: Any, device: torch.device) -> Any:
    """Move the tensors of a (nested list/tuple/dict) batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def weighted_backward(
    model: torch.nn.Module, loss_fn: LossFn, micro: Any, samples: int, total: int, scale: float = 1.0
) -> torch.Tensor:
    """Backward of one micro-batch's mean loss weighted by its share of the global batch (times ``scale``, which
    undoes a collective's averaging); returns loss * samples."""
    loss = loss_fn(model, micro)
    (loss * (samples * scale / total)).backward()
    return loss.detach() * samples


@dataclass
class _HookState:
    group: dist.ProcessGroup | None
    idle: bool = False
    metrics: WorkerMetrics | None = None


def _sum_and_deliver(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations here
    """All-reduce (sum) a gradient bucket; on an idle rank also write the result into the parameters' ``.grad``.

    Args:
        state (_HookState): the engine's hook state.
        bucket (dist.GradBucket): the bucket DDP hands over.

    Returns:
        torch.futures.Future[torch.Tensor]: the summed bucket.
    """
    issued = time.perf_counter()
    work = dist.all_reduce(bucket.buffer(), group=state.group, async_op=True)
    assert work is not None

    def done(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        reduced = fut.value()[0]
        if state.metrics is not None:
            state.metrics.observe_collective("grad_allreduce", time.perf_counter() - issued)
        if state.idle:  # the join hook all-reduced zeros for us and drops the result: keep it
            offset = 0
            for param in bucket.parameters():
                n = param.numel()
                param.grad = reduced[offset : offset + n].view_as(param).clone()
                offset += n
        return reduced

    return work.get_future().then(done)


class DDPEngine(Engine):
    """torch DDP with pliant's sum comm hook.

    Args:
        model: the module (moved to ``device``).
        optimizer_class, optimizer_kwargs: the optimizer to build over the model's parameters.
        device: where the model lives.
        group: the process group (default: the world).
        ddp_kwargs: passed to ``DistributedDataParallel``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer_class: type[torch.optim.Optimizer],
        optimizer_kwargs: dict[str, Any],
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        self.device = device
        device_ids = [device.index] if device.type == "cuda" else None
        self.model = DistributedDataParallel(model.to(device), device_ids=device_ids, process_group=group, **ddp_kwargs)
        self._hook = _HookState(group)
        self.model.register_comm_hook(self._hook, _sum_and_deliver)
        self.optimizer = self._optimizer(optimizer_class, optimizer_kwargs)

    def _optimizer(self, cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> torch.optim.Optimizer:
        return cls(self.model.parameters(), **kwargs)

    def step(self, batch: GlobalBatch, loss_fn: LossFn) -> float:
        started = time.perf_counter()
        self._hook.metrics = self.metrics
        micros = [(to_device(m, self.device), n) for m, n in zip(batch.micro_batches, batch.micro_sizes, strict=True)]
        total = batch.num_samples
        loss_sum: torch.Tensor | float = 0.0  # stays on the device: one sync per step, in float() below
        with self.model.no_sync():
            for micro, n in micros[:-1]:
                loss_sum = loss_sum + weighted_backward(self.model, loss_fn, micro, n, total)
        idle_somewhere = batch.plan.some_rank_idle
        self._hook.idle = idle_somewhere and not micros
        with Join([self.model]) if idle_somewhere else nullcontext():
            if micros:
                loss_sum = loss_sum + weighted_backward(self.model, loss_fn, *micros[-1], total)
        self._hook.idle = False
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss = float(loss_sum)
        self._observe(batch, started, shadow=idle_somewhere and not micros)
        return loss


class ZeroEngine(DDPEngine):
    """DDP with a ZeroRedundancyOptimizer: each rank keeps the optimizer state of its shard of the parameters."""

    def _optimizer(self, cls: type[torch.optim.Optimizer], kwargs: dict[str, Any]) -> torch.optim.Optimizer:
        return ZeroRedundancyOptimizer(self.model.parameters(), optimizer_class=cls, **kwargs)
