"""Records sealed with a job's key: what pliant reads from places others can write, and acts on only when the seal
holds.

A checkpoint directory may sit on storage that more than the job can write (a shared volume that every agent pod
mounts), and a node's TCPStores take any client. Nothing pliant reads there steers a worker or an agent unless it
carries a valid seal: a forged or altered record is ignored (and overwritten where pliant writes one), never trusted.

**The job's key** is 32 bytes, ``HMAC-SHA256(root, b"pliant checkpoint key v1\\0" + job_id)``, where ``root`` is the
control plane's sealing secret (32 random bytes: the embedded control plane keeps it in a file of the first node's
state directory, :func:`load_or_create_root`; a standalone coordinator in ``--seal-root-file`` or, by default, in etcd
under ``/pliant/seal-root``, created once). The key therefore survives the loss of every node, and, with the root kept
outside etcd, the loss of etcd too. A member receives its job's key in ``JoinResponse.checkpoint_key``; its workers in
``PLIANT_CHECKPOINT_KEY`` (hex). Without a key (a script run outside an agent) records carry no seal and are read as
they are.

**A sealed record** is one UTF-8 JSON object whose ``"mac"`` is the lowercase hex
``HMAC-SHA256(key, json.dumps(rest, sort_keys=True, separators=(",", ":")))`` of the object without ``"mac"``. Its
``"kind"`` says what it is, so that no record stands in for another: ``"commit"`` (a checkpoint's marker,
:mod:`pliant.worker.checkpoint`).

**Who holds which key.** The checkpoint key is in every worker's environment, so it seals only what workers write for
each other: commit markers. What stops or steers a job is sealed with keys no worker holds: an agent's store records
carry a short seal, :func:`tag`, under the job's **agent key** (:func:`agent_key`, given to agents at join, never to
workers; :mod:`pliant.agent.stores`), and the checkpoint directory's fence carries the control plane's signatures
(:mod:`pliant.security.warrant`, :mod:`pliant.fence`), which only seats and coordinator replicas can make.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pliant.errors import PliantError

__all__ = [
    "KEY_BYTES",
    "SealError",
    "agent_key",
    "job_key",
    "load_or_create_root",
    "parse_root",
    "seal",
    "tag",
    "unseal",
]

KEY_BYTES = 32
_KEY_LABEL = b"pliant checkpoint key v1\0"
_AGENT_LABEL = b"pliant agent key v1\0"


class SealError(PliantError):
    """A record is not what its seal says (forged, altered, sealed with another key, or not a record at all)."""


def job_key(root: bytes, job_id: str) -> bytes:
    """The checkpoint key of ``job_id`` under the control plane's sealing ``root``."""
    return hmac.new(root, _KEY_LABEL + job_id.encode(), hashlib.sha256).digest()


def agent_key(root: bytes, job_id: str) -> bytes:
    """The agent key of ``job_id`` under the control plane's sealing ``root``: what agents seal the records they act on
    in each other's stores with (:mod:`pliant.agent.stores`). Agents keep it from their workers."""
    return hmac.new(root, _AGENT_LABEL + job_id.encode(), hashlib.sha256).digest()


def tag(key: bytes, *parts: object) -> str:
    """A short seal (HMAC-SHA256, 32 hex digits) of ``parts`` under ``key``: what a node's store records carry
    (:mod:`pliant.agent.stores`)."""
    return hmac.new(key, "\0".join(map(str, parts)).encode(), hashlib.sha256).hexdigest()[:32]


def parse_root(text: str) -> bytes:
    """The sealing root written as ``text`` (hex); b"" when it is not one of :data:`KEY_BYTES` bytes."""
    try:
        root = bytes.fromhex(text.strip())
    except ValueError:
        return b""
    return root if len(root) == KEY_BYTES else b""


def load_or_create_root(path: str | os.PathLike[str]) -> bytes:
    """The sealing root kept in ``path`` (hex), created there (mode 0600, its directory 0700) when absent.

    Raises:
        SealError: the file exists but does not hold a root of :data:`KEY_BYTES` bytes, or is readable by others.
    """
    file = Path(path)
    if not file.exists():  # made whole, then linked into place: two runs starting at once read the same root
        file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(KEY_BYTES) + "\n")
            out.flush()
            os.fsync(out.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(tmp, file)
        tmp.unlink()
    if file.stat().st_mode & 0o077:
        raise SealError(
            f"sealing root {file} is readable by other users (mode {file.stat().st_mode & 0o777:o}); "
            f"run chmod 600 {file}"
        )
    root = parse_root(file.read_text())
    if not root:
        raise SealError(
            f"sealing root {file} must hold {KEY_BYTES} bytes as hex; restore it, or remove it to make a "
            f"new one (checkpoints sealed with the old one will no longer load)"
        )
    return root


def _canonical(record: Mapping[str, Any]) -> bytes:
    return json.dumps({k: v for k, v in record.items() if k != "mac"}, sort_keys=True, separators=(",", ":")).encode()


def seal(key: bytes | None, record: Mapping[str, Any]) -> str:
    """``record`` as sealed JSON text (unsealed when ``key`` is None or empty)."""
    out = dict(record)
    out.pop("mac", None)
    if key:
        out["mac"] = hmac.new(key, _canonical(out), hashlib.sha256).hexdigest()
    return json.dumps(out, sort_keys=True)


def unseal(key: bytes | None, text: str | bytes, kind: str) -> dict[str, Any]:
    """The record in ``text``, checked against ``key`` (not checked when ``key`` is None or empty).

    Raises:
        SealError: not a JSON object of that ``kind``, or (with a key) its seal is missing or wrong.
    """
    try:
        record = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SealError(f"not a JSON record ({exc})") from None
    if not isinstance(record, dict) or record.get("kind") != kind:
        raise SealError(f"not a {kind} record")
    if key:
        mac = record.get("mac")
        expected = hmac.new(key, _canonical(record), hashlib.sha256).hexdigest()
        if not isinstance(mac, str) or not hmac.compare_digest(mac, expected):
            raise SealError(f"its seal does not match this job's key ({'missing' if mac is None else 'wrong'})")
    return record
