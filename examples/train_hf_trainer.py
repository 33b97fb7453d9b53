"""A Hugging Face ``Trainer`` script made elastic with one line: ``callbacks=[pliant.transformers.Elastic()]`` (the rest
is an ordinary Trainer script). Nodes may join, leave or die: the Trainer's world is the generation's, a rescale saves
a Trainer checkpoint at a step boundary and the next world resumes from the last complete one.

    pliant run --nnodes 1:4 --nproc-per-node 1 examples/train_hf_trainer.py --output-dir /shared/hf-run

The model is a tiny GPT-2 built from a config (nothing is downloaded) and the data is generated. With ``--events FILE``
each rank appends one JSON line per trained step (used by the tests); ``--out FILE``: rank 0 writes the final
``global_step`` there.
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
    """Generated token sequences: each is its own language-modelling target."""

    def __init__(self, count: int, length: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (count, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class Events(TrainerCallback):
    """One JSON line per rank and trained step: its global step, the world and this process."""

    def __init__(self, path: str, step_time: float) -> None:
        self.path, self.step_time = path, step_time

    def on_step_end(self, args: TrainingArguments, state: object, control: object, **kwargs: object) -> None:
        if self.path:
            line = {
                "rank": args.process_index,
                "world": args.world_size,
                "step": state.global_step - 1,  # type: ignore[attr-defined]
                "generation": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + 1,
                "pid": os.getpid(),
                "time": time.time(),
            }
            with open(self.path, "a") as out:
                out.write(json.dumps(line) + "\n")
        time.sleep(self.step_time)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", required=True, help="where the Trainer's checkpoints go (shared by the nodes)")
    parser.add_argument("--max-steps", type=int, default=200)
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

    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_steps=args.save_steps,
        logging_steps=50,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
    )
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=Tokens(4096, 16, config.vocab_size),
        callbacks=[Events(args.events, args.step_time), pliant.transformers.Elastic()],  # pliant: the one line
    )
    trainer.train(resume_from_checkpoint=get_last_checkpoint(args.output_dir) if args.resume else None)
    if args.out and trainer.is_world_process_zero():
        with open(args.out, "w") as out:
            json.dump({"global_step": trainer.state.global_step, "world_size": training.world_size}, out)


if __name__ == "__main__":
    main()
