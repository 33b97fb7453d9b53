"""Does a gloo send that waits behind a full socket buffer wake when its peer dies? (It did not in torch 2.13.)

The survivor that the step guard cannot free (docs/architecture.md, "A break that releases nothing ends the
process") waits in gloo's ``UnboundBuffer::waitSend``. Reading gloo's TCP transport (``tcp/pair.cc``): a send whose
bytes do not all fit the socket's buffer stays queued on its pair (``tx_``) until the socket drains; when the pair
fails, ``Pair::signalException`` wakes the queued sends of bound buffers only (``op.buf``), not those of unbound
buffers (``op.ubuf``: every ``send`` / ``isend`` and the ring all-reduce's sends), and a write that meets ``EPIPE``
or ``ECONNRESET`` in async mode returns without an error. Such a send then waits for the group's timeout.

This script checks it with two plain gloo processes and no pliant: the receiver posts its receive and stops itself
(SIGSTOP, so it reads nothing), the sender sends ``--bytes``, and the receiver is killed (SIGKILL) 3 s later. A send
that fits the socket buffers completes at once; a larger one should fail as soon as its peer is gone. Prints how the
send ended and when, relative to the kill.

Usage: ``.venv/bin/python bench/gloo_queued_send.py [--bytes 67108864] [--timeout 20]`` (about ``--timeout`` s)
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist


def _rank(rank: int, nbytes: int, port: int, timeout_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=timeout_s))
    if rank == 1:
        dist.irecv(torch.empty(nbytes, dtype=torch.uint8), src=0)
        dist.barrier()
        os.kill(os.getpid(), signal.SIGSTOP)  # reads nothing from now on
        time.sleep(3600)
    dist.barrier()
    time.sleep(1.0)  # the receiver has stopped
    work = dist.isend(torch.ones(nbytes, dtype=torch.uint8), dst=1)
    print(f"posted {time.time():.3f}", flush=True)
    try:
        work.wait()
        print(f"completed {time.time():.3f}", flush=True)
    except RuntimeError as exc:
        print(f"raised {time.time():.3f} {str(exc).splitlines()[0][:160]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bytes", type=int, default=64 << 20)
    parser.add_argument("--timeout", type=float, default=20.0, help="the process group's timeout, s")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        _rank(args.rank, args.bytes, args.port, args.timeout)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, __file__, "--bytes", str(args.bytes), "--timeout", str(args.timeout), "--port", str(port)]
    receiver = subprocess.Popen([*argv, "--rank", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sender = subprocess.Popen([*argv, "--rank", "0"], stdout=subprocess.PIPE, text=True)
    try:
        assert sender.stdout is not None
        posted = sender.stdout.readline()
        if not posted.startswith("posted"):
            raise SystemExit(f"the sender did not post its send: {posted!r}")
        time.sleep(3.0)
        receiver.kill()
        killed = time.time()
        ended = sender.stdout.readline().strip().split(maxsplit=2)
        sender.wait(args.timeout + 30)
    finally:
        for proc in (receiver, sender):
            proc.kill()
            proc.wait()
    how, when = ended[0], float(ended[1])
    print(
        f"a send of {args.bytes} bytes to a peer killed 3 s after it was posted: {how} {when - killed:.2f} s after "
        f"the kill{': ' + ended[2] if len(ended) > 2 else ''} (process group timeout {args.timeout:g} s)"
    )


if __name__ == "__main__":
    main()
