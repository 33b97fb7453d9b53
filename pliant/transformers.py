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

A worker killed (kill -9, a lost node) gets no save: the next world resumes from the last complete checkpoint (a
rescale's or a periodic ``save_steps`` one) and redoes the steps since. ``output_dir`` must be a directory every node
reads, as ``--checkpoint-dir`` is (the Trainer writes model and optimizer from global rank 0 only); give each job its
own. In a world of another size, the Trainer skips the batches of the resumed epoch by count, as it does when resumed
by hand: steps are never repeated, but within that epoch a sample may be seen twice and another not at all.

Outside a pliant agent (torchrun, a plain process) the callback does nothing.

A Trainer checkpoint holds pickles (``optimizer.pt``, ``rng_state.pth``), the script's own files as with any Trainer
run: pliant neither seals nor reads them (docs/operations.md, "Checkpoints are data").
"""

from __future__ import annotations

import functools
import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

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


class Elastic(TrainerCallback):
    """Make a Trainer elastic under a pliant agent: save at a step boundary on a rescale, resume from the last complete
    checkpoint (see the module docstring).

    Threads: the main thread only (the rescale signal's flag is :class:`pliant.integration.RescaleRequest`'s).
    """

    def __init__(self) -> None:
        self._rescale = RescaleRequest()
        self._saving = False

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if not self._rescale.under_agent:
            return
        trainer = self._trainer_holding_me()
        if trainer is None:
            logger.warning(
                "pliant: the Trainer holding pliant.transformers.Elastic was not found, so a rescale does not "
                "resume by itself: pass resume_from_checkpoint=pliant.transformers.last_checkpoint(args.output_dir) "
                "to trainer.train()"
            )
        elif self._rescale.env.generation > 1:
            _resume_by_default(trainer)

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


def _resume_by_default(trainer: Trainer) -> None:
    """Make ``trainer.train()`` resume from the last complete checkpoint when the script names none."""
    train = trainer.train

    @functools.wraps(train)
    def elastic_train(resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint is None or resume_from_checkpoint is False:
            found = last_checkpoint(trainer.args.output_dir)
            if found is not None:
                logger.info("pliant: resuming from the last complete checkpoint %s", found)
                resume_from_checkpoint = str(found)
        return train(resume_from_checkpoint, *args, **kwargs)

    trainer.train = elastic_train  # type: ignore[method-assign]
