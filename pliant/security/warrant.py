"""Warrants: the control plane's signed word that a world of a job is real, which members and workers check and none of
them can make.

A record that stops a job's worlds (the checkpoint directory's fence, :mod:`pliant.fence`) must not be forgeable by
what a node or a worker holds: the job's checkpoint key is in every worker's environment. So the control plane signs
each generation it publishes with a key that only it holds, and whoever reads such a record checks the signature with
the public half, which is no secret.

**The job's control key** is an Ed25519 key whose 32-byte seed is ``HMAC-SHA256(root, b"pliant control key v1\\0" +
job_id)``, ``root`` being the control plane's sealing secret (:mod:`pliant.security.seal`; only coordinator replicas
and the seats of an embedded control plane hold it). Its public key (32 raw bytes) reaches members in
``JoinResponse.control_key`` and workers in ``PLIANT_CONTROL_KEY`` (hex).

**A warrant** is the hex Ed25519 signature, by the job's control key, of::

    b"pliant warrant v1\\0" + json.dumps({"generation": N, "incarnation": INC, "job": ID, "published_at": T},
                                          sort_keys=True, separators=(",", ":"))

where ``published_at`` is the generation's ``created_at`` (the leader's wall clock when it published it). The leader
signs every generation it publishes (``Generation.warrant``); agents pass their world's warrant to its workers
(``PLIANT_WARRANT``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass

__all__ = ["PUBLIC_KEY_BYTES", "World", "public_key", "sign", "verify"]

PUBLIC_KEY_BYTES = 32
_LABEL = b"pliant control key v1\0"
_CONTEXT = b"pliant warrant v1\0"


@dataclass(frozen=True)
class World:
    """One world of a job, as a warrant names it: the job, its incarnation, the generation number and when the leader
    published it (seconds since the epoch)."""

    job: str
    incarnation: str
    generation: int
    published_at: float

    def message(self) -> bytes:
        body = {
            "generation": self.generation,
            "incarnation": self.incarnation,
            "job": self.job,
            "published_at": self.published_at,
        }
        return _CONTEXT + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _private_key(root: bytes, job: str) -> object:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.from_private_bytes(hmac.new(root, _LABEL + job.encode(), hashlib.sha256).digest())


def public_key(root: bytes, job: str) -> bytes:
    """The public half of ``job``'s control key under the sealing ``root`` (32 raw bytes)."""
    from cryptography.hazmat.primitives import serialization

    key = _private_key(root, job).public_key()  # type: ignore[attr-defined]
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def sign(root: bytes, world: World) -> str:
    """The warrant of ``world`` (hex), signed with its job's control key under ``root``."""
    return _private_key(root, world.job).sign(world.message()).hex()  # type: ignore[attr-defined]


def verify(public: bytes, world: World, warrant: str) -> bool:
    """Whether ``warrant`` is the control plane's signature of ``world`` under the public key ``public``."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        Ed25519PublicKey.from_public_bytes(public).verify(bytes.fromhex(warrant), world.message())
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True
