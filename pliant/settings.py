"""Every environment variable pliant reads, and the defaults more than one module needs: declared here once, with
its type, default and meaning, and read through here only (a test checks that no other module reads the
environment). The env contract between an agent and its workers (torchrun's variables and ``PLIANT_*`` for
pliant.worker) is :mod:`pliant.env`'s.

A variable that sets a flag's default (:meth:`Setting.flag_default`) is read when the command's parser is built and
converted when the command line is parsed, so a bad value is reported like a bad flag's, naming the variable
(:func:`pliant.flags.typed`), and never breaks ``--help`` or another command.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "ABORT_GRACE_S",
    "BOOTSTRAP_LISTEN",
    "CA_CERT_HASH",
    "CHECKPOINT_DIR",
    "COORDINATOR",
    "DEFAULT_COORDINATOR",
    "ETCD",
    "ETCD_CACERT",
    "ETCD_CERT",
    "ETCD_KEY",
    "ETCD_KEY_ROOT",
    "ETCD_PREFIX",
    "FINISH_GRACE_S",
    "JOB",
    "JOIN_TOKEN",
    "LEADER_TTL",
    "LISTEN",
    "LOG_LEVEL",
    "MAX_JOBS",
    "METRICS_PORT",
    "REPLICA_ID",
    "RESCALE_GRACE_S",
    "SEAL_ROOT_FILE",
    "SEAT_KEY",
    "SETTINGS",
    "SIGNING_CA_DIR",
    "STATE_HOME",
    "STOP_GRACE_S",
    "TLS_DIR",
    "WORKER_PRELOAD",
    "EnvValue",
    "Setting",
]


class EnvValue(str):
    """A flag's default as the environment variable :attr:`var` gave it."""

    var: str


# -- defaults more than one module needs -------------------------------------------------------------------------------

STOP_GRACE_S = 5.0
"""``--stop-grace``: how long workers have between SIGTERM and SIGKILL."""
ABORT_GRACE_S = 0.5
"""``--abort-grace``: how long the workers of a world that failed (a worker died, a node was lost) have between
SIGTERM and SIGKILL: their collectives can never complete, so only a handler that needs no peer can still run."""
RESCALE_GRACE_S = 30.0
"""``--rescale-grace``: how long workers may take to save (or hand over) and exit for a rescale, and how long a
hand-over in place waits for its newcomers."""
FINISH_GRACE_S = 10.0
"""``--finish-grace``: how long workers may take to exit by themselves once the job succeeded elsewhere."""
DEFAULT_COORDINATOR = "127.0.0.1:29400"
"""The coordinator's API address when none is given (``pliant coordinator --listen``, the admin commands)."""
ETCD_KEY_ROOT = "/pliant/v1"
"""The root of pliant's etcd keys unless ``--prefix`` says otherwise."""


@dataclass(frozen=True)
class Setting:
    """An environment variable pliant reads.

    Attributes:
        name: the variable.
        default: its value when it is unset or empty (None: none).
        kind: what its value is, in words ("a path", "HOST:PORT", ...).
        meaning: what it sets.
    """

    name: str
    default: str | None
    kind: str
    meaning: str

    def read(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The variable's value (from ``environ``, default this process's environment), or :attr:`default`."""
        value = (os.environ if environ is None else environ).get(self.name)
        return value or self.default

    def flag_default(self) -> str | None:
        """The default of the flag the variable sets: its value, marked as the variable's so that a bad one is
        reported naming it (:func:`pliant.flags.typed`), or :attr:`default`."""
        value = os.environ.get(self.name)
        if not value:
            return self.default
        given = EnvValue(value)
        given.var = self.name
        return given


# -- the coordinator (`pliant coordinator`) ----------------------------------------------------------------------------

ETCD = Setting("PLIANT_ETCD", None, "URLs, comma-separated", "etcd's client URLs (--etcd)")
LISTEN = Setting("PLIANT_LISTEN", DEFAULT_COORDINATOR, "HOST:PORT", "where the coordinator serves gRPC (--listen)")
ETCD_CACERT = Setting("PLIANT_ETCD_CACERT", None, "a path", "the CA etcd's certificate is checked against")
ETCD_CERT = Setting("PLIANT_ETCD_CERT", None, "a path", "the client certificate for etcd's --client-cert-auth")
ETCD_KEY = Setting("PLIANT_ETCD_KEY", None, "a path", "that certificate's private key")
MAX_JOBS = Setting("PLIANT_MAX_JOBS", "1000", "an integer", "jobs the deployment holds at most (--max-jobs)")
SIGNING_CA_DIR = Setting(
    "PLIANT_SIGNING_CA_DIR", None, "a directory", "the CA that signs bootstrap joins' agent certificates"
)
BOOTSTRAP_LISTEN = Setting("PLIANT_BOOTSTRAP_LISTEN", "", "HOST:PORT", "where the bootstrap service listens")
SEAL_ROOT_FILE = Setting(
    "PLIANT_SEAL_ROOT_FILE", "", "a path", "the sealing secret jobs' checkpoint keys derive from (--seal-root-file)"
)
ETCD_PREFIX = Setting("PLIANT_ETCD_PREFIX", ETCD_KEY_ROOT, "an etcd key", "the root of pliant's etcd keys (--prefix)")
LEADER_TTL = Setting("PLIANT_LEADER_TTL", "5", "seconds", "the leader lease's TTL (--leader-ttl)")
REPLICA_ID = Setting("PLIANT_REPLICA_ID", "", "a name", "this replica's name (--replica-id)")

# -- every command that calls a coordinator ----------------------------------------------------------------------------

COORDINATOR = Setting(
    "PLIANT_COORDINATOR", None, "HOST:PORT[,HOST:PORT...]", "the coordinator replicas (--coordinator)"
)
TLS_DIR = Setting("PLIANT_TLS_DIR", None, "a directory", "the caller's certificate, key and CA (--tls-dir)")
METRICS_PORT = Setting("PLIANT_METRICS_PORT", None, "a port", "where Prometheus metrics are served (--metrics-port)")
LOG_LEVEL = Setting("PLIANT_LOG_LEVEL", None, "DEBUG, INFO or WARNING", "how much pliant logs (--log-level)")

# -- an agent (`pliant run`, `pliant agent`) ---------------------------------------------------------------------------

JOB = Setting("PLIANT_JOB", "default", "a job id", "the job the node joins (--job)")
SEAT_KEY = Setting("PLIANT_SEAT_KEY", "", "a seat key", "lets a node take a seat of the embedded control plane")
CA_CERT_HASH = Setting("PLIANT_CA_CERT_HASH", "", "sha256:HEX", "the coordinator CA a bootstrap join pins")
JOIN_TOKEN = Setting("PLIANT_JOIN_TOKEN", "", "a join token", "the job's join token (--join-token)")
CHECKPOINT_DIR = Setting("PLIANT_CHECKPOINT_DIR", "", "a directory", "the job's checkpoints (--checkpoint-dir)")
STATE_HOME = Setting(
    "XDG_STATE_HOME", None, "a directory", "the user's state directory (default ~/.local/state): pliant's is in it"
)
WORKER_PRELOAD = Setting(
    "PLIANT_WORKER_PRELOAD", None, "modules, comma-separated", "what the worker zygote imports before the script's"
)

SETTINGS = (
    ETCD,
    LISTEN,
    ETCD_CACERT,
    ETCD_CERT,
    ETCD_KEY,
    MAX_JOBS,
    SIGNING_CA_DIR,
    BOOTSTRAP_LISTEN,
    SEAL_ROOT_FILE,
    ETCD_PREFIX,
    LEADER_TTL,
    REPLICA_ID,
    COORDINATOR,
    TLS_DIR,
    METRICS_PORT,
    LOG_LEVEL,
    JOB,
    SEAT_KEY,
    CA_CERT_HASH,
    JOIN_TOKEN,
    CHECKPOINT_DIR,
    STATE_HOME,
    WORKER_PRELOAD,
)
"""Every variable pliant reads, in the order docs/operations.md lists them."""
