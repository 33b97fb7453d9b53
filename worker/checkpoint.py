"""Sharded checkpoints with torch.distributed.checkpoint (DCP), committed atomically, loadable at any world size.

Layout: ``DIR/step-<step:012d>/`` holds DCP's files (plain ``torch.distributed.checkpoint`` can read them) and, last,
pliant's commit marker ``pliant-commit.json`` (job, step, generation, world size, model fingerprint, the SHA-256 of
DCP's ``.metadata``), sealed with the job's key (:mod:`pliant.security.seal`) and written by rank 0 through a temporary
file, fsync and rename once every rank's shards and DCP's ``.metadata`` are on disk. A directory without the marker is
partial: never loaded, and removed once a newer checkpoint is committed. The last ``keep`` committed checkpoints are
kept; nothing is deleted that a committed checkpoint has not superseded. Files are 0640, directories 0750.

Checkpoints are data (:mod:`pliant.worker.sealed`): a marker counts only when its seal holds and its step is its
directory's; ``.metadata`` is read only when its digest is the marker's, and with an allowlist unpickler; non-tensor
items load with ``weights_only``. Paths come from the directory's listing (real directories named ``step-*``), never
from a marker, so pruning removes only checkpoint directories of this directory.

A checkpoint holds the model and optimizer (DCP's state-dict helpers: DDP and FSDP2 shard or replicate as they train;
ZeRO by parameter name), the loader's cursor, the step, and user extras. Loading reshards to the current world size.

Fencing and edges:

- Under a pliant agent (a job incarnation, see :class:`pliant.env.WorkerEnv`), rank 0 of each generation records
  (incarnation, generation) in the sealed fence ``pliant-fence.json`` when its manager opens; a commit from a
  superseded world (a zombie that was evicted and kept running) is refused, so two worlds never both commit into one
  directory, and the agent stops a group whose world the fence shows superseded. A new incarnation of the same job
  (the job started again after every node was lost) takes the directory over and resumes from its newest checkpoint;
  a directory fenced by another job is refused at open.
- Rank 0 alone picks the checkpoints to try (newest first) and sends the list to every rank, so ranks with different
  views of a shared filesystem still load the same step together. A checkpoint that fails to load on any rank is
  skipped on every rank and, once an older one loaded, renamed aside to ``corrupt-step-<step>-<time>`` (kept for
  inspection, never pruned in place of fresh ones).
- If checkpoints exist but none loads, :meth:`CheckpointManager.restore` raises :class:`CheckpointError` naming them
  and nothing is renamed or deleted; ``allow_fresh_start=True`` starts from step 0 instead.
- An async save that failed fails the step that reaps it (its path and errno in the error), unless a peer failed
  during it in place: it is then abandoned uncommitted, and the next step re-forms. Markers are fsynced.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from pliant.fence import FENCE, NOBODY, Fence, Warranted, read_fence
from pliant.security.seal import SealError, seal, unseal
from pliant.worker.contract import LOCAL, Engine, Runner, WorkerError, WorldPart
from pliant.worker.directio import DIR_MODE, FILE_MODE, DirectWriter
from pliant.worker.metrics import WorkerMetrics, tensor_bytes
from pliant.worker.sealed import DataLoadPlanner, SealedReader, metadata_digest, restrict_objects, unrestrict
from pliant.worker.staging import (
    BackgroundWriter,
    from_snapshot,
    resolve,
    split_replicas,
    stager,
    write_in_background,
)

if TYPE_CHECKING:
    from pliant.worker.inplace.world import World

__all__ = ["CheckpointError", "CheckpointInfo", "CheckpointManager"]

logger = logging.getLogger(__name__)

COMMIT = "pliant-commit.json"
_PREFIX = "step-"
_ASIDE = "corrupt-step-"
_MAX_CANDIDATES = 64


class CheckpointError(WorkerError):
    """A checkpoint that cannot be used for this job or model; the message names it and the fix."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint's marker (``path``: its directory, from the listing, never from the marker)."""

    path: str
    step: int
    generation: int
    world_size: int
    job_id: str
    fingerprint: str
    saved_at: float
    metadata_sha256: str = ""

    def to_record(self) -> dict[str, Any]:
        return {
            "kind": "commit",
            "job": self.job_id,
            "step": self.step,
            "generation": self.generation,
            "world_size": self.world_size,
            "fingerprint": self.fingerprint,
            "saved_at": self.saved_at,
            "metadata_sha256": self.metadata_sha256,
        }

    @classmethod
    def from_record(cls, path: Path, record: dict[str, Any]) -> CheckpointInfo:
        """Raises: SealError: a field is missing or of the wrong type."""
        try:
            return cls(
                str(path),
                int(record["step"]),
                int(record["generation"]),
                int(record["world_size"]),
                str(record["job"]),
                str(record["fingerprint"]),
                float(record["saved_at"]),
                str(record["metadata_sha256"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise SealError(f"commit record lacks a valid field ({exc})") from None


def _fingerprint(engine: Engine) -> str:
    """A hash of the model's parameter names and global shapes: equal for the same model at any world size."""
    items = sorted((name, tuple(value.shape)) for name, value in engine.module.state_dict().items())
    return hashlib.sha256(repr(items).encode()).hexdigest()[:16]


class _TrainState(Stateful):
    """The engine's model and optimizer as DCP sees them (:meth:`pliant.worker.contract.Engine.state_dict`).

    With ``freeze_buffers`` the module's buffers are copied at once: an async save's copy of the rest runs during the
    next forward, which may write buffers (DDP's buffer broadcast, running statistics) but never parameters or
    optimizer state (the optimizer step waits for the copy).
    """

    def __init__(
        self, engine: Engine, freeze_buffers: bool = False, scheduler: bool = True, split: bool = False
    ) -> None:
        self.engine = engine
        self.freeze_buffers = freeze_buffers
        self.split = split  # saving: hand DCP only this rank's share of the replicated sections (split_replicas)
        self.scheduler = scheduler and engine.scheduler is not None
        self.unscheduled = not scheduler and engine.scheduler is not None  # loading a checkpoint saved without one
        self.nbytes = 0  # tensor bytes of the last state handed to or received from DCP (this rank's shards)

    def state_dict(self) -> dict[str, Any]:
        state = self.engine.state_dict()
        if self.freeze_buffers:
            buffers = {b.data_ptr() for b in self.engine.module.buffers() if b.numel()}
            state = _clone_where(state, buffers)
        if self.split:
            state = split_replicas(
                state, self.engine.replicated, dist.get_rank(), dist.get_world_size(), self.engine.saved_by()
            )
        self.nbytes = tensor_bytes(state)
        if self.scheduler:
            state["scheduler"] = copy.deepcopy(self.engine.scheduler.state_dict())
        if self.unscheduled:  # a scheduler adds "initial_lr" to the optimizer's groups, which such a checkpoint lacks
            state = _without(state, "initial_lr")
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.nbytes = tensor_bytes(state)
        scheduler = state.pop("scheduler", None)
        self.engine.load_state_dict(state)
        if scheduler is not None:
            self.engine.scheduler.load_state_dict(scheduler)
        if self.unscheduled:  # the groups loaded may have dropped it: put back what the scheduler set
            for group, base in zip(self.engine.optimizer.param_groups, self.engine.scheduler.base_lrs, strict=False):
                group.setdefault("initial_lr", base)


class CheckpointManager(WorldPart):
    """Save and restore a training run.

    Args:
        directory: where checkpoints live (a local disk or a shared filesystem such as a Kubernetes PVC).
        engine: the engine whose model and optimizer are saved.
        loader: an object with ``state_dict``/``load_state_dict`` (the elastic loader), or None.
        job_id, generation: recorded in the marker; a checkpoint of another job is refused.
        incarnation: the job's incarnation (``PLIANT_JOB_INCARNATION``); "" (outside an agent) disables fencing.
        key: the job's checkpoint key (``PLIANT_CHECKPOINT_KEY``); None (outside an agent): markers are written
            unsealed and read unchecked (metadata is still read as data).
        control_key: the job's control public key (``PLIANT_CONTROL_KEY``): the fence counts only where the control
            plane's warrants in it hold (:mod:`pliant.fence`); None (outside an agent): read unchecked.
        warrant, published_at: the control plane's warrant of this generation and when it was published
            (``PLIANT_WARRANT``, ``PLIANT_PUBLISHED_AT``): what the fence records of this world.
        keep: committed checkpoints to keep.
        async_save: write in the background (one save in flight at most; the next save waits for it).
        every_steps: :meth:`after_step` saves every this many steps (0: never periodically).
        metrics: where save/load times and bytes are reported (the session's), or None.
        allow_fresh_start: when checkpoints exist but none loads, start from step 0 instead of raising.
        direct_io: write the files around the page cache (``O_DIRECT``, :mod:`pliant.worker.directio`) where the file
            system takes it; False: through it, as DCP's own writer does.
        runner: the engines' runner (default: the plain local step). Under an agent, the rescale protocol: a
            newcomer's :meth:`restore` takes the survivors' state from it, a save may write from its buddy snapshot,
            and a save a peer's failure broke is abandoned when it says the next step recovers.

    Threads: the training thread owns every field and calls every method. An async save runs in the background
    (:func:`pliant.worker.background.in_background`, or DCP's own thread for its stager); its completion callback,
    on that thread, commits the save and writes only ``_commit_error`` and the save's ``committed`` event, which the
    training thread reads after waiting for that event (:meth:`wait`).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        engine: Engine,
        loader: Any = None,
        job_id: str = "local",
        generation: int = 1,
        keep: int = 3,
        async_save: bool = True,
        every_steps: int = 0,
        metrics: WorkerMetrics | None = None,
        allow_fresh_start: bool = False,
        incarnation: str = "",
        direct_io: bool = True,
        key: bytes | None = None,
        runner: Runner = LOCAL,
        control_key: bytes | None = None,
        warrant: str = "",
        published_at: float = 0.0,
    ) -> None:
        if keep < 1:
            raise CheckpointError(f"keep={keep} must be >= 1")
        self.directory = Path(directory)
        self.engine, self.loader = engine, loader
        self.job_id, self.generation, self.keep, self.async_save = job_id, generation, keep, async_save
        self.every_steps, self.metrics, self.direct_io = every_steps, metrics, direct_io
        self.fingerprint = _fingerprint(engine)
        # Async saves' collectives run on a background thread: a group of their own, or they interleave and hang.
        self.group = dist.new_group(backend="gloo")
        restrict_objects(self.group)  # what DCP's planning sends over it is unpickled as data
        self.extras: dict[str, Any] = {}
        self.allow_fresh_start = allow_fresh_start
        self.incarnation, self.key = incarnation, key or None
        self.control_key, self.warrant, self.published_at = control_key or None, warrant, published_at
        self._ignored: dict[str, str] = {}  # checkpoint path -> why its marker is ignored (said once)
        self._fence_problem = ""  # why the fence file was last ignored (said once)
        self.runner = runner
        self._in_flight: Future[Any] | None = None
        self._committed = threading.Event()  # the in-flight save's completion callback has run (commit or error)
        self._in_flight_path: Path | None = None
        self._commit_error: Exception | None = None
        self.stalled_s = 0.0  # the last save's stall: save() blocked, plus the optimizer step's wait for an async copy
        self._stager: Any = None  # async saves' DCP stager: its host copies of the state are reused from save to save
        if dist.get_rank() == 0:
            self._open_directory(first=True)

    def reopen(self, generation: int, warrant: str = "", published_at: float = 0.0) -> None:
        """The world was re-formed in place (generation ``generation``, its warrant and when it was published): open
        this manager's group in it (collective, in the order the script made its managers) and raise the fence."""
        unrestrict(self.group)
        self.group = dist.new_group(backend="gloo")
        restrict_objects(self.group)
        self.generation, self.warrant, self.published_at = generation, warrant, published_at
        self.close()  # this rank's share of the state is cut anew in this world
        if dist.get_rank() == 0:
            self._open_directory()

    # -- moving to the next world (WorldPart)
    # ---------------------------------------------------------------------------

    def before_restart(self, step: int) -> None:
        """The restart path: save ``step`` (not yet run) now, synchronously; fresh workers restore from it."""
        stall = self.save(step, sync=True)
        logger.info("rescale (restart path): step %d checkpointed in %.2fs", step, stall)

    def quiesce(self) -> None:
        """Finish the save in flight (:meth:`wait`): this manager's group is about to be retired."""
        self.wait()

    def after_move(self, world: World) -> None:
        """Open this manager's group in the new world (:meth:`reopen`), its sockets noted by the world."""
        world.tracked(lambda: self.reopen(world.env.generation, world.env.warrant, world.env.published_at))

    def close(self) -> None:
        """Free the host copies that async saves reuse (the next async save makes them again)."""
        stager, self._stager = self._stager, None
        if stager is not None:
            stager.close()

    @property
    def pending(self) -> bool:
        """An async save is still being copied or written (:meth:`wait` finishes it)."""
        return self._in_flight is not None and not self._in_flight.done()

    def abandon(self) -> None:
        """Forget the save in flight (a peer died: it cannot complete); it is never committed."""
        if self._in_flight is not None:
            logger.warning(
                "checkpoint save to %s abandoned: a peer failed while it was in flight", self._in_flight_path
            )
        self._in_flight = self._in_flight_path = None
        self._commit_error = None

    # -- the generation fence ------------------------------------------------------------------------------------------

    def fence(self) -> Fence | None:
        """The directory's fence, if the control plane's warrants bear it out (one they do not counts as none)."""
        try:
            return read_fence(self.directory, self.control_key)
        except SealError as exc:
            if str(exc) != self._fence_problem:  # said once, not at every commit until the next world replaces it
                logger.warning("the fence file in %s is ignored: %s; this world replaces it", self.directory, exc)
            self._fence_problem = str(exc)
            return None

    def _open_directory(self, first: bool = False) -> None:
        """Rank 0: create the directory (0750) and raise the fence for this world (taking the directory over from an
        earlier incarnation of the job).

        Raises:
            CheckpointError: the directory is fenced by another job. When the manager is made (``first``), a fence
                that names another job refuses the directory even when its seal is another job's: a new job does not
                train over another job's checkpoints.
        """
        self.directory.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
        if not self.incarnation:
            return
        fence = self.fence()
        owner = fence.job if fence is not None else (_claimed_job(self.directory) if first else "")
        if owner and owner != self.job_id:
            raise CheckpointError(
                f"checkpoint directory {self.directory} belongs to job {owner!r}, not {self.job_id!r}; point "
                f"--checkpoint-dir at this job's directory (its fence {self.directory / FENCE} names the job)"
            )
        world = Warranted(self.incarnation, self.generation, self.published_at, self.warrant)
        opened = (fence or Fence(self.job_id, NOBODY)).opened_by(world)
        if opened is None:
            return
        if fence is not None and fence.owner.incarnation and fence.owner.incarnation != self.incarnation:
            logger.warning(
                "checkpoint directory %s: this incarnation of job %s takes it over from an earlier one "
                "(the job was started again); that one's worlds are fenced",
                self.directory,
                self.job_id,
            )
        _write_durably(self.directory / FENCE, json.dumps(opened.to_record(), sort_keys=True))

    def after_step(self, steps_done: int) -> None:
        """Call after every optimizer step with the number of steps done: saves every ``every_steps`` steps, and
        raises the error of an async save that failed. (Rescales happen in ``engine.step``:
        :mod:`pliant.worker.inplace.protocol`.)"""
        self._reap()
        if self.every_steps and steps_done % self.every_steps == 0:
            self.save(steps_done)

    # -- saving --------------------------------------------------------------------------------------------------------

    def _state(
        self, step: int, freeze_buffers: bool = False, scheduler: bool = True, split: bool = False
    ) -> dict[str, Any]:
        state: dict[str, Any] = {"train": _TrainState(self.engine, freeze_buffers, scheduler, split), "step": step}
        if self.loader is not None:
            state["data"] = dict(self.loader.state_dict())
        if self.extras:
            state["extras"] = dict(self.extras)
        return state

    def save(self, step: int, sync: bool | None = None) -> float:
        """Checkpoint ``step`` (collective). Returns the seconds the caller was blocked (the training stall)."""
        started = time.perf_counter()
        self.wait()
        path = self.directory / f"{_PREFIX}{step:012d}"
        if (path / COMMIT).exists():
            return time.perf_counter() - started
        background = self.async_save and not sync
        state = self._state(step, freeze_buffers=background, split=True)
        train = state["train"]
        saving = self.metrics.progress.saving() if self.metrics is not None else contextlib.nullcontext()
        snapshot_fed = False  # written from a buddy snapshot, whose copy's wait counts as the snapshot's stall
        with saving:  # the agent's hang detection gives a save the start timeout, not the step one
            if background:
                future = self._save_from_snapshot(state, path, step)
                snapshot_fed = future is not None
                future = future or self._save_in_background(state, path)
                committed = self._committed = threading.Event()
                future.add_done_callback(lambda f: self._async_done(f, path, step, started, train, committed))
                self._in_flight, self._in_flight_path = future, path
            else:
                try:
                    dcp.save(state, storage_writer=DirectWriter(str(path), self.direct_io), process_group=self.group)
                    self._saved(path, step, started, train)
                except (RuntimeError, dcp.CheckpointException) as exc:
                    if not self._abandoned(path, exc):
                        raise
        stall = self.stalled_s = time.perf_counter() - started
        if self.metrics is not None and (not background or snapshot_fed):  # else at the optimizer step's wait
            self.metrics.observe_save(stall)
        return stall

    def _save_in_background(self, state: dict[str, Any], path: Path) -> Future[Any]:
        """DCP's async save with its copy to host memory in the background too (``DefaultStager`` with async
        staging): the training loop goes on at once, and the engine's next optimizer step waits for the copy
        (:meth:`Engine.settle`), so the copy overlaps the next forward and backward. The stager is kept from save to
        save, so the copy goes into host memory it already touched (on CUDA, pinned); the write runs at a lowered
        priority (:class:`pliant.worker.staging.BackgroundWriter`). Returns the upload's future."""
        if self._stager is None:
            self._stager = stager(cuda=any(t.is_cuda for t in self.engine.module.parameters()))
        blocked = time.perf_counter()
        response = dcp.async_save(
            state,
            storage_writer=BackgroundWriter(str(path), self.direct_io),
            process_group=self.group,
            async_stager=self._stager,
        )
        if isinstance(response, Future):  # a torch whose stager copies in the caller
            return response
        blocked = time.perf_counter() - blocked
        staged, upload = response.staging_completion, response.upload_completion

        def settle() -> None:
            waited = time.perf_counter()
            staged.result()
            waited = time.perf_counter() - waited
            self.stalled_s += waited
            if self.metrics is not None:  # the stall: the call, plus the optimizer step's wait for the copy
                self.metrics.observe_save(blocked + waited)

        self.engine.staging = settle
        return upload

    def _save_from_snapshot(self, state: dict[str, Any], path: Path, step: int) -> Future[Any] | None:
        """Write ``step`` from the buddy snapshot of that step (:mod:`pliant.worker.staging`), which the protocol
        takes now if its cadence did not: the copy is the snapshot's (the next optimizer step waits for it, as for
        every snapshot), and the state is not copied a second time. None: no snapshot can feed this save (``state``
        is then resolved for DCP's stager)."""
        state.update(resolve(state))
        staged = self.runner.snapshot_for_save(self.engine, step)
        if staged is None:
            return None
        saved, shards = from_snapshot(state, staged.lookup)
        future = write_in_background(saved, str(path), self.group, staged.ready, shards, self.direct_io)
        staged.pin(future)
        logger.info(
            "rank %d: checkpoint of step %d is written from the buddy snapshot of that step", dist.get_rank(), step
        )
        return future

    def _async_done(
        self, future: Future[Any], path: Path, step: int, started: float, train: _TrainState, committed: threading.Event
    ) -> None:
        """An async save finished (DCP's thread): commit it; a refusal is raised by the step that reaps it."""
        try:
            if future.exception() is None:
                self._saved(path, step, started, train)
        except Exception as exc:
            self._commit_error = exc
        finally:
            committed.set()

    def _saved(self, path: Path, step: int, started: float, train: _TrainState) -> None:
        """A save completed on this rank: commit it (rank 0, as soon as complete) and report it."""
        self._commit(path, step)
        if self.metrics is not None:
            self.metrics.observe_saved(time.perf_counter() - started, train.nbytes)

    def wait(self) -> None:
        """Finish the save in flight, if any (rank 0 commits it when it completes).

        Raises:
            CheckpointError: the save failed (its path and the OS error), unless it was abandoned (:meth:`_abandoned`).
        """
        self.engine.settle()
        if self._in_flight is None:
            return
        future, path = self._in_flight, self._in_flight_path
        self._in_flight = self._in_flight_path = None
        try:
            future.result()
        except (Exception, dcp.CheckpointException) as exc:
            self._committed.wait()  # its callback committed nothing
            if not self._abandoned(path, exc):
                raise _save_error(path, exc) from exc
            return
        self._committed.wait()  # a future's waiters wake before its callbacks run: the commit is one of them
        error, self._commit_error = self._commit_error, None
        if error is not None:
            raise error

    def _abandoned(self, path: Path | None, exc: BaseException) -> bool:
        """A save that failed with ``exc`` is abandoned (never committed) when a peer failed during it and the next
        step re-forms in place (:meth:`Runner.peer_failed`); else the caller raises."""
        if not self.runner.peer_failed(exc):
            return False
        logger.warning("checkpoint save to %s abandoned: a peer failed during it (%s)", path, str(exc)[:200])
        return True

    def _reap(self) -> None:
        """Surface a finished async save's error at the step that sees it (never only at the next save)."""
        if self._in_flight is not None and self._in_flight.done():
            self.wait()

    def _commit(self, path: Path, step: int) -> None:
        """Rank 0 writes the marker, unless a newer generation opened the directory (then this world is a zombie).
        DCP's save returns (its future resolves) on rank 0 only after it gathered every rank's write results and
        wrote ``.metadata``: all shards are on disk, so no barrier is needed.

        Raises:
            CheckpointError: a newer generation owns the directory; nothing was committed.
        """
        if dist.get_rank() == 0:
            fence = self.fence() if self.incarnation else None
            if fence is not None and fence.supersedes(self.incarnation, self.generation):
                mine = fence.owner.incarnation == self.incarnation
                owner = f"generation {fence.owner.generation}" if mine else "a newer incarnation"
                raise CheckpointError(
                    f"commit of {path} refused: {owner} of job {self.job_id} owns {self.directory} and this worker "
                    f"runs generation {self.generation} (its world was superseded); stop this worker"
                )
            info = CheckpointInfo(
                str(path),
                step,
                self.generation,
                dist.get_world_size(),
                self.job_id,
                self.fingerprint,
                time.time(),
                metadata_digest(path),
            )
            _write_durably(path / COMMIT, seal(self.key, info.to_record()))
            _fsync_dir(self.directory)  # the step directory's own entry
            logger.info("checkpoint of step %d committed at %s", step, path)
            self._prune()

    def _prune(self) -> None:
        """Remove committed checkpoints past ``keep`` and partial ones older than the newest: directories of this
        directory's listing only (a marker names no path)."""
        committed = self.committed()
        newest = committed[0].step if committed else -1
        for info in committed[self.keep :]:
            shutil.rmtree(info.path, ignore_errors=True)
        for path in self._step_dirs():
            if not (path / COMMIT).exists() and _step_of(path) < newest:
                logger.warning("removing partial checkpoint %s (superseded by step %d)", path, newest)
                shutil.rmtree(path, ignore_errors=True)

    # -- loading -------------------------------------------------------------------------------------------------------

    def _step_dirs(self) -> list[Path]:
        """The checkpoint directories: real directories (not links) named ``step-<step>``."""
        if not self.directory.is_dir():
            return []
        return [p for p in self.directory.iterdir() if _step_of(p) >= 0 and p.is_dir() and not p.is_symlink()]

    def _marker(self, path: Path) -> CheckpointInfo | None:
        """The checkpoint at ``path``: its marker, if it is sealed with the job's key and names ``path``'s step.
        Markers that are not are ignored (and said once): they are never loaded, counted or pruned."""
        try:
            text = (path / COMMIT).read_bytes()
        except OSError:
            return None  # partial (or unreadable here)
        try:
            info = CheckpointInfo.from_record(path, unseal(self.key, text, "commit"))
            if info.step != _step_of(path):
                raise SealError(f"it names step {info.step}")
        except SealError as exc:
            if str(path) not in self._ignored:
                logger.warning("checkpoint %s is ignored: its commit marker is not this job's (%s)", path, exc)
            self._ignored[str(path)] = f"its commit marker is not this job's ({exc})"
            return None
        self._ignored.pop(str(path), None)
        return info

    def committed(self) -> list[CheckpointInfo]:
        """Committed checkpoints, newest first (partial ones, and ones whose marker does not hold, are ignored)."""
        out = [info for info in map(self._marker, self._step_dirs()) if info is not None]
        return sorted(out, key=lambda i: i.step, reverse=True)

    def _candidates(self) -> list[int]:
        """The steps every rank tries, newest first: rank 0's view, broadcast (collective)."""
        steps = [info.step for info in self.committed()][:_MAX_CANDIDATES] if dist.get_rank() == 0 else []
        buf = torch.full((_MAX_CANDIDATES + 1,), -1, dtype=torch.int64)
        buf[0] = len(steps)
        buf[1 : len(steps) + 1] = torch.tensor(steps, dtype=torch.int64)
        dist.broadcast(buf, src=0, group=self.group)
        return buf[1 : int(buf[0]) + 1].tolist()

    def _info(self, step: int) -> CheckpointInfo | None:
        path = self.directory / f"{_PREFIX}{step:012d}"
        return self._marker(path) if path.is_dir() and not path.is_symlink() else None

    def restore(self) -> int | None:
        """Load the newest usable checkpoint that rank 0 sees (collective). Returns its step, or None when there is
        none. A worker that joins a running world in place takes the survivors' state instead (no disk read) and
        returns its step.

        Raises:
            CheckpointError: the newest checkpoint belongs to another job or another model; or checkpoints exist but
                none loads (unless ``allow_fresh_start``).
        """
        resumed = self.runner.state_from_peers()
        if resumed is not None:
            return resumed  # a newcomer to a running world: its state came from the survivors, not from disk
        unusable: list[tuple[Path, str]] = []
        for step in self._candidates():
            path = self.directory / f"{_PREFIX}{step:012d}"
            info = self._info(step)
            if info is not None and info.job_id != self.job_id:
                raise CheckpointError(
                    f"checkpoint {info.path} belongs to job {info.job_id!r}, not {self.job_id!r}; point "
                    f"--checkpoint-dir at this job's directory"
                )
            if info is not None and info.fingerprint != self.fingerprint:
                raise CheckpointError(
                    f"checkpoint {info.path} was saved from another model (fingerprint {info.fingerprint}, this "
                    f"model {self.fingerprint}); use the same model definition or another --checkpoint-dir"
                )
            digest = info.metadata_sha256 if info is not None else ""
            state = self._state(step, scheduler=self._has_scheduler(path, digest))
            error = "" if info is not None else f"its marker {path / COMMIT} is unreadable on this rank"
            started = time.perf_counter()
            if not error:
                try:
                    dcp.load(
                        state,
                        storage_reader=SealedReader(path, digest),
                        planner=DataLoadPlanner(),
                        process_group=self.group,
                    )
                except (Exception, dcp.CheckpointException) as exc:  # CheckpointException is a BaseException
                    error = f"{type(exc).__name__}: {str(exc)[:300]}"
            flag = torch.tensor([1 if error else 0], dtype=torch.int64)
            dist.all_reduce(flag, group=self.group)  # every rank moves on together
            if flag.item():
                logger.warning(
                    "checkpoint %s is unusable on %d rank(s) (%s); trying the previous one",
                    path,
                    flag.item(),
                    error or "another rank failed",
                )
                unusable.append((path, error or "unusable on another rank"))
                continue
            if self.loader is not None and "data" in state:
                self.loader.load_state_dict(state["data"])
            self.extras = dict(state.get("extras", {}))
            if self.metrics is not None:
                self.metrics.observe_load(time.perf_counter() - started, state["train"].nbytes)
            assert info is not None
            logger.info(
                "restored step %d from %s (saved at world size %d, now %d)",
                step,
                path,
                info.world_size,
                dist.get_world_size(),
            )
            self._set_aside(unusable)
            return step
        return self._nothing_loaded(unusable)

    def _has_scheduler(self, path: Path, digest: str) -> bool:
        """Whether the checkpoint at ``path`` holds the engine's learning-rate scheduler (one saved before the script
        gave ``scheduler=`` does not: the scheduler then starts from its first step, with a warning)."""
        if self.engine.scheduler is None:
            return False
        try:
            keys = SealedReader(path, digest).read_metadata().state_dict_metadata
        except Exception:  # unreadable metadata: the load fails and says so
            return True
        if any(key.startswith("train.scheduler.") for key in keys):
            return True
        logger.warning(
            "checkpoint %s holds no learning-rate scheduler state (saved without scheduler=); the "
            "scheduler starts from its first step",
            path,
        )
        return False

    def _set_aside(self, unusable: list[tuple[Path, str]]) -> None:
        """Rank 0 renames checkpoints that failed to load (newer than the one that did) out of the ``step-*``
        namespace, so they are never tried or pruned in place of fresh ones."""
        if dist.get_rank() != 0:
            return
        for path, why in unusable:
            aside = self.directory / f"{_ASIDE}{_step_of(path)}-{int(time.time())}"
            try:
                os.replace(path, aside)
            except OSError as exc:
                logger.warning("could not move unusable checkpoint %s aside: %s", path, exc)
                continue
            logger.warning("unusable checkpoint %s moved aside to %s (%s)", path, aside, why)
        if unusable:
            _fsync_dir(self.directory)

    def _nothing_loaded(self, unusable: list[tuple[Path, str]]) -> int | None:
        """No checkpoint loaded: None (train from step 0) when there is none; else raise, since some exist (markers
        that do not hold count: sealed with another key, the job's checkpoints need the deployment's sealing secret)."""
        ignored = [(p, why) for p, why in self._ignored.items() if (Path(p) / COMMIT).exists()]
        unusable = [*unusable, *((Path(p), why) for p, why in ignored)]
        aside = sorted(p.name for p in self.directory.glob(f"{_ASIDE}*")) if self.directory.is_dir() else []
        if not unusable and not aside:
            return None
        found = [str(p) for p, _ in unusable] + [str(self.directory / a) for a in aside]
        if self.allow_fresh_start:
            logger.warning(
                "no checkpoint in %s loads (%s); starting from step 0 (allow_fresh_start)",
                self.directory,
                ", ".join(found),
            )
            return None
        details = "; ".join(f"{p}: {why}" for p, why in unusable) or "only checkpoints moved aside earlier remain"
        raise CheckpointError(
            f"checkpoints exist in {self.directory} but none can be loaded ({details}); nothing was deleted. Repair or "
            f"restore them (markers sealed with another key load with the sealing secret they were made under: "
            f"--seal-root-file), point --checkpoint-dir elsewhere, or train from step 0 with --allow-fresh-start "
            f"(pliant run / agent) or allow_fresh_start=True (session.checkpoints)"
        )


def _claimed_job(directory: Path) -> str:
    """The job a fence file in ``directory`` names, sealed or not ("" when there is none, or it names none)."""
    try:
        return str(read_fence(directory, None).job)  # type: ignore[union-attr]
    except (OSError, SealError, AttributeError):
        return ""


def _write_durably(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (0640) through a temporary file, fsync and rename, then fsync the directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # a leftover (or someone else's) file: this one is made new, with this mode
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE), "w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_error(path: Path | None, exc: BaseException) -> CheckpointError:
    errno = getattr(exc, "errno", None)
    cause = exc.__cause__ or exc.__context__
    errno = errno if errno is not None else getattr(cause, "errno", None)
    code = f" [errno {errno}: {os.strerror(errno)}]" if errno else ""
    return CheckpointError(
        f"checkpoint save to {path} failed{code}: {type(exc).__name__}: {str(exc)[:300]}; check the disk (space, "
        f"permissions, mount) behind --checkpoint-dir"
    )


def _step_of(path: Path) -> int:
    """The step of a directory named ``step-<digits>``; -1 for any other name."""
    digits = path.name[len(_PREFIX) :]
    return int(digits) if path.name.startswith(_PREFIX) and digits.isdigit() and digits.isascii() else -1


def _without(tree: Any, name: str) -> Any:
    """``tree`` (nested dicts and lists) without the dict entries named ``name``."""
    if isinstance(tree, dict):
        return {k: _without(v, name) for k, v in tree.items() if k != name}
    if isinstance(tree, list):
        return [_without(v, name) for v in tree]
    return tree


def _clone_where(tree: Any, pointers: set[int]) -> Any:
    """``tree`` (nested dicts) with its tensors whose storage starts at one of ``pointers`` cloned."""
    if isinstance(tree, dict):
        return {k: _clone_where(v, pointers) for k, v in tree.items()}
    if (
        isinstance(tree, torch.Tensor)
        and not hasattr(tree, "to_local")
        and tree.numel()
        and tree.data_ptr() in pointers
    ):
        return tree.detach().clone()
    return tree
