"""The node's worker zygote (a fork server): it imports torch once, then forks every worker of every generation.

A worker forked from here starts in milliseconds instead of paying an interpreter and a torch import, and runs the
training script as ``python SCRIPT`` / ``python -m MODULE`` would (``__main__``, ``sys.argv``, ``sys.path[0]``),
exiting through the normal interpreter shutdown (atexit handlers run).

Run as ``python -m pliant.agent.zygote FD [STORE_FD]`` where FD is a SOCK_SEQPACKET Unix socket to the agent. The
zygote stays single-threaded (forking is safe) and imports only the standard library and the preloaded modules. With
STORE_FD (the store host's end of another socket pair), it forks the node's store host (:mod:`pliant.agent.storehost`)
as soon as ``torch.distributed`` is imported, before the rest of the preload. Messages are JSON:

- agent -> zygote ``{"op": "spawn", "id": N, "env": {...}, "argv": [...], "module": bool}`` with one fd attached:
  the write end of the worker's output pipe. Reply ``{"id": N, "pid": PID}``.
- zygote -> agent ``{"exit": PID, "code": CODE}`` when a worker ends (CODE < 0: killed by that signal).
- ``{"ready": true}`` once the preload is imported; ``{"stores": PID}`` once the store host is forked.

Each worker leads its own session (stopping its process group stops everything it started) and gets SIGKILL when the
zygote dies; the zygote gets SIGKILL when the agent dies (started through :mod:`pliant.spawn`).
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys
from typing import Any

from pliant.env import STACKS_SIGNAL

# torch._dynamo is what DDP's constructor imports lazily (1.4 s on this machine): paid once here, not per worker.
PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo")
_PR_SET_PDEATHSIG = 1


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the agent is gone: we are about to be killed anyway
        sock.send(json.dumps(message).encode())


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _become_worker(sock: socket.socket, out_fd: int, job: dict[str, Any]) -> None:
    """In the forked child: detach, wire output, and set up ``__main__``'s world. Returns to run the script."""
    os.setsid()
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    sock.close()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    # The agent's "dump your stacks" before it stops a hung worker (pliant.env.STACKS_SIGNAL); C-level, so it works
    # while the interpreter is stuck inside a collective or holding the GIL.
    faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(job["env"])
    sys.argv = list(job["argv"])


def _defer_process_group_teardown() -> None:
    """Keep destroyed process groups referenced until interpreter shutdown (forked workers only).

    Seen here: a script calls ``destroy_process_group()``, then its DDP module is freed when ``main()`` returns and
    drops the last reference to the gloo process group; ``~ProcessGroupGloo`` joins its run-loop thread while holding
    the GIL, and that thread waits for the GIL to release a Python object captured with its last work item: a
    deadlock (about 1 run in 10 in forked workers, none seen in cold ones). Holding a reference defers the destructor
    to interpreter shutdown, where a C++ thread asking for the GIL exits instead of waiting.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not hasattr(dist, "destroy_process_group"):
        return
    original = dist.destroy_process_group
    kept: list[object] = []

    def destroy_process_group(group: object = None) -> None:
        from torch.distributed import distributed_c10d

        kept.extend(list(distributed_c10d._world.pg_map) if group is None else [group])
        original(group)

    destroy_process_group.__doc__ = original.__doc__
    dist.destroy_process_group = destroy_process_group
    dist.distributed_c10d.destroy_process_group = destroy_process_group


def serve(sock: socket.socket) -> dict[str, Any] | None:
    """The zygote's loop. Returns only in a forked child, with the job it must run."""
    _send(sock, {"ready": True})
    while True:
        readable, _, _ = select.select([sock], [], [], 0.05)
        _reap(sock)
        if not readable:
            continue
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, 4)
        except OSError:
            data, fds = b"", []
        if not data:  # the agent closed the socket
            return None
        message = json.loads(data)
        if message.get("op") != "spawn" or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _become_worker(sock, fds[0], message)
            return message
        os.close(fds[0])
        _send(sock, {"id": message["id"], "pid": pid})


def _fork_store_host(sock: socket.socket, store_fd: int) -> None:
    """Fork the node's store host (:mod:`pliant.agent.storehost`) on ``store_fd``, with torch already imported."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        sock.close()
        from pliant.agent.storehost import serve as serve_stores

        serve_stores(store_fd)  # never returns
    os.close(store_fd)
    _send(sock, {"stores": pid})


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    store_fd = int(sys.argv[2]) if len(sys.argv) > 2 else None
    for name in os.environ.get("PLIANT_WORKER_PRELOAD", ",".join(PRELOAD)).split(","):
        if name:
            with contextlib.suppress(ImportError):  # the script reports what it misses itself
                importlib.import_module(name)
        if store_fd is not None and "torch.distributed" in sys.modules:  # the stores need no more than this
            _fork_store_host(sock, store_fd)
            store_fd = None
    if store_fd is not None:  # a preload without torch.distributed: the host imports it itself
        _fork_store_host(sock, store_fd)
    job = serve(sock)
    if job is None:
        return
    _defer_process_group_teardown()
    if job.get("module"):  # python -m MODULE: sys.path[0] stays the working directory
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:  # python SCRIPT: sys.path[0] is the script's directory
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
