"""Samples repeated and missed in an epoch that a world of another size resumes, per kind of script, with the
framework's own data and with pliant.data.

Each kind trains under torchrun on one rank to the middle of its first epoch (saving a checkpoint there), then resumes
from that checkpoint on two ranks to the epoch's end; the samples every rank trained in that epoch are counted:
repeated (trained more than once) and missed (never trained). ``framework``: the script's data as it is without
pliant (Lightning's and the Trainer's ``DistributedSampler`` and resume by batch count; for the torchrun script a
``DistributedSampler`` with the resumed epoch's trained batches skipped by count). ``pliant.data``: the same scripts
with a fixed global batch (``pliant.lightning.DDP(global_batch=)``, ``pliant.transformers.Elastic(global_batch=)``,
``pliant.data.GlobalBatchLoader``), whose position follows the optimizer step.

    .venv/bin/python bench/data_resume.py [--kinds torchrun lightning trainer] [--steps 40]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from common import read_jsonl

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node")


def _kinds(steps: int) -> dict[str, dict]:
    """Per kind: the script, its dataset size, the flags of both phases and of each data mode."""
    return {
        "torchrun": {
            "script": EXAMPLES / "train_torchrun_data.py",
            "samples": 2048,
            "common": ["--samples", "2048", "--batch-size", "16", "--ckpt", "{dir}/ckpt.pt"],
            "first": ["--max-steps", str(steps)],
            "second": ["--max-steps", "64"],  # the epoch's end in both modes: 2048 / 32 steps
            "framework": ["--sampler", "distributed"],
            "pliant.data": ["--global-batch", "32"],
        },
        "lightning": {
            "script": EXAMPLES / "train_lightning_elastic.py",
            "samples": 4096,
            "common": ["--batch-size", "16", "--world-from-env", "--save-every", str(steps), "--save-dir", "{dir}/own"],
            "first": ["--max-steps", str(steps)],
            "second": ["--max-steps", "-1", "--max-epochs", "1"],
            "framework": [],
            "pliant.data": ["--global-batch", "32"],
        },
        "trainer": {
            "script": EXAMPLES / "train_hf_trainer.py",
            "samples": 4096,
            "common": ["--batch-size", "16", "--output-dir", "{dir}/hf", "--save-steps", str(steps)],
            "first": ["--max-steps", str(steps)],
            "second": ["--max-steps", "-1", "--epochs", "1", "--resume"],
            "framework": [],
            "pliant.data": ["--global-batch", "32"],
        },
    }


def _run(kind: dict, mode: str, folder: Path) -> tuple[int, int, int]:
    """Both phases of ``kind`` in ``mode``; (samples trained, repeated, missed) in the epoch."""
    events = folder / "events.jsonl"
    for phase, ranks in (("first", "1"), ("second", "2")):
        flags = [f.format(dir=folder) for f in kind["common"] + kind[phase] + kind[mode]]
        argv = [*TORCHRUN, ranks, str(kind["script"]), *flags, "--events", str(events)]
        done = subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    seen = Counter(i for event in read_jsonl(events) for i in event["samples"])
    trained = sum(seen.values())
    return trained, sum(c - 1 for c in seen.values()), kind["samples"] - len(seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", nargs="+", default=["torchrun", "lightning", "trainer"])
    parser.add_argument("--steps", type=int, default=40, help="steps the first world trains before the resume")
    args = parser.parse_args()
    kinds = _kinds(args.steps)
    print(f"resume on 2 ranks after {args.steps} steps on 1, to the first epoch's end")
    print(f"{'kind':<10} {'data':<12} {'samples':>8} {'trained':>8} {'repeated':>9} {'missed':>7} {'time':>6}")
    with tempfile.TemporaryDirectory(prefix="pliant-data-resume-") as tmp:
        for name in args.kinds:
            for mode in ("framework", "pliant.data"):
                folder = Path(tmp) / f"{name}-{mode}"
                folder.mkdir()
                started = time.monotonic()
                trained, repeated, missed = _run(kinds[name], mode, folder)
                took = time.monotonic() - started
                samples = kinds[name]["samples"]
                print(f"{name:<10} {mode:<12} {samples:>8} {trained:>8} {repeated:>9} {missed:>7} {took:>5.0f}s")


if __name__ == "__main__":
    main()
