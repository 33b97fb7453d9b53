"""A node's worker processes for one generation: start them with the env contract, watch them, stop them.

Workers are forked by the node's :class:`Zygote`, which imported torch once, so a new generation starts in a fraction
of a second instead of paying an interpreter and a torch import per worker; a cold start (a new interpreter) is the
fallback (``--no-python``, or no zygote). Each worker runs in its own session (its own process
group), so stopping it signals every process it started (DataLoader workers included): SIGTERM, a bounded grace,
then SIGKILL of the whole group, then a bounded wait. Each is started through :mod:`pliant.spawn`, so it dies with the
agent even if the agent is killed with -9. Output is prefixed with the global rank on the console and, with a log
directory, written to one file per worker.
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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO

from pliant.agent import ipc
from pliant.agent.contract import AgentError, GroupResult
from pliant.agent.hints import Hints
from pliant.agent.preload import Preload
from pliant.agent.storehost import StoreHost
from pliant.env import RESCALE_EXIT_CODE, RESCALE_SIGNAL, STACKS_SIGNAL, WorkerEnv
from pliant.progress import Directive, in_place_ready, read_directive, read_record, takes_signal, write_directive
from pliant.spawn import alive as process_alive
from pliant.spawn import die_with_parent
from pliant.statusline import write_output

__all__ = ["ForkedProc", "WorkerCommand", "WorkerGroup", "Zygote", "worker_base_env"]

logger = logging.getLogger(__name__)

_hints = Hints()  # the hints this agent said about its workers' output (each once)
HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"  # torch's switch (c10's CPU allocator): madvise(MADV_HUGEPAGE) on >= 2 MB
AGENT_SECRETS = ("PLIANT_JOIN_TOKEN", "PLIANT_SEAT_KEY")  # the agent's credentials: never in a worker's environment


def worker_base_env(nproc_per_node: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment workers inherit: the agent's, unbuffered, (like torchrun) one OpenMP thread per worker when
    several share the node and the user did not choose, and torch's host tensors of 2 MB or more on transparent huge
    pages (``THP_MEM_ALLOC_ENABLE=1``, unless the user set it; ``0`` turns it off). With 4 KB pages, the first touch
    of a large fresh buffer (DDP's gradient buckets after a re-wrap, state received from peers) faults every page:
    with the 1 GB model of ``bench/inplace.py`` the steps ran about 20 % faster and a join's pause was 25 % shorter
    on huge pages. The zygote gets it too: torch reads it once per process, and the workers are forked from it.
    The agent's own credentials (:data:`AGENT_SECRETS`: the join token, the seat key) are left out: a worker runs the
    user's code, and needs neither."""
    env = {k: v for k, v in (os.environ if environ is None else environ).items() if k not in AGENT_SECRETS}
    env["PYTHONUNBUFFERED"] = "1"
    if nproc_per_node > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = "1"
    env.setdefault(HUGE_PAGES_ENV, "1")
    return env


@dataclass(frozen=True)
class WorkerCommand:
    """What a worker runs: a script with arguments, a module (``-m``), or any command (``no_python``)."""

    argv: tuple[str, ...]
    module: bool = False
    no_python: bool = False

    @classmethod
    def from_launch(cls, command: Sequence[str], no_python: bool) -> WorkerCommand:
        if no_python:
            return cls(tuple(command), no_python=True)
        if command and command[0] == "-m":
            return cls(tuple(command[1:]), module=True)
        return cls(tuple(command))

    def cold(self) -> list[str]:
        """The command line of a worker started from scratch."""
        if self.no_python:
            return list(self.argv)
        return [sys.executable, "-u", *(["-m"] if self.module else []), *self.argv]


def _kill_group(proc: subprocess.Popen[bytes] | ForkedProc, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)  # each worker leads its own session and process group


class ForkedProc:
    """A worker forked by the zygote, with the part of ``subprocess.Popen``'s interface the group uses."""

    def __init__(self, pid: int, stdout: IO[bytes], zygote: Zygote) -> None:
        self.pid = pid
        self.stdout = stdout
        self._zygote = zygote
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode


Proc = subprocess.Popen[bytes] | ForkedProc


class Zygote:
    """The agent's handle on its fork server (:mod:`pliant.agent.zygote`): it imports torch once, and every worker
    of every generation is forked from it. Start it from the thread that outlives the workers (see
    :mod:`pliant.spawn`).

    Args:
        base_env: the zygote's environment (what workers inherit before their own variables).
        preload: what the training script imports, for the zygote to import after torch (None: torch only).
    """

    def __init__(self, base_env: Mapping[str, str], preload: Preload | None = None) -> None:
        self.base_env = dict(base_env)
        self._started = time.monotonic()
        self._sock, theirs = ipc.pair()
        stores, host_end = StoreHost.pair()
        fds = [theirs.fileno(), host_end.fileno()]
        argv = [sys.executable, "-u", "-m", "pliant.agent.zygote", *map(str, fds)]
        if preload is not None and preload.imports:
            argv += ["--preload", preload.to_json()]
        if preload is not None and preload.source != "script":  # the script's own list is logged once imported
            named = ", ".join(i.module for i in preload.imports) or "nothing"
            logger.info("worker zygote: preloading torch and %s (%s)", named, preload.source)
        self.proc = subprocess.Popen(
            die_with_parent(argv), env=self.base_env, stdin=subprocess.DEVNULL, pass_fds=fds, start_new_session=True
        )
        theirs.close()
        host_end.close()
        self.stores = StoreHost(stores)  # the node's store host, which the zygote forks once torch is imported
        self.stores_pid: int | None = None
        self.ready = False  # its preload imported: it forks at once (set by the reader thread)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._pids: dict[int, int] = {}
        self._exits: dict[int, int] = {}
        self._next_id = 0
        self._reader = threading.Thread(target=self._read, name="zygote", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            message, _fds = ipc.receive(self._sock)
            with self._changed:
                if message is None:
                    self._changed.notify_all()
                    return
                if "exit" in message:
                    self._exits[message["exit"]] = message["code"]
                elif "stores" in message:
                    self.stores_pid = message["stores"]
                    self._log_import("torch.distributed imported and the store host forked")
                elif "ready" in message:
                    self.ready = True
                    modules = message.get("preloaded") or []
                    script = f" and {len(modules)} of the script's modules ({', '.join(modules)})" if modules else ""
                    self._log_import(f"torch{script} imported: ready to fork workers")
                elif "skipped" in message:
                    logger.info(
                        "worker zygote: not preloading %s: %s; each worker imports it itself",
                        message["skipped"],
                        message["why"],
                    )
                elif "id" in message:
                    self._pids[message["id"]] = message["pid"]
                self._changed.notify_all()

    def _log_import(self, what: str) -> None:
        """Log a step of the zygote's start with the host's load: a slow torch import on a busy host is what delays
        a restarted node's join (its store host) and its first workers."""
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        logger.info(
            "worker zygote (pid %d): %s %.1fs after its start (load average %.1f on %d CPUs)",
            self.proc.pid,
            what,
            time.monotonic() - self._started,
            load,
            os.cpu_count() or 0,
        )

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until the zygote imported its preload (or exited, or ``timeout_s`` passed); returns whether it did."""
        with self._changed:
            self._changed.wait_for(lambda: self.ready or not self.alive, timeout_s)
            return self.ready

    def spawn(self, env: Mapping[str, str], command: WorkerCommand, timeout_s: float = 120.0) -> ForkedProc:
        """Fork a worker running ``command`` with ``env`` (the full environment).

        Raises:
            AgentError: the zygote is gone or did not answer within ``timeout_s`` (it may still be importing torch).
        """
        read_fd, write_fd = os.pipe()
        with self._lock:
            self._next_id += 1
            ident = self._next_id
        message = {"op": "spawn", "id": ident, "env": dict(env), "argv": list(command.argv), "module": command.module}
        try:
            ipc.send(self._sock, message, [write_fd])
        except OSError as exc:
            os.close(read_fd)
            raise AgentError(f"the worker zygote (pid {self.proc.pid}) is gone: {exc}") from exc
        finally:
            os.close(write_fd)
        with self._changed:
            if not self._changed.wait_for(lambda: ident in self._pids or not self.alive, timeout_s):
                os.close(read_fd)
                raise AgentError(f"the worker zygote (pid {self.proc.pid}) did not fork within {timeout_s:g}s")
            pid = self._pids.pop(ident, None)
        if pid is None:
            os.close(read_fd)
            raise AgentError(f"the worker zygote exited with code {self.proc.poll()} before forking a worker")
        return ForkedProc(pid, os.fdopen(read_fd, "rb"), self)

    def exit_code(self, pid: int) -> int | None:
        """A forked worker's exit code once it ended (SIGKILL's if the zygote died and took it along)."""
        with self._lock:
            if pid in self._exits:
                return self._exits.pop(pid)
        if not self.alive and not process_alive(pid):
            return -signal.SIGKILL
        return None

    def close(self) -> None:
        self.stores.close()
        with contextlib.suppress(OSError):
            self._sock.close()
        _kill_group(self.proc, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


class _Worker:
    def __init__(self, env: WorkerEnv, proc: Proc, log: IO[bytes] | None) -> None:
        self.env = env
        self.proc = proc
        self.log = log
        self.pump = threading.Thread(target=self._pump, name=f"output rank {env.rank}", daemon=True)
        self.pump.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in iter(self.proc.stdout.readline, b""):
            prefix = f"[{self.env.rank}]:".encode()  # the rank may change in place
            if self.log is not None:
                self.log.write(line)
                self.log.flush()
            write_output(prefix + line)
            hint = _hints.first(line)
            if hint is not None:
                logger.warning("rank %d: %s", self.env.rank, hint)
        self.proc.stdout.close()
        if self.log is not None:
            self.log.close()


class WorkerGroup:
    """The workers of one generation on this node.

    Args:
        generation: the generation number.
        envs: one WorkerEnv per local worker.
        command: what the workers run.
        log_dir: directory for ``rank-<r>.log`` files (None: console only).
        base_env: the environment workers inherit, before their own variables.
        zygote: the fork server to start workers from (None: start every worker cold).
    """

    def __init__(
        self,
        generation: int,
        envs: Sequence[WorkerEnv],
        command: WorkerCommand,
        log_dir: Path | None = None,
        base_env: Mapping[str, str] | None = None,
        zygote: Zygote | None = None,
    ) -> None:
        self.generation = generation
        self.envs = list(envs)
        self.command = command
        self.log_dir = log_dir
        self.base_env = dict(base_env) if base_env is not None else worker_base_env(len(self.envs))
        self.zygote = zygote
        self.workers: list[_Worker] = []
        self.gone: list[_Worker] = []  # workers that died while the others stayed (an in-place group)
        self.started_at = 0.0
        self._stopped = False
        self._why = ""  # how the stop is told in its log line (" for the rescale")

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    def exits(self) -> list[tuple[int, int | None]]:
        """(pid, exit code) of each worker as last polled (None: still running)."""
        return [(w.proc.pid, w.proc.returncode) for w in [*self.gone, *self.workers]]

    @property
    def alive(self) -> int:
        return sum(w.proc.poll() is None for w in self.workers)

    def ready(self) -> bool:
        """Every live worker announced that it re-forms in place (pliant.worker under ``--rescale in-place``)."""
        live = [w for w in self.workers if w.proc.returncode is None]
        return bool(live) and all(in_place_ready(w.env.progress_file) for w in live)

    def forget_dead(self) -> None:
        """Stop watching workers that exited (the others stay, in place); :meth:`reconfigure` replaces them."""
        self.gone += [w for w in self.workers if w.proc.poll() is not None]
        self.workers = [w for w in self.workers if w.proc.returncode is None]

    def progress(self) -> dict[int, tuple[int, str, int]]:
        """Each live worker's (step, phase, generation) from its progress file, by local rank (workers that write none
        are left out, and so is a wait in a generation older than the one already handed to the worker)."""
        out: dict[int, tuple[int, str, int]] = {}
        for worker in self.workers:
            if worker.proc.returncode is None and worker.env.progress_file:
                record = read_record(worker.env.progress_file)
                if record is None or record[1] == "done":
                    continue
                step, phase, generation = record
                if phase == "wait" and generation:
                    handed = read_directive(worker.env.progress_file)
                    if handed is not None and handed.generation > generation:
                        continue  # it failed in an older generation and will take the one already handed to it
                out[worker.env.local_rank] = (step, phase, generation)
        return out

    def dump_stacks(self) -> None:
        """Ask every live worker for its Python stacks (faulthandler, into its log through the output pumps), waking a
        stopped one first. Returns at once: a stop's ``DUMP`` stage gives the dumps their time
        (:mod:`pliant.agent.stopping`)."""
        for worker in self.workers:
            if worker.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.proc.pid, signal.SIGCONT)
                    os.kill(worker.proc.pid, STACKS_SIGNAL)

    def direct(self, mode: str, generation: int, envs: Mapping[int, WorkerEnv] | None = None) -> int:
        """Write each live worker's directive (its env in ``envs`` by local rank, for ``in-place``), then send it
        the rescale signal; only to workers that announced they handle it (:func:`pliant.progress.takes_signal`: a
        script without pliant.worker would die of it). Returns how many were directed."""
        directed = 0
        for worker in self.workers:
            if worker.proc.poll() is not None or not takes_signal(worker.env.progress_file):
                continue
            directed += 1
            env = envs.get(worker.env.local_rank) if envs is not None else None
            with contextlib.suppress(OSError):
                write_directive(worker.env.progress_file, Directive(generation, mode, env.to_env() if env else {}))
            if env is not None:
                worker.env = env
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.proc.pid, RESCALE_SIGNAL)
        return directed

    def reconfigure(self, generation: int, envs: Sequence[WorkerEnv]) -> tuple[int, int]:
        """Hand the group ``generation`` in place: live workers get directives with their new env (keeping their
        progress files), local ranks without a live worker get a fresh one. Returns (kept, started)."""
        self.forget_dead()
        live = {w.env.local_rank: w for w in self.workers}
        kept = {
            e.local_rank: replace(e, progress_file=live[e.local_rank].env.progress_file)
            for e in envs
            if e.local_rank in live
        }
        self.direct("in-place", generation, kept)
        self.generation = generation
        fresh = [e for e in envs if e.local_rank not in live]
        for env in fresh:
            self._add(env)
        self.workers.sort(key=lambda w: w.env.local_rank)
        logger.info(
            "generation %d in place: %d workers kept (pids %s), %d started",
            generation,
            len(kept),
            [live[r].proc.pid for r in sorted(kept)],
            len(fresh),
        )
        return len(kept), len(fresh)

    def _launch(self, env: WorkerEnv) -> tuple[Proc, bool]:
        child_env = {**self.base_env, **env.to_env()}
        if self.zygote is not None and self.zygote.alive and not self.command.no_python:
            return self.zygote.spawn(child_env, self.command), True
        proc = subprocess.Popen(
            die_with_parent(self.command.cold()),
            env=child_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return proc, False

    def start(self) -> None:
        """Start every worker. Call from a thread that outlives the workers (see :mod:`pliant.spawn`)."""
        self.started_at = time.monotonic()
        forked = sum(self._add(env) for env in self.envs)
        logger.info(
            "generation %d: started %d workers (%d forked by the zygote; ranks %s, pids %s)",
            self.generation,
            len(self.workers),
            forked,
            [w.env.rank for w in self.workers],
            self.pids,
        )

    def _add(self, env: WorkerEnv) -> bool:
        """Start one worker; True if the zygote forked it."""
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        proc, was_forked = self._launch(env)
        log = open(self.log_dir / f"rank-{env.rank}.log", "ab") if self.log_dir else None  # noqa: SIM115
        self.workers.append(_Worker(env, proc, log))
        return was_forked

    def poll(self) -> GroupResult | None:
        """The group's result once it is over: a worker failed, or all exited (with 0, or the rescale code). None
        while it runs."""
        codes = {w.env.local_rank: w.proc.poll() for w in self.workers}
        exited = {rank: code for rank, code in codes.items() if code is not None}
        if not exited:
            return None
        if len(exited) == len(codes) or any(code not in (0, RESCALE_EXIT_CODE) for code in exited.values()):
            return GroupResult(self.generation, exited, stopped=self._stopped)
        return None

    # -- stopping, a stage at a time (the agent's core keeps the deadlines: pliant.agent.stopping) ---------------------

    def begin_stop(self, rescale: bool = False, leave: bool = False, finish: bool = False, hung: bool = False) -> bool:
        """Begin stopping the workers without waiting. ``finish``: nothing yet (they end by themselves); ``hung``:
        nothing yet (their stacks are on their way to the logs; SIGTERM follows). ``rescale``:
        ask the workers that run the rescale protocol to checkpoint and exit (a ``restart`` directive and the rescale
        signal; ``leave``: a ``leave`` directive, to hand over and exit while the others re-form in place); when none
        takes the request, SIGTERM at once. Otherwise SIGTERM every worker's process group (what torchrun does, so a
        script's own SIGTERM handler runs: save on preemption). Returns whether a request or the finish is awaited
        (False: SIGTERM was sent)."""
        self._stopped = True
        self._why = " for the rescale" if rescale else ""
        if finish or hung or (rescale and self.direct("leave" if leave else "restart", self.generation + 1)):
            return True
        self.signal(signal.SIGTERM)
        return False

    def late(self) -> list[int]:
        """The pids of the workers still running."""
        return [w.proc.pid for w in self.workers if w.proc.poll() is None]

    def dump_late(self, grace_s: float) -> None:
        """The workers still running after a rescale's grace of ``grace_s``: their Python stacks to their logs (through
        the output pumps), before they are stopped."""
        late = self.late()
        if late:
            logger.warning(
                "generation %d: workers %s did not exit within the rescale grace (%.0fs); their stacks follow",
                self.generation,
                late,
                grace_s,
            )
        for pid in late:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, STACKS_SIGNAL)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to every worker's process group."""
        for worker in self.workers:
            _kill_group(worker.proc, sig)

    def reap(self) -> GroupResult:
        """The stopped group's result, once no worker runs (one that outlived SIGKILL is logged and left)."""
        for worker in self.workers:
            if worker.proc.poll() is None:
                logger.error("worker pid %d did not die after SIGKILL", worker.proc.pid)
            worker.pump.join(2)
        codes = {w.env.local_rank: w.proc.returncode for w in self.workers}
        logger.info("generation %d: workers stopped%s (%s)", self.generation, self._why, _stopped_codes(codes))
        return GroupResult(self.generation, codes, stopped=True)

    def stop(self, grace_s: float, rescale_grace_s: float = 0.0, leave: bool = False) -> GroupResult:
        """Stop the workers and reap them all, waiting (the agent's own exit; tests): with ``rescale_grace_s`` (a
        rescale), ask first and wait up to that long (:meth:`begin_stop`); then SIGTERM, and SIGKILL what is left
        after ``grace_s``."""

        def wait(seconds: float) -> None:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and self.late():
                time.sleep(0.02)

        if self.begin_stop(rescale=rescale_grace_s > 0, leave=leave):
            wait(rescale_grace_s)
            if self.late():
                self.dump_late(rescale_grace_s)
                time.sleep(0.5)
            self.signal(signal.SIGTERM)
        wait(grace_s)
        self.signal(signal.SIGKILL)
        for worker in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(10)
        return self.reap()


def _stopped_codes(codes: Mapping[int, int | None]) -> str:
    """How stopped workers ended, by local rank, in words: ``exited 0``, ``by SIGTERM``, ``by SIGKILL``."""
    words = []
    for rank, code in sorted(codes.items()):
        if code is None:
            how = "still running"
        elif code < 0:
            try:
                how = f"by {signal.Signals(-code).name}"
            except ValueError:
                how = f"by signal {-code}"
        else:
            how = f"exited {code}"
        words.append(f"local rank {rank} {how}")
    return ", ".join(words) or "none running"
