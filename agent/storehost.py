"""The node's store host: the process that runs this node's TCPStores, so that the agent itself never imports torch.

TCPStore (servers and clients) lives in torch, and importing torch costs an agent start seconds of CPU. A node
start pays it once already, in its worker zygote (:mod:`pliant.agent.zygote`), so the zygote forks the store host
as soon as it has imported ``torch.distributed``; an agent without a zygote (``--no-python``) starts it as ``python -m
pliant.agent.storehost FD``. The agent's joining and its heartbeats never wait for torch; its stores are up when the
zygote could fork the first worker anyway.

The agent talks to its store host over a socket pair (:mod:`pliant.agent.ipc`'s framing), one request or reply a
message:

- ``{"id": N, "op": "serve", "host": H, "port": P}`` starts a TCPStore server listening on ``H:P`` only (P 0: a free
  port); reply ``{"id": N, "value": PORT}``. A listening socket sent with the request (SCM_RIGHTS) is served
  instead: the agent binds its long-lived store's port before it joins, so the address it announces stays its own
  while the host is still importing torch. ``{"op": "close", "port": P}`` stops it.
- ``{"op": "set" | "get" | "add", "address": "H:P", "key": K, ...}`` on the store at that address: one this host
  serves, or any other node's (as a client, within ``timeout`` seconds). ``get`` with ``check`` answers null at once
  for a key that is not set; ``add`` adds ``amount`` and answers the sum; ``keep`` keeps the client for the next
  requests (polling; the four newest are kept: a closed store's client would hold a descriptor).
- A failed request is answered ``{"id": N, "error": "..."}``.

Requests are answered each on its own thread, so a ``get`` waiting for a key does not hold back a heartbeat's ``set``.
The host exits when the agent's end of the socket closes (the agent exited or was killed).
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import traceback
from datetime import timedelta
from typing import Any

from pliant.agent import ipc
from pliant.agent.contract import AgentError
from pliant.env import STACKS_SIGNAL
from pliant.net import parse_host_port
from pliant.spawn import die_with_parent

__all__ = ["PROCESS_NAME", "StoreHost", "StoreHostError", "listen", "serve"]

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # a first request waits for the host's torch import (seconds on a loaded node)
REPLY_MARGIN_S = 5.0  # beyond a request's own timeout
_KEPT_CLIENTS = 4  # clients kept for polling (one per generation store a hand-over polls)
PROCESS_NAME = "pliant-stores"  # the store host's process name (at most 15 characters)
_PR_SET_NAME = 15


class StoreHostError(AgentError):
    """The store host failed a request, did not answer in time, or is gone."""


# -- the host ----------------------------------------------------------------------------------------------------------


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` only (port 0: a free one). torch's TCPStore server would listen on every
    interface; this one is handed over with ``master_listen_fd``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


class _Host:
    def __init__(self, sock: socket.socket) -> None:
        from torch.distributed import TCPStore

        self._store_type = TCPStore
        self._sock = sock
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._servers: dict[int, tuple[str, Any]] = {}  # port -> (host, TCPStore server)
        self._clients: dict[str, Any] = {}  # kept clients by address

    def run(self) -> None:
        while True:
            request, fds = ipc.receive(self._sock)
            if request is None:  # the agent is gone
                return
            threading.Thread(target=self._answer, args=(request, fds), daemon=True).start()

    def _answer(self, request: dict[str, Any], fds: list[int]) -> None:
        try:
            reply = {"value": self._do(request, fds)}
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"}
        finally:
            for fd in fds:  # a socket served is detached from the list; any other is closed
                with contextlib.suppress(OSError):
                    os.close(fd)
        reply["id"] = request.get("id")
        with self._send_lock, contextlib.suppress(OSError):
            ipc.send(self._sock, reply)

    def _do(self, request: dict[str, Any], fds: list[int]) -> Any:
        op = request.get("op")
        if op == "serve":
            return self._serve(str(request["host"]), int(request["port"]), fds.pop() if fds else None)
        if op == "close":
            with self._lock:
                self._servers.pop(int(request["port"]), None)  # the server closes its socket as it is freed
            return None
        if op not in ("set", "get", "add"):
            raise ValueError(f"unknown op {op!r}")
        address, keep = str(request["address"]), bool(request.get("keep"))
        store = self._store(address, float(request.get("timeout", 5.0)), keep)
        try:
            if op == "set":
                store.set(request["key"], str(request["value"]))
                return None
            if op == "add":
                return int(store.add(request["key"], int(request.get("amount", 0))))
            if request.get("check") and not store.check([request["key"]]):
                return None
            return store.get(request["key"]).decode()
        except Exception:
            with self._lock:
                self._clients.pop(address, None)
            raise

    def _serve(self, host: str, port: int, listening: int | None) -> int:
        sock = listen(host, port) if listening is None else socket.socket(fileno=listening)
        bound = int(sock.getsockname()[1])
        fd = sock.detach()
        try:
            server = self._store_type(
                host,
                bound,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=30),
                master_listen_fd=fd,
                use_libuv=True,
            )
        except Exception:
            os.close(fd)
            raise
        with self._lock:
            self._servers[bound] = (host, server)
        return bound

    def _store(self, address: str, timeout_s: float, keep: bool) -> Any:
        host, port = parse_host_port(address)
        with self._lock:
            served = self._servers.get(port)
            if served is not None and served[0] == host:
                return served[1]
            if address in self._clients:
                return self._clients[address]
        client = self._store_type(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        if keep:
            with self._lock:
                self._clients[address] = client
                while len(self._clients) > _KEPT_CLIENTS:  # older generations' stores: closed by now
                    del self._clients[next(iter(self._clients))]
        return client


def serve(fd: int) -> None:
    """Run the store host on the connected socket ``fd`` until the agent's end closes; then end the process (its
    servers with it). Called in a child the zygote forked, or by ``python -m pliant.agent.storehost FD``.

    The process is named :data:`PROCESS_NAME` (``ps``, ``/proc/PID/comm``), which tells it from the workers the same
    zygote forked, and writes its threads' stacks on :data:`pliant.env.STACKS_SIGNAL` as a worker does."""
    with contextlib.suppress(OSError):
        os.setsid()  # out of the zygote's process group: stopping workers never stops the stores
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    ctypes.CDLL(None).prctl(_PR_SET_NAME, PROCESS_NAME.encode(), 0, 0, 0)
    faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True)
    sock = socket.socket(fileno=fd)
    try:
        _Host(sock).run()
    except BaseException:  # e.g. torch missing: say why in the node's log; the agent sees the host gone
        traceback.print_exc()
        print(
            f"pliant store host (pid {os.getpid()}): exiting; this node's agent cannot serve its stores",
            file=sys.stderr,
            flush=True,
        )
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # not back into a forked zygote's loop; the servers' threads end with the process


# -- the agent's side --------------------------------------------------------------------------------------------------


class StoreHost:
    """The agent's handle on its store host.

    Args:
        sock: the agent's end of the socket pair whose other end the host serves.
        proc: the host's process when the agent started it itself (None: forked by the zygote).
    """

    def __init__(self, sock: socket.socket, proc: subprocess.Popen[bytes] | None = None) -> None:
        self._sock = sock
        self.proc = proc
        self._changed = threading.Condition()
        self._replies: dict[int, dict[str, Any] | None] = {}  # id -> reply (None: awaited)
        self._next_id = 0
        self._closed = False
        threading.Thread(target=self._read, name="store host", daemon=True).start()

    @staticmethod
    def pair() -> tuple[socket.socket, socket.socket]:
        """(the agent's end, the host's end) of a new socket pair."""
        return ipc.pair()

    @classmethod
    def standalone(cls, env: dict[str, str] | None = None) -> StoreHost:
        """Start a store host process of its own (it imports torch itself): for an agent without a zygote."""
        ours, theirs = cls.pair()
        proc = subprocess.Popen(
            die_with_parent([sys.executable, "-u", "-m", "pliant.agent.storehost", str(theirs.fileno())]),
            env=env,
            stdin=subprocess.DEVNULL,
            pass_fds=[theirs.fileno()],
            start_new_session=True,
        )
        theirs.close()
        return cls(ours, proc)

    def _read(self) -> None:
        while True:
            reply, _fds = ipc.receive(self._sock)
            with self._changed:
                if reply is None:
                    self._closed = True
                    self._changed.notify_all()
                    return
                if reply.get("id") in self._replies:  # a caller that gave up on it is not waiting any more
                    self._replies[reply["id"]] = reply
                    self._changed.notify_all()

    @property
    def closed(self) -> bool:
        """The host's end closed: it exited (or was killed), and its stores with it."""
        return self._closed

    def request(self, op: str, wait_s: float, fds: tuple[int, ...] = (), **fields: Any) -> Any:
        """Send one request (with the descriptors ``fds``, which the host receives as its own) and return its reply's
        value.

        Raises:
            StoreHostError: the host answered with an error, did not answer within ``wait_s``, or is gone.
        """
        with self._changed:
            self._next_id += 1
            ident = self._next_id
            self._replies[ident] = None
        try:
            try:
                ipc.send(self._sock, {"id": ident, "op": op, **fields}, fds)
            except OSError as exc:
                raise StoreHostError(f"the store host is gone ({exc})") from exc
            with self._changed:
                if not self._changed.wait_for(lambda: self._replies[ident] is not None or self._closed, wait_s):
                    raise StoreHostError(f"the store host did not answer {op!r} within {wait_s:g}s")
                reply = self._replies[ident]
            if reply is None:
                raise StoreHostError(f"the store host is gone (it exited before answering {op!r})")
            if "error" in reply:
                raise StoreHostError(str(reply["error"]))
            return reply.get("value")
        finally:
            with self._changed:
                self._replies.pop(ident, None)

    def close(self) -> None:
        """Close the agent's end: the host exits, and its stores with it."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()
        if self.proc is not None:
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
