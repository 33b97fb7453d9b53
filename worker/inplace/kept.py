"""Buddy snapshot buffers that outlive their process: node-local shared memory, read back by the worker that
replaces a dead one.

A sharded engine's buddy copies (:mod:`pliant.worker.inplace.buddy`) protect a rank's shard against the loss of that
rank or of its node: the shard's owner holds one copy, a rank on another node the other. A shard is lost only when both
die together, and then the job goes back to its last disk checkpoint. That happened in soaks with two workers per node:
a node died, and a worker of another node, blocked in gloo on a send to the dead node, gave up (its step guard) with
its buddy on the dead node.

A worker's own node usually outlives the worker. So every rank keeps its snapshot buffers (its own shard's copies and
its wards') in files under its agent's snapshot directory (``pliant run --snapshot-dir``, by default a new folder in
``/dev/shm``, which is memory: tmpfs), mapped into the process (``MAP_SHARED``). The copy and the exchange with the
buddy write them exactly as they wrote anonymous memory, so this costs no extra copy and no extra memory; a small
header per slot (JSON, replaced atomically) says which step each buffer holds once it is whole. When the process dies,
the files stay; the fresh worker its agent starts for the same local rank reads the headers and offers those copies
to the roll back (:meth:`KeptSlots.load`; :func:`pliant.worker.inplace.buddy.choose_rollback` takes them only when they
are of the survivors' world). The first snapshot of a new world removes the folder's older files; the agent removes its
directory when it exits, and a later agent on the host removes those of agents that died.

Limits: where the directory is missing or too small (a container's 64 MB ``/dev/shm``), or on CUDA (the own copy is
pinned host memory there, made by torch), the buffers are anonymous memory as before and die with the process; the
choice is logged once. Nothing here crosses ranks.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pliant.worker.contract import WorkerError

__all__ = ["HEADROOM_BYTES", "KeptError", "KeptSlot", "KeptSlots", "SlotHeader"]

logger = logging.getLogger(__name__)

HEADROOM_BYTES = 64 << 20  # left free in the directory's file system: tmpfs kills a writer that fills it (SIGBUS)
_VERSION = 1


class KeptError(WorkerError):
    """A slot header that cannot be read back (corrupt, another version, files missing): it is skipped."""


@dataclass(frozen=True)
class SlotHeader:
    """What one slot's files hold, once whole.

    Attributes:
        generation: the world whose buddy copies these are (:attr:`pliant.worker.inplace.buddy.BuddyCopies.generation`).
        world: that world's size.
        rank: this rank's rank in that world.
        step: the committed step of the copies.
        partition: the owning rank of each parameter in that world (the sharded engine's partition).
        own: (file name, bytes) of this rank's own copy; None when it is not in a kept file (CUDA).
        wards: old rank -> (file name, bytes) of each ward's complete copy.
    """

    generation: int
    world: int
    rank: int
    step: int
    partition: tuple[int, ...]
    own: tuple[str, int] | None
    wards: Mapping[int, tuple[str, int]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": _VERSION,
                "generation": self.generation,
                "world": self.world,
                "rank": self.rank,
                "step": self.step,
                "partition": list(self.partition),
                "own": list(self.own) if self.own else None,
                "wards": {str(k): list(v) for k, v in self.wards.items()},
            }
        )

    @classmethod
    def from_json(cls, text: str) -> SlotHeader:
        """Raises:
        KeptError: ``text`` is not a header of this version.
        """
        try:
            raw = json.loads(text)
            if raw.get("version") != _VERSION:
                raise KeptError(f"slot header version {raw.get('version')!r}, not {_VERSION}")
            own = raw["own"]
            header = cls(
                int(raw["generation"]),
                int(raw["world"]),
                int(raw["rank"]),
                int(raw["step"]),
                tuple(int(p) for p in raw["partition"]),
                (str(own[0]), int(own[1])) if own else None,
                {int(k): (str(v[0]), int(v[1])) for k, v in raw["wards"].items()},
            )
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise KeptError(f"unreadable slot header ({type(exc).__name__}: {exc})") from exc
        names = [n for n, _ in ([header.own] if header.own else []) + list(header.wards.values())]
        if not 0 <= header.rank < header.world or header.step < 0 or any("/" in n or n.startswith(".") for n in names):
            raise KeptError(
                f"slot header out of range: rank {header.rank} of {header.world}, step {header.step}, files {names}"
            )
        return header


@dataclass
class KeptSlot:
    """A slot read back from a dead predecessor's files: its header and its buffers, mapped."""

    header: SlotHeader
    own: torch.Tensor | None
    wards: dict[int, torch.Tensor]


class KeptSlots:
    """One worker's snapshot buffers, in ``directory`` (its local rank's folder of the agent's snapshot directory).

    Args:
        directory: the folder; "" keeps the buffers in anonymous memory (nothing outlives the process).

    Threads: none of its own, and no lock: its owner (:class:`~pliant.worker.inplace.buddy.BuddyCopies`) calls it
    from the training thread and from its background tasks, always under the owner's lock.
    """

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory) if directory else None
        self._names: dict[int, str] = {}  # a kept buffer's data pointer -> its file's name
        self._numbers = itertools.count(1)
        self._told = False
        if self.directory is not None:
            try:
                self.directory.mkdir(exist_ok=True)  # not the agent's directory: gone, it is not ours to make
            except OSError as exc:
                self._anonymous(f"its folder {self.directory} cannot be made ({exc})")

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def buffer(self, size: int) -> torch.Tensor:
        """A byte buffer of ``size`` bytes: a file of this folder mapped shared, or anonymous memory when the folder
        is off or its file system lacks the room (logged once)."""
        if self.directory is None or size == 0:
            return torch.empty(size, dtype=torch.uint8)
        name = f"{os.getpid()}-{next(self._numbers)}.bin"
        path = self.directory / name
        try:
            free = os.statvfs(self.directory)
            if free.f_bavail * free.f_frsize < size + HEADROOM_BYTES:
                raise OSError(errno.ENOSPC, f"{free.f_bavail * free.f_frsize >> 20} MiB free, {size >> 20} MiB needed")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)  # reserved: a write into the mapping never finds tmpfs full
            finally:
                os.close(fd)
            out = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        except OSError as exc:
            with contextlib.suppress(OSError):
                path.unlink()
            self._anonymous(f"{exc.strerror or exc} in {self.directory}")
            return torch.empty(size, dtype=torch.uint8)
        self._names[out.data_ptr()] = name
        return out

    def name(self, buffer: torch.Tensor | None) -> tuple[str, int] | None:
        """(file name, bytes) of a buffer :meth:`buffer` made in a file; None for anonymous memory."""
        if buffer is None or buffer.numel() == 0:
            return None
        name = self._names.get(buffer.data_ptr())
        return (name, buffer.numel()) if name is not None else None

    def record(self, index: int, header: SlotHeader | None) -> None:
        """Say what slot ``index`` holds (None: nothing whole, before its buffers are written again). Atomic."""
        if self.directory is None:
            return
        path = self.directory / f"slot-{index}.json"
        try:
            if header is None:
                path.unlink(missing_ok=True)
                return
            temporary = path.with_suffix(".tmp")
            temporary.write_text(header.to_json())
            os.replace(temporary, path)
        except OSError as exc:  # the copies in memory still serve this process; only a successor loses them
            self._anonymous(f"its headers cannot be written ({exc})")

    def load(self) -> list[KeptSlot]:
        """The slots a dead predecessor left in this folder, newest world only, their files mapped (a header that
        cannot be read back is skipped with a warning)."""
        if self.directory is None:
            return []
        out: list[KeptSlot] = []
        for path in sorted(self.directory.glob("slot-*.json")):
            try:
                header = SlotHeader.from_json(path.read_text())
                own = self._map(header.own) if header.own else None
                wards = {old: self._map(entry) for old, entry in header.wards.items()}
            except (OSError, KeptError) as exc:
                logger.warning("kept snapshot %s skipped: %s", path, exc)
                continue
            out.append(KeptSlot(header, own, wards))
        newest = max((s.header.generation for s in out), default=-1)
        return [s for s in out if s.header.generation == newest]

    def _map(self, entry: tuple[str, int]) -> torch.Tensor:
        name, size = entry
        assert self.directory is not None
        path = self.directory / name
        actual = path.stat().st_size
        if actual < size:  # a mapping past the end of a file faults on first read
            raise KeptError(f"{path} has {actual} bytes, its header says {size}")
        return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)

    def sweep(self) -> None:
        """Remove every file of this folder (a predecessor's, this process's older ones) and every header. Mapped
        buffers stay valid: a file's memory goes when its last mapping does."""
        if self.directory is None:
            return
        for path in self.directory.iterdir():
            with contextlib.suppress(OSError):
                path.unlink()
        self._names = {}

    def release(self, buffer: torch.Tensor | None) -> None:
        """Remove the file of a buffer that is being replaced (its memory goes with its last mapping)."""
        named = self.name(buffer)
        if buffer is None or named is None or self.directory is None:
            return
        del self._names[buffer.data_ptr()]
        with contextlib.suppress(OSError):
            (self.directory / named[0]).unlink()

    def _anonymous(self, why: str) -> None:
        """From now on, anonymous memory only: the headers go first, since the kept buffers' bytes will change
        without them."""
        if self.directory is not None:
            for path in self.directory.glob("slot-*.json"):
                with contextlib.suppress(OSError):
                    path.unlink()
        if not self._told:
            self._told = True
            logger.warning("buddy snapshots kept in process memory only (a dead worker's copies die with it): %s", why)
        self.directory = None
