"""pliant.worker: what a training script imports.

A session (:func:`init`) reads the env contract and initialises the process group; its engines (``ddp``, ``zero``,
``fsdp``) keep the global batch fixed whatever the world size, shadowing for ranks with fewer micro-batches; its
loader feeds every sample of an epoch exactly once across rescales; its checkpoints restore at any world size. Under
``pliant run`` a world change is taken in place (:mod:`pliant.worker.inplace`); a rank that leaves ends the script
with :class:`RescaleExit` from ``engine.step``.

The top of this package is the script's API; :mod:`pliant.worker.inplace` is the machinery of the in-place world.
"""

from pliant.worker.checkpoint import CheckpointError, CheckpointInfo, CheckpointManager
from pliant.worker.contract import (
    DataError,
    Engine,
    EngineError,
    EngineKind,
    ExitReason,
    GlobalBatch,
    RescaleExit,
    WorkerError,
)
from pliant.worker.data import ElasticLoader, ElasticSampler
from pliant.worker.plan import StepPlan, plan_step
from pliant.worker.session import Session, init

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "DataError",
    "ElasticLoader",
    "ElasticSampler",
    "Engine",
    "EngineError",
    "EngineKind",
    "ExitReason",
    "GlobalBatch",
    "RescaleExit",
    "Session",
    "StepPlan",
    "WorkerError",
    "init",
    "plan_step",
]
