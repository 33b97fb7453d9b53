"""pliant.worker: what a training script imports.

A session (:func:`init`) reads the env contract and initialises the process group; its engines (``ddp``, ``zero``,
``fsdp``) keep the global batch fixed whatever the world size, shadowing for ranks with fewer micro-batches; its
loader feeds every sample of an epoch exactly once across rescales. Under ``pliant run`` a world change is taken in
place (:mod:`pliant.worker.rescale`); a rank that leaves ends the script with :class:`RescaleExit` from
``engine.step``.
"""

from pliant.worker.checkpoint import CheckpointError, CheckpointInfo, CheckpointManager
from pliant.worker.contract import DataError, Engine, EngineError, EngineKind, GlobalBatch, WorkerError
from pliant.worker.data import ElasticLoader, ElasticSampler
from pliant.worker.plan import StepPlan, plan_step
from pliant.worker.rescale import RescaleExit
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
    "GlobalBatch",
    "RescaleExit",
    "Session",
    "StepPlan",
    "WorkerError",
    "init",
    "plan_step",
]
