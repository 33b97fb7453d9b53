"""A TCP proxy a test can cut and heal: one node's path to the control plane, partitioned while the rest of the
fleet (and this node's peers) still reach each other. Network namespaces do this for real (issue 14); on loopback a
proxy is enough to cut exactly one agent off."""

from __future__ import annotations

import contextlib
import socket
import threading

__all__ = ["Proxy"]


class Proxy:
    """Forward ``127.0.0.1:<port>`` to ``target`` (HOST:PORT) until :meth:`cut`; :meth:`heal` restores it.

    While cut, every open connection is closed and new ones are closed as soon as they are accepted (the node sees
    the coordinator unreachable). While muted (:meth:`mute`), connections stay open and nothing gets through: the
    far side goes silent, as behind a partition.
    """

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._open = True
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self._muted = False
        threading.Thread(target=self._accept, name="proxy", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._open:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=2)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if not self._muted:
                    dst.sendall(data)
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        self._open = False
        with self._lock:
            conns, self._conns = self._conns, []
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def mute(self) -> None:
        """Drop everything both ways from now on, keeping every connection open (no reset, no close)."""
        self._muted = True

    def heal(self) -> None:
        self._open = True
        self._muted = False

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._listener.close()
