"""A Hugging Face ``Trainer`` script made elastic with one line: ``callbacks=[pliant.transformers.Elastic()]`` (the rest
is an ordinary Trainer script). Nodes may join, leave or die: the Trainer's world is the generation's, a rescale saves
a Trainer checkpoint at a step boundary and the next world resumes from the last complete one.

    pliant run --nnodes 1:4 --nproc-per-node 1 examples/train_hf_trainer.py --output-dir /shared/hf-run

The model is a tiny GPT-2 built from a config (nothing is downloaded) and the data is generated. ``--global-batch N``
keeps N sequences per optimizer step at every world size (``Elastic(global_batch=N)`` sets the accumulation); the
callback feeds every sample of an epoch once across world changes either way. With ``--events FILE`` each rank
appends one JSON line per optimizer step (used by the tests: the step, the world and the dataset indices it trained);
``--out FILE``: rank 0 writes the final ``global_step`` and the parameters there.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

import pliant.transformers


class Tokens(torch.utils.data.Dataset):
    """Generated token sequences: each is its own language-modelling target, with its index in the dataset."""

    def __init__(self, count: int, length: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (count, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor | int]:
        return {"input_ids": self.ids[index], "labels": self.ids[index], "index": index}


class Collate:
    """Batches the sequences and keeps each batch's dataset indices, in the order the batches were made."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        self.batches.append([f["index"] for f in features])
        return {key: torch.stack([f[key] for f in features]) for key in ("input_ids", "labels")}


class Events(TrainerCallback):
    """One JSON line per rank and optimizer step: its global step, the world, this process and the dataset indices of
    the sequences it trained (the step's batches: the first ones made and not yet counted); then the simulated
    compute time."""

    def __init__(self, path: str, step_time: float, collate: Collate) -> None:
        self.path, self.step_time, self.collate = path, step_time, collate

    def on_step_end(self, args: TrainingArguments, state: object, control: object, **kwargs: object) -> None:
        batches = self.collate.batches[: args.gradient_accumulation_steps]
        del self.collate.batches[: args.gradient_accumulation_steps]
        if self.path:
            line = {
                "rank": args.process_index,
                "world": args.world_size,
                "step": state.global_step - 1,  # type: ignore[attr-defined]
                "generation": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + 1,
                "pid": os.getpid(),
                "time": time.time(),
                "samples": [i for batch in batches for i in batch],
            }
            with open(self.path, "a") as out:
                out.write(json.dumps(line) + "\n")
        time.sleep(self.step_time)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", required=True, help="where the Trainer's checkpoints go (shared by the nodes)")
    parser.add_argument("--max-steps", type=int, default=200, help="-1: train --epochs epochs")
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per batch (per rank)")
    parser.add_argument("--global-batch", type=int, default=None, help="sequences per step at every world size")
    parser.add_argument("--save-steps", type=int, default=100, help="the Trainer's own periodic checkpoints")
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (simulated compute)")
    parser.add_argument("--events", default="")
    parser.add_argument("--out", default="")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="resume from the newest checkpoint in --output-dir, as a script under torchrun does itself (under pliant "
        "the callback does it)",
    )
    args = parser.parse_args()

    config = GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=1,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,  # no dropout: the same steps give the same parameters
    )
    torch.manual_seed(0)  # the same initial parameters in every run: the tests compare them with a static run
    model = GPT2LMHeadModel(config)
    collate = Collate()
    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        num_train_epochs=args.epochs,
        per_device_train_batch_size=args.batch_size,
        learning_rate=1e-3,
        save_steps=args.save_steps,
        logging_steps=50,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
        remove_unused_columns=False,  # Collate drops the index itself
    )
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=Tokens(4096, 16, config.vocab_size),
        data_collator=collate,
        callbacks=[
            Events(args.events, args.step_time, collate),
            pliant.transformers.Elastic(global_batch=args.global_batch),  # pliant: the one line
        ],
    )
    trainer.train(resume_from_checkpoint=get_last_checkpoint(args.output_dir) if args.resume else None)
    if args.out and trainer.is_world_process_zero():
        params = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
        with open(args.out, "w") as out:
            json.dump(
                {"global_step": trainer.state.global_step, "world_size": training.world_size, "params": params}, out
            )


if __name__ == "__main__":
    main()
