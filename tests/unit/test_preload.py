"""What the worker zygote preloads (pliant.agent.preload): the script's top-level imports, read and never run."""

from __future__ import annotations

from pathlib import Path

from pliant.agent.preload import Import, Preload, module_source, plan, script_imports

SCRIPT = '''
"""A training script."""
from __future__ import annotations
import os, json
import numpy as np
import torch.nn.functional as F
from transformers import Trainer, TrainingArguments
from transformers import AutoConfig
from . import sibling
from .pkg import thing
from torch.utils.data import *
try:
    import wandb
except ImportError:
    wandb = None
if TYPE_CHECKING:
    import typing_only
elif False:
    import in_else
if typing.TYPE_CHECKING:
    import also_typing_only
with open(__file__):
    import under_with

def main():
    import inside_a_function

class Model:
    import inside_a_class

if __name__ == "__main__":
    import under_the_main_guard
    main()
'''


def test_the_top_level_imports_in_order_with_the_names_read_from_them() -> None:
    assert script_imports(SCRIPT) == (
        Import("numpy"),
        Import("torch.nn.functional"),
        Import("transformers", ("AutoConfig", "Trainer", "TrainingArguments")),
        Import("torch.utils.data"),
        Import("wandb"),
        Import("in_else"),
        Import("under_with"),
        Import("under_the_main_guard"),
    ), "no stdlib, __future__, relative, TYPE_CHECKING, function or class imports; a star import reads no name"


def test_a_named_preload_or_none_replaces_the_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import transformers\n")
    assert plan([str(script)], None, cwd=str(tmp_path)) == Preload((Import("transformers"),), str(tmp_path), "script")
    named = plan([str(script)], ("datasets", "accelerate"), cwd="/elsewhere")
    assert named.imports == (Import("datasets"), Import("accelerate")) and named.source == "--preload"
    assert plan(["train.py"], (), cwd=str(tmp_path)) == Preload((), str(tmp_path), "--no-preload")


def test_a_script_that_cannot_be_read_or_parsed_preloads_nothing(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("import torch\ndef (:\n")
    assert plan(["broken.py"], None, cwd=str(tmp_path)).imports == ()
    assert plan(["missing.py"], None, cwd=str(tmp_path)).imports == ()


def test_the_home_of_a_script_is_its_directory_and_of_a_module_the_working_directory(tmp_path: Path) -> None:
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "train.py").write_text("import transformers\nimport model\n")
    script = plan(["jobs/train.py", "--lr", "1"], None, cwd=str(tmp_path))
    assert script.home == str(tmp_path / "jobs")
    assert script.imports == (Import("transformers"), Import("model")), "the zygote tells local modules by place"

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("import torch\n")
    (tmp_path / "pkg" / "train.py").write_text("import accelerate\n")
    module = plan(["-m", "pkg.train", "--lr", "1"], None, cwd=str(tmp_path))
    assert module == Preload((Import("accelerate"),), str(tmp_path), "script")


def test_a_modules_source_is_found_without_running_it(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("raise SystemExit('never run')\n")
    (tmp_path / "pkg" / "sub" / "__main__.py").write_text("")
    (tmp_path / "solo.py").write_text("")
    assert module_source("pkg.sub", [str(tmp_path)]) == tmp_path / "pkg" / "sub" / "__main__.py"
    assert module_source("solo", [str(tmp_path)]) == tmp_path / "solo.py"
    assert module_source("pkg.missing", [str(tmp_path)]) is None
    torch_run = module_source("torch.distributed.run", [str(tmp_path)])  # an installed package, located by its finder
    assert torch_run is not None and torch_run.name == "run.py"


def test_the_wire_format_round_trips() -> None:
    preload = Preload((Import("transformers", ("Trainer",)), Import("numpy")), "/jobs")
    assert Preload.from_json(preload.to_json()) == preload
