"""The checkpoint directory's fence: which world of which incarnation of the job owns the directory.

**Wire format**: ``pliant-fence.json`` in the checkpoint directory, one JSON object::

    {"kind": "fence", "job": ID,
     "owner": {"incarnation": INC, "generation": N, "published_at": T, "warrant": HEX},
     "superseded": [{"incarnation": ..., "generation": ..., "published_at": ..., "warrant": ...}, ...]}

Each world in it carries its **warrant**, the control plane's signature of (job, incarnation, generation,
published_at) (:mod:`pliant.security.warrant`): nothing a member or a worker holds can make one, so nobody but the
control plane
decides which worlds the fence stops. The owner is the newest world that opened the directory; ``superseded`` lists
earlier incarnations' owners, newest last, at most :data:`MAX_SUPERSEDED`, each published before the owner. Rank 0 of
each world writes it when its checkpoint manager opens the directory (:mod:`pliant.worker.checkpoint`); agents read it
on their ticks.

**The rule** (pure, :class:`Fence`): a world is superseded when its incarnation is listed, or is the owner's at a
higher generation. A world of another incarnation takes the directory over when its first world opens it, if the
control plane published it after the owner (the job started again after the loss of every node: its earlier
incarnation's worlds are fenced for good); an earlier one neither takes it over nor is stopped by it.

**Reading**: with the job's control public key, a fence counts only when its owner's warrant holds; a listed world
whose warrant does not hold, or that was published after the owner, is dropped. Without a key (a script run outside
an agent) nothing is checked, and nothing is fenced (worlds outside an agent have no incarnation).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pliant.security.seal import SealError
from pliant.security.warrant import World, verify

__all__ = ["FENCE", "MAX_SUPERSEDED", "NOBODY", "Fence", "Warranted", "read_fence"]

FENCE = "pliant-fence.json"
MAX_SUPERSEDED = 16
MAX_FENCE_BYTES = 64 * 1024  # a fence of MAX_SUPERSEDED + 1 worlds takes about 5 KB


@dataclass(frozen=True)
class Warranted:
    """One world of the job as the fence records it: its incarnation, generation, when the control plane published
    it, and its warrant (hex; "" outside an agent)."""

    incarnation: str
    generation: int
    published_at: float = 0.0
    warrant: str = ""

    def world(self, job: str) -> World:
        return World(job, self.incarnation, self.generation, self.published_at)

    def to_record(self) -> dict[str, Any]:
        return {
            "incarnation": self.incarnation,
            "generation": self.generation,
            "published_at": self.published_at,
            "warrant": self.warrant,
        }

    @classmethod
    def from_record(cls, record: Any) -> Warranted:
        """Raises: SealError: not a world record."""
        try:
            return cls(
                str(record["incarnation"]),
                int(record["generation"]),
                float(record.get("published_at", 0.0)),
                str(record.get("warrant", "")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SealError(f"fence record lacks a valid world ({exc})") from None


NOBODY = Warranted("", 0)


@dataclass(frozen=True)
class Fence:
    """Who owns a checkpoint directory: the newest world that opened it, and the earlier incarnations it fenced."""

    job: str
    owner: Warranted
    superseded: tuple[Warranted, ...] = ()

    def supersedes(self, incarnation: str, generation: int) -> bool:
        """Whether the world ``(incarnation, generation)`` of this fence's job has been superseded."""
        if not incarnation:
            return False
        if incarnation == self.owner.incarnation:
            return generation < self.owner.generation
        return any(s.incarnation == incarnation for s in self.superseded)

    def opened_by(self, world: Warranted) -> Fence | None:
        """The fence after ``world`` opens the directory; None when it writes nothing (it is superseded, already owns
        the directory at that generation or a newer one, or is another incarnation's published before the owner)."""
        if self.supersedes(world.incarnation, world.generation):
            return None
        if world.incarnation == self.owner.incarnation:
            return replace(self, owner=world) if world.generation > self.owner.generation else None
        if self.owner.incarnation and world.published_at <= self.owner.published_at:
            return None
        earlier = self.superseded
        if self.owner.incarnation:
            earlier = (*(s for s in earlier if s.incarnation != self.owner.incarnation), self.owner)
        return Fence(self.job, world, earlier[-MAX_SUPERSEDED:])

    def to_record(self) -> dict[str, Any]:
        return {
            "kind": "fence",
            "job": self.job,
            "owner": self.owner.to_record(),
            "superseded": [s.to_record() for s in self.superseded],
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Fence:
        """Raises: SealError: a field is missing or of the wrong type."""
        try:
            superseded = tuple(Warranted.from_record(s) for s in record.get("superseded", ()))
            return cls(str(record["job"]), Warranted.from_record(record["owner"]), superseded)
        except (KeyError, TypeError) as exc:
            raise SealError(f"fence record lacks a valid field ({exc})") from None

    def checked(self, control_key: bytes) -> Fence:
        """This fence as far as the control plane's warrants bear it out (``control_key``: the job's public key).

        Raises:
            SealError: the owner's warrant does not hold.
        """
        if not verify(control_key, self.owner.world(self.job), self.owner.warrant):
            raise SealError("its owner's warrant is not the control plane's signature of that world")
        kept = tuple(
            s
            for s in self.superseded
            if s.published_at < self.owner.published_at and verify(control_key, s.world(self.job), s.warrant)
        )
        return replace(self, superseded=kept)


def read_fence(directory: str | os.PathLike[str], control_key: bytes | None) -> Fence | None:
    """The fence of ``directory``, checked against the job's control public key (not checked when it is None or
    empty); None when it has none.

    Raises:
        SealError: a fence file is there but is not a fence, or (with a key) its owner's warrant does not hold.
    """
    path = Path(directory) / FENCE
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SealError(f"{path} is unreadable ({exc})") from None
    if len(text) > MAX_FENCE_BYTES:
        raise SealError(f"{path} holds {len(text)} bytes, more than a fence ({MAX_FENCE_BYTES})")
    try:
        record = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SealError(f"not a JSON record ({exc})") from None
    if not isinstance(record, dict) or record.get("kind") != "fence":
        raise SealError("not a fence record")
    fence = Fence.from_record(record)
    return fence.checked(control_key) if control_key else fence
