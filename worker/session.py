"""The session a training script opens: reads the env contract, initialises the process group, and hands out engines
and elastic loaders. Works under the pliant agent, under torchrun, and as a single plain process.

    session = pliant.worker.init()
    engine = session.engine(model, "ddp", torch.optim.SGD, lr=0.1)
    for batch in session.loader(dataset, global_batch=64, micro_batch=8, max_steps=1000):
        engine.step(batch, lambda model, micro: F.cross_entropy(model(micro[0]), micro[1]))
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from pliant.env import WorkerEnv
from pliant.worker.contract import Engine, EngineError, EngineKind
from pliant.worker.data import ElasticLoader, ElasticSampler

__all__ = ["Session", "init"]

logger = logging.getLogger(__name__)


class Session:
    """One worker process's view of the job.

    Args:
        env: the env contract (default: read once from the environment).
        backend: ``gloo`` or ``nccl`` (default: nccl when CUDA is available, else gloo).
        timeout_s: collective timeout.
    """

    def __init__(self, env: WorkerEnv | None = None, backend: str | None = None, timeout_s: float = 600.0) -> None:
        self.env = env or WorkerEnv.from_env()
        cuda = torch.cuda.is_available()
        self.backend = backend or ("nccl" if cuda else "gloo")
        if self.backend == "nccl":
            self.device = torch.device("cuda", self.env.local_rank % max(1, torch.cuda.device_count()))
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            timeout = timedelta(seconds=timeout_s)
            if self.env.master_port:
                dist.init_process_group(self.backend, rank=self.env.rank, world_size=self.env.world_size,
                                        timeout=timeout)  # fmt: skip
            else:  # a plain single process: no store to meet at
                dist.init_process_group(self.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        logger.info("rank %d/%d (generation %d, %s on %s)", self.rank, self.world_size, self.env.generation,
                    self.backend, self.device)  # fmt: skip

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    def engine(
        self,
        model: torch.nn.Module,
        kind: str | EngineKind = EngineKind.DDP,
        optimizer: type[torch.optim.Optimizer] = torch.optim.SGD,
        **optimizer_kwargs: Any,
    ) -> Engine:
        """Wrap ``model`` and build its optimizer.

        Raises:
            EngineError: an unknown kind.
        """
        try:
            kind = EngineKind(kind)
        except ValueError:
            raise EngineError(f"engine {kind!r} is unknown; use one of {[k.value for k in EngineKind]}") from None
        if kind is EngineKind.FSDP:
            from pliant.worker.fsdp import FSDPEngine

            return FSDPEngine(model, optimizer, optimizer_kwargs, self.device)
        from pliant.worker.engines import DDPEngine, ZeroEngine

        cls = ZeroEngine if kind is EngineKind.ZERO else DDPEngine
        return cls(model, optimizer, optimizer_kwargs, self.device)

    def loader(
        self,
        dataset: Dataset,
        global_batch: int,
        micro_batch: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        max_steps: int | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
    ) -> ElasticLoader:
        """An exactly-once elastic loader over ``dataset`` for this rank (see :mod:`pliant.worker.data`)."""
        sampler = ElasticSampler(len(dataset), global_batch, micro_batch, seed, shuffle, drop_last)  # type: ignore[arg-type]
        return ElasticLoader(dataset, sampler, self.rank, self.world_size, max_steps, collate_fn, num_workers,
                             pin_memory=self.device.type == "cuda")  # fmt: skip

    def all_reduce_sum(self, value: float) -> float:
        """Sum ``value`` over every rank (e.g. ``engine.step``'s return, for the global mean loss)."""
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return float(tensor.item())

    def close(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def init(**kwargs: Any) -> Session:
    """Open the worker session (see :class:`Session`)."""
    return Session(**kwargs)
