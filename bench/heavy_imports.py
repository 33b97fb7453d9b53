"""examples/train_elastic.py behind a framework's imports at the top of the script, as a Trainer or Lightning script
has them (Hugging Face transformers' Trainer and a model class, Accelerate, Lightning: about 3 s beyond torch on the
2-core machine): the script of ``bench/elastic.py``'s ``+imports`` columns, where a fresh worker either imports them
itself (torchrun) or is forked with them loaded (pliant's zygote reads them from this file)."""

from __future__ import annotations

import runpy
from pathlib import Path

import accelerate  # noqa: F401
import lightning  # noqa: F401
import torch  # noqa: F401
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: F401

import pliant.worker  # noqa: F401

if __name__ == "__main__":
    runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "train_elastic.py"), run_name="__main__")
