"""Lightning under pliant with one line: ``Trainer(strategy=pliant.lightning.DDP(), ...)`` (or ``FSDP()``).

A Lightning ``Trainer`` counts its world as ``devices * num_nodes``, fixed when the script starts; under ``pliant run
--nnodes MIN:MAX`` nodes come and go, and a ``Trainer(strategy="ddp", num_nodes=1)`` fails the first join ("You set
devices=1 and num_nodes=1 ... does not match the world size (2)"). These strategies are Lightning's own DDP and FSDP
strategies with three changes, and nothing else for the script to write:

- **The world follows the generation.** ``num_nodes`` is the generation's node count (``GROUP_WORLD_SIZE``) and the
  node's devices one per local process (``--nproc-per-node``: ``cuda:LOCAL_RANK``, or the CPU), whatever the script
  passed, so Lightning's checks, its ranks and its ``DistributedSampler`` (``num_replicas``) agree with the world the
  agent formed.
- **A rescale saves at a step boundary.** The strategy takes the rescale signal (:mod:`pliant.integration`) and at
  the start of training batches (about every 0.1 s) the ranks vote on whether one was asked. When one was, every
  rank saves a Lightning checkpoint (``Trainer.save_checkpoint``: Lightning's own format, as its SLURM requeue path
  does) and exits with :data:`pliant.env.RESCALE_EXIT_CODE`, which the agent takes for "saved for the rescale", not a
  failure. The batch whose start it was is not trained: it is the first one of the next world.
- **The next world resumes from the newest complete checkpoint.** When the script passed no ``ckpt_path``, the fit
  resumes from the newest (by modification time) complete checkpoint of the job: the rescale checkpoint, or, in a
  generation after the job's first, one the script's own ``ModelCheckpoint`` callbacks wrote (``*.ckpt`` in their
  ``dirpath``, ``last.ckpt`` included): weights, optimizer, loop progress (``global_step``), callbacks. Complete: a
  whole ``torch.save`` archive (its zip directory, written last, is there), so a file cut short by a kill is passed
  over. The rescale checkpoint is ``<--checkpoint-dir>/lightning/rescale.ckpt`` (the directory every node shares),
  else under the trainer's ``default_root_dir``; it is written to a temporary name and renamed by global rank 0, so a
  kill during the save leaves the previous one. Every rank chooses by itself, so the script's checkpoint directory
  must be one every node sees (as Lightning's own resume needs). Like Lightning's own resume from an HPC checkpoint
  the rescale checkpoint is found by its place: a job started on a directory that holds another run's rescale
  checkpoint resumes from it, so give each job its own ``--checkpoint-dir``.

- **Every sample once, and the global batch the script chose.** Under an agent the training ``DataLoader`` is
  replaced by a :class:`pliant.data.GlobalBatchLoader` over the same dataset, batch size, workers and collation: its
  position in the sample stream is a function of ``trainer.global_step``, saved in the Lightning checkpoint with the
  fit loop's state, so a world of any size resumes at the next unseen sample (see :mod:`pliant.data`). With
  ``global_batch=N`` the strategy sets ``accumulate_grad_batches`` so that batch size x accumulation x world = N at
  every world size, and refuses, naming the numbers, a world that cannot divide N; without it the global batch is
  batch size x ``accumulate_grad_batches`` x world, as in Lightning. The epoch loop's batch counters are set to the
  resumed step's place in its epoch, in the new world's batches. The rescale vote and its save happen at the start of
  an optimizer step (a batch whose index is a multiple of the accumulation).

A worker killed (kill -9, a lost node) gets no such save: the next world resumes from the newest of the last rescale
checkpoint and the script's own checkpoints, and redoes the steps since, on the same samples.

Outside a pliant agent (torchrun, a plain process) the strategies are Lightning's, unchanged, except that with
``global_batch`` they install the same loader and accumulation (so a static run trains the same steps).

The Lightning checkpoint is a pickle (``torch.save``), the script's own file as with any Lightning run: pliant neither
seals nor reads it (docs/operations.md, "Checkpoints are data").
"""

from __future__ import annotations

import logging
import os
import sys
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler

from pliant.data import GlobalBatchLoader
from pliant.env import RESCALE_EXIT_CODE, WorkerEnv
from pliant.errors import PliantError
from pliant.integration import RescaleRequest

try:
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
except ImportError:  # the older package name
    from pytorch_lightning.strategies import DDPStrategy, FSDPStrategy  # type: ignore[no-redef]

__all__ = ["DDP", "FSDP", "LightningError", "complete", "newest_checkpoint", "rescale_checkpoint"]

logger = logging.getLogger(__name__)

CHECKPOINT = Path("lightning") / "rescale.ckpt"  # under the job's checkpoint directory


class LightningError(PliantError):
    """This Lightning keeps what the strategy needs elsewhere."""


def rescale_checkpoint(env: WorkerEnv, default_root_dir: str) -> Path:
    """Where a rescale checkpoint of this job goes: under the job's checkpoint directory (shared by the nodes), else
    under the trainer's ``default_root_dir``."""
    return Path(env.checkpoint_dir or default_root_dir) / CHECKPOINT


class _Elastic:
    """What :class:`DDP` and :class:`FSDP` add to Lightning's strategies (see the module docstring).

    Threads: the main thread only (the rescale signal's flag is :class:`pliant.integration.RescaleRequest`'s).
    """

    _rescale: RescaleRequest
    _num_nodes: int
    _global_batch: int | None
    _loader: GlobalBatchLoader | None

    def _init_elastic(self, global_batch: int | None) -> None:
        if global_batch is not None and global_batch < 1:
            raise LightningError(f"global_batch={global_batch} must be >= 1 (or None: batch size x world)")
        self._rescale = RescaleRequest()
        self._global_batch = global_batch
        self._loader = None

    @property
    def _env(self) -> WorkerEnv:
        return self._rescale.env

    @property
    def _under_agent(self) -> bool:
        rescale = getattr(self, "_rescale", None)  # None while Lightning's own __init__ runs
        return rescale is not None and rescale.under_agent

    @property
    def num_nodes(self) -> int:
        """The generation's node count under a pliant agent, else what the script set."""
        return self._env.num_nodes if self._under_agent else self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes  # Lightning resets ranks from num_nodes; under an agent the env decides

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """This node's devices: under a pliant agent one per local process (``--nproc-per-node``), of the kind the
        script asked for (``cuda:i`` for local rank ``i``, or the CPU), whatever ``devices`` it passed."""
        devices = getattr(self, "_parallel_devices", None)
        if not self._under_agent or not devices or len(devices) == self._env.local_world_size:
            return devices
        if devices[0].type == "cuda":
            return [torch.device("cuda", i) for i in range(self._env.local_world_size)]
        return [devices[0]] * self._env.local_world_size

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        self._parallel_devices = devices

    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]
        if not self._under_agent:
            return
        self._rescale.listen()
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        path = rescale_checkpoint(self._env, trainer.default_root_dir)
        if path.exists() or self._env.generation > 1:
            _resume_newest(trainer, path, scripts=self._env.generation > 1)

    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        if trainer.training and (self._under_agent or self._global_batch is not None):
            dataloader = self._exactly_once(trainer, dataloader)
        return dataloader

    def _exactly_once(self, trainer: Any, dataloader: object) -> object:
        """The training loader as a :class:`pliant.data.GlobalBatchLoader` (see the module docstring); a loader it
        cannot replace (an iterable dataset, a batch sampler of the script's own) is kept, with a warning.

        Raises:
            pliant.data.DataError: this world cannot divide ``global_batch``.
        """
        if isinstance(dataloader, GlobalBatchLoader):
            loader = dataloader
            loader.global_batch_sampler.step_fn = lambda: trainer.global_step
        elif not isinstance(dataloader, DataLoader) or dataloader.batch_size is None:
            logger.warning(
                "pliant: the training loader (%s) has no batch size of its own (a batch sampler, or not a "
                "DataLoader), so its samples after a rescale are Lightning's: pass a DataLoader with batch_size",
                type(dataloader).__name__,
            )
            return dataloader
        elif isinstance(dataloader.dataset, IterableDataset):
            logger.warning(
                "pliant: the training dataset is iterable, so pliant cannot resume it at the next unseen sample; "
                "use a map-style dataset (with __len__ and __getitem__) for exactly-once data"
            )
            return dataloader
        else:
            loader = _global_batch_loader(dataloader, self, trainer)
        sampler = loader.global_batch_sampler
        trainer.accumulate_grad_batches = sampler.accumulation_for_framework(
            "accumulate_grad_batches", trainer.accumulate_grad_batches
        )
        logger.info("pliant: exactly-once data: %s", sampler.describe())
        self._loader = loader
        return loader

    def on_train_start(self) -> None:
        super().on_train_start()  # type: ignore[misc]
        loader = self._loader
        if loader is not None and loader.global_batch_sampler.resumed_from is not None:
            _align_epoch_counters(self.lightning_module.trainer, loader)  # type: ignore[attr-defined]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        at_step_start = batch_idx % trainer.accumulate_grad_batches == 0
        if self._under_agent and at_step_start and self._rescale.agreed(self.root_device):  # type: ignore[attr-defined]
            self._save_and_exit()

    def _save_and_exit(self) -> None:
        """Every rank saves the Lightning checkpoint at this batch's start, then exits for the rescale."""
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        path = rescale_checkpoint(self._env, trainer.default_root_dir)
        partial = path.with_name(f".{path.name}.partial")
        if trainer.is_global_zero:
            path.parent.mkdir(parents=True, exist_ok=True)
        self.barrier("pliant-rescale-save")  # type: ignore[attr-defined]
        trainer.save_checkpoint(partial)
        self.barrier("pliant-rescale-saved")  # type: ignore[attr-defined]
        if trainer.is_global_zero:
            os.replace(partial, path)
            logger.info("pliant: saved for the rescale at global step %d: %s", trainer.global_step, path)
        self.barrier("pliant-rescale-renamed")  # type: ignore[attr-defined]
        sys.exit(RESCALE_EXIT_CODE)


def _global_batch_loader(dataloader: DataLoader, strategy: _Elastic, trainer: Any) -> GlobalBatchLoader:
    """A :class:`pliant.data.GlobalBatchLoader` over ``dataloader``'s dataset, batch size, workers and collation, in
    its order (shuffled or not, with the seed of the ``DistributedSampler`` Lightning put in, else 0), stepping with
    ``trainer.global_step``."""
    sampler = dataloader.sampler
    if isinstance(sampler, DistributedSampler):
        shuffle, seed = sampler.shuffle, sampler.seed
    else:
        shuffle, seed = isinstance(sampler, RandomSampler), 0
    extra: dict[str, Any] = {}
    if dataloader.num_workers > 0:
        extra = {"prefetch_factor": dataloader.prefetch_factor, "persistent_workers": dataloader.persistent_workers}
    return GlobalBatchLoader(
        dataloader.dataset,
        int(dataloader.batch_size or 1),
        strategy._global_batch,
        accumulation=trainer.accumulate_grad_batches,
        seed=seed,
        shuffle=shuffle,
        rank=trainer.global_rank,
        world_size=trainer.world_size,
        step_fn=lambda: trainer.global_step,
        num_workers=dataloader.num_workers,
        collate_fn=dataloader.collate_fn,
        pin_memory=dataloader.pin_memory,
        timeout=dataloader.timeout,
        worker_init_fn=dataloader.worker_init_fn,
        multiprocessing_context=dataloader.multiprocessing_context,
        generator=dataloader.generator,
        **extra,
    )


def _align_epoch_counters(trainer: Any, loader: GlobalBatchLoader) -> None:
    """Set the epoch loop's batch counters to the resumed step's place in its epoch, counted in this world's batches
    (``(global_step % steps_per_epoch) * accumulation``), so that Lightning's accumulation boundaries and the epoch's
    end fall where the loader's steps do. A checkpoint saved at a batch's end makes Lightning count that batch once
    more as it restarts: the counters are set one short of the place, and at an epoch's end to the batch that ends
    it."""
    sampler = loader.global_batch_sampler
    epoch_loop = trainer.fit_loop.epoch_loop
    in_epoch = trainer.global_step % sampler.steps_per_epoch
    done = in_epoch * sampler.accumulation
    if getattr(epoch_loop, "restarted_on_train_batch_end", False):
        done = (in_epoch or sampler.steps_per_epoch) * sampler.accumulation - 1
    current = epoch_loop.batch_progress.current
    current.ready = current.started = current.processed = current.completed = done
    logger.info(
        "pliant: resumed at step %d, position %d of the sample stream: batch %d of %d of this epoch",
        trainer.global_step,
        sampler.cursor.position(trainer.global_step),
        in_epoch * sampler.accumulation,
        len(sampler),
    )


def complete(path: Path) -> bool:
    """Whether ``path`` is a whole ``torch.save`` archive: its zip directory, written last, is there (nothing is
    unpickled)."""
    try:
        return path.is_file() and zipfile.is_zipfile(path)
    except OSError:
        return False


def newest_checkpoint(trainer: Any, rescale: Path, scripts: bool = True) -> Path | None:
    """The newest complete checkpoint of this fit, by modification time: ``rescale``, or (``scripts``) a ``*.ckpt``
    that one of the trainer's ``ModelCheckpoint`` callbacks writes to its ``dirpath``; None when there is none."""
    candidates = [rescale]
    if scripts:
        for callback in getattr(trainer, "checkpoint_callbacks", None) or []:
            dirpath = getattr(callback, "dirpath", None)
            if dirpath and os.path.isdir(dirpath):
                candidates += sorted(Path(dirpath).glob("*.ckpt"))
    found = [path for path in candidates if complete(path)]
    return max(found, key=lambda path: path.stat().st_mtime, default=None)


def _resume_newest(trainer: Any, rescale: Path, scripts: bool) -> None:
    """Make this fit resume from the newest complete checkpoint (:func:`newest_checkpoint`) unless the script named
    one itself: Lightning chose the fit's path before its strategy is set up, and restores it just after the setup
    hooks (which resolve the ``ModelCheckpoint`` directories), so the restore is pointed at the newest once (the
    checkpoint connector's ``_restore_modules_and_callbacks``).

    Raises:
        LightningError: this Lightning restores elsewhere.
    """
    connector = trainer._checkpoint_connector
    original = getattr(connector, "_restore_modules_and_callbacks", None)
    if original is None:
        raise LightningError(
            "this Lightning restores a fit's checkpoint elsewhere: pass ckpt_path to trainer.fit yourself "
            f"(the rescale checkpoint is {rescale})"
        )

    def restore(checkpoint_path: Any = None, *args: Any, **kwargs: Any) -> Any:
        connector._restore_modules_and_callbacks = original
        if checkpoint_path is None:
            newest = newest_checkpoint(trainer, rescale, scripts)
            if newest is not None:
                which = "the rescale checkpoint" if newest == rescale else "the script's checkpoint"
                logger.info("pliant: resuming from %s %s (the newest complete one)", which, newest)
                checkpoint_path = str(newest)
        return original(checkpoint_path, *args, **kwargs)

    connector._restore_modules_and_callbacks = restore


class DDP(_Elastic, DDPStrategy):
    """Lightning's ``DDPStrategy`` whose world follows pliant's generations (see the module docstring). Takes
    ``DDPStrategy``'s arguments.

    Args:
        global_batch: samples per optimizer step at every world size (None: batch size x accumulation x world).

    Raises:
        LightningError: ``global_batch`` < 1.
    """

    def __init__(self, *args: Any, global_batch: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_elastic(global_batch)


class FSDP(_Elastic, FSDPStrategy):
    """Lightning's ``FSDPStrategy`` whose world follows pliant's generations (see the module docstring). Takes
    ``FSDPStrategy``'s arguments; its rescale checkpoint is a full state dict (``state_dict_type="full"``, the
    default here), so any world size loads it.

    Args:
        global_batch: samples per optimizer step at every world size (None: batch size x accumulation x world).

    Raises:
        LightningError: ``global_batch`` < 1.
    """

    def __init__(self, *args: Any, global_batch: int | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("state_dict_type", "full")
        super().__init__(*args, **kwargs)
        self._init_elastic(global_batch)
