"""Scratch directories: made by a process for as long as it runs, and removed by the next one when it could not.

A process makes one with :func:`make` (a new directory under a parent folder: the temporary folder, or node-local
memory for the buddy copies) and removes it with :func:`remove` when it ends. A process killed with ``kill -9`` (the
OOM killer, a preempted container's runtime, a test's node kill) removes nothing, and what it leaves can be large: an
embedded etcd's data directory holds over 100 MB. So each directory holds an :data:`OWNER_FILE` naming the processes
that use it (the maker, and those it names with :func:`add_owner`, such as the etcd that keeps its data there), and
:func:`make` first removes the directories of the same kind in the same parent whose owners are all gone
(:func:`sweep`).

The owner file holds a line per process, ``<pid> <pid namespace> <start time>``: the pid, the inode of the pid
namespace it was written in (``/proc/self/ns/pid``; a pid means nothing in another namespace, such as a container
sharing the folder) and the process's start time (psutil's ``create_time``, so that a pid the kernel gave to a new
process since does not keep a dead owner's directory).

What holds:

- a directory without a readable owner file (being made, made by another program), another user's directory, and a
  link are never removed;
- a directory is removed only when every line of its owner file names a process of this pid namespace that is gone:
  its pid unused, a zombie, or a process started at another time. A line of another form, or of another namespace,
  or a process this user may not inspect, keeps the directory.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

__all__ = ["OWNER_FILE", "add_owner", "make", "owners_gone", "remove", "sweep"]

logger = logging.getLogger(__name__)

OWNER_FILE = "owner"
"""The file in each scratch directory that names the processes that use it."""


def _namespace() -> int:
    """The inode of this process's pid namespace (0 where /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _owner_line(pid: int) -> str:
    """Raises psutil.NoSuchProcess when ``pid`` has ended."""
    import psutil  # here, not at the top: the agent's lightest imports stay light

    return f"{pid} {_namespace()} {psutil.Process(pid).create_time():.2f}\n"


def _gone(line: str) -> bool:
    import psutil

    try:
        pid_text, namespace_text, started_text = line.split()
        pid, namespace, started = int(pid_text), int(namespace_text), float(started_text)
    except ValueError:
        return False
    if namespace != _namespace():
        return False
    try:
        process = psutil.Process(pid)
        return process.status() == psutil.STATUS_ZOMBIE or abs(process.create_time() - started) > 0.05
    except psutil.NoSuchProcess:
        return True
    except psutil.AccessDenied:
        return False


def owners_gone(text: str) -> bool:
    """Whether every process an owner file's ``text`` names has ended (False for an empty file)."""
    lines = text.splitlines()
    return bool(lines) and all(_gone(line) for line in lines)


def _name_part(name: str) -> str:
    """``name`` (a node id) as a part of a file name: letters, digits, ``-``, ``_`` and ``.``, at most 64 of them."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:64]


def make(kind: str, name: str = "", parent: str | None = None) -> str:
    """A new directory ``<parent>/<kind><name>-XXXXXXXX`` (mode 0700) owned by this process, after removing those of
    its kind in ``parent`` whose owners are all gone.

    Args:
        kind: the name prefix every directory of its kind has (``pliant-progress-``); they are swept by it.
        name: what the directory is for (a node id), made safe for a file name.
        parent: the folder it goes in (None: the temporary folder).

    Raises:
        OSError: the directory cannot be made in ``parent``.
    """
    parent = parent or tempfile.gettempdir()
    sweep(parent, kind)
    directory = tempfile.mkdtemp(prefix=f"{kind}{_name_part(name)}-" if name else kind, dir=parent)
    Path(directory, OWNER_FILE).write_text(_owner_line(os.getpid()))
    return directory


def add_owner(directory: str, pid: int) -> None:
    """Name process ``pid`` an owner of ``directory`` too: it is not swept while that process runs (nothing when it has
    ended already)."""
    import psutil

    try:
        line = _owner_line(pid)
    except psutil.NoSuchProcess:
        return
    with open(Path(directory, OWNER_FILE), "a") as owners:
        owners.write(line)


def sweep(parent: str, kind: str) -> list[str]:
    """Remove the directories in ``parent`` whose names start with ``kind`` and whose owners are all gone; returns
    them."""
    gone = []
    for directory in Path(parent).glob(f"{kind}*"):
        try:
            made = directory.lstat()
            if not stat.S_ISDIR(made.st_mode) or made.st_uid != os.getuid():
                continue  # a link, a file, or another user's: never this process's to remove
            text = (directory / OWNER_FILE).read_text()
        except OSError:
            continue  # being made, or not made by make()
        if owners_gone(text):
            shutil.rmtree(directory, ignore_errors=True)
            gone.append(str(directory))
    if gone:
        logger.info("removed %d directories of processes that are gone: %s", len(gone), gone)
    return gone


def remove(*directories: str) -> None:
    """Remove directories this process made (nothing for "")."""
    for directory in filter(None, directories):
        shutil.rmtree(directory, ignore_errors=True)
