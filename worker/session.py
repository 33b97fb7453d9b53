"""The session a training script opens: reads the env contract, initialises the process group, and hands out engines
and elastic loaders. Works under the pliant agent, under torchrun, and as a single plain process.

    session = pliant.worker.init()
    engine = session.engine(model, "ddp", torch.optim.SGD, lr=0.1)
    for batch in session.loader(dataset, global_batch=64, micro_batch=8, max_steps=1000):
        engine.step(batch, lambda model, micro: F.cross_entropy(model(micro[0]), micro[1]))
"""

from __future__ import annotations

import faulthandler
import logging
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

from pliant.env import STACKS_SIGNAL, WorkerEnv
from pliant.logsetup import setup_library_logging
from pliant.worker.checkpoint import CheckpointError, CheckpointManager
from pliant.worker.contract import LOCAL, Engine, EngineError, EngineKind, Runner
from pliant.worker.data import ElasticLoader, ElasticSampler
from pliant.worker.inplace import nccl
from pliant.worker.inplace.groups import retire_groups
from pliant.worker.inplace.protocol import Protocol
from pliant.worker.inplace.world import World
from pliant.worker.metrics import WorkerMetrics

__all__ = ["Session", "init"]

logger = logging.getLogger(__name__)


def settle_gloo_threads(timeout_s: float = 2.0) -> None:
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
        backend: ``gloo`` or ``nccl`` (default: nccl on GPU ``LOCAL_RANK`` when every process on the node has a GPU of
            its own, else gloo on the CPU; :func:`pliant.worker.inplace.nccl.plan_device`).
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
        env = env or WorkerEnv.from_env()
        if env.under_agent:
            setup_library_logging()
        self.metrics = WorkerMetrics(env, registry)
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        plan = nccl.plan_device(backend, env.local_rank, env.local_world_size, gpus)
        if plan.warning and env.local_rank == 0:
            logger.warning("%s", plan.warning)
        self.backend = plan.backend
        if plan.cuda_index is None:
            self.device = torch.device("cpu")
        else:
            self.device = torch.device("cuda", plan.cuda_index)
            torch.cuda.set_device(self.device)
        self.world = World(env, self.backend, timedelta(seconds=timeout_s), self.metrics.progress)
        self._owns_group = not dist.is_initialized()
        nccl.prepare(self.backend, self.world.in_place)
        self._group_pending = self._owns_group
        # Under an agent, every engine step runs through the rescale protocol (pliant.worker.inplace.protocol).
        self.protocol: Protocol | None = None
        if env.under_agent and self._owns_group:
            self.protocol = Protocol(self.world, self.device, self.metrics, rescale_in_place=env.rescale == "in-place")
        self._runner: Runner = self.protocol or LOCAL
        # A fresh worker of a later generation may be joining a running world, whose survivors wait for it from the
        # moment it counts itself in: it meets them only when the script first needs the group (``engine()``,
        # ``loader()``, ``checkpoints()``, a collective), so building the model does not lengthen their pause.
        if not (self.world.in_place and env.generation > 1):
            self._meet()
        if env.under_agent and threading.current_thread() is threading.main_thread():
            faulthandler.register(STACKS_SIGNAL, all_threads=True)  # the agent's "dump your stacks" (hangs)
        logger.info(
            "rank %d/%d (generation %d, %s on %s)",
            self.rank,
            self.world_size,
            env.generation,
            self.backend,
            self.device,
        )

    @property
    def env(self) -> WorkerEnv:
        """The env of the world this process is in now (a newer generation's after a rescale in place)."""
        return self.world.env

    def _meet(self) -> None:
        """Join the world now, if that was left for the first moment the script needs it (see ``__init__``)."""
        if not self._group_pending:
            return
        self._group_pending = False
        if self.world.in_place:
            self.world.announce_arrival()
        if self.protocol is not None and self.world.in_place:
            self.protocol.form_group()  # follows a newer generation handed over while the ranks meet
        else:
            self.world.meet()
        if self.protocol is not None:
            self.protocol.joined()

    @property
    def rank(self) -> int:
        return self.env.rank if self._group_pending else dist.get_rank()

    @property
    def world_size(self) -> int:
        return self.env.world_size if self._group_pending else dist.get_world_size()

    def engine(
        self,
        model: torch.nn.Module,
        kind: str | EngineKind = EngineKind.DDP,
        optimizer: type[torch.optim.Optimizer] = torch.optim.SGD,
        *,
        scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        shard_group: int | None = None,
        **optimizer_kwargs: Any,
    ) -> Engine:
        """Wrap ``model`` and build its optimizer (``optimizer(params, **optimizer_kwargs)``).

        Args:
            scheduler: builds the learning-rate scheduler over the optimizer, e.g. ``lambda opt:
                torch.optim.lr_scheduler.StepLR(opt, 100)``. The engine steps it after every committed step (do not
                step it yourself) and keeps its state with the optimizer's: in checkpoints, for newcomers, and in a
                sharded engine's roll back (:meth:`Engine.use_scheduler`).
            shard_group: ``"hsdp"`` only: the ranks each replica's shards are cut over (default: this node's ranks,
                ``LOCAL_WORLD_SIZE``); every world size of the job must be a multiple of it.

        Raises:
            EngineError: an unknown kind, a scheduler that steps on a metric, or a shard group for another kind than
                ``"hsdp"``.
        """
        try:
            kind = EngineKind(kind)
        except ValueError:
            raise EngineError(f"engine {kind!r} is unknown; use one of {[k.value for k in EngineKind]}") from None
        if shard_group is not None and kind is not EngineKind.HSDP:
            raise EngineError(f"shard_group={shard_group} is for the hsdp engine only; drop it for {kind.value!r}")
        engine: Engine
        if kind is EngineKind.HSDP:
            from pliant.worker.hsdp import HSDPEngine

            self._meet()
            group = shard_group if shard_group is not None else self.env.local_world_size
            engine = HSDPEngine(
                model, optimizer, optimizer_kwargs, self.device, group, runner=self._runner, track=self.world.tracked
            )
        elif kind is EngineKind.FSDP:
            from pliant.worker.fsdp import FSDPEngine

            self._meet()
            engine = FSDPEngine(model, optimizer, optimizer_kwargs, self.device, runner=self._runner)
        else:
            from pliant.worker.engines import DDPEngine, ZeroEngine

            cls = ZeroEngine if kind is EngineKind.ZERO else DDPEngine
            # Not met yet: most likely a newcomer, whose survivors wait for it from the meeting on (see __init__).
            prepared = cls.prepare(model, optimizer, optimizer_kwargs, self.device) if self._group_pending else None
            self._meet()
            joining = self.protocol is not None and self.protocol.pending_sync  # its state comes from peers
            if prepared is not None and not joining:
                prepared.state.clear()  # no peer holds state: the optimizer starts fresh (or from a checkpoint)
            engine = cls(
                model,
                optimizer,
                optimizer_kwargs,
                self.device,
                init_sync=not joining,
                prepared=prepared,
                runner=self._runner,
            )
        engine.metrics = self.metrics
        if scheduler is not None:
            engine.use_scheduler(scheduler)
        if self.protocol is not None:
            self.protocol.add_engine(engine)
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
        self._meet()
        sampler = ElasticSampler(len(dataset), global_batch, micro_batch, seed, shuffle, drop_last)  # type: ignore[arg-type]
        loader = ElasticLoader(
            dataset,
            sampler,
            self.rank,
            self.world_size,
            max_steps,
            collate_fn,
            num_workers,
            pin_memory=self.device.type == "cuda",
            runner=self._runner,
        )
        if self.protocol is not None:
            self.protocol.add_loader(loader)
        return loader

    def checkpoints(
        self,
        engine: Engine,
        loader: ElasticLoader | None = None,
        directory: str | None = None,
        every_steps: int = 0,
        keep: int = 3,
        async_save: bool = True,
        allow_fresh_start: bool | None = None,
        direct_io: bool = True,
    ) -> CheckpointManager:
        """A checkpoint manager for this job (see :mod:`pliant.worker.checkpoint`).

        Args:
            engine, loader: what to save.
            directory: default: the agent's ``--checkpoint-dir`` (PLIANT_CHECKPOINT_DIR).
            every_steps: periodic saves (0: only on rescale).
            keep, async_save, allow_fresh_start, direct_io: see :class:`CheckpointManager` (``allow_fresh_start``
                default: the agent's ``--allow-fresh-start``).

        Raises:
            CheckpointError: no directory.
        """
        self._meet()
        directory = directory or self.env.checkpoint_dir
        if not directory:
            raise CheckpointError("no checkpoint directory: pass directory=... or run with --checkpoint-dir DIR")
        env = self.env
        fresh = env.allow_fresh_start if allow_fresh_start is None else allow_fresh_start
        manager = self.world.tracked(
            lambda: CheckpointManager(
                directory,
                engine,
                loader,
                job_id=env.job_id,
                generation=env.generation,
                keep=keep,
                async_save=async_save,
                every_steps=every_steps,
                metrics=self.metrics,
                allow_fresh_start=fresh,
                incarnation=env.incarnation,
                direct_io=direct_io,
                key=bytes.fromhex(env.checkpoint_key),
                runner=self._runner,
                control_key=bytes.fromhex(env.control_key),
                warrant=env.warrant,
                published_at=env.published_at,
            )
        )
        if self.protocol is not None:  # rescales (in place, or the restart path's save) happen in engine.step
            self.protocol.add_part(manager)
        return manager

    def all_reduce_sum(self, value: float) -> float:
        """Sum ``value`` over every rank (e.g. ``engine.step``'s return, for the global mean loss).

        In place, a peer that fails during it costs nothing but this one sum: this rank's own ``value`` is returned
        and the next ``engine.step`` re-forms the world first (a collective of the script's own between steps has no
        such protection: use this one)."""
        self._meet()
        started = time.perf_counter()
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        try:
            if self.protocol is not None:
                self.protocol.guarded(lambda: dist.all_reduce(tensor))
            else:
                dist.all_reduce(tensor)
            total = float(tensor.item())
        except RuntimeError as exc:  # a peer died between steps: the next engine.step re-forms and goes on
            if not self._runner.peer_failed(exc, started):
                raise
            logger.warning(
                "rank %d: a peer failed during all_reduce_sum; returning this rank's own value (%g)",
                self.env.rank,
                value,
            )
            return value
        self.metrics.observe_collective("control", time.perf_counter() - started)
        return total

    def close(self) -> None:
        """Destroy the process groups this session created.

        The groups are never freed (:func:`pliant.worker.inplace.groups.retire_groups`): a gloo group's destructor joins
        its worker threads, and a worker thread that needs the GIL as it exits either deadlocks with the destroying
        thread (when a DDP reducer drops the group as the training function returns) or, during interpreter shutdown,
        is ended by Python with ``pthread_exit`` inside a ``noexcept`` frame, which aborts the process ("terminate
        called without an active exception").
        """
        self.metrics.progress.write(self.metrics.progress.step, "done")
        if self.protocol is not None:
            self.protocol.close()
        if self._group_pending:  # never needed the world: it is not waited for either (a script that did nothing)
            return
        if self._owns_group and dist.is_initialized():
            retire_groups()
            settle_gloo_threads()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def init(**kwargs: Any) -> Session:
    """Open the worker session (see :class:`Session`)."""
    return Session(**kwargs)
