"""``pliant run`` as a user runs it: the embedded etcd and coordinator, torchrun-style flags, clear errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading

import pytest

from bench.common import PLIANT
from pliant.agent.contract import ExitCode
from tests.conftest import wait_for
from tests.integration.harness import ELASTIC, SCRIPT, read_steps

pytestmark = pytest.mark.timeout(120)


def _run(args: list[str], timeout: float = 90) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        err = (exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        pytest.fail(f"{' '.join(args)} did not finish in {timeout}s\nstdout:\n{out[-4000:]}\nstderr:\n{err[-6000:]}")


@pytest.mark.slow
def test_a_run_says_what_a_person_needs_and_no_more(tmp_path) -> None:
    """Quiet by default: the control plane's address, how to watch the job, one line per world, the summary; the
    components' INFO records only with --log-level info. (--nnodes 1:1: no node can join, so no join command.)"""
    env = {k: v for k, v in os.environ.items() if k != "PLIANT_LOG_LEVEL"}
    argv = [sys.executable, "-m", "pliant", "run", "--nproc-per-node", "2", "--checkpoint-dir", str(tmp_path / "ck")]
    script = [str(ELASTIC), "--steps", "20", "--events", str(tmp_path / "events.jsonl")]
    result = subprocess.run([*argv, *script], capture_output=True, text=True, timeout=90, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in (result.stdout + result.stderr).splitlines() if not line.startswith("[")]  # not ranks'
    assert len(lines) <= 8 and not [line for line in lines if " INFO " in line], lines
    assert [
        line
        for line in lines
        if line.startswith("pliant: generation 1 (start): world 2, ranks 0..1 on this node, 2 workers started in ")
    ], lines
    assert lines[-2] == (
        "pliant: job default succeeded: finished at full size, world 2 (1 node): every node's workers completed "
        "generation 1"
    ), lines
    assert re.fullmatch(
        r"pliant: job default succeeded at full size: 20 steps in [\d.]+s on this node; world sizes 2; "
        r"0 rescales and 0 recoveries from failures, 0 of them in place; goodput [\d.]+% \(badput: .+\)",
        lines[-1],
    ), lines
    assert not [line for line in lines if "join with" in line or "PLIANT_JOIN_TOKEN" in line], lines


def _pliant_lines(output: str) -> list[str]:
    """The lines pliant printed (not the ranks' ``[r]:`` lines)."""
    return [line for line in output.splitlines() if not line.startswith("[")]


@pytest.mark.slow
def test_a_join_says_what_a_person_needs_and_no_more(tmp_path) -> None:
    """Both consoles of a join, quiet by default: the world change names the newcomer, each node ends with its
    summary, and the join command is printed so that it runs as pasted."""
    env = {k: v for k, v in os.environ.items() if k != "PLIANT_LOG_LEVEL"}
    argv = [sys.executable, "-m", "pliant", "run", "--nnodes", "1:2", "--nproc-per-node", "1"]
    # 15 s of training: the joining node's workers (its zygote imports torch, 4-11 s on two loaded cores) come while
    # the first node still trains, so that the world grows (a node that comes as the job ends never trains).
    argv += ["--checkpoint-dir", str(tmp_path / "ck"), str(ELASTIC), "--steps", "150", "--step-time", "0.1"]
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    said: list[str] = []
    reader = threading.Thread(target=lambda: said.extend(first.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()  # the first node's output is read all along: a full pipe would stall its workers
    try:
        started = "pliant: generation 1 (start)"  # the first world: the second node's join then rescales it
        wait_for(lambda: [line for line in said if line.startswith(started)], 60, "the first world")
        join = next(line for line in said if "PLIANT_JOIN_TOKEN=" in line).strip()
        second = subprocess.run(["bash", "-c", join], capture_output=True, text=True, timeout=90, env=env, cwd=tmp_path)
        first.wait(timeout=60)
        reader.join(10)
    finally:
        first.kill()
        first.wait()
    assert first.returncode == 0 and second.returncode == 0, ("".join(said)[-3000:], second.stderr[-3000:])
    for output in ("".join(said), second.stdout + second.stderr):
        lines = _pliant_lines(output)
        waits = [line for line in lines if re.search(r"\(\d+s so far", line)]  # a slow newcomer: one line
        # At most: the join line and the seat line (two lines each), the loopback note, the status command, two
        # worlds, and the end (how the job ended, this node's summary).
        assert (
            len(lines) - len(waits) <= 10
            and len(waits) <= 1
            and not [line for line in lines if " INFO " in line or "Traceback" in line]
        ), lines
        assert re.fullmatch(
            r"pliant: job default succeeded at full size: 150 steps in [\d.]+s on this node; .*", lines[-1]
        ), lines
    first_lines = _pliant_lines("".join(said))
    assert [
        line
        for line in first_lines
        if re.fullmatch(
            r"pliant: generation 2 \(join\): world 1 -> 2 \(\S+ joined\) in place in [\d.]+s, 1 worker kept, 0 started",
            line,
        )
    ], first_lines
    second_lines = _pliant_lines(second.stdout + second.stderr)
    assert [
        line
        for line in second_lines
        if line.startswith("pliant: generation 2 (join): world 2, ranks 1..1 on this node, 1 worker started in ")
    ], second_lines
    assert "world sizes 1 -> 2; 1 rescale and 0 recoveries from failures, 1 of them in place" in first_lines[-1], (
        first_lines
    )


@pytest.mark.slow
def test_a_failing_worker_reads_like_the_script_run_by_python(tmp_path) -> None:
    """A worker shows in ``ps`` as the command that would run its script, and dies with the script's own
    traceback: no frame of pliant's zygote or of runpy."""
    script = tmp_path / "boom.py"
    script.write_text(
        "import os, time\n"
        "print('cmdline', open('/proc/self/cmdline').read().replace(chr(0), ' ').strip(), flush=True)\n"
        "print('comm', open('/proc/self/comm').read().strip(), flush=True)\n"
        "def fail():\n"
        "    raise ValueError('bad batch')\n"
        "if os.environ['RANK'] == '1':\n"
        "    fail()\n"
        "time.sleep(1)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PLIANT_LOG_LEVEL"}
    argv = [sys.executable, "-m", "pliant", "run", "--nproc-per-node", "2", "--max-restarts", "0"]
    result = subprocess.run([*argv, str(script), "--lr", "0.1"], capture_output=True, text=True, timeout=90, env=env)
    assert result.returncode == ExitCode.JOB_FAILED, result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert f"[0]:cmdline {sys.executable} -u {script} --lr 0.1" in out, out[-3000:]
    assert "[0]:comm boom.py" in out, out[-3000:]
    trace = [line[4:] for line in out.splitlines() if line.startswith("[1]:")][2:]
    assert trace[:2] == ["Traceback (most recent call last):", f'  File "{script}", line 7, in <module>'], trace
    assert trace[-1] == "ValueError: bad batch" and not [line for line in trace if "pliant" in line], trace
    assert not [line for line in out.splitlines() if "runpy" in line or "zygote" in line], out[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("entry", [["-m", "pliant", "run"], ["-m", "pliant.run"]], ids=["pliant run", "-m pliant.run"])
def test_pliant_run_with_the_embedded_control_plane(entry: list[str], tmp_path) -> None:
    events = tmp_path / "events.jsonl"
    result = _run(
        [
            sys.executable,
            *entry,
            "--nnodes",
            "1:2",
            "--nproc-per-node",
            "2",
            "--log-dir",
            str(tmp_path / "logs"),
            str(SCRIPT),
            "--steps",
            "6",
            "--events",
            str(events),
        ]
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert "other nodes join with:" in out and "pliant run --coordinator 127.0.0.1:" in out
    assert "mutual TLS, certificates in" in out and "--tls-dir" in out and "PLIANT_JOIN_TOKEN=" in out
    join = next(line for line in out.splitlines() if "pliant run --coordinator 127.0.0.1:" in line)
    assert "--checkpoint-dir" not in join, "only when one is given"
    assert "no --checkpoint-dir: unless the script saves its own checkpoints" in out, "the warning at start"
    assert "[0]:step 5 world 2" in out, "rank-prefixed console output"
    assert re.search(
        r"worker zygote \(pid \d+\): torch.distributed imported and the store host forked [\d.]+s after "
        r"its start \(load average [\d.]+ on \d+ CPUs\)",
        out,
    ), "a slow node start names its cause"
    assert re.search(r"worker zygote \(pid \d+\): torch imported: ready to fork workers [\d.]+s after", out), (
        "the script imports nothing but torch"
    )
    steps = read_steps(events)
    assert {(s.rank, s.world, s.restart) for s in steps} == {(0, 2, 0), (1, 2, 0)}
    assert sorted(s.step for s in steps if s.rank == 0) == list(range(6))
    logs = sorted(p.name for p in (tmp_path / "logs" / "default" / "gen-1").iterdir())
    assert logs == ["rank-0.log", "rank-1.log"]
    assert "step 5 world 2" in (tmp_path / "logs" / "default" / "gen-1" / "rank-0.log").read_text()


@pytest.mark.slow
def test_the_same_script_runs_under_torchrun(tmp_path) -> None:
    events = tmp_path / "events.jsonl"
    result = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(SCRIPT),
            "--steps",
            "3",
            "--events",
            str(events),
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert {(s.rank, s.world) for s in read_steps(events)} == {(0, 2), (1, 2)}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_lightning_ddp_script_runs_unchanged(tmp_path) -> None:
    out = tmp_path / "ranks.jsonl"
    script = SCRIPT.parent / "train_lightning.py"
    result = _run(
        [
            *PLIANT,
            "run",
            "--nproc-per-node",
            "2",
            str(script),
            "--max-steps",
            "3",
            "--out",
            str(out),
        ],
        timeout=220,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = {tuple(sorted(json.loads(line).items())) for line in out.read_text().splitlines()}
    expected = {
        (("cluster", "TorchElasticEnvironment"), ("global_rank", r), ("steps", 3), ("world_size", 2)) for r in (0, 1)
    }
    assert ranks == expected


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--nnodes", "3:2"], "--nnodes '3:2' must have 1 <= MIN <= MAX"),
        (["--nnodes", "two"], "--nnodes 'two' must be N or MIN:MAX"),
        (["--nproc-per-node", "0"], "--nproc-per-node '0' must be a positive integer"),
        (["--node-rank", "1"], "--node-rank is not supported by pliant: pliant assigns node ranks in join order"),
        (["--master-port", "29500"], "join a job with --coordinator HOST:PORT"),
        (["--max-restarts", "-1"], "max_restarts=-1 must be an integer >= 0"),
        (["--heartbeat-ttl", "1"], "heartbeat_ttl_s=1.0 must be between 2 and 3600"),
        (["--job", "bad/id"], "job_id 'bad/id' is invalid"),
    ],
)
def test_bad_flags_are_clear_errors(flags: list[str], needle: str) -> None:
    result = _run([sys.executable, "-m", "pliant", "run", *flags, str(SCRIPT)], timeout=30)
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr, result.stderr


def test_a_missing_script_is_a_clear_error(tmp_path) -> None:
    result = _run([sys.executable, "-m", "pliant", "run", str(tmp_path / "nope.py")], timeout=30)
    assert result.returncode == 2
    assert f"training script '{tmp_path / 'nope.py'}' not found" in result.stderr


def test_an_unreachable_coordinator_is_a_clear_error() -> None:
    result = _run(
        [
            *PLIANT,
            "agent",
            "--coordinator",
            "127.0.0.1:1",
            "--job",
            "j",
            "--rpc-retry",
            "3",
            "--insecure",
            str(SCRIPT),
        ],
        timeout=60,
    )
    assert result.returncode == ExitCode.ERROR  # this agent cannot take part; the job (if any) goes on
    assert re.search(
        r"pliant: waiting for a coordinator at 127.0.0.1:1 \(\d+s so far; CreateJob: .+; gives up after 3s\)",
        result.stderr,
    ), "what a transient failure waits for"
    assert "no coordinator answered at 127.0.0.1:1 for 3s" in result.stderr, result.stderr


def test_agent_requires_a_coordinator() -> None:
    result = _run([sys.executable, "-m", "pliant", "agent", "--job", "j", str(SCRIPT)], timeout=30)
    assert result.returncode == 2
    assert "the following arguments are required: --coordinator" in result.stderr
