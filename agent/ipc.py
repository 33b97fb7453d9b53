"""The framing between the agent and the processes it starts beside it (the worker zygote, :mod:`pliant.agent.zygote`;
the store host, :mod:`pliant.agent.storehost`): each pair of them talks over a SOCK_SEQPACKET Unix socket pair.

Wire format: one message is one record, the UTF-8 JSON text of one object, at most :data:`MAX_MESSAGE` bytes, with at
most :data:`MAX_FDS` file descriptors attached to the same record (SCM_RIGHTS), which the receiver owns from then
on. A read of nothing is the other end's close (its process exited or was killed). What the objects say is each
protocol's own (the zygote's and the store host's docstrings).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["MAX_FDS", "MAX_MESSAGE", "pair", "receive", "send"]

MAX_MESSAGE = 1 << 20
"""The largest message either side reads (a worker's spawn carries its whole environment)."""
MAX_FDS = 4
"""The most descriptors one message carries."""


def pair() -> tuple[socket.socket, socket.socket]:
    """Two connected ends: keep one, hand the other's descriptor to the process started beside this one."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def send(sock: socket.socket, message: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
    """Send ``message`` (and the descriptors ``fds``, which the receiver gets as its own).

    Raises:
        OSError: the other end is gone.
    """
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def receive(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message and the descriptors sent with it; (None, []) once the other end closed (or the socket
    failed)."""
    try:
        data, fds, _flags, _address = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
    except OSError:
        return None, []
    if not data:
        return None, fds
    return json.loads(data), fds
