"""The node's worker zygote (a fork server): it imports torch once, then forks every worker of every generation.

A worker forked from here starts in milliseconds instead of paying an interpreter and a torch import, and runs the
training script as ``python SCRIPT`` / ``python -m MODULE`` would (``__main__``, ``sys.argv``, ``sys.path[0]``),
exiting through the normal interpreter shutdown (atexit handlers run).

Run as ``python -m pliant.agent.zygote FD [STORE_FD] [--preload JSON] [--skip MODULE,...]`` where FD is a socket to the
agent (:mod:`pliant.agent.ipc`'s framing). The zygote stays single-threaded (forking is safe) and imports only the
standard library, pliant's few modules of its own and the preloaded modules: torch (:data:`PRELOAD`), then what the
training script imports (:mod:`pliant.agent.preload`'s JSON). With STORE_FD (the store host's end of another socket
pair), it forks the node's store host (:mod:`pliant.agent.storehost`) as soon as ``torch.distributed`` is imported,
before the rest of the preload. A script's module that fails to import is skipped; one that starts a thread or
initialises CUDA cannot be unloaded, so the zygote executes itself again (same pid, same sockets, the store host kept)
with that module in ``--skip``. The messages:

- agent -> zygote ``{"op": "spawn", "id": N, "env": {...}, "argv": [...], "module": bool}`` with one fd attached:
  the write end of the worker's output pipe. Reply ``{"id": N, "pid": PID}``.
- zygote -> agent ``{"exit": PID, "code": CODE}`` when a worker ends (CODE < 0: killed by that signal).
- ``{"ready": true, "preloaded": [MODULE, ...]}`` once the preload is imported (the script's modules it imported);
  ``{"stores": PID}`` once the store host is forked; ``{"skipped": MODULE, "why": TEXT}`` for each of the script's
  modules it does not preload.

Every fork is preceded by ``gc.freeze()``: what the zygote imported moves to the collector's permanent generation, so
a child's collections never traverse it (a framework's ``gc.collect()`` at the start of training took 0.26 s over the
objects of torch, transformers and Lightning, 0.001 s frozen) nor write to its pages, which stay shared with the
zygote instead of being copied into every worker.

Each worker leads its own session (stopping its process group stops everything it started) and gets SIGKILL when the
zygote dies; the zygote gets SIGKILL when the agent dies (started through :mod:`pliant.spawn`). A worker looks like
the process that ``python SCRIPT ARGS`` would be: ``ps`` shows that command line (and ``top`` the script's name), and
a traceback it dies with starts at the script's frame, without the zygote's and runpy's.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import faulthandler
import gc
import importlib
import importlib.util
import json
import os
import runpy
import select
import signal
import socket
import sys
import traceback
from types import TracebackType
from typing import Any

from pliant import settings
from pliant.agent import ipc
from pliant.env import STACKS_SIGNAL, error_file, install
from pliant.errorfile import write_error

# torch._dynamo is what DDP's constructor imports lazily, at a cost of seconds: paid once here, not per worker.
PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo")
_PR_SET_PDEATHSIG = 1


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the agent is gone: we are about to be killed anyway
        ipc.send(sock, message)


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
    _name_process(job["argv"], bool(job.get("module")))  # first: it moves the environment the next lines rewrite
    install(job["env"], replace=True)
    sys.argv = list(job["argv"])
    sys.excepthook = _script_excepthook


def _name_process(argv: list[str], module: bool) -> None:
    """Show this worker as the command that would run it cold (``ps``), named after its script (``top``)."""
    try:
        import setproctitle
    except ImportError:  # an install without it: the worker keeps the zygote's name
        return
    setproctitle.setproctitle(" ".join([sys.executable, "-u", *(["-m"] if module else []), *argv]))
    setproctitle.setthreadtitle(os.path.basename(argv[0]) if argv else "python")


def _script_excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    """Print an uncaught exception as ``python SCRIPT`` would: the traceback starts at the script's own frame; and
    write it to the worker's error file (:mod:`pliant.errorfile`) for its agent."""
    while tb is not None and _is_launch_frame(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    traceback.print_exception(kind, value, tb)
    write_error(error_file(), kind, value, tb)


def _is_launch_frame(filename: str) -> bool:
    """Whether ``filename`` is code that runs the script (this module, runpy) rather than the script."""
    return filename == __file__ or os.path.basename(filename) in ("runpy.py", "<frozen runpy>")


def _defer_process_group_teardown() -> None:
    """Keep destroyed process groups referenced until interpreter shutdown (forked workers only).

    When a script calls ``destroy_process_group()`` and its DDP module is freed as ``main()`` returns, the module
    drops the last reference to the gloo process group; ``~ProcessGroupGloo`` joins its run-loop thread while holding
    the GIL, and that thread waits for the GIL to release a Python object captured with its last work item: a
    deadlock, in forked workers. Holding a reference defers the destructor to interpreter shutdown, where a C++ thread
    asking for the GIL exits instead of waiting.
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


def serve(sock: socket.socket, preloaded: list[str]) -> dict[str, Any] | None:
    """The zygote's loop. Returns only in a forked child, with the job it must run."""
    _send(sock, {"ready": True, "preloaded": preloaded})
    while True:
        readable, _, _ = select.select([sock], [], [], 0.05)
        _reap(sock)
        if not readable:
            continue
        message, fds = ipc.receive(sock)
        if message is None:  # the agent closed the socket
            for fd in fds:
                os.close(fd)
            return None
        if message.get("op") != "spawn" or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        gc.freeze()
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
    gc.freeze()
    pid = os.fork()
    if pid == 0:
        sock.close()
        from pliant.agent.storehost import serve as serve_stores

        serve_stores(store_fd)  # never returns
    os.close(store_fd)
    _send(sock, {"stores": pid})


def _threads() -> int:
    """This process's threads, native ones included (a library's thread pool is not in ``threading``)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda.is_initialized())


def _is_home(name: str, home: str) -> bool:
    """Whether module ``name`` would be found in ``home`` (the user's own code, next to the script)."""
    try:
        spec = importlib.util.find_spec(name.partition(".")[0])
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    places = [spec.origin or "", *(spec.submodule_search_locations or [])]
    root = os.path.join(os.path.abspath(home), "")
    return any(place and os.path.abspath(place).startswith(root) for place in places)


def _import(module: str, names: list[str]) -> None:
    """``from module import names`` (``import module`` without names): a lazy framework loads a name on first read."""
    loaded = importlib.import_module(module)
    for name in names:
        if not hasattr(loaded, name):
            importlib.import_module(f"{module}.{name}")


def _preload_script(sock: socket.socket, preload: dict[str, Any], skip: set[str]) -> list[str]:
    """Import the script's modules one at a time; returns those it imported (not those torch's preload had). A
    module that starts a thread or initialises CUDA makes the zygote execute itself again without it (this call then
    never returns)."""
    home = preload["home"]
    if home:
        sys.path[0] = home  # what the worker's sys.path[0] will be: modules the worker would not see are not loaded
    before = set(sys.modules)
    failed_modules = set()
    for module, names in preload["imports"]:
        if module in skip or _is_home(module, home):
            continue
        threads = _threads()
        failed = ""
        try:
            _import(module, names)
        except BaseException as exc:  # a script's import may raise anything, SystemExit included
            failed = f"its import failed ({type(exc).__name__}: {exc})"[:300]
        if _threads() > threads:
            why = f"its import started {_threads() - threads} thread(s), and a process that forks must hold none"
            _send(sock, {"skipped": module, "why": why})
            _exec_again(sock, preload, skip | {module})
        if _cuda_initialised():
            _send(sock, {"skipped": module, "why": "its import initialised CUDA, which a forked process cannot use"})
            _exec_again(sock, preload, skip | {module})
        if failed:
            _send(sock, {"skipped": module, "why": failed})
            failed_modules.add(module)
    return [m for m, _ in preload["imports"] if m not in before and m in sys.modules and m not in failed_modules]


def _exec_again(sock: socket.socket, preload: dict[str, Any], skip: set[str]) -> None:
    """Replace this process with a fresh zygote on the same socket (the store host, already forked, stays a child)."""
    os.set_inheritable(sock.fileno(), True)
    sys.stdout.flush()
    sys.stderr.flush()
    argv = [sys.executable, "-u", "-m", "pliant.agent.zygote", str(sock.fileno())]
    argv += ["--preload", json.dumps(preload), "--skip", ",".join(sorted(skip))]
    os.execv(sys.executable, argv)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m pliant.agent.zygote")
    parser.add_argument("fd", type=int)
    parser.add_argument("store_fd", type=int, nargs="?")
    parser.add_argument("--preload", default="", help="what the script imports (pliant.agent.preload's JSON)")
    parser.add_argument("--skip", default="", help="the script's modules not to preload")
    args = parser.parse_args()
    sock = socket.socket(fileno=args.fd)
    store_fd = args.store_fd
    for name in (settings.WORKER_PRELOAD.read() or ",".join(PRELOAD)).split(","):
        if name:
            with contextlib.suppress(ImportError):  # the script reports what it misses itself
                importlib.import_module(name)
        if store_fd is not None and "torch.distributed" in sys.modules:  # the stores need no more than this
            _fork_store_host(sock, store_fd)
            store_fd = None
    if store_fd is not None:  # a preload without torch.distributed: the host imports it itself
        _fork_store_host(sock, store_fd)
    skip = {name for name in args.skip.split(",") if name}
    preloaded = _preload_script(sock, json.loads(args.preload), skip) if args.preload else []
    job = serve(sock, preloaded)
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
