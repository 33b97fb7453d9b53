"""The checkpoint directory's fence: which world of which incarnation of the job owns the directory.

**Wire format**: ``pliant-fence.json`` in the checkpoint directory, a record sealed with the job's key
(:mod:`pliant.seal`)::

    {"kind": "fence", "job": ID, "owner": INCARNATION, "generation": N, "superseded": [INCARNATION, ...], "mac": ...}

The owner is the incarnation (a UUID the control plane writes once, when it creates the job) of the newest world that
opened the directory, at generation ``N``; ``superseded`` lists earlier owners, newest last, at most
:data:`MAX_SUPERSEDED`. Rank 0 of each world writes it when its checkpoint manager opens the directory
(:mod:`pliant.worker.checkpoint`); agents read it on their ticks.

**The rule** (pure, :class:`Fence`): a world is superseded when its incarnation is listed, or is the owner at a higher
generation. A new incarnation of the same job takes the directory over when its first world opens it (the old owner
goes to ``superseded``): resuming after the loss of every node is the default for the same job id, and the earlier
incarnation's worlds are fenced for good. A fence whose seal does not hold is no fence.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pliant.seal import SealError, unseal

__all__ = ["FENCE", "MAX_SUPERSEDED", "Fence", "read_fence"]

FENCE = "pliant-fence.json"
MAX_SUPERSEDED = 16


@dataclass(frozen=True)
class Fence:
    """Who owns a checkpoint directory: the newest world (incarnation, generation) that opened it."""

    job: str
    owner: str
    generation: int
    superseded: tuple[str, ...] = ()

    def supersedes(self, incarnation: str, generation: int) -> bool:
        """Whether the world ``(incarnation, generation)`` of this fence's job has been superseded."""
        if not incarnation:
            return False
        return incarnation in self.superseded or (incarnation == self.owner and generation < self.generation)

    def opened_by(self, incarnation: str, generation: int) -> Fence | None:
        """The fence after the world ``(incarnation, generation)`` opens the directory; None when it writes nothing
        (it is superseded, or already owns the directory at that generation or a newer one)."""
        if self.supersedes(incarnation, generation) or (incarnation == self.owner and generation == self.generation):
            return None
        if incarnation == self.owner:
            return Fence(self.job, incarnation, generation, self.superseded)
        earlier = (*[s for s in self.superseded if s != self.owner], self.owner) if self.owner else self.superseded
        return Fence(self.job, incarnation, generation, earlier[-MAX_SUPERSEDED:])

    def to_record(self) -> dict[str, Any]:
        return {
            "kind": "fence",
            "job": self.job,
            "owner": self.owner,
            "generation": self.generation,
            "superseded": list(self.superseded),
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Fence:
        """Raises: SealError: a field is missing or of the wrong type."""
        try:
            superseded = tuple(str(s) for s in record.get("superseded", ()))
            return cls(str(record["job"]), str(record["owner"]), int(record["generation"]), superseded)
        except (KeyError, TypeError, ValueError) as exc:
            raise SealError(f"fence record lacks a valid field ({exc})") from None


def read_fence(directory: str | os.PathLike[str], key: bytes | None) -> Fence | None:
    """The fence of ``directory``; None when it has none.

    Raises:
        SealError: a fence file is there but is not a fence sealed with ``key``.
    """
    try:
        text = (Path(directory) / FENCE).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SealError(f"{Path(directory) / FENCE} is unreadable ({exc})") from None
    return Fence.from_record(unseal(key, text, "fence"))
