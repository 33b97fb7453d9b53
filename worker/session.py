"""The session a training script opens: reads the env contract, initialises the process group, and hands out engines
and elastic loaders. Works under the pliant agent, under torchrun, and as a single plain process.

    session = pliant.worker.init()
    engine = session.engine(model, "ddp", torch.optim.SGD, lr=0.1)
    for batch in session.loader(dataset, global_batch=64, micro_batch=8, max_steps=1000):
        engine.step(batch, lambda model, micro: F.cross_entropy(model(micro[0]), micro[1]))
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry
from torch.utils.data import Dataset

from pliant.env import RESCALE_SIGNAL, STACKS_SIGNAL, WorkerEnv
from pliant.worker.checkpoint import CheckpointError, CheckpointManager
from pliant.worker.contract import Engine, EngineError, EngineKind
from pliant.worker.data import ElasticLoader, ElasticSampler
from pliant.worker.metrics import WorkerMetrics

__all__ = ["Session", "init"]

logger = logging.getLogger(__name__)

_RETIRED_GROUPS: list[object] = []  # groups whose destructor must never run; see Session.close


def _settle_gloo_threads(timeout_s: float = 2.0) -> None:
    """Give gloo's worker threads (``pt_gloo_runloop``) the GIL to finish a collective's clean-up before the script
    may end: such a thread drops the last reference to a collective's tensors after the caller's wait returned, which
    needs the GIL, and a thread that asks for the GIL while the interpreter finalizes is ended in a ``noexcept`` frame
    (an abort). Polls /proc (Linux) with the GIL released until no such thread runs, for at most ``timeout_s``."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return
    deadline, quiet = time.monotonic() + timeout_s, 0
    while quiet < 3 and time.monotonic() < deadline:
        running = False
        for task in tasks.iterdir():
            try:
                if (task / "comm").read_text().startswith("pt_gloo_runloop"):
                    running |= (task / "stat").read_text().rsplit(")", 1)[1].split()[0] == "R"
            except OSError:  # the thread ended meanwhile
                continue
        quiet = 0 if running else quiet + 1
        time.sleep(0.002)


class Session:
    """One worker process's view of the job.

    Args:
        env: the env contract (default: read once from the environment).
        backend: ``gloo`` or ``nccl`` (default: nccl when CUDA is available, else gloo).
        timeout_s: collective timeout.
        registry: where the worker's metrics go (default: a new registry; under the agent they also land in the
            node's multiprocess directory, which the agent serves).

    Attributes:
        metrics: the worker's metrics; ``session.metrics.publish(loss=...)`` publishes your own values.
    """

    def __init__(
        self,
        env: WorkerEnv | None = None,
        backend: str | None = None,
        timeout_s: float = 600.0,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.env = env or WorkerEnv.from_env()
        self.metrics = WorkerMetrics(self.env, registry)
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
        self._rescale_asked = False
        if self.env.agent_store and threading.current_thread() is threading.main_thread():
            faulthandler.register(STACKS_SIGNAL, all_threads=True)  # the agent's "dump your stacks" (hangs)
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
        engine: Engine
        if kind is EngineKind.FSDP:
            from pliant.worker.fsdp import FSDPEngine

            engine = FSDPEngine(model, optimizer, optimizer_kwargs, self.device)
        else:
            from pliant.worker.engines import DDPEngine, ZeroEngine

            cls = ZeroEngine if kind is EngineKind.ZERO else DDPEngine
            engine = cls(model, optimizer, optimizer_kwargs, self.device)
        engine.metrics = self.metrics
        return engine

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

    def _on_rescale_signal(self, signum: int, frame: object) -> None:
        self._rescale_asked = True

    def rescale_requested(self) -> bool:
        """True on every rank once any rank's agent asked for a rescale: one one-integer all-reduce (collective)."""
        started = time.perf_counter()
        flag = torch.tensor([int(self._rescale_asked)], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        asked = bool(flag.item())
        self.metrics.observe_collective("control", time.perf_counter() - started)
        return asked

    def checkpoints(
        self,
        engine: Engine,
        loader: ElasticLoader | None = None,
        directory: str | None = None,
        every_steps: int = 0,
        keep: int = 3,
        async_save: bool = True,
        allow_fresh_start: bool | None = None,
    ) -> CheckpointManager:
        """A checkpoint manager for this job (see :mod:`pliant.worker.checkpoint`).

        Args:
            engine, loader: what to save.
            directory: default: the agent's ``--checkpoint-dir`` (PLIANT_CHECKPOINT_DIR).
            every_steps: periodic saves (0: only on rescale).
            keep, async_save, allow_fresh_start: see :class:`CheckpointManager` (``allow_fresh_start`` default: the
                agent's ``--allow-fresh-start``).

        Raises:
            CheckpointError: no directory.
        """
        directory = directory or self.env.checkpoint_dir
        if not directory:
            raise CheckpointError("no checkpoint directory: pass directory=... or run with --checkpoint-dir DIR")
        rescale = self.rescale_requested if self.env.agent_store else None
        if rescale is not None and threading.current_thread() is threading.main_thread():
            # The agent's "checkpoint and exit". Only a loop with a checkpoint manager can answer it; without one the
            # signal keeps its default action, so the worker stops at once and a rescale never waits out the grace.
            signal.signal(RESCALE_SIGNAL, self._on_rescale_signal)
        env = self.env
        fresh = env.allow_fresh_start if allow_fresh_start is None else allow_fresh_start
        return CheckpointManager(directory, engine, loader, job_id=env.job_id, generation=env.generation, keep=keep,
                                 async_save=async_save, every_steps=every_steps, rescale=rescale,
                                 metrics=self.metrics,
                                 allow_fresh_start=fresh,
                                 epoch=env.job_epoch)  # fmt: skip

    def all_reduce_sum(self, value: float) -> float:
        """Sum ``value`` over every rank (e.g. ``engine.step``'s return, for the global mean loss)."""
        started = time.perf_counter()
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        total = float(tensor.item())
        self.metrics.observe_collective("control", time.perf_counter() - started)
        return total

    def close(self) -> None:
        """Destroy the process groups this session created.

        The groups are never freed: a gloo group's destructor joins its worker threads, and a worker thread that
        needs the GIL as it exits either deadlocks with the destroying thread (when a DDP reducer drops the group as
        the training function returns) or, during interpreter shutdown, is ended by Python with ``pthread_exit``
        inside a ``noexcept`` frame, which aborts the process ("terminate called without an active exception", seen
        under torchrun on a loaded machine). One reference per group is leaked on purpose, so the destructor never
        runs; the threads stay parked until the process exits.
        """
        self.metrics.progress.write(self.metrics.progress.step, "done")
        if self._owns_group and dist.is_initialized():
            for group in dist.distributed_c10d._world.pg_map:
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
                _RETIRED_GROUPS.append(group)
            dist.destroy_process_group()
            _settle_gloo_threads()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def init(**kwargs: Any) -> Session:
    """Open the worker session (see :class:`Session`)."""
    return Session(**kwargs)
