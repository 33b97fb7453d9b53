"""The step guard on gloo (pliant.worker.inplace.guard): a rank blocked in a collective on a peer that went silent
without closing its connection is released once its agent hands over a newer generation; real gloo processes on
loopback."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from pliant.progress import Directive, write_directive
from pliant.worker.inplace.guard import STALL_S

pytestmark = pytest.mark.timeout(90)

# One rank of a three-rank gloo world (collective timeout 60 s). Rank 2 meets, then goes silent without closing
# anything (as a peer behind a partition). Ranks 0 and 1 run an all-reduce, rank 0 under the step guard of generation
# 5, and report how it ended. argv: rank, store port, progress file.
_RANK = """
import sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from pliant.worker.inplace.groups import retire_groups, socket_fds
from pliant.worker.session import settle_gloo_threads
from pliant.worker.inplace.guard import Guard
from pliant.worker.inplace.protocol import is_peer_failure
from pliant.worker.inplace.world import newer_directive
rank, port, progress = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=timedelta(seconds=30))
before = socket_fds()
dist.init_process_group("gloo", store=store, rank=rank, world_size=3, timeout=timedelta(seconds=60))
fds = socket_fds() - before
dist.barrier()
print("met", flush=True)
if rank == 2:
    time.sleep(80)
guard = Guard(lambda than: newer_directive(progress, than), nccl=False, sockets=lambda: fds)
guard.begin(5)
started = time.monotonic()
try:
    dist.all_reduce(torch.ones(1000))
    guard.check()
    print("completed", flush=True)
except RuntimeError as exc:
    print(f"raised after {time.monotonic() - started:.1f}s peer={is_peer_failure(exc)}: {str(exc)[:160]}",
          flush=True)
guard.end(committed=False)
print("alive", flush=True)
retire_groups()  # as Session.close does: a gloo group's destructor at interpreter exit may abort the process
settle_gloo_threads()
"""


def test_a_step_blocked_on_a_silent_peer_breaks_once_a_newer_generation_waits(tmp_path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, 4, is_master=True, wait_for_workers=False)
    progress = str(tmp_path / "progress-0")
    files = [progress, str(tmp_path / "progress-1"), str(tmp_path / "progress-2")]
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(rank), str(store.port), files[rank]],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(3)
    ]
    try:
        write_directive(progress, Directive(5, "in-place"))  # this generation's own: no reason to break
        assert ranks[0].stdout is not None and ranks[0].stdout.readline().strip() == "met"
        time.sleep(STALL_S + 0.5)  # past the rule: only a newer generation breaks the step
        assert ranks[0].poll() is None, "rank 0 ended before a newer generation came"
        handed = time.monotonic()
        write_directive(progress, Directive(6, "in-place"))
        out, _ = ranks[0].communicate(timeout=30)
        released = time.monotonic() - handed
        assert ranks[0].returncode == 0, out
        assert "alive" in out, out
        assert "peer=True" in out and "Connection closed" in out, out
        assert released < 10.0, f"released {released:.1f}s after the newer generation came (collective timeout 60 s)"
        print(f"rank 0 released {released:.2f}s after generation 6 was handed over: {out.splitlines()[-2]}")
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()


def test_a_slow_step_of_a_lone_rank_is_not_broken_when_a_newer_generation_waits(tmp_path: Path) -> None:
    """A world of one rank: nothing can block its step, so a step slowed past the rule (a newcomer starting on the
    same machine) runs to its end, and the rank re-forms at the boundary; with peers the same step is broken."""
    from pliant.worker.inplace.guard import Guard
    from pliant.worker.inplace.world import newer_directive

    progress = str(tmp_path / "progress-0")
    write_directive(progress, Directive(6, "in-place"))  # the newer generation waits from the start
    for peers in (False, True):
        guard = Guard(
            lambda than: newer_directive(progress, than), nccl=False, sockets=set
        )  # no step before this one: the rule's floor, STALL_S
        guard.begin(5, peers=peers)
        time.sleep(STALL_S + 0.5)  # a slow step, past the rule
        try:
            if peers:
                with pytest.raises(RuntimeError, match="the step guard broke the step"):
                    guard.check()
            else:
                guard.check()  # not broken
        finally:
            guard.end()


# One rank of a three-rank session (collective timeout 60 s) with an async-saving checkpoint manager. Rank 2 goes
# silent once the manager's group is made; ranks 0 and 1 start a save, whose collectives on that group then wait for
# rank 2 in DCP's thread. Then they sever the session's sockets (as a peer failure or the step guard does) and exit,
# which joins that thread. argv: rank, port, checkpoint directory.
_SAVER = """
import os, sys, time
import torch
import pliant.worker as pw
from pliant.env import WorkerEnv
from pliant.worker.inplace.groups import sever
rank, port, directory = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
session = pw.Session(env=WorkerEnv(rank=rank, local_rank=rank, world_size=3, local_world_size=3, master_port=port),
                     timeout_s=60)
engine = session.engine(torch.nn.Linear(64, 64), "ddp", torch.optim.SGD, lr=0.1)
manager = session.checkpoints(engine, directory=directory, async_save=True)
print("made", flush=True)
if rank == 2:
    time.sleep(80)
manager.save(1)
time.sleep(1.0)
sever(session.world.group_fds)
print("exiting", flush=True)
"""


def test_an_async_save_blocked_on_a_silent_peer_is_released_by_severing_the_session(tmp_path: Path) -> None:
    """The checkpoint manager's group is among the session's sockets: a leaving or failed rank's exit, which joins
    DCP's save thread, is not held until the collective timeout by a save waiting on a peer behind a partition."""
    from pliant.net import free_port

    port = free_port()
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _SAVER, str(rank), str(port), str(tmp_path / "ckpt")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(3)
    ]
    try:
        assert ranks[0].stdout is not None
        lines = []
        while "exiting" not in lines[-1:]:
            line = ranks[0].stdout.readline()
            assert line, "rank 0 ended early: " + "".join(lines)
            lines.append(line.strip())
        exiting = time.monotonic()
        ranks[0].wait(timeout=40)
        exited = time.monotonic() - exiting
        assert exited < 10.0, f"rank 0 took {exited:.1f}s to exit (the collective timeout is 60 s)"
        assert not (tmp_path / "ckpt" / "step-000000000001" / "pliant-commit.json").exists()
        print(f"rank 0 exited {exited:.2f}s after severing, with its save blocked on rank 2")
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()


# A rank whose step is blocked in something a break does not release (here a plain wait, on no socket), under the
# step guard of generation 5 with a short give-up time. argv: progress file.
_WEDGED = """
import logging, sys, threading
import pliant.worker.inplace.guard as guard
from pliant.worker.inplace.world import newer_directive
logging.basicConfig(level=logging.INFO)
guard.GIVE_UP_S = 1.0
g = guard.Guard(lambda than: newer_directive(sys.argv[1], than), nccl=False, sockets=lambda: set())
g.begin(5)
print("stepping", flush=True)
def blocked_in_the_step():
    threading.Event().wait(60)
blocked_in_the_step()
print("released", flush=True)
"""


def test_a_step_that_its_break_does_not_release_ends_the_process_with_its_stacks(tmp_path: Path) -> None:
    """The guard gives up on a broken step still blocked after GIVE_UP_S: every thread's stack on stderr, and the
    exit code the agent reports as a dead worker's (its peers re-form without it)."""
    from pliant.env import GUARD_EXIT_CODE

    progress = str(tmp_path / "progress-0")
    proc = subprocess.Popen(
        [sys.executable, "-c", _WEDGED, progress], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "stepping"
        handed = time.monotonic()
        write_directive(progress, Directive(6, "in-place"))
        out, _ = proc.communicate(timeout=30)
        ended = time.monotonic() - handed
        assert proc.returncode == GUARD_EXIT_CODE, out
        assert "released" not in out
        assert "shutting down the gloo connections of generation 5" in out, out
        assert "still blocked" in out and f"exiting with code {GUARD_EXIT_CODE}" in out, out
        assert "in blocked_in_the_step" in out, out  # the main thread's stack, as faulthandler writes it
        assert "pliant-step-guard" in out or "_give_up" in out, out  # and the guard's own thread
        assert ended < 2 * STALL_S + 5, f"ended {ended:.1f}s after the newer generation came"
        print(
            f"the wedged rank ended {ended:.2f}s after generation 6 was handed over (break at {STALL_S:g}s, "
            f"give up 1s later)"
        )
    finally:
        proc.kill()
        proc.wait()
