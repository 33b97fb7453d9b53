"""A node's view of its job, for ``pliant status`` with no flags on any node of the job (the first or not).

Each agent serves its view while it runs on a Unix socket under the node's state directory::

    <state home>/status/<job>/<node>.sock      (the directory 0700)

A client connects and reads to the end: one byte, then the rest. ``0``: a serialized ``pliant.v1.JobStatus`` (the
job as the agent's own GetJob returns it: the member view, node addresses removed); ``1``: an error, UTF-8 text.
The agent asks its control plane on each connection, with the certificate it holds in memory: the socket gives a
reader of the job's status and nothing else (no key, no other call), so a process of the node's user that reaches it
(a worker included) learns what ``pliant status`` shows and can do nothing with it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import socketserver
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from pliant.errors import ConfigError
from pliant.home import state_home

__all__ = ["ViewServer", "find_view", "read_view", "serve_view"]

_OK, _ERROR = b"\x00", b"\x01"
MAX_VIEW_BYTES = 64 << 20  # what a reader takes of one view (a job of 10,000 members is a few MB)


def _root() -> Path:
    return state_home() / "status"


_SUN_PATH_MAX = 107  # what a Unix socket's address holds (sockaddr_un's 108 bytes, with its NUL)


@contextlib.contextmanager
def _addressable(path: Path) -> Iterator[str]:
    """An address ``path`` can be bound or connected at: itself, or, when it is longer than a Unix socket's address
    holds (a deep state directory), the same file reached through a descriptor of its folder (``/proc/self/fd/N``),
    valid while the context lasts."""
    if len(os.fsencode(path)) <= _SUN_PATH_MAX:
        yield str(path)
        return
    folder = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{folder}/{path.name}"
    finally:
        os.close(folder)


class ViewServer:
    """Serves a node's view of its job on its socket until :meth:`close` (a thread of its own per connection).

    Args:
        path: the socket's path.
        fetch: returns the serialized ``JobStatus`` (any thread); an exception it raises is sent as the error.
    """

    def __init__(self, path: Path, fetch: Callable[[], bytes]) -> None:
        self.path = path

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                try:
                    answer = _OK + fetch()
                except Exception as exc:  # the control plane did not answer: the reader is told why
                    answer = _ERROR + str(exc).encode()
                with contextlib.suppress(OSError):
                    self.request.sendall(answer)

        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # an agent of this node killed before it could remove it
        with _addressable(path) as address:
            self._server = socketserver.ThreadingUnixStreamServer(address, Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="status-view", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        with contextlib.suppress(OSError):
            self.path.parent.rmdir()  # the last node's view of the job here


def serve_view(job: str, node: str, fetch: Callable[[], bytes]) -> ViewServer | None:
    """Serve ``node``'s view of ``job`` (None when the state directory is not writable: the node trains all the
    same, and ``pliant status`` then needs its flags)."""
    folder = _root() / job
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(folder, 0o700)
        return ViewServer(folder / f"{node}.sock", fetch)
    except OSError:
        return None


def find_view(job: str | None) -> tuple[str, list[Path]]:
    """The job viewed on this machine (``job``, or the only one) and its nodes' sockets, newest first.

    Raises:
        ConfigError: no agent of that job runs here, or several jobs are viewed and none was named.
    """
    root = _root()
    jobs = sorted(p.name for p in root.iterdir() if any(p.glob("*.sock"))) if root.is_dir() else []
    if job is None and len(jobs) > 1:
        raise ConfigError(f"this machine runs agents of several jobs ({', '.join(jobs)}); name one with --job")
    name = job or (jobs[0] if jobs else "")
    sockets = sorted((root / name).glob("*.sock"), key=lambda p: p.stat().st_mtime, reverse=True) if name else []
    if not sockets:
        what = f"of job {job!r} " if job else ""
        raise ConfigError(
            f"no pliant agent {what}runs on this machine, so `pliant status` has no view of it here; run it on a node "
            f"of the job, or pass --coordinator HOST:PORT with --tls-dir DIR (an admin's certificates, `pliant certs`)"
        )
    return name, sockets


def read_view(path: Path, timeout_s: float = 30.0) -> bytes:
    """The serialized ``JobStatus`` the agent at ``path`` serves.

    Raises:
        ConfigError: the agent is gone (a socket left behind) or its control plane did not answer (the reason).
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout_s)
        try:
            with _addressable(path) as address:
                conn.connect(address)
            chunks, size = [], 0
            while size <= MAX_VIEW_BYTES:
                chunk = conn.recv(1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        except OSError as exc:
            raise ConfigError(
                f"the agent's view at {path} does not answer ({exc}); is its agent still running?"
            ) from exc
    data = b"".join(chunks)
    if data[:1] == _OK:
        return data[1:]
    why = data[1:].decode(errors="replace") if data[:1] == _ERROR else "an empty answer"
    raise ConfigError(f"the agent's view at {path} could not be read: {why}")
