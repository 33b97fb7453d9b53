"""A node's view of its job, for ``pliant status`` with no flags on any node of the job (the first or not).

Each agent that holds a certificate keeps it, while it runs, under the node's state directory::

    <state home>/status/<job>/<node>/     (0700)
        ca.crt, tls.crt, tls.key          the agent's current certificate (the key 0600)
        coordinators                      the control plane's coordinators, HOST:PORT[,HOST:PORT], as last heard

The agent writes it after its join, after each renewal of its certificate and when the coordinators change, and
removes it when it exits. The certificate is the agent's own: it may read its own job (GetJob, node addresses
removed), besides what the agent itself may do for its node, so it is kept as the agent's user's, never shared.
``pliant status`` reads the newest view of the job asked (or of the only job viewed here).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pliant.errors import ConfigError
from pliant.home import state_home
from pliant.tls import TlsMaterial

__all__ = ["View", "find_view", "remove_view", "write_view"]

_COORDINATORS = "coordinators"


@dataclass(frozen=True)
class View:
    """A node's view: its job, the coordinators to call and the TLS directory to call them with."""

    job: str
    coordinators: str
    tls_dir: Path


def _root() -> Path:
    return state_home() / "status"


def write_view(job: str, node: str, tls: TlsMaterial, coordinators: Sequence[str]) -> Path:
    """Write (or rewrite) ``node``'s view of ``job``; returns its directory. Never raises: a node whose state
    directory is not writable trains all the same (``pliant status`` then needs its flags)."""
    folder = _root() / job / node
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(folder, 0o700)
        for name, data, mode in (
            ("ca.crt", tls.ca_pem, 0o644),
            ("tls.crt", tls.cert_pem, 0o644),
            ("tls.key", tls.key_pem, 0o600),
            (_COORDINATORS, ",".join(coordinators).encode(), 0o644),
        ):
            partial = folder / f".{name}.partial"
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.replace(partial, folder / name)
    except OSError:
        pass
    return folder


def remove_view(job: str, node: str) -> None:
    """Remove ``node``'s view of ``job`` (the agent exits)."""
    shutil.rmtree(_root() / job / node, ignore_errors=True)
    with contextlib.suppress(OSError):
        (_root() / job).rmdir()  # the last node's view of the job here


def find_view(job: str | None) -> View:
    """The newest view of ``job`` on this machine (None: of the only job viewed here).

    Raises:
        ConfigError: no agent of that job runs here, or several jobs are viewed and none was named.
    """
    root = _root()
    jobs = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    if job is None and len(jobs) > 1:
        raise ConfigError(f"this machine runs agents of several jobs ({', '.join(jobs)}); name one with --job")
    name = job or (jobs[0] if jobs else "")
    views = [p for p in (root / name).iterdir() if (p / _COORDINATORS).is_file()] if name and name in jobs else []
    if not views:
        what = f"of job {job!r} " if job else ""
        raise ConfigError(
            f"no pliant agent {what}runs on this machine, so `pliant status` has no view of it here; run it on a node "
            f"of the job, or pass --coordinator HOST:PORT with --tls-dir DIR (an admin's certificates, `pliant certs`)"
        )
    newest = max(views, key=lambda p: (p / _COORDINATORS).stat().st_mtime)
    return View(name, (newest / _COORDINATORS).read_text().strip(), newest)
