"""A node's worker processes for one generation: start them with the env contract, watch them, stop them.

Each worker runs in its own session (its own process group), so stopping it signals every process it started
(DataLoader workers included): SIGTERM, a bounded grace, then SIGKILL of the whole group, then a bounded wait. Each
worker is also started through :mod:`pliant.spawn`, so it dies with the agent even if the agent is killed with -9.
Output is prefixed with the global rank on the console and, with a log directory, written to one file per worker.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from pliant.agent.contract import GroupResult
from pliant.env import WorkerEnv
from pliant.spawn import die_with_parent

__all__ = ["WorkerGroup"]

logger = logging.getLogger(__name__)

_console_lock = threading.Lock()


class _Worker:
    def __init__(self, env: WorkerEnv, proc: subprocess.Popen[bytes], log: IO[bytes] | None) -> None:
        self.env = env
        self.proc = proc
        self.log = log
        self.pump = threading.Thread(target=self._pump, name=f"output rank {env.rank}", daemon=True)
        self.pump.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        prefix = f"[{self.env.rank}]:".encode()
        out = sys.stdout.buffer
        for line in iter(self.proc.stdout.readline, b""):
            if self.log is not None:
                self.log.write(line)
                self.log.flush()
            with _console_lock:
                out.write(prefix + line)
                out.flush()
        self.proc.stdout.close()
        if self.log is not None:
            self.log.close()


class WorkerGroup:
    """The workers of one generation on this node.

    Args:
        generation: the generation number.
        envs: one WorkerEnv per local worker.
        command: the worker command (interpreter included).
        log_dir: directory for ``rank-<r>.log`` files (None: console only).
        base_env: the environment the workers inherit (default: the agent's).
    """

    def __init__(
        self,
        generation: int,
        envs: Sequence[WorkerEnv],
        command: Sequence[str],
        log_dir: Path | None = None,
        base_env: Mapping[str, str] | None = None,
    ) -> None:
        self.generation = generation
        self.envs = list(envs)
        self.command = list(command)
        self.log_dir = log_dir
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.workers: list[_Worker] = []
        self.started_at = 0.0
        self._stopped = False

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    def start(self) -> None:
        """Start every worker. Call from a thread that outlives the workers (see :mod:`pliant.spawn`)."""
        self.started_at = time.monotonic()
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        for env in self.envs:
            child_env = {**self.base_env, **env.to_env(), "PYTHONUNBUFFERED": "1"}
            log = open(self.log_dir / f"rank-{env.rank}.log", "ab") if self.log_dir else None  # noqa: SIM115
            proc = subprocess.Popen(
                die_with_parent(self.command),
                env=child_env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self.workers.append(_Worker(env, proc, log))
        logger.info(
            "generation %d: started %d workers (ranks %s, pids %s)",
            self.generation, len(self.workers), [w.env.rank for w in self.workers], self.pids,
        )  # fmt: skip

    def poll(self) -> GroupResult | None:
        """The group's result once it is over: any worker failed, or all exited. None while it runs."""
        codes = {w.env.local_rank: w.proc.poll() for w in self.workers}
        exited = {rank: code for rank, code in codes.items() if code is not None}
        if not exited:
            return None
        if len(exited) == len(codes) or any(code != 0 for code in exited.values()):
            return GroupResult(self.generation, exited, stopped=self._stopped)
        return None

    def stop(self, grace_s: float) -> GroupResult:
        """SIGTERM every worker's process group, SIGKILL what is left after ``grace_s``, and reap them all."""
        self._stopped = True
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(w.proc.poll() is None for w in self.workers):
            time.sleep(0.02)
        self._signal_all(signal.SIGKILL)
        for worker in self.workers:
            try:
                worker.proc.wait(10)
            except subprocess.TimeoutExpired:
                logger.error("worker pid %d did not die after SIGKILL", worker.proc.pid)
            worker.pump.join(2)
        codes = {w.env.local_rank: w.proc.returncode for w in self.workers}
        logger.info("generation %d: workers stopped (exit codes %s)", self.generation, codes)
        return GroupResult(self.generation, codes, stopped=True)

    def _signal_all(self, sig: int) -> None:
        for worker in self.workers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(worker.proc.pid, sig)  # the worker leads its own session and process group
