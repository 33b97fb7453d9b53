"""The worker zygote preloads what the training script imports (pliant.agent.preload, pliant.agent.zygote): a real
zygote forks a real worker, which finds the script's installed modules already imported (a lazy name already read);
a module that fails, starts a thread or lives next to the script is not preloaded, and the worker imports it itself."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from pliant.agent.preload import plan
from pliant.agent.workers import WorkerCommand, Zygote

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SITE = {
    # A framework that loads a name lazily, on its first read (as transformers does).
    "lazyframe/__init__.py": (
        "import importlib\n"
        "def __getattr__(name):\n"
        "    if name == 'Trainer':\n"
        "        return importlib.import_module('lazyframe.trainer').Trainer\n"
        "    raise AttributeError(name)\n"
    ),
    "lazyframe/trainer.py": "class Trainer:\n    pass\n",
    "threadmod.py": "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n",
    "brokenmod.py": "raise RuntimeError('needs a GPU driver')\n",
    "plainmod.py": "VALUE = 7\n",
}

SCRIPT = """
import json, sys
WARM = sorted(m for m in ("lazyframe", "lazyframe.trainer", "threadmod", "brokenmod", "plainmod", "localmod")
              if m in sys.modules)
from lazyframe import Trainer
import plainmod
import threadmod
import localmod
try:
    import brokenmod
except RuntimeError:
    pass
print("WARM " + json.dumps(WARM), flush=True)
"""


def test_the_zygote_preloads_the_scripts_installed_imports_and_skips_the_unsafe(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    site = tmp_path / "site"
    for name, text in SITE.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(text)
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "train.py").write_text(SCRIPT)
    (jobs / "localmod.py").write_text("VALUE = 1\n")  # the user's own code, next to the script
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "PLIANT_WORKER_PRELOAD": "torch"}
    preload = plan([str(jobs / "train.py")], None)
    caplog.set_level(logging.INFO, logger="pliant.agent.workers")
    zygote = Zygote(env, preload)
    try:
        pid = zygote.proc.pid
        worker = zygote.spawn(env, WorkerCommand((str(jobs / "train.py"),)))
        assert worker.wait(60) == 0
        out = worker.stdout.read().decode()
        assert zygote.proc.pid == pid and zygote.alive, "the zygote executed itself again in place"
    finally:
        zygote.close()
    warm = json.loads(next(line for line in out.splitlines() if line.startswith("WARM "))[5:])
    assert warm == ["lazyframe", "lazyframe.trainer", "plainmod"], out
    logs = "\n".join(r.getMessage() for r in caplog.records)
    assert "not preloading threadmod: its import started 1 thread(s)" in logs, logs
    assert "not preloading brokenmod: its import failed (RuntimeError: needs a GPU driver)" in logs, logs
    assert "localmod" not in logs, "the user's own modules are left out without a word"
    assert "torch and 2 of the script's modules (lazyframe, plainmod) imported: ready to fork workers" in logs, logs


def test_the_preload_can_be_named_or_turned_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "plainmod.py").write_text("VALUE = 7\n")
    (tmp_path / "jobs").mkdir()
    script = tmp_path / "jobs" / "train.py"
    script.write_text("import sys\nprint('WARM', 'plainmod' in sys.modules, flush=True)\nimport plainmod\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path), "PLIANT_WORKER_PRELOAD": "torch"}
    caplog.set_level(logging.INFO, logger="pliant.agent.workers")
    for preload, warm in ((("plainmod",), "True"), ((), "False")):
        zygote = Zygote(env, plan([str(script)], preload))
        try:
            worker = zygote.spawn(env, WorkerCommand((str(script),)))
            assert worker.wait(60) == 0
            assert f"WARM {warm}" in worker.stdout.read().decode()
        finally:
            zygote.close()
    logs = "\n".join(r.getMessage() for r in caplog.records)
    assert "preloading torch and plainmod (--preload)" in logs and "preloading torch and nothing (--no-preload)" in logs
