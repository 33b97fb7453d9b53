"""Checkpoint files written around the page cache (``O_DIRECT``), for DCP's file writer.

Why: a buffered write copies every byte into the page cache, whose pages the kernel must find (fresh ones are
costly), and the kernel's writeback then walks them again, on threads of its own; with ``O_DIRECT`` from memory the
writer already touched, the device reads it itself, for a fraction of that CPU (docs/benchmarks.md has the figures).
An async save runs beside the training, so that CPU is taken from the steps; a sync save waits for it.

How: :class:`DirectStream` gathers what DCP (``torch.save`` of each item) writes into one reused, page-aligned buffer
per thread and writes it out whole (:data:`CHUNK`) at aligned offsets; at ``close`` it writes the last partial block
padded, cuts the file to its length and ``fsync``-s it (a file is durable once closed). The bytes in the file are
exactly DCP's own: any reader (any world size, torch's own ``FileSystemReader``) loads them. A file system that
refuses ``O_DIRECT`` (tmpfs, some FUSE and network file systems; a platform without it) gets an ordinary buffered
file, with the same result, and the choice is logged once per directory.

Modes: files are made :data:`FILE_MODE` (0640) and directories :data:`DIR_MODE` (0750), whatever the umask: a
checkpoint is readable by its owner's group (a sidecar that uploads it), writable by its owner only.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import mmap
import os
import threading
from collections.abc import Generator
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

__all__ = ["ALIGN", "CHUNK", "DIR_MODE", "FILE_MODE", "DirectFileSystem", "DirectStream", "DirectWriter"]

logger = logging.getLogger(__name__)

ALIGN = 4096  # offsets and lengths of O_DIRECT writes: a multiple of any device's logical block size
CHUNK = 8 << 20  # bytes gathered before one write (a multiple of ALIGN)
FILE_MODE = 0o640
DIR_MODE = 0o750
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none: buffered files
_buffers = threading.local()  # each writing thread's aligned buffer, reused from file to file
_told: set[str] = set()  # directories whose buffered fallback was logged


def _take_buffer() -> mmap.mmap:
    """A page-aligned buffer of :data:`CHUNK` bytes: this thread's (made once per thread), or a new one while another
    open stream of this thread holds that."""
    if getattr(_buffers, "busy", False):
        return mmap.mmap(-1, CHUNK)
    if getattr(_buffers, "buf", None) is None:
        _buffers.buf = mmap.mmap(-1, CHUNK)
    _buffers.busy = True
    return _buffers.buf


def _give_back(buf: mmap.mmap) -> None:
    if buf is getattr(_buffers, "buf", None):
        _buffers.busy = False


class DirectStream(io.RawIOBase):
    """A write-only binary file written through ``O_DIRECT`` in aligned chunks (see the module's docstring).

    ``flush()`` writes nothing: DCP calls it after every item, and a partial block written early would only be
    written again. The bytes reach the file as each chunk fills and at ``close``, which also syncs the file.

    Args:
        path: the file to create (truncated if it exists).
        fd: its descriptor, opened with ``O_DIRECT``; the stream owns it.
    """

    def __init__(self, path: Path, fd: int) -> None:
        super().__init__()
        self.path, self._fd = path, fd
        self._buf = _take_buffer()
        self._base = 0  # the file offset of the buffer's first byte (a multiple of ALIGN)
        self._fill = 0  # bytes in the buffer

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def tell(self) -> int:
        return self._base + self._fill

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            take = min(len(view) - done, CHUNK - self._fill)
            self._buf[self._fill : self._fill + take] = view[done : done + take]
            self._fill += take
            done += take
            if self._fill == CHUNK:
                self._write_out(CHUNK)
                self._base += CHUNK
                self._fill = 0
        return done

    def flush(self) -> None:
        """Nothing to do: see the class's docstring."""

    def close(self) -> None:
        """Write the last partial block (padded with zeros, then cut off), sync the file and close it."""
        if self.closed:
            return
        try:
            if self._fill:
                padded = -(-self._fill // ALIGN) * ALIGN
                self._buf[self._fill : padded] = bytes(padded - self._fill)
                self._write_out(padded)
                os.ftruncate(self._fd, self._base + self._fill)
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            _give_back(self._buf)
            super().close()

    def _write_out(self, length: int) -> None:
        """Write the buffer's first ``length`` bytes at the buffer's offset in the file."""
        view = memoryview(self._buf)[:length]
        written = 0
        try:
            while written < length:  # O_DIRECT writes of whole blocks: a short one ends on a block boundary
                written += os.pwrite(self._fd, view[written:], self._base + written)
        except OSError as exc:
            if exc.errno != errno.EINVAL or written:
                raise
            self._buffered()  # the file system took the flag at open but not these writes
            while written < length:
                written += os.pwrite(self._fd, view[written:], self._base + written)
        finally:
            view.release()

    def _buffered(self) -> None:
        """Go on without ``O_DIRECT`` (the same file, the same offsets)."""
        import fcntl

        fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~_O_DIRECT)
        _buffered_in(self.path.parent, "it refused an O_DIRECT write")


class DirectFileSystem(FileSystem):
    """DCP's local file system, with files for writing opened as :class:`DirectStream` where ``O_DIRECT`` is
    accepted and ``direct`` (else as DCP's own buffered files), made :data:`FILE_MODE` in directories made
    :data:`DIR_MODE`."""

    def __init__(self, direct: bool = True) -> None:
        super().__init__()
        self.direct = direct

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        path = Path(path)
        fd = _open_direct(path) if mode == "wb" and self.direct else None
        if fd is None:
            if mode == "wb":
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE))
                os.chmod(path, FILE_MODE)  # an existing file keeps its mode at open
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with DirectStream(path, fd) as stream:
            yield stream

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        Path(path).mkdir(parents=True, exist_ok=True, mode=DIR_MODE)


def _open_direct(path: Path) -> int | None:
    """A descriptor of ``path`` created for writing with ``O_DIRECT``, or None where it cannot be (logged)."""
    if not _O_DIRECT:
        _buffered_in(path.parent, "this platform has no O_DIRECT")
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, FILE_MODE)
        os.fchmod(fd, FILE_MODE)  # an existing file keeps its mode at open
        return fd
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        _buffered_in(path.parent, "its file system refused O_DIRECT")
        return None


def _buffered_in(directory: Path, why: str) -> None:
    """Log, once per checkpoint directory (``directory`` is one checkpoint's), that its files go through the page
    cache, and ``why``."""
    key = str(directory.parent)  # one line per checkpoint directory, not per checkpoint
    if key not in _told:
        _told.add(key)
        logger.info("checkpoints under %s are written through the page cache: %s", key, why)


class DirectWriter(dcp.FileSystemWriter):
    """DCP's file writer (one file per rank, synced) on :class:`DirectFileSystem`; with ``direct=False``, DCP's
    own buffered files (``CheckpointManager(direct_io=False)``)."""

    def __init__(self, path: str | os.PathLike[str], direct: bool = True) -> None:
        super().__init__(path)
        self.fs = DirectFileSystem(direct)
