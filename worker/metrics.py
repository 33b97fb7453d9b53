"""A worker's Prometheus metrics: steps, throughput, world, checkpoints, shadow steps, collectives, and the user's own.

Under the pliant agent the env contract names a prometheus_client multiprocess directory (``PLIANT_METRICS_DIR``);
every value written here lands in a file there and the agent's endpoint serves the whole node (no port per worker).
Series are per node: histograms and counters sum the node's ranks, gauges take the live ranks' maximum (step,
generation, world size) or sum (samples per second). Outside the agent (torchrun, a plain process) the values stay in
the session's registry, which a script may serve itself with :func:`pliant.metrics.serve_metrics`.

Publish your own values with ``session.metrics.publish(loss=0.25)`` (a gauge ``pliant_user_loss`` labelled by rank)
or take a gauge with ``session.metrics.gauge("loss")``.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values

from pliant.env import WorkerEnv, install
from pliant.metrics import SLOW_BUCKETS_S
from pliant.progress import ProgressFile
from pliant.worker.contract import WorkerError

__all__ = ["RECOVERY_PHASES", "WorkerMetrics", "tensor_bytes"]

RECOVERY_PHASES = ("detect", "decide", "reform", "transfer", "first_step")

logger = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _use_multiprocess_dir(directory: str) -> None:
    """Make sure prometheus_client writes values into ``directory``'s files.

    prometheus_client picks its value class when it is first imported, from PROMETHEUS_MULTIPROC_DIR. A worker forked
    from the agent's zygote, or a script that imported it before the env was set, may have picked the in-memory one.
    """
    install({"PROMETHEUS_MULTIPROC_DIR": directory})  # the env contract's value (pliant.env), for prometheus_client
    if values.ValueClass.__name__ == "MutexValue":
        values.ValueClass = values.get_value_class()


def tensor_bytes(obj: Any) -> int:
    """Bytes of the (local shards of the) tensors in a nested state dict."""
    import torch

    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return local.numel() * local.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


class WorkerMetrics:
    """Every series one worker process writes.

    Args:
        env: the worker's env contract (its multiprocess directory and rank).
        registry: where to register (default: a new one; never the global registry).
    """

    def __init__(self, env: WorkerEnv, registry: CollectorRegistry | None = None) -> None:
        if env.metrics_dir:
            _use_multiprocess_dir(env.metrics_dir)
        self.registry = CollectorRegistry(auto_describe=True) if registry is None else registry
        self.rank = str(env.rank)
        r = self.registry
        self.step_seconds = Histogram(
            "pliant_worker_step_duration_seconds",
            "Time of one engine step (forward, backward, all-reduce, optimizer).",
            buckets=_STEP_BUCKETS_S,
            registry=r,
        )
        self.steps = Counter("pliant_worker_steps", "Engine steps run, summed over the node's ranks.", registry=r)
        self.samples = Counter(
            "pliant_worker_samples", "Real training samples processed by the node's ranks.", registry=r
        )
        self.step = Gauge(
            "pliant_worker_step", "The last global step completed.", multiprocess_mode="livemax", registry=r
        )
        self.world_size = Gauge(
            "pliant_worker_world_size", "Ranks in the worker's process group.", multiprocess_mode="livemax", registry=r
        )
        self.generation = Gauge(
            "pliant_worker_generation", "The generation the worker runs in.", multiprocess_mode="livemax", registry=r
        )
        self.shadow_steps = Counter(
            "pliant_worker_shadow_steps",
            "Steps a rank had no micro-batch and shadowed the others' collectives (Join).",
            registry=r,
        )
        self.collective_seconds = Counter(
            "pliant_worker_collective_seconds",
            "Time collectives were in flight: gradient all-reduces from issue to "
            "completion, and pliant's blocking control collectives.",
            ["op"],
            registry=r,
        )
        self.save_seconds = Histogram(
            "pliant_worker_checkpoint_save_duration_seconds",
            "Time from the start of a checkpoint save to its completion on this rank.",
            buckets=SLOW_BUCKETS_S,
            registry=r,
        )
        self.stall_seconds = Histogram(
            "pliant_worker_checkpoint_stall_seconds",
            "Time a checkpoint save blocked training.",
            buckets=SLOW_BUCKETS_S,
            registry=r,
        )
        self.load_seconds = Histogram(
            "pliant_worker_checkpoint_load_duration_seconds",
            "Time to load a checkpoint.",
            buckets=SLOW_BUCKETS_S,
            registry=r,
        )
        self.saved_bytes = Counter(
            "pliant_worker_checkpoint_saved_bytes", "Tensor bytes written to checkpoints.", registry=r
        )
        self.loaded_bytes = Counter(
            "pliant_worker_checkpoint_loaded_bytes", "Tensor bytes loaded from checkpoints.", registry=r
        )
        self.reconfigurations = Counter(
            "pliant_worker_reconfigurations",
            "In-place re-formations of this worker's process group, by why (boundary: a join or leave at a step "
            "boundary; failure: a peer died mid-step).",
            ["why"],
            registry=r,
        )
        self.reconfigure_seconds = Histogram(
            "pliant_worker_reconfigure_duration_seconds",
            "Time from the start of an in-place re-formation to the new world's state being in sync (the pause).",
            buckets=SLOW_BUCKETS_S,
            registry=r,
        )
        self.state_sync_bytes = Counter(
            "pliant_worker_state_sync_bytes", "Tensor bytes of training state sent or received in place.", registry=r
        )
        self.snapshot_seconds = Histogram(
            "pliant_worker_snapshot_stall_seconds",
            "Time a buddy snapshot of a sharded engine blocked training (the copy of this rank's shard).",
            buckets=_STEP_BUCKETS_S,
            registry=r,
        )
        self.snapshot_bytes = Counter(
            "pliant_worker_snapshot_bytes", "Bytes of this rank's shard copied and sent to its buddy.", registry=r
        )
        self.snapshot_every = Gauge(
            "pliant_worker_snapshot_every",
            "Committed steps between a sharded engine's buddy snapshots (K: the most steps a peer's death runs again).",
            multiprocess_mode="livemax",
            registry=r,
        )
        self.steps_redone = Counter(
            "pliant_worker_steps_redone",
            "Committed steps run again after a peer's death (a sharded engine rolls back to its last snapshot).",
            registry=r,
        )
        self.recovery_seconds = Histogram(
            "pliant_worker_recovery_phase_seconds",
            "A survivor's recovery from a peer's failure, by phase: detect (the broken step, or collective between "
            "steps, until it failed), decide (until the agent handed over the next generation), reform (the new "
            "world's groups), transfer (the state to every rank) and first_step (the new world's first step).",
            ["phase"],
            buckets=_STEP_BUCKETS_S,
            registry=r,
        )
        for phase in RECOVERY_PHASES:
            self.recovery_seconds.labels(phase)
        for why in ("boundary", "failure"):
            self.reconfigurations.labels(why)
        self.world_size.set(env.world_size)
        self.generation.set(env.generation)
        self._generation = env.generation  # a step's progress record names it: the agent reports that the world met
        self._user: dict[str, Gauge] = {}
        # What the agent's hang detection reads (pliant.progress); a no-op outside an agent.
        self.progress = ProgressFile(env.progress_file)
        self.progress.write(0, "start")

    # -- the engines and the checkpoint manager report here --------------------------------------------------------

    def observe_step(self, step: int, samples: int, seconds: float, shadow: bool) -> None:
        """One engine step of this rank: ``samples`` real samples (0 when it shadowed) in ``seconds``."""
        self.step_seconds.observe(seconds)
        self.steps.inc()
        self.samples.inc(samples)
        self.step.set(step + 1)
        self.progress.write(step + 1, "step", self._generation)
        if shadow:
            self.shadow_steps.inc()

    def observe_recovery(self, phase: str, seconds: float) -> None:
        """A phase of a recovery from a peer's failure (:data:`RECOVERY_PHASES`) took ``seconds``."""
        self.recovery_seconds.labels(phase).observe(seconds)

    def observe_collective(self, op: str, seconds: float) -> None:
        self.collective_seconds.labels(op).inc(seconds)

    def observe_save(self, stall_s: float) -> None:
        self.stall_seconds.observe(stall_s)

    def observe_saved(self, seconds: float, nbytes: int) -> None:
        self.save_seconds.observe(seconds)
        self.saved_bytes.inc(nbytes)

    def observe_load(self, seconds: float, nbytes: int) -> None:
        self.load_seconds.observe(seconds)
        self.loaded_bytes.inc(nbytes)

    def observe_reconfigured(self, env: WorkerEnv, why: str, seconds: float, nbytes: int) -> None:
        """This worker re-formed in place into ``env``'s world."""
        self.rank = str(env.rank)
        self.world_size.set(env.world_size)
        self.generation.set(env.generation)
        self._generation = env.generation
        self.reconfigurations.labels(why).inc()
        self.reconfigure_seconds.observe(seconds)
        self.state_sync_bytes.inc(nbytes)

    # -- the user's own values -------------------------------------------------------------------------------------

    def gauge(self, name: str, documentation: str = "") -> Gauge:
        """This rank's gauge ``pliant_user_<name>{rank="<rank>"}`` (created on first use).

        Raises:
            WorkerError: ``name`` is not a valid Prometheus name part.
        """
        if name not in self._user:
            if not _NAME_RE.match(name):
                raise WorkerError(f"metric name {name!r} must match [a-zA-Z_][a-zA-Z0-9_]*, e.g. 'loss' or 'lr'")
            self._user[name] = Gauge(
                f"pliant_user_{name}",
                documentation or f"User metric {name}.",
                ["rank"],
                multiprocess_mode="livemax",
                registry=self.registry,
            )
        return self._user[name].labels(self.rank)

    def publish(self, **named_values: float) -> None:
        """Set user gauges, e.g. ``publish(loss=0.25, lr=1e-3)``."""
        for name, value in named_values.items():
            self.gauge(name).set(float(value))
