"""The rescale protocol, worker side: re-form in place at a step boundary, and redo a step a dead peer broke.

Under a pliant agent every engine step goes through :meth:`Protocol.step`, in this order:

1. **Boundary.** If the previous step's vote said that some rank's agent asked for a rescale, every rank reads the
   directive its agent wrote (:mod:`pliant.progress`), if any yet, and the old world agrees with one all-reduce:
   - ``restart`` on any rank: every rank saves its checkpoint managers' checkpoint (the step not yet run is not in
     it) and raises :class:`RescaleExit`; the agent starts fresh workers, which restore from disk (today's path, and
     the one for engines that cannot move in place).
   - otherwise a rank without a directive waits for it (a leaving node's agent writes one at once; the others' only
     once the coordinator published the next generation). ``leave`` (this node is not in the next generation; a
     DDP replica holds nothing the others lack) and a late ``restart`` raise :class:`RescaleExit` at once (a fresh
     worker takes the rank's place and gets its state from the others); ``in-place`` re-forms
     (:meth:`Protocol._reform` below), then the step's batch is cut again for the new world.
2. **Vote and compute**: the engine's forward and backward with their gradient collectives, then, before the optimizer
   step, the commit vote. The gradient all-reduce (DDP, ZeRO) or reduce-scatter (FSDP2) already needs every rank's
   contribution, so a rank whose collectives fail never applies the step. Some steps' vote also carries "my agent asked
   for a rescale" in one more all-reduce of three integers, issued before the forward and waited for before the
   optimizer step. Its other integers are the rank's last step time and the interval between buddy snapshots that their
   measured cost asks for: from the largest, every rank computes the same step for the next vote (about every
   :data:`~pliant.worker.cadence.VOTE_WITHIN_S`, and in the first step of a job or of a new world) and the same number
   of steps between snapshots (:mod:`pliant.worker.cadence`). A rescale starts within about that time or two steps.
3. **Commit**: the optimizer step.

**A peer dies** during 2 or 3: the collective raises on every survivor (gloo at once). The survivor drops the step's
gradients, writes ``wait`` to its progress file (its agent reports the failure, so the coordinator publishes the next
generation at once, evicting a node whose agent is unreachable), waits for its directive and re-forms. The survivors
then agree on the newest committed step: all-reduce of the steps done; the lowest rank that has the most sends its
state. A survivor whose vote failed while another's completed (the peer died inside the vote) takes the newer state, and
its step counts as done; the ranks that were ahead skip one loop iteration (their loader yields that step again), so
every rank's training loop stays in step with the others' collectives. Everyone else redoes the broken step in the new
world on the same global batch: at most one step is redone per failure.

**Re-forming** (:meth:`Protocol._reform`), the same sequence on survivors and on newcomers (fresh processes, whose
session starts in the new world): the process group is re-initialised on the new generation's store; every rank says
whether it holds state (one all-reduce; a newcomer's session does it in ``init``); each engine is wrapped again (without
DDP's broadcast of rank 0's parameters: rank 0 may be a newcomer, as when a node that held rank 0 comes back) and each
checkpoint manager opens its group again, in the order the script made them; then the state is sent from the source
rank: the step, each loader's cursor, the parameters, the optimizer's state and hyperparameters, and the RNG state. Only
tensors cross ranks. A newcomer takes part from ``CheckpointManager.restore`` or the start of the loader's iteration,
whichever comes first, so a script's setup between ``init`` and its loop must not run collectives of its own.

Anything that fails while re-forming raises, so the worker exits with an error; its agent reports it and the next
generation starts fresh workers that restore from disk. That is the way back.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pliant.env import RESCALE_EXIT_CODE, RESCALE_SIGNAL, WorkerEnv
from pliant.progress import Directive, announce_in_place, announce_signal, read_directive
from pliant.worker.buddy import BuddyCopies, choose_rollback, decode, encode
from pliant.worker.cadence import Cadence
from pliant.worker.contract import Engine, GlobalBatch, LossFn, Staged, WorkerError
from pliant.worker.engines import sync_scheduler
from pliant.worker.groups import RendezvousWatch, announce_arrival, retire_groups, sever
from pliant.worker.guard import Guard, NoGuard

if TYPE_CHECKING:
    from pliant.worker.checkpoint import CheckpointManager
    from pliant.worker.data import ElasticLoader
    from pliant.worker.session import Session

__all__ = [
    "DIRECTIVE_WAIT_S",
    "MEET_S",
    "Protocol",
    "RescaleError",
    "RescaleExit",
    "is_peer_failure",
]

logger = logging.getLogger(__name__)

DIRECTIVE_WAIT_S = 600.0  # the agent's start timeout watches a worker waiting in the "wait" phase
MEET_S = 30.0  # survivors re-forming in place meet within this; see Protocol.form_group


class RescaleError(WorkerError):
    """Re-forming in place failed; the worker exits and its agent takes the restart path."""


class RescaleExit(SystemExit):
    """Raised by ``engine.step`` at a step boundary when this rank leaves the job (its node is not in the next
    generation) or its agent asked for the restart path (after the checkpoint was saved). It is the only place
    pliant.worker ends a script: let it propagate; the process exits with :data:`pliant.env.RESCALE_EXIT_CODE`, which
    the agent expects."""

    def __init__(self, why: str) -> None:
        super().__init__(RESCALE_EXIT_CODE)
        self.why = why


def is_peer_failure(exc: BaseException) -> bool:
    """True for a collective that failed because a peer went away (gloo's transport errors, torch's DistError)."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        mark in text for mark in ("gloo", "Connection reset", "Connection closed", "Broken pipe", "NCCL")
    )


class Protocol:
    """One worker's side of the rescale protocol (see the module docstring). Made by the session under an agent.

    Args:
        session: the worker's session (its env, backend, metrics; it registers engines, loaders and managers here).
        rescale_in_place: the agent runs in-place rescales (``--rescale in-place``); False keeps only the restart
            path.
    """

    def __init__(self, session: Session, rescale_in_place: bool) -> None:
        self.session = session
        self.rescale_in_place = rescale_in_place
        self.asked = False
        self.boundary_due = False
        self.pending_sync = False
        self.steps_done = 0
        self.cadence = Cadence(session.env.snapshot_every)  # the steps of the votes and of the buddy snapshots
        self.parts: list[Engine | CheckpointManager] = []  # in the order the script made them
        self.loaders: list[ElasticLoader] = []
        self._positions: list[list[int]] | None = None  # each loader's (epoch, cursor, step) from the last sync
        self.copies = BuddyCopies(session.tracked, session.metrics, session.env.kept_dir)  # (worker.buddy, kept)
        self._rolling_back = False
        self.failed_between = ""  # a collective between steps failed (failed_between_steps); the next step re-forms
        self.exited = ""  # why a RescaleExit ended this rank (leave, restart); a later step is the script's error
        # A step that a dead or cut-off peer blocks is broken by the step guard (pliant.worker.guard).
        nccl, fds = session.backend == "nccl", lambda: session.group_fds
        self.guard = Guard(session.env.progress_file, nccl, fds) if rescale_in_place else NoGuard()
        if threading.current_thread() is threading.main_thread():
            signal.signal(RESCALE_SIGNAL, self._on_signal)
            # Python puts the default action (death) back as it exits: a script past its last step would die of a
            # signal its agent sent, and count as failed. Ignored from the start of the interpreter's exit.
            atexit.register(signal.signal, RESCALE_SIGNAL, signal.SIG_IGN)
            announce_signal(session.env.progress_file)  # the agent asks this worker to rescale with the signal
        if rescale_in_place:  # the agent may now hand this worker its next generation (an engine that cannot move
            announce_in_place(session.env.progress_file)  # in place makes the boundary take the restart path instead)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.asked = True

    def _exit(self, why: str) -> RescaleExit:
        """The exception that ends this rank's part in the job (``leave``, ``restart``); remembered, so that a script
        that swallows it and steps again gets a clear error instead of a rank that trains outside any world."""
        self.exited = why
        return RescaleExit(why)

    @property
    def engines(self) -> list[Engine]:
        return [p for p in self.parts if isinstance(p, Engine)]

    @property
    def managers(self) -> list[CheckpointManager]:
        return [p for p in self.parts if not isinstance(p, Engine)]

    @property
    def sharded(self) -> Engine | None:
        """The one sharded engine whose buddy copies this protocol keeps (None: none, or more than one)."""
        sharded = [e for e in self.engines if e.sharded]
        return sharded[0] if self.rescale_in_place and len(sharded) == 1 else None

    def _recoverable(self, engine: Engine) -> bool:
        """A peer's death costs only a step (replicas) or the steps since the last snapshot (buddy copies)."""
        return self.rescale_in_place and (engine.survives_peer_loss or (engine is self.sharded and self.copies.taken))

    # -- joining a world -----------------------------------------------------------------------------------------------

    def add_loader(self, loader: ElasticLoader) -> None:
        """Register a loader the session made: it is re-cut on every re-formation (and, made by a newcomer after its
        state came from peers, starts at the position they sent)."""
        self.loaders.append(loader)
        loader.on_start = self.sync_pending
        if self._positions is not None:
            self._place(loader)

    def _place(self, loader: ElasticLoader) -> None:
        index = self.loaders.index(loader)
        loader.moved(dist.get_rank(), dist.get_world_size())
        if self._positions is not None and index < len(self._positions):
            loader.load_position(*self._positions[index])

    def exchange(self, holds_state: bool) -> bool:
        """Every rank of the new world says whether it holds training state (collective). True if any does."""
        flag = torch.tensor([int(holds_state)], dtype=torch.int64, device=self.session.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def joined(self) -> None:
        """A fresh worker's session opened its world: if survivors hold state, take it from them before training."""
        if self.rescale_in_place:
            self.pending_sync = self.exchange(holds_state=False)
            if self.pending_sync:
                logger.info("rank %d joins a running world: its state comes from its peers", dist.get_rank())

    def sync_pending(self) -> int | None:
        """A newcomer's state from its peers, once (the loader's start or ``CheckpointManager.restore``). Returns the
        step it resumes at, or None when nothing came from peers."""
        if not self.pending_sync:
            return None
        self.pending_sync = False
        started = time.perf_counter()
        nbytes, _behind, _ahead = self._sync(holds_state=False)
        self.session.metrics.state_sync_bytes.inc(nbytes)
        logger.info(
            "rank %d: state of step %d received from peers in %.2fs (%d bytes)",
            dist.get_rank(),
            self.steps_done,
            time.perf_counter() - started,
            nbytes,
        )
        return self.steps_done

    # -- every step ----------------------------------------------------------------------------------------------------

    def step(self, engine: Engine, batch: GlobalBatch, loss_fn: LossFn) -> float:
        """One engine step under the protocol (see the module docstring).

        Raises:
            RescaleExit: this rank leaves, or takes the restart path.
            RescaleError: the script caught an earlier :class:`RescaleExit` and stepped again.
        """
        if self.exited:
            raise RescaleError(
                f"engine.step was called after RescaleExit ({self.exited!r}) ended this rank's part in the job: the "
                f"script caught it (an `except SystemExit`, `except BaseException` or bare `except:` around the "
                f"loop); let RescaleExit propagate, so that the process exits and the next generation forms"
            )
        self.session.setup_window.close()  # the loop has begun: the script's own collectives are its business
        self.cadence.tick(batch.step, time.perf_counter(), time.process_time())
        self.sync_pending()
        if self.failed_between:  # a collective between steps failed: re-form before this step, as if it broke
            logger.warning(
                "rank %d: a peer failed before step %d (%s); waiting for the next generation",
                self.session.env.rank,
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
            self.guard.begin(self.session.env.generation, peers=self.session.env.world_size > 1)
            try:
                vote = self._vote() if batch.step >= self.cadence.next_vote else None  # runs while the step computes
                loss = engine.forward_backward(batch, loss_fn)
                self.guard.check()  # the step's collectives completed on every rank, or raise
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
                engine.discard_update()
                logger.warning(
                    "rank %d: a peer failed during step %d (%s); waiting for the next generation",
                    self.session.env.rank,
                    batch.step,
                    failure,
                )
                if not self._recover(batch):
                    return 0.0  # this step was committed elsewhere (and is in the state received), or skipped
                continue
            engine.observe(batch, started)
            self.boundary_due = asked
            return loss

    def failed_between_steps(self, exc: BaseException) -> bool:
        """A collective the session ran between steps failed (``Session.all_reduce_sum``). True when it is a peer
        failure the next step recovers from (it re-forms first); the peers still blocked in it are woken now."""
        if not (self.engines and all(self._recoverable(e) for e in self.engines) and is_peer_failure(exc)):
            return False
        self.failed_between = str(exc).splitlines()[0][:200]
        self.session.metrics.progress.write(self.steps_done, "wait", self.session.env.generation)
        sever(self.session.group_fds)
        return True

    def guarded(self, collective: Callable[[], object]) -> None:
        """Run a collective of the session's between steps under the step guard."""
        self.guard.begin(self.session.env.generation, peers=self.session.env.world_size > 1)
        try:
            collective()
            self.guard.check()
        finally:
            self.guard.end()

    def _snapshot(self, engine: Engine, positions: list[tuple[int, int, int]], by_step: bool = True) -> None:
        """Copy this rank's shard at the step just committed and send it to its buddy, in the background."""
        env = self.session.env
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
            env = self.session.env
            directive = read_directive(env.progress_file) if env.progress_file else None
            self.asked = directive is not None and directive.generation > env.generation
        flag = torch.tensor([int(self.asked), *self.cadence.ballot()], dtype=torch.int32)  # on NCCL too: gloo
        return dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag  # type: ignore[return-value]

    def _counted(self, vote: tuple[dist.Work, torch.Tensor], step: int) -> bool:
        """Wait for the commit vote of ``step`` and set the next vote's step and K; returns "a rescale was asked"
        (raises when a peer failed)."""
        started = time.perf_counter()
        work, flag = vote
        work.wait()
        self.session.metrics.observe_collective("control", time.perf_counter() - started)
        self.cadence.agreed(step, int(flag[1]), int(flag[2]))  # all-reduced: the same on every rank
        if self.sharded is not None:
            self.session.metrics.snapshot_every.set(self.cadence.every)
        return bool(flag[0])

    # -- the step boundary ---------------------------------------------------------------------------------------------

    def _boundary(self, engine: Engine, batch: GlobalBatch) -> bool:
        """The step boundary (see the module docstring). Returns whether to run ``batch`` (False only when a peer
        failed during the old world's part of it and the recovery says so, as in :meth:`_recover`)."""
        self.boundary_due = False
        self.asked = False
        env = self.session.env
        self.guard.begin(None)
        directive = read_directive(env.progress_file) if env.progress_file else None
        if directive is not None and directive.generation <= env.generation:
            directive = None  # an old one; this rank's agent has not written its next yet
        movable = self.rescale_in_place and all(e.can_move() for e in self.engines)
        restart = (directive is not None and directive.mode == "restart") or not movable
        flag = torch.tensor([int(restart)], dtype=torch.int64)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # the old world, if whole: a restart anywhere is for everyone
            for loader in self.loaders:
                loader.rewind(batch)  # the step not run yet belongs to the next world
            if flag.item():
                for manager in self.managers:
                    stall = manager.save(batch.step, sync=True)
                    logger.info("rescale (restart path): step %d checkpointed in %.2fs", batch.step, stall)
                raise self._exit("restart")
            for manager in self.managers:
                manager.wait()  # its group is about to be retired
            for part in self.engines:
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
            directive = self._await_directive()
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
        self.session.metrics.progress.write(batch.step, "wait", self.session.env.generation)
        for manager in self.managers:
            manager.abandon()
        sever(self.session.group_fds)  # wakes the peers still blocked in a collective with this rank
        directive = self._await_directive()
        if directive.mode != "in-place":
            raise self._exit(directive.mode)
        for loader in self.loaders:
            loader.rewind(batch)
        committed = self.steps_done
        behind, ahead = self._reform(directive, "failure")
        if self.steps_done < committed:
            self.session.metrics.steps_redone.inc(committed - self.steps_done)
            logger.info(
                "rank %d: committed steps %d-%d run again", self.session.env.rank, self.steps_done, committed - 1
            )
        if behind:
            logger.info(
                "rank %d: step %d was committed by peers; taking their state", self.session.env.rank, batch.step
            )
            batch.micro_batches, batch.micro_sizes = [], []
            return False
        if ahead:
            logger.info(
                "rank %d: step %d is skipped once so every rank's loop stays in step", self.session.env.rank, batch.step
            )
            batch.micro_batches, batch.micro_sizes = [], []
            return False
        self._refetch(batch)
        return True

    def _refetch(self, batch: GlobalBatch) -> None:
        if batch.source is not None:
            batch.source.refetch(batch)

    def _await_directive(self) -> Directive:
        """This worker's directive for a generation newer than its own (its agent writes it, maybe after this rank
        got here).

        Raises:
            RescaleError: none came within :data:`DIRECTIVE_WAIT_S`.
        """
        env = self.session.env
        deadline = time.monotonic() + DIRECTIVE_WAIT_S
        while time.monotonic() < deadline:
            directive = read_directive(env.progress_file) if env.progress_file else None
            if directive is not None and directive.generation > env.generation:
                return directive
            time.sleep(0.005)
        raise RescaleError(
            f"no directive for a generation after {env.generation} within {DIRECTIVE_WAIT_S:g}s "
            f"(from the agent, in {env.progress_file}.next)"
        )

    # -- re-forming ----------------------------------------------------------------------------------------------------

    def _reform(self, directive: Directive, why: str) -> tuple[bool, bool]:
        """Leave the old world and join ``directive``'s with this rank's state; returns (behind, ahead) as
        :meth:`_sync` does. A newer generation handed over before the state moves (the ranks met, but a peer or the
        store went away while they opened their groups) is formed instead.

        Raises:
            RescaleError: any step failed (the worker exits; its agent takes the restart path).
        """
        self.copies.finish(check=False)  # a snapshot's copy still running: done before the state changes
        started = time.perf_counter()
        old = self.session.env
        env = WorkerEnv.from_env({**os.environ, **directive.env})
        self._rolling_back = why == "failure" and self.sharded is not None
        try:
            while True:
                retire_groups()
                os.environ.update(directive.env)
                self.session.env = env
                self.form_group(survivor=True)
                env = self.session.env  # a newer generation's, if the agent handed one over while the ranks met
                self.guard.begin(env.generation, peers=env.world_size > 1)  # the new world's communicator
                try:
                    self.exchange(holds_state=True)
                    for part in self.parts:
                        if isinstance(part, Engine):
                            part.rewrap()
                        else:
                            self.session.tracked(lambda: part.reopen(env.generation))  # noqa: B023 (run now)
                    break
                except Exception as exc:
                    newer = read_directive(env.progress_file) if env.progress_file else None
                    if newer is None or newer.generation <= env.generation or newer.mode != "in-place":
                        raise
                    logger.warning(
                        "rank %d: generation %d gave way to generation %d as its groups opened (%s); forming that one",
                        env.rank,
                        env.generation,
                        newer.generation,
                        str(exc).splitlines()[0][:200],
                    )
                    directive, env = newer, WorkerEnv.from_env({**os.environ, **newer.env})
            nbytes, behind, ahead = self._sync(holds_state=True)
        except Exception as exc:
            raise RescaleError(
                f"re-forming generation {old.generation} -> {env.generation} in place failed: "
                f"{type(exc).__name__}: {str(exc)[:300]}"
            ) from exc
        finally:
            self.guard.end()
        seconds = time.perf_counter() - started
        self.session.metrics.observe_reconfigured(env, why, seconds, nbytes)
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
            nbytes,
        )
        return behind, ahead

    def form_group(self, survivor: bool = False) -> None:
        """Initialise the process group of the session's generation. If the agent hands over a newer generation while
        its ranks are still meeting (one of them died or was evicted before the others met it, and would be waited for
        until the timeout), abandon it: the sockets the rendezvous opened are shut down, which fails its wait, and
        the newer generation is formed instead. A ``survivor`` (re-forming in place) meets within :data:`MEET_S`; if
        its generation's ranks do not all meet by then, it waits in place, like a survivor of a failed step, for the
        next generation that its agent's failure report brings.

        Raises:
            RescaleExit: the newer generation's directive is ``leave`` or ``restart``.
        """
        while True:
            env = self.session.env
            watch = RendezvousWatch(env.progress_file, env.generation)
            try:
                self.session.init_group(watch.superseded, MEET_S if survivor else None)
            except Exception as exc:
                directive = watch.finish()
                if directive is None:
                    if not survivor:
                        raise
                    logger.warning(
                        "rank %d: generation %d's ranks did not all meet (%s: %s); waiting in place for the "
                        "next generation",
                        env.rank,
                        env.generation,
                        type(exc).__name__,
                        str(exc).splitlines()[0][:200],
                    )
                    self.session.metrics.progress.write(self.steps_done, "wait", env.generation)
                    directive = self._await_directive()
            else:
                directive = watch.finish()
                if directive is None:
                    return
            logger.warning(
                "rank %d: generation %d gave way to generation %d before its ranks met; forming that one",
                env.rank,
                env.generation,
                directive.generation,
            )
            retire_groups()
            if directive.mode != "in-place":
                raise self._exit(directive.mode)
            os.environ.update(directive.env)
            self.session.env = WorkerEnv.from_env({**os.environ, **directive.env})
            if not survivor:  # the survivors' agents wait for the newcomers to count themselves in this one too
                try:
                    announce_arrival(self.session.env, timeout_s=5.0)
                except RuntimeError as exc:  # they then wait their rescale grace instead
                    logger.warning(
                        "rank %d: could not count in generation %d: %s",
                        self.session.env.rank,
                        self.session.env.generation,
                        str(exc).splitlines()[0][:200],
                    )

    def _sync(self, holds_state: bool) -> tuple[int, bool, bool]:
        """Agree on the newest committed step and send the state of the lowest rank that has it to every rank
        (collective). Returns (tensor bytes moved here, this rank was behind, some rank was behind)."""
        world = dist.get_world_size()
        old_world = self.copies.world if holds_state else 0
        wanted = torch.tensor([int(self._rolling_back), old_world], dtype=torch.int64)
        dist.all_reduce(wanted, op=dist.ReduceOp.MAX)  # a survivor of a sharded engine's failure asks to roll back
        self._rolling_back = False
        received = self._roll_back(holds_state, int(wanted[1])) if wanted[0] else 0
        mine = self.steps_done if holds_state else -1
        span = torch.tensor([mine, -mine if holds_state else -(2**62)], dtype=torch.int64)
        dist.all_reduce(span, op=dist.ReduceOp.MAX)
        newest, oldest = int(span[0]), -int(span[1])
        if newest < 0:
            raise RescaleError("no rank of the new world holds training state; the restart path applies")
        candidate = torch.tensor([dist.get_rank() if mine == newest else world], dtype=torch.int64)
        dist.all_reduce(candidate, op=dist.ReduceOp.MIN)
        src = int(candidate.item())
        position = torch.tensor([[*loader.position()] for loader in self.loaders] or [[0, 0, 0]], dtype=torch.int64)
        dist.broadcast(position, src)
        nbytes = received + sum(engine.sync_state(src) + sync_scheduler(engine, src) for engine in self.engines)
        rng = torch.get_rng_state()
        dist.broadcast(rng, src)
        if not holds_state:  # survivors keep their own streams; a newcomer continues the source's
            torch.set_rng_state(rng)
        self._positions = position.tolist()
        for loader in self.loaders:
            self._place(loader)
        behind = holds_state and mine < newest
        self.steps_done = newest
        self.cadence.reformed(newest)  # every rank of the new world votes in its first step
        sharded = self.sharded
        if sharded is not None:  # the new world's first copies, before its first step
            positions = [tuple(p) for p in self._positions][: len(self.loaders)]
            self._snapshot(sharded, positions, by_step=False)  # type: ignore[arg-type]
        return nbytes, behind, holds_state and oldest < newest and not behind

    def _roll_back(self, holds_state: bool, old_world: int) -> int:
        """Every rank of the new world takes the sharded engine's state at the newest snapshot step that every old
        shard's holder has (:func:`pliant.worker.buddy.choose_rollback`); survivors also take that step's loader
        positions and RNG state. Collective. Returns the bytes received.

        Raises:
            RescaleError: no snapshot covers every shard (the restart path applies).
        """
        engine = self.sharded
        if engine is None:
            raise RescaleError("a roll back was asked, but this rank has no single sharded engine")
        held = self.copies.held() if holds_state else self.copies.adopt()  # a fresh worker: what its predecessor kept
        mine = encode(held, old_world)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine)
        plan = choose_rollback([decode(row, old_world) for row in rows], old_world)
        survivor = min(plan.holders.values())
        partition = torch.tensor(
            self.copies.partition if dist.get_rank() == survivor else [0] * len(list(engine.module.parameters())),
            dtype=torch.int64,
        )
        dist.broadcast(partition, survivor)
        me = dist.get_rank()

        def receive(old: int, nbytes: int) -> torch.Tensor:
            holder = plan.holders[old]
            buffer = self.copies.buffer(old, plan.step) if me == holder else torch.empty(nbytes, dtype=torch.uint8)
            if buffer.numel() != nbytes:
                raise RescaleError(f"the copy of old rank {old}'s shard has {buffer.numel()} bytes, not {nbytes}")
            if nbytes:
                dist.broadcast(buffer, holder)
            return buffer

        slot = self.copies.slot(plan.step) if holds_state else None
        nbytes = engine.rebuild(partition.tolist(), receive, slot.hyper if slot else None)
        if slot is not None:
            if slot.scheduler is not None:  # the learning rates of the redone steps
                engine.scheduler.load_state_dict(slot.scheduler)
            for loader, position in zip(self.loaders, slot.positions, strict=False):
                loader.load_position(*position)
            assert slot.rng is not None
            torch.set_rng_state(slot.rng)
            self.steps_done = plan.step
        logger.info(
            "rank %d: rolled back to the snapshot of step %d (the old ranks' shards from new ranks %s)",
            me,
            plan.step,
            sorted(set(plan.holders.values())),
        )
        return nbytes
