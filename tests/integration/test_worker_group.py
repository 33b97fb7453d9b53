"""An agent's worker group (pliant.agent.workers.WorkerGroup) stopping real worker processes: a worker that does not
exit within the rescale grace has its Python stacks logged before it is stopped, so what held it shows; a script
without pliant.worker is stopped as torchrun stops it (SIGTERM, which its own handler sees, never the rescale
signal)."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import pytest

from pliant.agent.workers import WorkerCommand, WorkerGroup
from pliant.env import STACKS_SIGNAL, WorkerEnv
from tests.conftest import wait_for

pytestmark = pytest.mark.timeout(60)

# A worker that dumps its stacks on the agent's signal (as the zygote arranges) and ignores the rescale request it
# announced it takes, stuck in a function whose name the dump must show.
_STUCK = f"""
import faulthandler, os, signal, sys, time
from pliant.env import RESCALE_SIGNAL
from pliant.progress import announce_signal
faulthandler.register({int(STACKS_SIGNAL)}, file=sys.stderr, all_threads=True)
signal.signal(RESCALE_SIGNAL, signal.SIG_IGN)
announce_signal(os.environ["PLIANT_PROGRESS_FILE"])
def held_by_something():
    print("ready", flush=True)
    time.sleep(600)
held_by_something()
"""


def _started(tmp_path: Path, code: str) -> tuple[WorkerGroup, Path]:
    """A group of one worker running ``code``, started and past its ``ready`` line; (the group, its log)."""
    script = tmp_path / "worker.py"
    script.write_text(code)
    env = WorkerEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, progress_file=str(tmp_path / "progress"))
    group = WorkerGroup(
        1,
        [env],
        WorkerCommand((str(script),)),
        log_dir=tmp_path / "logs",
        base_env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)},
    )
    group.start()
    log = tmp_path / "logs" / "rank-0.log"
    wait_for(lambda: log.exists() and "ready" in log.read_text(), 30, "the worker to start")
    return group, log


def test_a_worker_that_ignores_the_rescale_grace_has_its_stacks_logged(tmp_path: Path) -> None:
    group, log = _started(tmp_path, _STUCK)
    started = time.monotonic()
    result = group.stop(grace_s=2.0, rescale_grace_s=1.0)
    assert time.monotonic() - started < 10
    assert result.stopped and result.exit_codes[0] != 0
    text = log.read_text()
    assert "held_by_something" in text, text


# A plain torchrun-style script: no pliant.worker, its own SIGTERM handler (save on preemption), and no handler for
# the rescale signal, which would kill it (exit -10, read as a crash).
_PLAIN = """
import signal, sys, time
def on_term(signum, frame):
    print(f"saved on signal {signal.Signals(signum).name}", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
time.sleep(600)
"""


def test_a_plain_script_is_stopped_for_a_rescale_with_sigterm_and_its_handler_runs(tmp_path: Path, caplog) -> None:
    group, log = _started(tmp_path, _PLAIN)
    caplog.set_level(logging.INFO, logger="pliant.agent.workers")
    started = time.monotonic()
    result = group.stop(grace_s=5.0, rescale_grace_s=30.0)  # no rescale grace spent on a script that cannot use it
    assert time.monotonic() - started < 5
    assert result.stopped and result.exit_codes == {0: 0}
    wait_for(lambda: "saved on signal SIGTERM" in log.read_text(), 5, "the script's SIGTERM handler")
    assert "workers stopped for the rescale (local rank 0 exited 0)" in caplog.text
    assert not Path(str(tmp_path / "progress") + ".next").exists(), "no directive for a script that takes none"


def test_a_stopped_group_leaves_its_workers_kept_copies_to_their_replacements(tmp_path: Path) -> None:
    """Buddy copies kept in node-local memory (pliant.worker.inplace.kept) outlive their worker for its replacement. A
    node whose only worker died does not re-form in place: its agent stops (reaps) the group and starts a fresh one for
    the next generation, while the survivors roll back in place, so the stop must leave them (the replacement's
    first snapshot removes them; the agent's exit removes its whole directory)."""
    script = tmp_path / "idle.py"
    script.write_text("import time\nprint('ready', flush=True)\ntime.sleep(600)\n")
    env = WorkerEnv(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        progress_file=str(tmp_path / "progress"),
        snapshot_dir=str(tmp_path / "snapshots"),
    )
    kept = Path(env.kept_dir)
    kept.mkdir(parents=True)
    (kept / "123-1.bin").write_bytes(b"\0" * 4096)
    group = WorkerGroup(
        1,
        [env],
        WorkerCommand((str(script),)),
        log_dir=tmp_path / "logs",
        base_env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)},
    )
    group.start()
    log = tmp_path / "logs" / "rank-0.log"
    wait_for(lambda: log.exists() and "ready" in log.read_text(), 30, "the worker to start")
    group.stop(grace_s=2.0)
    assert (kept / "123-1.bin").exists()
