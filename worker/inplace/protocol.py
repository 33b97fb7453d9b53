"""The rescale protocol, worker side: re-form in place at a step boundary, and redo a step a dead peer broke.

Under a pliant agent every engine step goes through :meth:`Protocol.step` (the engine's runner), in this order:

1. **Boundary.** If the previous step's vote said that some rank's agent asked for a rescale, every rank asks its
   :class:`~pliant.worker.inplace.world.World` for the directive its agent wrote (:mod:`pliant.progress`), if any yet,
   and the old world agrees with one all-reduce:
   - ``restart`` on any rank: every part saves what it saves for a restart (checkpoint managers: the step not yet run
     is not in it) and every rank raises :class:`~pliant.worker.contract.RescaleExit`; the agent starts fresh
     workers, which restore from disk (the path for engines that cannot move in place).
   - otherwise a rank without a directive waits for it (a leaving node's agent writes one at once; the others' only
     once the coordinator published the next generation). ``leave`` (this node is not in the next generation; a
     DDP replica holds nothing the others lack) and a late ``restart`` raise :class:`RescaleExit` at once (a fresh
     worker takes the rank's place and gets its state from the others); ``in-place`` re-forms
     (:meth:`Protocol._reform` below), then the step's batch is cut again for the new world.
2. **Vote and compute**: the engine's forward and backward with their gradient collectives, then, before the optimizer
   step, the commit vote. The gradient all-reduce (DDP, ZeRO) or reduce-scatter (FSDP2) already needs every rank's
   contribution, so a rank whose collectives fail never applies the step. HSDP's do not (a shard's all-reduce joins
   its replicas only: a death can fail one shard's and not another's), so its step is applied only after one more
   all-reduce that every rank reaches after its collectives. Some steps' vote also carries "my agent asked
   for a rescale" in one more all-reduce of three integers, issued before the forward and waited for before the
   optimizer step. Its other integers are the rank's last step time and the interval between buddy snapshots that their
   measured cost asks for: from the largest, every rank computes the same step for the next vote (about every
   :data:`~pliant.rescale_vote.VOTE_WITHIN_S`, and in the first step of a job or of a new world) and the
   same number of steps between snapshots (:mod:`pliant.worker.inplace.cadence`). A rescale starts within about that
   time or two steps.
3. **Commit**: the optimizer step.

**A peer dies** during 2 or 3: the collective raises on every survivor (gloo at once). The survivor drops the step's
gradients, writes ``wait`` to its progress file (its agent reports the failure, so the coordinator publishes the next
generation at once, evicting a node whose agent is unreachable), waits for its directive and re-forms. The survivors
then agree on the newest committed step (:mod:`pliant.worker.inplace.transfer`). A survivor whose vote failed while
another's completed (the peer died inside the vote) takes the newer state, and its step counts as done; the ranks that
were ahead skip one loop iteration (their loader yields that step again), so every rank's training loop stays in step
with the others' collectives. Everyone else redoes the broken step in the new world on the same global batch: at most
one step is redone per failure.

**Re-forming** (:meth:`Protocol._reform`), the same sequence on survivors and on newcomers (fresh processes, whose
session starts in the new world): the world retires its group and forms the new generation's; every rank says whether
it holds state (one all-reduce; a newcomer's session does it when it meets the world); each part is moved to the new
world in the order the script made it (:meth:`~pliant.worker.contract.WorldPart.after_move`: an engine is wrapped
again, without DDP's broadcast of rank 0's parameters, since rank 0 may be a newcomer; a checkpoint manager opens its
group again); then the state moves from the source rank (:func:`~pliant.worker.inplace.transfer.transfer`). A newcomer
takes part from ``CheckpointManager.restore`` or the start of the loader's iteration, whichever comes first
(:meth:`Protocol.state_from_peers`), so a script's setup between ``init`` and its loop must not run collectives of its
own (:mod:`pliant.worker.inplace.setup_window` refuses them).

Anything that fails while re-forming raises :class:`RescaleError`, so the worker exits with an error; its agent reports
it and the next generation starts fresh workers that restore from disk. That is the way back.
"""

from __future__ import annotations

import atexit
import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pliant.env import RESCALE_SIGNAL
from pliant.errorfile import peer_gone
from pliant.progress import Directive, announce_in_place, announce_signal
from pliant.worker.contract import (
    Engine,
    ExitReason,
    GlobalBatch,
    LossFn,
    RescaleExit,
    Runner,
    Staged,
    WorkerError,
    WorldPart,
)
from pliant.worker.inplace.buddy import BuddyCopies
from pliant.worker.inplace.cadence import Cadence
from pliant.worker.inplace.guard import Guard, NoGuard
from pliant.worker.inplace.setup_window import SetupWindow
from pliant.worker.inplace.transfer import Transferred, exchange, transfer
from pliant.worker.inplace.world import World

if TYPE_CHECKING:
    from pliant.worker.data import ElasticLoader
    from pliant.worker.metrics import WorkerMetrics

__all__ = ["Protocol", "RescaleError", "is_peer_failure"]

logger = logging.getLogger(__name__)


class RescaleError(WorkerError):
    """Re-forming in place failed, or the script stepped after its :class:`RescaleExit`; the worker exits and its agent
    takes the restart path."""


def is_peer_failure(exc: BaseException) -> bool:
    """True for a collective that failed because a peer went away (torch's DistError, or a RuntimeError that says so:
    :data:`pliant.errorfile.PEER_GONE`, or any of gloo's or NCCL's, which a re-formed world recovers from)."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        peer_gone(text) or any(mark in text for mark in ("gloo", "NCCL", "Connection reset", "Connection closed"))
    )


class Protocol(Runner):
    """One worker's side of the rescale protocol (see the module docstring): the runner of its engines' steps. Made
    by the session under an agent.

    Args:
        world: this process's world (its env, process group and directive).
        device: the session's device (where the small collectives' tensors live).
        metrics: the worker's metrics.
        rescale_in_place: the agent runs in-place rescales (``--rescale in-place``); False keeps only the restart
            path.

    Threads: the script's thread owns every field but :attr:`asked`, which the rescale signal's handler sets (run by
    the interpreter on the script's thread, between two bytecodes). The step guard's thread owns the guard's fields
    (:class:`~pliant.worker.inplace.guard.Guard`); the buddy copies' threads, theirs.
    """

    def __init__(self, world: World, device: torch.device, metrics: WorkerMetrics, rescale_in_place: bool) -> None:
        self.world = world
        self.device = device
        self.metrics = metrics
        self.rescale_in_place = rescale_in_place
        self.asked = False
        self.boundary_due = False
        self.pending_sync = False
        self.steps_done = 0
        self.cadence = Cadence(world.env.snapshot_every)  # the steps of the votes and of the buddy snapshots
        self.parts: list[WorldPart] = []  # engines and checkpoint managers, in the order the script made them
        self.engines: list[Engine] = []
        self.loaders: list[ElasticLoader] = []
        self._positions: list[tuple[int, int, int]] | None = None  # each loader's position from the last transfer
        self.copies = BuddyCopies(world.tracked, metrics, world.env.kept_dir)
        self._rolling_back = False
        self.failed_between = ""  # a collective between steps failed (peer_failed); the next step re-forms
        self._recovered = False  # re-formed after a failure: the next step that completes is the recovery's last phase
        self.exited: ExitReason | None = (
            None  # what ended this rank (leave, restart); a later step is the script's error
        )
        # A step that a dead or cut-off peer blocks is broken by the step guard (pliant.worker.inplace.guard).
        nccl = world.backend == "nccl"
        self.guard = Guard(world.newer, nccl, lambda: world.group_fds) if rescale_in_place else NoGuard()
        # In place, the script's own collectives are refused until its first step (pliant.worker.inplace.setup_window).
        self.setup_window = SetupWindow()
        if world.in_place:
            self.setup_window.start()
        if threading.current_thread() is threading.main_thread():
            signal.signal(RESCALE_SIGNAL, self._on_signal)
            # Python puts the default action (death) back as it exits: a script past its last step would die of a
            # signal its agent sent, and count as failed. Ignored from the start of the interpreter's exit.
            atexit.register(signal.signal, RESCALE_SIGNAL, signal.SIG_IGN)
            announce_signal(world.env.progress_file)  # the agent asks this worker to rescale with the signal
        if rescale_in_place:  # the agent may now hand this worker its next generation (an engine that cannot move
            announce_in_place(world.env.progress_file)  # in place makes the boundary take the restart path instead)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.asked = True

    def _exit(self, reason: ExitReason | str) -> RescaleExit:
        """The exception that ends this rank's part in the job; remembered, so that a script that swallows it and
        steps again gets a clear error instead of a rank that trains outside any world."""
        self.exited = ExitReason(reason)
        return RescaleExit(self.exited)

    def close(self) -> None:
        """The session closes: the set-up window, if still open, closes with it."""
        self.setup_window.close()

    @property
    def sharded(self) -> Engine | None:
        """The one sharded engine whose buddy copies this protocol keeps (None: none, or more than one)."""
        sharded = [e for e in self.engines if e.sharded]
        return sharded[0] if self.rescale_in_place and len(sharded) == 1 else None

    def _recoverable(self, engine: Engine) -> bool:
        """A peer's death costs only a step (replicas) or the steps since the last snapshot (buddy copies)."""
        return self.rescale_in_place and (engine.survives_peer_loss or (engine is self.sharded and self.copies.taken))

    # -- the parts of the run ------------------------------------------------------------------------------------------

    def add_engine(self, engine: Engine) -> None:
        """Register an engine the session made (its runner is this protocol): moved on every re-formation, its state
        sent to newcomers."""
        self.engines.append(engine)
        self.parts.append(engine)

    def add_part(self, part: WorldPart) -> None:
        """Register another part the session made (a checkpoint manager): moved on every re-formation, after the parts
        made before it."""
        self.parts.append(part)

    def add_loader(self, loader: ElasticLoader) -> None:
        """Register a loader the session made: it is re-cut on every re-formation (and, made by a newcomer after its
        state came from peers, starts at the position they sent)."""
        self.loaders.append(loader)
        if self._positions is not None:
            self._place(loader)

    def _place(self, loader: ElasticLoader) -> None:
        index = self.loaders.index(loader)
        loader.moved(dist.get_rank(), dist.get_world_size())
        if self._positions is not None and index < len(self._positions):
            loader.load_position(*self._positions[index])

    # -- joining a world -----------------------------------------------------------------------------------------------

    def form_group(self, survivor: bool = False) -> None:
        """Form the world's generation (:meth:`World.form`).

        Raises:
            RescaleExit: a newer generation handed over meanwhile is ``leave`` or ``restart`` for this rank.
        """
        left = self.world.form(survivor, self.steps_done)
        if left is not None:
            raise self._exit(left.mode)

    def joined(self) -> None:
        """A fresh worker's session opened its world: if survivors hold state, take it from them before training."""
        if self.rescale_in_place:
            self.pending_sync = exchange(holds_state=False, device=self.device)
            if self.pending_sync:
                logger.info("rank %d joins a running world: its state comes from its peers", dist.get_rank())

    def state_from_peers(self) -> int | None:
        """A newcomer's state from its peers, once (the loader's start or ``CheckpointManager.restore``). Returns the
        step it resumes at, or None when nothing came from peers."""
        if not self.pending_sync:
            return None
        self.pending_sync = False
        started = time.perf_counter()
        moved = self._transfer(holds_state=False)
        self.metrics.state_sync_bytes.inc(moved.nbytes)
        logger.info(
            "rank %d: state of step %d received from peers in %.2fs (%d bytes)",
            dist.get_rank(),
            self.steps_done,
            time.perf_counter() - started,
            moved.nbytes,
        )
        return self.steps_done

    # -- every step ----------------------------------------------------------------------------------------------------

    def step(self, engine: Engine, batch: GlobalBatch, loss_fn: LossFn) -> float:
        """One engine step under the protocol (see the module docstring).

        Raises:
            RescaleExit: this rank leaves, or takes the restart path.
            RescaleError: the script caught an earlier :class:`RescaleExit` and stepped again.
        """
        if self.exited is not None:
            raise RescaleError(
                f"engine.step was called after RescaleExit ({self.exited.value!r}) ended this rank's part in the job: "
                f"the script caught it (an `except SystemExit`, `except BaseException` or bare `except:` around the "
                f"loop); let RescaleExit propagate, so that the process exits and the next generation forms"
            )
        self.setup_window.close()  # the loop has begun: the script's own collectives are its business
        self.cadence.tick(batch.step, time.perf_counter(), time.process_time())
        self.state_from_peers()
        if self.failed_between:  # a collective between steps failed: re-form before this step, as if it broke
            logger.warning(
                "rank %d: a peer failed before step %d (%s); waiting for the next generation",
                self.world.env.rank,
                batch.step,
                self.failed_between,
            )
            self.failed_between, self.boundary_due = "", False
            if not self._recover(batch):
                return 0.0
        elif self.boundary_due and not self._boundary(engine, batch):
            return 0.0  # a peer failed at the boundary, and this step was committed elsewhere or is skipped
        while True:
            started = time.perf_counter()
            failure = ""
            self.guard.begin(self.world.env.generation, peers=self.world.env.world_size > 1)
            try:
                vote = self._vote() if batch.step >= self.cadence.next_vote else None  # runs while the step computes
                loss = engine.forward_backward(batch, loss_fn)
                self.guard.check()  # the step's collectives completed on every rank, or raise
                if engine.partial_collectives:
                    failure = "the commit"
                    self._all_completed()
                failure = "the vote"
                asked = self._counted(vote, batch.step) if vote is not None else False
                failure = "the buddy copies"
                self.copies.settle()  # the last snapshot's copy and send, which ran while this step computed
                failure = "the update"  # ZeRO's step broadcasts the updated parameters
                engine.settle()  # an async checkpoint's copy of the state, overlapped with the forward and backward
                engine.apply_update()
                self.steps_done = batch.step + 1
                failure = "the buddy copies"
                if engine is self.sharded and (self.cadence.snapshot_due(self.steps_done) or not self.copies.taken):
                    self._snapshot(engine, [loader.position() for loader in self.loaders])
                failure = ""
            except RuntimeError as exc:
                if not (self._recoverable(engine) and is_peer_failure(exc)):
                    raise
                failure = f"{failure or 'the step'}: {str(exc).splitlines()[0][:200]}"
            self.guard.end(committed=not failure)
            if failure:  # outside the except block: the traceback (and the autograd graph it holds) is gone
                self.metrics.observe_recovery("detect", time.perf_counter() - started)
                engine.discard_update()
                logger.warning(
                    "rank %d: a peer failed during step %d (%s); waiting for the next generation",
                    self.world.env.rank,
                    batch.step,
                    failure,
                )
                if not self._recover(batch):
                    return 0.0  # this step was committed elsewhere (and is in the state received), or skipped
                continue
            engine.observe(batch, started)
            if self._recovered:  # the new world's first step after a failure
                self._recovered = False
                self.metrics.observe_recovery("first_step", time.perf_counter() - started)
            self.boundary_due = asked
            return loss

    def peer_failed(self, exc: BaseException, started: float | None = None) -> bool:
        """A collective run between steps (``Session.all_reduce_sum``, an async checkpoint's), begun at ``started``
        (``time.perf_counter``; None: not known), failed with ``exc``. True when it is a peer failure the next step
        recovers from (it re-forms first): the time from ``started`` is the recovery's detect phase, and the peers
        still blocked in it are woken now."""
        if not (self.engines and all(self._recoverable(e) for e in self.engines) and is_peer_failure(exc)):
            return False
        if started is not None:
            self.metrics.observe_recovery("detect", time.perf_counter() - started)
        self.failed_between = str(exc).splitlines()[0][:200]
        self.world.wait_for_next(self.steps_done)
        self.world.sever()
        return True

    def guarded(self, collective: Callable[[], object]) -> None:
        """Run a collective of the session's between steps under the step guard."""
        self.guard.begin(self.world.env.generation, peers=self.world.env.world_size > 1)
        try:
            collective()
            self.guard.check()
        finally:
            self.guard.end()

    def _snapshot(self, engine: Engine, positions: list[tuple[int, int, int]], by_step: bool = True) -> None:
        """Copy this rank's shard at the step just committed and send it to its buddy, in the background."""
        env = self.world.env
        self.copies.snapshot(engine, env.generation, env.node_rank, self.steps_done, positions)
        self.cadence.took(self.steps_done, by_step and not self.copies.fresh)  # measured: a step's, buffers reused

    def snapshot_for_save(self, engine: Engine, step: int) -> Staged | None:
        """The buddy snapshot of the committed ``step`` for a checkpoint, taken now if the cadence took none then
        and allows one (every rank saves the same step); None: DCP's own copy applies."""
        if engine is not self.sharded or step != self.steps_done:
            return None
        try:
            if self.copies.staged(step) is None and self.cadence.save_may_snapshot(step):
                self._snapshot(engine, [loader.position() for loader in self.loaders], by_step=False)
        except RuntimeError as exc:  # a peer failed: the next step re-forms
            logger.warning("rank %d: no snapshot for the checkpoint of step %d (%s)", dist.get_rank(), step, exc)
            return None
        return self.copies.staged(step)

    def _vote(self) -> tuple[dist.Work, torch.Tensor]:
        """Start the commit vote: one all-reduce (max) of three integers that every rank must reach, carrying "my agent
        asked for a rescale", this rank's last step time and the snapshot interval it asks for
        (:meth:`Cadence.ballot`). It is issued before the step's forward, so on gloo it completes while the step
        computes, ahead of the gradient all-reduce; :meth:`_counted` waits for it before the
        optimizer step."""
        if self.asked:  # the agent writes the directive before it signals; a signal with none newer is stale
            self.asked = self.world.newer() is not None
        flag = torch.tensor([int(self.asked), *self.cadence.ballot()], dtype=torch.int32)  # on NCCL too: gloo
        return dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag  # type: ignore[return-value]

    def _all_completed(self) -> None:
        """One all-reduce that every rank reaches only after its step's collectives completed: for an engine whose
        collectives do not each join every rank (:attr:`~pliant.worker.contract.Engine.partial_collectives`), the
        proof that no rank's failed before any rank applies the step (raises when a peer failed)."""
        started = time.perf_counter()
        dist.all_reduce(torch.zeros(1, dtype=torch.int32))  # on NCCL too: gloo (the default group's CPU backend)
        self.metrics.observe_collective("control", time.perf_counter() - started)

    def _counted(self, vote: tuple[dist.Work, torch.Tensor], step: int) -> bool:
        """Wait for the commit vote of ``step`` and set the next vote's step and K; returns "a rescale was asked"
        (raises when a peer failed)."""
        started = time.perf_counter()
        work, flag = vote
        work.wait()
        self.metrics.observe_collective("control", time.perf_counter() - started)
        self.cadence.agreed(step, int(flag[1]), int(flag[2]))  # all-reduced: the same on every rank
        if self.sharded is not None:
            self.metrics.snapshot_every.set(self.cadence.every)
        return bool(flag[0])

    # -- the step boundary ---------------------------------------------------------------------------------------------

    def _boundary(self, engine: Engine, batch: GlobalBatch) -> bool:
        """The step boundary (see the module docstring). Returns whether to run ``batch`` (False only when a peer
        failed during the old world's part of it and the recovery says so, as in :meth:`_recover`)."""
        self.boundary_due = False
        self.asked = False
        env = self.world.env
        self.guard.begin(None)
        directive = self.world.newer()  # None: this rank's agent has not written its next yet
        movable = self.rescale_in_place and all(part.can_move() for part in self.parts)
        restart = (directive is not None and directive.mode == ExitReason.RESTART.value) or not movable
        flag = torch.tensor([int(restart)], dtype=torch.int64)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # the old world, if whole: a restart anywhere is for everyone
            for loader in self.loaders:
                loader.rewind(batch)  # the step not run yet belongs to the next world
            if flag.item():
                for part in self.parts:
                    part.before_restart(batch.step)
                raise self._exit(ExitReason.RESTART)
            for part in self.parts:
                part.quiesce()  # a checkpoint's save in flight: its group is about to be retired
            for part in self.parts:
                part.before_move()  # what only some ranks hold (ZeRO's shards), gathered while every rank is here
            failed = ""
        except RuntimeError as exc:  # a peer died or was cut off as the boundary began: the failure path
            if not (self._recoverable(engine) and is_peer_failure(exc)):
                raise
            failed = str(exc).splitlines()[0][:200]
        self.guard.end()
        if failed:
            logger.warning(
                "rank %d: a peer failed at the step boundary before step %d (%s); waiting for the next generation",
                env.rank,
                batch.step,
                failed,
            )
            return self._recover(batch)
        if directive is None:
            directive = self.world.await_newer()
        if directive.mode != "in-place":
            # Leaving (a DDP replica holds nothing the others lack), or told to restart after the others agreed to
            # re-form: a fresh worker takes this rank's place and gets its state from them.
            logger.info(
                "rank %d exits at step %d (%s, generation %d)",
                env.rank,
                batch.step,
                directive.mode,
                directive.generation,
            )
            raise self._exit(directive.mode)
        self._reform(directive, "boundary")
        self._refetch(batch)
        return True

    def _recover(self, batch: GlobalBatch) -> bool:
        """A peer failed mid-step: re-form and decide what this rank does with ``batch``. True: run it again (cut for
        the new world); False: return from the step (committed by the newer state, or skipped to stay in step)."""
        self.world.wait_for_next(batch.step)
        for part in self.parts:
            part.abandon()
        self.world.sever()  # wakes the peers still blocked in a collective with this rank
        waited = time.perf_counter()
        directive = self.world.await_newer()
        self.metrics.observe_recovery("decide", time.perf_counter() - waited)
        if directive.mode != "in-place":
            raise self._exit(directive.mode)
        for loader in self.loaders:
            loader.rewind(batch)
        committed = self.steps_done
        moved = self._reform(directive, "failure")
        self._recovered = True
        rank = self.world.env.rank
        if self.steps_done < committed:
            self.metrics.steps_redone.inc(committed - self.steps_done)
            logger.info("rank %d: committed steps %d-%d run again", rank, self.steps_done, committed - 1)
        if moved.behind:
            logger.info("rank %d: step %d was committed by peers; taking their state", rank, batch.step)
            batch.micro_batches, batch.micro_sizes = [], []
            return False
        if moved.ahead:
            logger.info("rank %d: step %d is skipped once so every rank's loop stays in step", rank, batch.step)
            batch.micro_batches, batch.micro_sizes = [], []
            return False
        self._refetch(batch)
        return True

    def _refetch(self, batch: GlobalBatch) -> None:
        if batch.source is not None:
            batch.source.refetch(batch)

    # -- re-forming ----------------------------------------------------------------------------------------------------

    def _reform(self, directive: Directive, why: str) -> Transferred:
        """Leave the old world and join ``directive``'s with this rank's state; returns what the transfer left. A newer
        generation handed over before the state moves (the ranks met, but a peer or the store went away while they
        opened their groups) is formed instead.

        Raises:
            RescaleError: any step failed (the worker exits; its agent takes the restart path).
            RescaleExit: a newer generation handed over while the ranks met is ``leave`` or ``restart`` here.
        """
        self.copies.finish(check=False)  # a snapshot's copy still running: done before the state changes
        started = time.perf_counter()
        world = self.world
        old = world.env
        self._rolling_back = why == "failure" and self.sharded is not None
        try:
            while True:
                world.retire()
                world.adopt(directive)
                self.form_group(survivor=True)
                env = world.env  # a newer generation's, if the agent handed one over while the ranks met
                self.guard.begin(env.generation, peers=env.world_size > 1)  # the new world's communicator
                try:
                    exchange(holds_state=True, device=self.device)
                    for part in self.parts:
                        part.after_move(world)
                    break
                except Exception as exc:
                    newer = world.newer()
                    if newer is None or newer.mode != "in-place":
                        raise
                    logger.warning(
                        "rank %d: generation %d gave way to generation %d as its groups opened (%s); forming that one",
                        env.rank,
                        env.generation,
                        newer.generation,
                        str(exc).splitlines()[0][:200],
                    )
                    directive = newer
            formed = time.perf_counter()
            moved = self._transfer(holds_state=True)
            if why == "failure":
                self.metrics.observe_recovery("reform", formed - started)
                self.metrics.observe_recovery("transfer", time.perf_counter() - formed)
        except Exception as exc:
            raise RescaleError(
                f"re-forming generation {old.generation} -> {world.env.generation} in place failed: "
                f"{type(exc).__name__}: {str(exc)[:300]}"
            ) from exc
        finally:
            self.guard.end()
        env = world.env
        seconds = time.perf_counter() - started
        self.metrics.observe_reconfigured(env, why, seconds, moved.nbytes)
        logger.info(
            "rescale in place (%s): generation %d -> %d, rank %d/%d -> %d/%d, step %d, %.3fs, %d state bytes "
            "sent or received",
            why,
            old.generation,
            env.generation,
            old.rank,
            old.world_size,
            env.rank,
            env.world_size,
            self.steps_done,
            seconds,
            moved.nbytes,
        )
        return moved

    def _transfer(self, holds_state: bool) -> Transferred:
        """Move the state to every rank of the new world (:func:`~pliant.worker.inplace.transfer.transfer`), then take
        its step and positions here, and the sharded engine's first snapshot in the new world."""
        rolling_back, self._rolling_back = self._rolling_back, False
        sharded = self.sharded
        self.world.moving_state(self.steps_done)
        moved = transfer(holds_state, self.steps_done, self.engines, self.loaders, self.copies, sharded, rolling_back)
        self._positions = moved.positions
        for loader in self.loaders:
            self._place(loader)
        self.steps_done = moved.step
        self.cadence.reformed(moved.step)  # every rank of the new world votes in its first step
        if sharded is not None:  # the new world's first copies, before its first step
            self._snapshot(sharded, moved.positions[: len(self.loaders)], by_step=False)
        return moved
