"""Hugging Face ``Trainer`` under pliant with one line: ``Trainer(..., callbacks=[pliant.transformers.Elastic()])``.

A ``Trainer`` script runs under ``pliant run`` as it runs under torchrun: Accelerate reads the generation's world from
the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) when the worker starts, and every rescale starts
fresh workers. Without the callback a rescale stops the workers as torchrun does (SIGTERM, then SIGKILL after
``--stop-grace``) and the script resumes from whatever checkpoint it finds itself, redoing the steps since. The
callback adds two things:

- **A rescale saves at a step boundary.** The callback takes the rescale signal (:mod:`pliant.integration`) and at
  the end of optimizer steps (about every 0.1 s) the ranks vote on whether one was asked. When one was, the step is
  saved as a Trainer checkpoint (``<output_dir>/checkpoint-<global_step>``, the Trainer's own format and rotation:
  ``save_total_limit`` applies) and every rank exits with :data:`pliant.env.RESCALE_EXIT_CODE`, which the agent
  takes for "saved for the rescale", not a failure. No step is trained twice after a join or a leave.
- **The next world resumes from the last complete checkpoint.** In every generation after a job's first, when the
  script calls ``trainer.train()`` without ``resume_from_checkpoint`` (or with ``False``), the fit resumes from
  :func:`last_checkpoint` of ``output_dir``: weights, optimizer, scheduler, ``global_step`` and the data position.
  A checkpoint is complete once the Trainer wrote its ``trainer_state.json`` (the last file of a save), so a worker
  killed while saving leaves the one before. A script that names its checkpoint itself keeps it.

- **Every sample once, and the global batch the script chose.** Under an agent the training ``DataLoader`` draws its
  batches from a :class:`pliant.data.GlobalBatchSampler` over the same dataset (the Trainer's collation, workers and
  device placement unchanged): its position in the sample stream is a function of ``state.global_step``, kept in the
  checkpoint's ``trainer_state.json`` (the callback's exportable state), so a world of any size resumes at the next
  unseen sample (see :mod:`pliant.data`). An iteration covers the current epoch from its first step, and the
  Trainer's own skip of the resumed epoch's trained batches (by count, in the new world's batches) lands on the
  resumed step. With ``Elastic(global_batch=N)`` the callback sets ``gradient_accumulation_steps`` so that
  ``per_device_train_batch_size`` x accumulation x world = N at every world size, and refuses, naming the numbers, a
  world that cannot divide N; without it the global batch is the Trainer's (batch x accumulation x world).

A worker killed (kill -9, a lost node) gets no save: the next world resumes from the last complete checkpoint (a
rescale's or a periodic ``save_steps`` one) and redoes the steps since, on the same samples. ``output_dir`` must be a
directory every node reads, as ``--checkpoint-dir`` is (the Trainer writes model and optimizer from global rank 0
only); give each job its own.

Outside a pliant agent (torchrun, a plain process) the callback does nothing, except that with ``global_batch`` it
installs the same sampler and accumulation (so a static run trains the same steps).

A Trainer checkpoint holds pickles (``optimizer.pt``, ``rng_state.pth``), the script's own files as with any Trainer
run: pliant neither seals nor reads them (docs/operations.md, "Checkpoints are data").
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import get_last_checkpoint, seed_worker
from transformers.utils import is_datasets_available

from pliant.data import DataError, GlobalBatchSampler
from pliant.env import RESCALE_EXIT_CODE
from pliant.integration import RescaleRequest

__all__ = ["Elastic", "last_checkpoint"]

logger = logging.getLogger(__name__)

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_STATE = "trainer_state.json"  # the Trainer's TRAINER_STATE_NAME, written last in a save
_FRAMES = 8  # how far above on_init_end the Trainer's __init__ may be (subclasses add a frame each)


def last_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete Trainer checkpoint under ``output_dir``, or None.

    Complete: its ``trainer_state.json`` exists, parses, and names the step in the directory's name.
    """
    folder = Path(output_dir)
    if not folder.is_dir():
        return None
    found = sorted(
        ((int(match.group(1)), child) for child in folder.iterdir() if (match := _CHECKPOINT.match(child.name))),
        reverse=True,
    )
    for step, child in found:
        try:
            state = json.loads((child / _STATE).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(state, dict) and state.get("global_step") == step:
            return child
    return None


class Elastic(TrainerCallback, ExportableState):
    """Make a Trainer elastic under a pliant agent: save at a step boundary on a rescale, resume from the last complete
    checkpoint, every sample once (see the module docstring).

    Args:
        global_batch: samples per optimizer step at every world size (None: the Trainer's batch x accumulation x
            world).

    Raises:
        pliant.data.DataError: ``global_batch`` < 1.

    Threads: the main thread only (the rescale signal's flag is :class:`pliant.integration.RescaleRequest`'s).
    """

    def __init__(self, global_batch: int | None = None) -> None:
        if global_batch is not None and global_batch < 1:
            raise DataError(f"global_batch={global_batch} must be >= 1 (or None: the Trainer's batch x world)")
        self._rescale = RescaleRequest()
        self._saving = False
        self._global_batch = global_batch
        self._sampler: GlobalBatchSampler | None = None
        self._data_state: dict[str, Any] | None = None  # the data state of the checkpoint train() resumes from

    def state(self) -> dict[str, Any]:
        """What the Trainer keeps in a checkpoint's ``trainer_state.json`` for this callback: the data position."""
        data = self._sampler.state_dict() if self._sampler is not None else None
        return {"args": {"global_batch": self._global_batch}, "attributes": {"_data_state": data}}

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        exactly_once = self._rescale.under_agent or self._global_batch is not None
        if not exactly_once:
            return
        trainer = self._trainer_holding_me()
        if trainer is None:
            logger.warning(
                "pliant: the Trainer holding pliant.transformers.Elastic was not found, so a rescale does not "
                "resume by itself and its data is the Trainer's: pass resume_from_checkpoint="
                "pliant.transformers.last_checkpoint(args.output_dir) to trainer.train()"
            )
            return
        self._install(trainer)
        _resume_by_default(trainer, self, by_default=self._rescale.under_agent and self._rescale.env.generation > 1)

    def _install(self, trainer: Trainer) -> None:
        """Fix the accumulation (with ``global_batch``) and draw the training batches from the sample stream.

        Raises:
            pliant.data.DataError: this world cannot divide ``global_batch``.
        """
        args = trainer.args
        micro, world = args.per_device_train_batch_size, args.world_size
        dataset = trainer.train_dataset
        if dataset is None or not hasattr(dataset, "__len__") or isinstance(dataset, torch.utils.data.IterableDataset):
            logger.warning(
                "pliant: the training dataset has no length (an iterable dataset), so pliant cannot resume it at the "
                "next unseen sample; use a map-style dataset for exactly-once data"
            )
            return
        sampler = GlobalBatchSampler(
            len(dataset),
            micro,
            self._global_batch,
            accumulation=args.gradient_accumulation_steps,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            rank=args.process_index,
            world_size=world,
            step_fn=lambda: trainer.state.global_step,
            from_epoch_start=True,  # the Trainer skips the resumed epoch's trained batches itself
        )
        args.gradient_accumulation_steps = sampler.accumulation_for_framework(
            "gradient_accumulation_steps", args.gradient_accumulation_steps
        )
        self._sampler = sampler
        original = trainer.get_train_dataloader

        @functools.wraps(original)
        def train_dataloader() -> Any:
            return _stream_loader(trainer, sampler, self._data_state) or original()

        trainer.get_train_dataloader = train_dataloader  # type: ignore[method-assign]
        if args.process_index == 0:
            logger.info("pliant: exactly-once data: %s", sampler.describe())

    def _trainer_holding_me(self) -> Trainer | None:
        """The Trainer whose ``__init__`` is calling this ``on_init_end``: the callback gets no reference to it."""
        frame = sys._getframe(1)
        for _ in range(_FRAMES):
            if frame is None:
                break
            holder = frame.f_locals.get("self")
            if isinstance(holder, Trainer) and any(c is self for c in holder.callback_handler.callbacks):
                return holder
            frame = frame.f_back
        return None

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._rescale.listen()
        if self._sampler is None:  # a copy the Trainer made from a checkpoint (restore_callback_states_from_checkpoint)
            self._sampler = _sampler_of(kwargs.get("train_dataloader"))

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        if self._rescale.agreed(args.device):
            self._saving = True
            control.should_save = True  # the Trainer saves this step, then calls on_save
        return control

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if not self._saving:
            return
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # global rank 0 wrote trainer_state.json: the checkpoint is complete
        if args.process_index == 0:
            logger.info(
                "pliant: saved for the rescale at global step %d: %s",
                state.global_step,
                Path(args.output_dir) / f"checkpoint-{state.global_step}",
            )
        sys.exit(RESCALE_EXIT_CODE)


def _resume_by_default(trainer: Trainer, callback: Elastic, by_default: bool) -> None:
    """Make ``trainer.train()`` resume from the last complete checkpoint when the script names none (``by_default``),
    and take the data position of whichever checkpoint it resumes from."""
    train = trainer.train

    @functools.wraps(train)
    def elastic_train(resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if by_default and (resume_from_checkpoint is None or resume_from_checkpoint is False):
            found = last_checkpoint(trainer.args.output_dir)
            if found is not None:
                logger.info("pliant: resuming from the last complete checkpoint %s", found)
                resume_from_checkpoint = str(found)
        path = resume_from_checkpoint
        if path is True:
            path = get_last_checkpoint(trainer.args.output_dir)
        callback._data_state = _data_state(Path(path)) if isinstance(path, str) else None
        return train(resume_from_checkpoint, *args, **kwargs)

    trainer.train = elastic_train  # type: ignore[method-assign]


def _sampler_of(loader: Any) -> GlobalBatchSampler | None:
    """The :class:`pliant.data.GlobalBatchSampler` under a training loader's batch samplers (Accelerate's shard and
    skip wrappers hold the one below as ``batch_sampler``), or None."""
    found = getattr(loader, "batch_sampler", None)
    for _ in range(4):
        if found is None or isinstance(found, GlobalBatchSampler):
            return found
        found = getattr(found, "batch_sampler", None)
    return None


def _data_state(checkpoint: Path) -> dict[str, Any] | None:
    """The data position a checkpoint's ``trainer_state.json`` keeps for :class:`Elastic`, or None (a checkpoint
    written without it: the stream then starts from the resumed step at position 0's pace)."""
    try:
        saved = json.loads((checkpoint / _STATE).read_text()).get("stateful_callbacks", {}).get("Elastic")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(saved, list):
        saved = saved[-1] if saved else None
    data = saved.get("attributes", {}).get("_data_state") if isinstance(saved, dict) else None
    return data if isinstance(data, dict) else None


def _stream_loader(trainer: Trainer, sampler: GlobalBatchSampler, state: dict[str, Any] | None) -> Any:
    """The Trainer's training ``DataLoader`` (its collation, workers and Accelerate's device placement) drawing its
    batches from ``sampler``, positioned by ``state``; None when this Trainer builds its loaders elsewhere (the caller
    then keeps the Trainer's own, with a warning)."""
    remove_columns = getattr(trainer, "_remove_unused_columns", None)
    collator_for = getattr(trainer, "_get_collator_with_removed_columns", None)
    if remove_columns is None or collator_for is None:
        logger.warning(
            "pliant: this transformers builds its loaders elsewhere, so the training data is the Trainer's own "
            "(exactly once only within a world)"
        )
        return None
    args, dataset = trainer.args, trainer.train_dataset
    collate = trainer.data_collator
    if is_datasets_available() and isinstance(dataset, importlib.import_module("datasets").Dataset):
        dataset = remove_columns(dataset, description="Training")
    else:
        collate = collator_for(collate, description="Training")
    if state is not None:
        sampler.load_state_dict(state)
    params: dict[str, Any] = {
        "batch_sampler": sampler,
        "collate_fn": collate,
        "num_workers": args.dataloader_num_workers,
        "pin_memory": args.dataloader_pin_memory,
        "worker_init_fn": functools.partial(
            seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index
        ),
    }
    if args.dataloader_num_workers > 0:
        params["persistent_workers"] = args.dataloader_persistent_workers
        params["prefetch_factor"] = args.dataloader_prefetch_factor
    loader = trainer.accelerator.prepare(torch.utils.data.DataLoader(dataset, **params))
    shard = getattr(loader, "batch_sampler", None)
    if shard is not None and getattr(shard, "batch_sampler", None) is sampler:
        shard.num_processes, shard.process_index = 1, 0  # the sampler is this rank's already: no second shard
    return loader
