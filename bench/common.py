"""Helpers shared by the benchmarks and the tests (each benchmark runs as ``python bench/NAME.py``, so this imports as
``common``; the tests import it as ``bench.common``)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

# The processes a benchmark starts log their components' INFO records (quiet is the default): it reads them.
os.environ.setdefault("PLIANT_LOG_LEVEL", "INFO")

__all__ = [
    "ELASTIC",
    "PLIANT",
    "ask_for_stacks",
    "batches_counted",
    "change_gap",
    "counted_samples",
    "elastic_args",
    "end_soon",
    "in_run_cost",
    "join_flags",
    "longest_pause",
    "max_param_diff",
    "read_jsonl",
    "scrape",
    "static_params",
]

PLIANT = (sys.executable, "-m", "pliant")
"""How the benchmarks and the tests run the ``pliant`` command: this interpreter's."""
ELASTIC = Path(__file__).resolve().parent.parent / "examples" / "train_elastic.py"
"""The elastic training script the benchmarks and the tests run."""


_TAILS: dict[str, tuple[int, int, list[dict]]] = {}  # path -> (inode, bytes parsed, items): see read_jsonl
_TAILS_LOCK = threading.Lock()


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, the nearest rank (NaN for none): every bench's p50 and p99."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def read_jsonl(path: Path) -> list[dict]:
    """The JSON lines of ``path`` (none if it does not exist), skipping a line still being written or garbled.

    The files read are logs that training processes append to while a test or a benchmark polls them, often every
    few tens of milliseconds: each call parses only the complete lines appended since the last call on ``path`` (a
    replaced or truncated file is read again from its start), so polling costs no CPU the job under test needs."""
    key = str(path)
    try:
        with open(path, "rb") as f:
            inode = os.fstat(f.fileno()).st_ino
            with _TAILS_LOCK:
                known, offset, items = _TAILS.get(key, (inode, 0, []))
                if known != inode or os.fstat(f.fileno()).st_size < offset:
                    offset, items = 0, []
                f.seek(offset)
                data = f.read()
                end = data.rfind(b"\n") + 1  # only complete lines: the last one may still be being written
                for line in data[:end].splitlines():
                    try:
                        items.append(json.loads(line))
                    except ValueError:
                        continue
                _TAILS[key] = (inode, offset + end, items)
                return list(items)
    except FileNotFoundError:
        return []


def end_soon(events: Path, stop: Path, steps: int, margin: int) -> int:
    """Have a job of ``examples/train_elastic.py --events events --stop-file stop`` end ``margin`` steps after the
    newest step a rank logged (its ranks step within one of each other; each reads the file after every step), once
    a test or a soak has seen what it waits for. Returns the job's step count now (its static twin's)."""
    now = min(steps, max((e["step"] for e in read_jsonl(events)), default=-1) + 1 + margin)
    part = stop.with_name(stop.name + ".part")
    part.write_text(str(now))
    os.replace(part, stop)  # whole or absent to a rank that reads it
    return now


def longest_pause(events: list[dict], since: float) -> float:
    """The longest gap between two consecutive steps of rank 0 after ``since`` (wall time) in a training script's
    step events (``rank``, ``time``)."""
    times = sorted(e["time"] for e in events if e["rank"] == 0 and e["time"] >= since)
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def change_gap(events: list[dict], old_world: int, new_world: int) -> float:
    """Rank 0's last step at world ``old_world`` to its first at ``new_world`` (wall seconds) in a training script's
    step events (``rank``, ``world``, ``time``): the gap across the world change alone, without the steps before it
    that a newcomer starting on the same machine slows."""
    mine = [e for e in events if e["rank"] == 0]
    last = max(e["time"] for e in mine if e["world"] == old_world)
    return min(e["time"] for e in mine if e["world"] == new_world and e["time"] > last) - last


def ask_for_stacks(root: int) -> int:
    """Ask every Python process under ``root`` (an agent, a ``pliant run``) for its threads' stacks, as an agent does
    before it stops a hung worker: workers and store hosts write them (faulthandler on
    :data:`pliant.env.STACKS_SIGNAL`) to their output, which their agent logs. The zygote, ``root``'s child that the
    workers are forked from (and share a command line with), is left out. Returns how many were asked."""
    from pliant.env import STACKS_SIGNAL

    asked = 0
    with contextlib.suppress(psutil.NoSuchProcess):
        for proc in psutil.Process(root).children(recursive=True):
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                command = " ".join(proc.cmdline())
                if "python" not in (proc.name() + command[:200]).lower():
                    continue  # etcd, a shell
                if proc.ppid() == root and "pliant.agent.zygote" in command:
                    continue
                os.kill(proc.pid, STACKS_SIGNAL)
                asked += 1
    return asked


def stop_tree(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """Stop a launcher and every process under it at the end of a measurement: SIGTERM first (``pliant run`` leaves
    gracefully and deletes its embedded etcd's temporary data directory, 123 MB, which a SIGKILL leaves in /tmp),
    then SIGKILL what is left after ``grace_s``."""
    import psutil

    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    proc.wait(10)


def join_flags(log: Path, timeout_s: float = 60.0) -> list[str]:
    """``--join-token=TOKEN --ca-cert-hash sha256:HEX`` from the join command a ``pliant run`` with the embedded
    control plane printed to ``log`` (another node joins with them by bootstrap)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        found = re.search(r"PLIANT_JOIN_TOKEN=(\S+) .*run --coordinator \S+ --ca-cert-hash (\S+)", text)
        if found:
            return [f"--join-token={shlex.split(found[1])[0]}", "--ca-cert-hash", found[2]]
        time.sleep(0.1)
    raise TimeoutError(f"no join command in {log} within {timeout_s:g}s")


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def sample(metrics: dict[str, float], name: str, **labels: str) -> float | None:
    """The value of ``name`` in a :func:`scrape` among the samples whose labels include ``labels`` (their sum when
    several do, as when only ``job_id`` tells them apart); None when none does."""
    found = [
        value
        for key, value in metrics.items()
        if key.split("{", 1)[0] == name
        and labels.items() <= dict(_LABEL.findall(key.split("{", 1)[1] if "{" in key else "")).items()
    ]
    return sum(found) if found else None


def scrape(url: str) -> dict[str, float]:
    """name{labels} -> value of every sample of a Prometheus endpoint (empty when it does not answer); read one with
    :func:`sample`."""
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}


def counted_samples(events: list[dict]) -> tuple[list[int], dict[int, list[int]]]:
    """(the steps run, the samples per epoch used by the updates that count) from a training script's step events
    (``step``, ``generation``, ``epoch``, ``samples``). The generation that ran a step last is the one whose update
    counts (an older one's was lost to a restart or a failure)."""
    last_gen: dict[int, int] = {}
    for e in events:
        last_gen[e["step"]] = max(last_gen.get(e["step"], 0), e["generation"])
    per_epoch: dict[int, list[int]] = {}
    for e in events:
        if e["generation"] == last_gen[e["step"]]:
            per_epoch.setdefault(e["epoch"], []).extend(e["samples"])
    return sorted(last_gen), per_epoch


def batches_counted(
    events: list[dict], samples: int, global_batch: int, micro_batch: int = 8
) -> tuple[list[int], dict[int, list[int]], int, int]:
    """Like :func:`counted_samples`, checked against the global batches the elastic sampler gives each step (seed 0,
    as ``examples/train_elastic.py``). A rank killed after its step committed but before its script logged the step
    leaves that step's line missing: such a step counts with its whole global batch once what was logged is part of
    it. Returns (steps run, samples per epoch, samples logged outside their step's global batch, steps completed that
    way); a caller allows at most one such step per kill."""
    from pliant.worker.data import ElasticSampler

    steps_run, _ = counted_samples(events)
    last = {e["step"]: e["generation"] for e in sorted(events, key=lambda e: e["generation"])}
    logged: dict[int, list[int]] = {}  # step -> its ranks' samples, in the generation that counts
    for e in events:
        if e["generation"] == last[e["step"]]:
            logged.setdefault(e["step"], []).extend(e["samples"])
    sampler = ElasticSampler(samples, global_batch, micro_batch)
    per_step = -(-samples // global_batch)
    per_epoch: dict[int, list[int]] = {}
    wrong = unlogged = 0
    for step in steps_run:
        epoch, index = divmod(step, per_step)
        expected = sampler.order(epoch)[index * global_batch : (index + 1) * global_batch].tolist()
        seen = logged.get(step, [])
        wrong += len(set(seen) - set(expected))
        if sorted(seen) != sorted(expected) and set(seen) <= set(expected):
            unlogged += 1
            per_epoch.setdefault(epoch, []).extend(sorted(set(expected) - set(seen)))
        per_epoch.setdefault(epoch, []).extend(seen)
    return steps_run, per_epoch, wrong, unlogged


def max_param_diff(a: dict, b: dict) -> float:
    """The largest absolute difference between two state dicts' tensors (``b``'s keys)."""
    return max((a[k] - b[k]).abs().max().item() for k in b)


def in_run_cost(times: dict[int, float], steps: range, snapshots: list[int], horizon: int = 4) -> float:
    """A cost paid at each snapshot (the buddy copies'), measured inside one run, free of the spread between runs.

    Args:
        times: step -> when it ended (step ``s`` took a snapshot when ``s + 1`` is in ``snapshots``).
        steps: the steps whose durations count.
        snapshots: the committed steps at each snapshot, in order (:func:`snapshot_steps`).
        horizon: the place after a snapshot from which no copy reaches a step: those steps' mean is the base.

    Returns:
        The excess time of the steps nearer a snapshot than ``horizon`` over the base, as a share of all the steps'
        time. Given a run without copies and the schedule of one with them, it gives the estimate's noise.
    """
    durations = {step: times[step] - times[step - 1] for step in steps}

    def place(step: int) -> int:
        before = [s for s in snapshots if s <= step + 1]
        return step + 1 - before[-1] if before else horizon

    near = [d for step, d in durations.items() if place(step) < horizon]
    base = statistics.mean(d for step, d in durations.items() if place(step) >= horizon)
    return sum(d - base for d in near) / sum(durations.values())


def snapshot_steps(changes: list[tuple[int, int]], until: int, first_every: int) -> list[int]:
    """The committed steps at which an automatic interval's snapshots were taken, up to step ``until``, from the K
    changes the workers logged (``changes``: (K, the vote's step) in order) and the first K, with the protocol's own
    rule (:class:`pliant.worker.inplace.cadence.Cadence`); re-formations not included."""
    from pliant.worker.inplace.cadence import Cadence

    cadence, taken = Cadence(first_every), []
    for step in range(until):
        for every, at in changes:
            if at == step:
                cadence.every = every
        if cadence.snapshot_due(step + 1):
            cadence.took(step + 1)
            taken.append(step + 1)
    return taken


def elastic_args(
    steps: int,
    samples: int,
    global_batch: int,
    micro_batch: int = 8,
    step_time: float | None = None,
    engine: str = "",
    events: Path | str | None = None,
    params_out: Path | str | None = None,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """The arguments of :data:`ELASTIC` (after its path): ``steps`` steps over ``samples`` samples in global batches of
    ``global_batch`` (micro-batches of ``micro_batch``), each ``step_time`` s at least (None: as fast as it goes), on
    ``engine`` ("": the script's default), its events and final parameters where given, then ``extra``."""
    args = ["--steps", str(steps), "--samples", str(samples), "--global-batch", str(global_batch)]
    args += ["--micro-batch", str(micro_batch)]
    args += ["--step-time", str(step_time)] if step_time is not None else []
    args += ["--engine", engine] if engine else []
    args += ["--events", str(events)] if events is not None else []
    args += ["--params-out", str(params_out)] if params_out is not None else []
    return [*args, *extra]


def static_params(
    out: Path, steps: int, samples: int, global_batch: int, engine: str = "ddp", timeout_s: float = 1800.0
) -> dict:
    """The final parameters of :data:`ELASTIC` run as one plain process on the same global batches, in float64 (the
    exactness checks' precision), written to ``out``.

    Raises:
        RuntimeError: the run failed (its output's tail says why).
    """
    import torch

    args = elastic_args(steps, samples, global_batch, engine=engine, params_out=out, extra=("--float64",))
    result = subprocess.run([sys.executable, str(ELASTIC), *args], capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    return torch.load(out)
