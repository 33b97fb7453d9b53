"""Process groups' sockets are known by descriptor and inode (pliant.worker.inplace.groups.socket_fds): a new group's
socket that reuses a descriptor closed after the snapshot counts as new, and a stale entry never touches the socket that
reused its descriptor. Real sockets of this process (Linux /proc)."""

from __future__ import annotations

import os
import socket
import sys

import pytest

from pliant.worker.inplace.groups import shut_down, socket_fds

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd (Linux)")


def _under(fd: int) -> tuple[socket.socket, socket.socket]:
    """A connected pair whose first socket is also open as descriptor ``fd`` (free: the kernel may give it anyway)."""
    new, peer = socket.socketpair()
    if new.fileno() != fd:
        os.dup2(new.fileno(), fd)
    return new, peer


def _close(fd: int, new: socket.socket, peer: socket.socket) -> None:
    if new.fileno() != fd:
        os.close(fd)
    new.close()
    peer.close()


def test_a_socket_that_reuses_a_descriptor_closed_after_the_snapshot_counts_as_opened() -> None:
    old = socket.socket()
    fd = old.fileno()
    before = socket_fds()
    old.close()  # as an old group's socket that gloo closes while the next group forms
    new, peer = _under(fd)  # the new group's socket under the freed number
    try:
        opened = socket_fds() - before
        assert any(entry[0] == fd for entry in opened), "the reused descriptor is among the sockets opened"
    finally:
        _close(fd, new, peer)


def test_a_stale_entry_never_shuts_down_the_socket_that_reused_its_descriptor() -> None:
    old = socket.socket()
    fd = old.fileno()
    stale = {entry for entry in socket_fds() if entry[0] == fd}
    old.close()
    new, peer = _under(fd)
    try:
        shut_down(stale)
        os.write(fd, b"x")  # still open both ways
        assert peer.recv(1) == b"x"
        shut_down({entry for entry in socket_fds() if entry[0] == fd})  # the socket itself: shut down
        assert peer.recv(1) == b""
    finally:
        _close(fd, new, peer)
