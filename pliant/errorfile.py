"""The worker error file: the exception a worker died of, where its agent reads it.

The file is torchrun's ``TORCHELASTIC_ERROR_FILE``, in the format torch's ``@record`` writes (so a script decorated
with it, and torch's own tools, read and write the same file)::

    {"message": {"message": "<Type>: <str(exception)>",
                 "extraInfo": {"py_callstack": "<traceback>", "timestamp": "<seconds since the epoch>"}}}

A worker the agent's zygote forks writes it from its uncaught-exception hook unless the script already wrote it
(``@record``); a worker that exits with ``sys.exit``, or dies of a signal, writes none. The agent reads ``message``,
the failure's identity (:mod:`pliant.coordinator.planner` compares it across nodes), bounded to
:data:`MAX_ERROR_FILE_BYTES` read.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from types import TracebackType

__all__ = ["MAX_ERROR_FILE_BYTES", "PEER_GONE", "describe", "peer_gone", "read_error", "write_error"]

MAX_ERROR_FILE_BYTES = 1 << 20  # what the agent reads of an error file (a traceback of a deep recursion is long)

PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
    "NCCL communicator was aborted",
)
"""What a collective's error says when a peer of it went away (gloo's TCP transport, NCCL): the error the peers of a
failed worker die of, which names no fault of their own."""


def peer_gone(identity: str) -> bool:
    """Whether a worker's error ``identity`` (``Type: message``) is a collective's failure because a peer went away
    (:data:`PEER_GONE`)."""
    return any(mark in identity for mark in PEER_GONE)


def describe(value: BaseException) -> str:
    """An exception as its identity: ``Type: message`` (``Type`` alone when its message is empty)."""
    text = str(value)
    return f"{type(value).__name__}: {text}" if text else type(value).__name__


def write_error(path: str, kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    """Write ``value`` to the error file at ``path`` unless one is there already (the script's ``@record`` wrote
    it); never raises (a worker that cannot write it dies of its exception all the same)."""
    if not path or os.path.exists(path):
        return
    record = {
        "message": {
            "message": describe(value),
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(kind, value, tb)),
                "timestamp": str(int(time.time())),
            },
        }
    }
    try:
        with open(path, "w", encoding="utf-8") as out:
            json.dump(record, out)
    except OSError:
        pass


def read_error(path: str) -> str:
    """The ``Type: message`` of the error file at ``path`` ("" when there is none, or it is not one: a worker's
    file is its own, never trusted to be well formed)."""
    if not path:
        return ""
    try:
        with open(path, encoding="utf-8", errors="replace") as source:
            record = json.loads(source.read(MAX_ERROR_FILE_BYTES))
    except (OSError, ValueError):
        return ""
    message = record.get("message") if isinstance(record, dict) else None
    if isinstance(message, dict):
        message = message.get("message")
    return message.strip() if isinstance(message, str) else ""
