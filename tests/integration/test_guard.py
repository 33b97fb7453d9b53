"""The step guard on gloo (pliant.worker.guard): a rank blocked in a collective on a peer that went silent without
closing its connection is released once its agent hands over a newer generation; real gloo processes on loopback."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from pliant.progress import Directive, write_directive
from pliant.worker.guard import STALL_S

pytestmark = pytest.mark.timeout(90)

# One rank of a three-rank gloo world (collective timeout 60 s). Rank 2 meets, then goes silent without closing
# anything (as a peer behind a partition). Ranks 0 and 1 run an all-reduce, rank 0 under the step guard of generation
# 5, and report how it ended. argv: rank, store port, progress file.
_RANK = """
import sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from pliant.worker.groups import socket_fds
from pliant.worker.guard import Guard
from pliant.worker.rescale import is_peer_failure
rank, port, progress = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=timedelta(seconds=30))
before = socket_fds()
dist.init_process_group("gloo", store=store, rank=rank, world_size=3, timeout=timedelta(seconds=60))
fds = socket_fds() - before
dist.barrier()
print("met", flush=True)
if rank == 2:
    time.sleep(80)
guard = Guard(progress, nccl=False, sockets=lambda: fds)
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
"""


def test_a_step_blocked_on_a_silent_peer_breaks_once_a_newer_generation_waits(tmp_path: Path) -> None:
    store = dist.TCPStore("127.0.0.1", 0, 4, is_master=True, wait_for_workers=False)
    progress = str(tmp_path / "progress-0")
    files = [progress, str(tmp_path / "progress-1"), str(tmp_path / "progress-2")]
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK, str(rank), str(store.port), files[rank]],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(3)]
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
