"""A shim that makes a child die with its parent: ``python -m pliant.spawn PARENT_PID -- CMD...`` sets the Linux
parent-death signal (SIGKILL), checks the parent is still the one expected, then execs CMD (the setting survives exec).

Used for worker processes and the embedded etcd, so kill -9 of an agent or of ``pliant run`` leaves nothing behind.
``preexec_fn`` would do the same without the extra exec, but it is unsafe in a process with threads (the agent has
gRPC threads). Note that the signal fires when the parent *thread* that spawned the child exits: spawn from a thread
that lives as long as the child should.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["alive", "die_with_parent"]

_PR_SET_PDEATHSIG = 1


def die_with_parent(cmd: list[str]) -> list[str]:
    """Wrap ``cmd`` so the process it starts is SIGKILLed when the calling process dies (Linux; elsewhere unchanged)."""
    if not sys.platform.startswith("linux"):
        return list(cmd)
    return [sys.executable, "-m", "pliant.spawn", str(os.getpid()), "--", *cmd]


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs: a zombie (dead, not yet reaped) does not; one this user may not inspect
    does."""
    import psutil  # here, not at the top: the shim's own start stays light

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def _main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit("usage: python -m pliant.spawn PARENT_PID -- COMMAND [ARGS...]")
    parent = int(argv[0])
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise SystemExit(f"prctl(PR_SET_PDEATHSIG) failed: errno {ctypes.get_errno()}")
    if os.getppid() != parent:  # the parent died before the setting took effect
        raise SystemExit(f"parent {parent} is gone")
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    _main(sys.argv[1:])
