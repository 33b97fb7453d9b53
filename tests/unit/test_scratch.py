"""Scratch directories (pliant.scratch): a directory is swept once every process named in its owner file is gone, and
never otherwise."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from pliant import scratch

pytestmark = pytest.mark.timeout(60)


def _ended_process() -> int:
    """The pid of a process that has ended (and been reaped)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def _namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def _left(tmp_path: Path, name: str, owners: str) -> Path:
    """A directory that a process left behind, with this owner file."""
    directory = tmp_path / name
    (directory / "member").mkdir(parents=True)
    (directory / scratch.OWNER_FILE).write_text(owners)
    return directory


def test_a_directory_is_made_for_its_maker_and_removed_by_it(tmp_path: Path) -> None:
    made = Path(scratch.make("pliant-progress-", "node/1", str(tmp_path)))
    assert made.parent == tmp_path and made.name.startswith("pliant-progress-node_1-")
    assert oct(made.stat().st_mode & 0o777) == oct(0o700)
    pid, namespace, started = (made / scratch.OWNER_FILE).read_text().split()
    assert int(pid) == os.getpid() and int(namespace) == _namespace()
    assert abs(float(started) - psutil.Process().create_time()) < 0.01
    scratch.remove(str(made), "")
    assert not made.exists()


def test_the_next_make_sweeps_what_dead_owners_left_and_nothing_else(tmp_path: Path) -> None:
    dead, me = _ended_process(), psutil.Process()
    gone = _left(tmp_path, "pliant-etcd-dead", f"{dead} {_namespace()} 1000.00\n")
    reused = _left(tmp_path, "pliant-etcd-reused", f"{os.getpid()} {_namespace()} {me.create_time() - 60:.2f}\n")
    mine = f"{os.getpid()} {_namespace()} {me.create_time():.2f}\n"
    half = _left(tmp_path, "pliant-etcd-half", f"{dead} {_namespace()} 1000.00\n{mine}")
    live = _left(tmp_path, "pliant-etcd-live", mine)
    other_namespace = _left(tmp_path, "pliant-etcd-container", f"{dead} {_namespace() + 1} 1000.00\n")
    unreadable = _left(tmp_path, "pliant-etcd-torn", f"{dead} {_namespace()}")
    empty = _left(tmp_path, "pliant-etcd-empty", "")
    no_owner = tmp_path / "pliant-etcd-old"
    no_owner.mkdir()
    other_kind = _left(tmp_path, "pliant-certs-dead", f"{dead} {_namespace()} 1000.00\n")
    elsewhere = _left(tmp_path / "elsewhere", "dir", f"{dead} {_namespace()} 1000.00\n")
    link = tmp_path / "pliant-etcd-link"
    link.symlink_to(elsewhere)

    made = Path(scratch.make("pliant-etcd-", parent=str(tmp_path)))

    assert not gone.exists(), "its owner ended"
    assert not reused.exists(), "its pid belongs to a process started at another time"
    kept = [live, half, other_namespace, unreadable, empty, no_owner, other_kind, elsewhere, link, made]
    assert all(path.exists() for path in kept), [path for path in kept if not path.exists()]


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a directory to another user (chown needs root)")
def test_another_users_directory_is_never_swept(tmp_path: Path) -> None:
    others = _left(tmp_path, "pliant-etcd-another-users", f"{_ended_process()} {_namespace()} 1000.00\n")
    os.chown(others, 12345, 12345)
    assert scratch.sweep(str(tmp_path), "pliant-etcd-") == [] and others.exists()


def test_a_directory_stays_while_any_owner_runs(tmp_path: Path) -> None:
    """The maker killed with kill -9 while a process it started (an etcd) still uses the directory: it stays until
    that process ends too."""
    maker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; from pliant import scratch\n"
            f"d = scratch.make('pliant-etcd-', parent={str(tmp_path)!r})\n"
            "child = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
            "scratch.add_owner(d, child.pid)\n"
            "print(d, child.pid, flush=True)\n"
            "time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    child = 0
    try:
        assert maker.stdout is not None
        directory, pid = maker.stdout.readline().split()
        child = int(pid)
        maker.kill()
        maker.wait(10)
        scratch.sweep(str(tmp_path), "pliant-etcd-")
        assert Path(directory).exists(), "its second owner still runs"
        os.kill(child, signal.SIGKILL)
        psutil.Process(child).wait(10)
        scratch.sweep(str(tmp_path), "pliant-etcd-")
        assert not Path(directory).exists()
    finally:
        maker.kill()
        maker.wait(10)
        if child and psutil.pid_exists(child):
            os.kill(child, signal.SIGKILL)
