"""The env contract between an agent and its workers: built by the agent with ``to_env()``, put into a worker's
process with :func:`install` (the zygote, as it starts a worker; a worker re-formed in place, at each new generation)
and read by a worker with ``from_env()`` (and :func:`error_file`). Nothing else in pliant reads or writes these
variables; every other variable pliant reads is declared in :mod:`pliant.settings`.

The variables are torchrun's (so unmodified torchrun scripts, and frameworks such as Lightning that detect
torchelastic, run unchanged) plus ``PLIANT_*`` for pliant's own worker library.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from pliant.errors import ConfigError

__all__ = [
    "AUTO",
    "GUARD_EXIT_CODE",
    "RESCALE_EXIT_CODE",
    "RESCALE_MODES",
    "RESCALE_SIGNAL",
    "STACKS_SIGNAL",
    "WorkerEnv",
    "error_file",
    "install",
    "parse_every",
]

# The rescale protocol: the agent sends RESCALE_SIGNAL to its workers when a new generation (or its own leave) is
# coming, after writing each worker's directive (pliant.progress). pliant.worker agrees on a step boundary across
# ranks and either re-forms in place or, on the restart path, checkpoints and exits with RESCALE_EXIT_CODE, which the
# agent does not count as a failure (see pliant.worker.inplace.protocol). The signal goes only to workers that announced
# they handle it (pliant.progress); scripts that do not use pliant.worker are stopped as torchrun stops them: SIGTERM,
# then SIGKILL after the stop grace.
RESCALE_SIGNAL = signal.SIGUSR1
RESCALE_EXIT_CODE = 75
RESCALE_MODES = ("in-place", "restart")
# An in-place worker whose step its step guard broke but which stayed blocked writes its stacks and exits with this
# code (pliant.worker.inplace.guard): a failure, which its agent reports as it does any dead worker's (the survivors
# re-form in place without it).
GUARD_EXIT_CODE = 76
AUTO = "auto"  # --snapshot-every auto / PLIANT_SNAPSHOT_EVERY=auto: K from the snapshots' measured cost
# The agent sends STACKS_SIGNAL to a hung worker before it stops it: the worker's faulthandler (registered by the zygote
# and by pliant.worker) writes every thread's Python stack to its output, which the agent logs.
STACKS_SIGNAL = signal.SIGUSR2


def parse_every(text: str, name: str) -> int | None:
    """``--snapshot-every`` / ``PLIANT_SNAPSHOT_EVERY``: ``auto`` (or empty) is None, else a whole number of steps.

    Raises:
        ConfigError: ``text`` is neither (its range is checked where it is used).
    """
    if text.strip().lower() in ("", AUTO):
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name} {text!r} must be 'auto' or a whole number of steps between buddy copies") from None


def install(variables: Mapping[str, str], replace: bool = False) -> None:
    """Put a worker's ``variables`` (:meth:`WorkerEnv.to_env`'s, with whatever else its agent passes on) into this
    process's environment, where code that reads it itself finds them (torch's ``env://``, frameworks, the user's
    script); ``replace``: they become the whole environment (a worker's start)."""
    if replace:
        os.environ.clear()
    os.environ.update(variables)


def error_file(environ: Mapping[str, str] | None = None) -> str:
    """Where this worker writes the exception it dies of (:attr:`WorkerEnv.error_file`; "" for nowhere), read on its
    own: an exception hook must not fail on an environment that :meth:`WorkerEnv.from_env` refuses."""
    return (os.environ if environ is None else environ).get("TORCHELASTIC_ERROR_FILE", "")


@dataclass(frozen=True)
class WorkerEnv:
    """Everything a worker process knows about its place in the job.

    Attributes:
        rank: global rank.
        local_rank: rank on this node.
        world_size: processes in the generation.
        local_world_size: processes on this node.
        node_rank: this node's rank in the generation (torchrun's GROUP_RANK).
        num_nodes: nodes in the generation (GROUP_WORLD_SIZE).
        master_addr, master_port: the generation's TCPStore, hosted by the agent of node rank 0.
        job_id: the job (TORCHELASTIC_RUN_ID).
        generation: the generation number (1-based); TORCHELASTIC_RESTART_COUNT is ``generation - 1``.
        max_restarts: the job's restart budget.
        node_id: this node's id.
        agent_store: host:port of this node's agent store (used by the worker library's rescale protocol).
        checkpoint_dir: where the job's checkpoints live ("" when not configured).
        metrics_dir: prometheus_client multiprocess directory ("" when not configured).
        allow_fresh_start: when checkpoints exist but none loads, train from step 0 instead of failing
            (``--allow-fresh-start``).
        incarnation: the job's incarnation, a UUID the control plane wrote when it created the job ("" outside a
            pliant agent); with ``generation`` it fences the checkpoint directory (:mod:`pliant.fence`).
        checkpoint_key: the job's checkpoint key, hex ("" outside a pliant agent: records are not sealed); the
            checkpoint commit markers are sealed and checked with it (:mod:`pliant.security.seal`).
        control_key: the job's control public key, hex ("" outside a pliant agent): the checkpoint directory's fence
            counts only where the control plane's warrants it carries hold under it (:mod:`pliant.security.warrant`).
        warrant: the control plane's warrant of this generation, hex (what the fence records of this world).
        published_at: when the control plane published this generation (seconds since the epoch; 0 outside an
            agent).
        progress_file: where the worker writes its step and phase for the agent's hang detection
            (:mod:`pliant.progress`; "" when no agent watches).
        error_file: where the exception a worker dies of is written (torchrun's ``TORCHELASTIC_ERROR_FILE``,
            :mod:`pliant.errorfile`; "" when no agent reads it).
        rescale: ``in-place`` (the agent hands running workers their next generation) or ``restart`` (workers
            checkpoint and exit on a rescale); the agent's ``--rescale``.
        snapshot_every: committed steps between a sharded engine's buddy copies (:mod:`pliant.worker.inplace.buddy`), or
            None to choose them from their measured cost (:mod:`pliant.worker.inplace.cadence`); the agent's
            ``--snapshot-every`` (``auto``: None).
        snapshot_dir: the agent's folder (node-local memory, tmpfs) where workers keep their buddy copies so that
            they outlive a worker's death (:mod:`pliant.worker.inplace.kept`); "" keeps them in process memory only.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    job_id: str = "local"
    generation: int = 1
    max_restarts: int = 0
    node_id: str = "local"
    agent_store: str = ""
    checkpoint_dir: str = ""
    metrics_dir: str = ""
    incarnation: str = ""
    checkpoint_key: str = field(default="", repr=False)
    control_key: str = ""
    warrant: str = ""
    published_at: float = 0.0
    progress_file: str = ""
    error_file: str = ""
    allow_fresh_start: bool = False
    rescale: str = "restart"
    snapshot_every: int | None = None
    snapshot_dir: str = ""

    @property
    def under_agent(self) -> bool:
        """True in a worker a pliant agent started (its agent store is known); False under torchrun or alone."""
        return bool(self.agent_store)

    def __post_init__(self) -> None:
        if self.rescale not in RESCALE_MODES:
            raise ConfigError(f"PLIANT_RESCALE={self.rescale!r} must be one of {', '.join(RESCALE_MODES)}")
        if self.snapshot_every is not None and self.snapshot_every < 1:
            raise ConfigError(
                f"PLIANT_SNAPSHOT_EVERY={self.snapshot_every} must be 'auto' or at least 1 (steps "
                f"between buddy copies; --snapshot-every)"
            )
        if self.checkpoint_key and not _is_key(self.checkpoint_key):
            raise ConfigError(
                "PLIANT_CHECKPOINT_KEY must be 64 hex digits (the job's checkpoint key, set by the pliant agent); "
                "unset it outside an agent"
            )
        if self.control_key and not _is_key(self.control_key):
            raise ConfigError(
                "PLIANT_CONTROL_KEY must be 64 hex digits (the job's control public key, set by the pliant agent); "
                "unset it outside an agent"
            )
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"RANK={self.rank} is outside WORLD_SIZE={self.world_size}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ConfigError(f"LOCAL_RANK={self.local_rank} is outside LOCAL_WORLD_SIZE={self.local_world_size}")

    @property
    def kept_dir(self) -> str:
        """This worker's folder of :attr:`snapshot_dir` (by local rank: the worker that replaces it uses the same)."""
        return os.path.join(self.snapshot_dir, f"local-{self.local_rank}") if self.snapshot_dir else ""

    @property
    def restart_count(self) -> int:
        return max(self.generation - 1, 0)

    def to_env(self) -> dict[str, str]:
        """The variables a worker process is started with."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "GROUP_WORLD_SIZE": str(self.num_nodes),
            "ROLE_RANK": str(self.rank),
            "ROLE_WORLD_SIZE": str(self.world_size),
            "ROLE_NAME": "default",
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "TORCHELASTIC_RUN_ID": self.job_id,
            "TORCHELASTIC_RESTART_COUNT": str(self.restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
            # Workers connect to the agent-hosted store instead of rank 0 hosting one (torch's env:// honours it).
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "PLIANT_JOB_ID": self.job_id,
            "PLIANT_GENERATION": str(self.generation),
            "PLIANT_NODE_ID": self.node_id,
            "PLIANT_AGENT_STORE": self.agent_store,
            "PLIANT_CHECKPOINT_DIR": self.checkpoint_dir,
            "PLIANT_METRICS_DIR": self.metrics_dir,
            "PLIANT_PROGRESS_FILE": self.progress_file,
            **({"TORCHELASTIC_ERROR_FILE": self.error_file} if self.error_file else {}),
            "PLIANT_JOB_INCARNATION": self.incarnation,
            "PLIANT_CHECKPOINT_KEY": self.checkpoint_key,
            "PLIANT_CONTROL_KEY": self.control_key,
            "PLIANT_WARRANT": self.warrant,
            "PLIANT_PUBLISHED_AT": repr(self.published_at),
            "PLIANT_ALLOW_FRESH_START": "1" if self.allow_fresh_start else "",
            "PLIANT_RESCALE": self.rescale,
            "PLIANT_SNAPSHOT_EVERY": AUTO if self.snapshot_every is None else str(self.snapshot_every),
            "PLIANT_SNAPSHOT_DIR": self.snapshot_dir,
            # prometheus_client's multiprocess mode, read when the worker imports it: the agent serves these files.
            **({"PROMETHEUS_MULTIPROC_DIR": self.metrics_dir} if self.metrics_dir else {}),
        }

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        """Read the contract from ``environ`` (default ``os.environ``).

        Works under the pliant agent, under torchrun (no PLIANT_* variables) and as a single process (nothing set:
        rank 0 of a world of 1).

        Raises:
            ConfigError: a variable is set to something that is not a valid value.
        """
        env = os.environ if environ is None else environ

        def integer(name: str, default: int) -> int:
            text = env.get(name, "")
            if text == "":
                return default
            try:
                return int(text)
            except ValueError:
                raise ConfigError(f"environment variable {name}={text!r} is not an integer") from None

        def number(name: str) -> float:
            text = env.get(name, "")
            try:
                return float(text) if text else 0.0
            except ValueError:
                raise ConfigError(f"environment variable {name}={text!r} is not a number") from None

        world = integer("WORLD_SIZE", 1)
        local_world = integer("LOCAL_WORLD_SIZE", world)
        job = env.get("PLIANT_JOB_ID") or env.get("TORCHELASTIC_RUN_ID") or cls.job_id
        generation = integer("PLIANT_GENERATION", integer("TORCHELASTIC_RESTART_COUNT", 0) + 1)
        defaults = {f.name: f.default for f in fields(cls)}
        return cls(
            rank=integer("RANK", 0),
            local_rank=integer("LOCAL_RANK", 0),
            world_size=world,
            local_world_size=local_world,
            node_rank=integer("GROUP_RANK", 0),
            num_nodes=integer("GROUP_WORLD_SIZE", max(1, world // max(1, local_world))),
            master_addr=env.get("MASTER_ADDR") or defaults["master_addr"],
            master_port=integer("MASTER_PORT", 0),
            job_id=job,
            generation=generation,
            max_restarts=integer("TORCHELASTIC_MAX_RESTARTS", 0),
            node_id=env.get("PLIANT_NODE_ID") or defaults["node_id"],
            agent_store=env.get("PLIANT_AGENT_STORE", ""),
            checkpoint_dir=env.get("PLIANT_CHECKPOINT_DIR", ""),
            metrics_dir=env.get("PLIANT_METRICS_DIR", ""),
            progress_file=env.get("PLIANT_PROGRESS_FILE", ""),
            error_file=env.get("TORCHELASTIC_ERROR_FILE", ""),
            incarnation=env.get("PLIANT_JOB_INCARNATION", ""),
            checkpoint_key=env.get("PLIANT_CHECKPOINT_KEY", ""),
            control_key=env.get("PLIANT_CONTROL_KEY", ""),
            warrant=env.get("PLIANT_WARRANT", ""),
            published_at=number("PLIANT_PUBLISHED_AT"),
            allow_fresh_start=env.get("PLIANT_ALLOW_FRESH_START", "") not in ("", "0"),
            rescale=env.get("PLIANT_RESCALE") or defaults["rescale"],
            snapshot_every=parse_every(env.get("PLIANT_SNAPSHOT_EVERY", ""), "PLIANT_SNAPSHOT_EVERY"),
            snapshot_dir=env.get("PLIANT_SNAPSHOT_DIR", ""),
        )


def _is_key(text: str) -> bool:
    try:
        return len(bytes.fromhex(text)) == 32
    except ValueError:
        return False
