"""Secure by default, as a user runs it: ``pliant run`` makes its own CA, the join command it prints works when pasted,
a wrong token is refused with a clear error, and an admin's ``pliant job create`` token lets agents with their own
certificates join a standalone coordinator."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common import PLIANT
from pliant.agent.contract import ExitCode, left_on
from tests.conftest import TEST_JOIN_TOKEN, wait_for
from tests.fleet import admin_tls, agent_tls
from tests.integration.harness import SCRIPT, assert_all_gone, descendants, first_node, read_steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _printed(proc_output: callable, pattern: str) -> re.Match[str]:
    return wait_for(lambda: re.search(pattern, proc_output()), 60, f"output matching {pattern!r}")  # type: ignore[return-value]


def test_the_printed_join_command_works_when_pasted(spawn, tmp_path: Path) -> None:
    events, certs = tmp_path / "events.jsonl", tmp_path / "certs"
    first = spawn(first_node("1:2", certs, events), name="first")
    join = _printed(first.output, r"other nodes join with:\n  (\S+ .*run .*)\n").group(1)
    assert join.startswith("PLIANT_JOIN_TOKEN=") and "--ca-cert-hash sha256:" in join and "--tls-dir" not in join
    assert "--join-token" not in join, "the token stays off the command line (ps shows it to every local user)"
    assert "mutual TLS, certificates in" in first.output()
    for name in ("ca.crt", "coordinator/tls.key", "admin/tls.crt", "self/tls.crt"):
        assert (certs / name).is_file(), name
    assert not (certs / "ca.key").exists(), "the CA's key stays in the run's memory"
    wait_for(lambda: any(s.world == 1 for s in read_steps(events)), 60, "the first node stepping")

    # A wrong token is refused at once, with where the right one comes from.
    wrong = re.sub(r"PLIANT_JOIN_TOKEN=\S+", "PLIANT_JOIN_TOKEN=not-the-token-0123456789", join)
    bad = subprocess.run(["env", *shlex.split(wrong)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == ExitCode.ERROR and "a wrong join token for job 'default'" in bad.stderr, bad.stderr[-2000:]

    argv = ["env", *shlex.split(join)]  # what a shell does with the pasted line
    argv[argv.index("run") + 1 : argv.index("run") + 1] = ["--node-id", "second"]
    second = spawn(argv, name="second")
    wait_for(lambda: {s.rank for s in read_steps(events) if s.world == 2} == {0, 1}, 90, "world 2 stepping")
    status = subprocess.run(
        [
            *PLIANT,
            "status",
            "--coordinator",
            re.search(r"--coordinator (\S+)", join).group(1),
            "--tls-dir",
            str(certs / "admin"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert status.returncode == 0 and '"node_id": "second"' in status.stdout, status.stderr
    workers = [p for p in descendants(second.pid) if "train_ddp" in Path(f"/proc/{p}/cmdline").read_text()]
    assert workers, "the second node's workers"
    for pid in workers:  # the token opened the node's way in; its workers, the user's code, never hold it
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert not [v for v in environ if v.startswith((b"PLIANT_JOIN_TOKEN=", b"PLIANT_SEAT_KEY="))], pid
    pids = [first.pid, second.pid, *descendants(first.pid), *descendants(second.pid)]
    second.kill(15)  # a graceful leave
    wait_for(lambda: second.proc.poll() is not None, 30, "the second node to leave")
    assert second.proc.returncode == left_on(15), second.output()[-3000:]
    first.kill(15)
    wait_for(lambda: first.proc.poll() is not None, 30, "the first node to stop")
    assert_all_gone(pids)


def test_an_admin_creates_the_job_and_agents_join_with_its_token(make_coordinator, pki, spawn, tmp_path) -> None:
    server = make_coordinator()
    admin = str(Path(admin_tls(pki).cert).parent)
    created = subprocess.run(
        [
            *PLIANT,
            "job",
            "create",
            "j1",
            "--coordinator",
            server.address,
            "--tls-dir",
            admin,
            "--nnodes",
            "1:2",
            "--nproc-per-node",
            "1",
            "--heartbeat-ttl",
            "3",
            "--join-token-file",
            str(_token_file(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert created.returncode == 0 and f"PLIANT_JOIN_TOKEN={TEST_JOIN_TOKEN}" in created.stdout, created.stderr
    events = tmp_path / "events.jsonl"
    agent = spawn(
        [
            *PLIANT,
            "agent",
            "--coordinator",
            server.address,
            "--job",
            "j1",
            "--tls-dir",
            str(Path(agent_tls(pki, "n1").cert).parent),
            "--join-token-file",
            str(_token_file(tmp_path)),
            "--nproc-per-node",
            "1",
            str(SCRIPT),
            "--steps",
            "5",
            "--events",
            str(events),
        ],
        name="agent",
    )
    wait_for(lambda: agent.proc.poll() is not None, 90, "the job to finish")
    assert agent.proc.returncode == 0, agent.output()[-3000:]
    assert sorted(s.step for s in read_steps(events)) == [0, 1, 2, 3, 4]
    # Its flags (the default --nnodes 1:1) disagree with the job the admin made: one line says which values win.
    assert "job j1 exists with its own spec: its --nnodes 1:2 wins over this node's 1:1" in agent.output()
    # The agent's certificate may not create jobs: a job that does not exist says who creates it.
    missing = subprocess.run(
        [
            *PLIANT,
            "agent",
            "--coordinator",
            server.address,
            "--job",
            "nope",
            "--tls-dir",
            str(Path(agent_tls(pki, "n1").cert).parent),
            "--join-token",
            TEST_JOIN_TOKEN,
            str(SCRIPT),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == ExitCode.ERROR and "pliant job create nope" in missing.stderr, missing.stderr[-2000:]
    # No token for a job that exists: the line says to pass its token, never that the job does not exist.
    no_token = [sys.executable, "-m", "pliant", "agent", "--coordinator", server.address, "--job", "j1"]
    tokenless = subprocess.run(
        [*no_token, "--tls-dir", str(Path(agent_tls(pki, "n2").cert).parent), str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert tokenless.returncode == ExitCode.ERROR, tokenless.stderr[-2000:]
    assert "job 'j1': this agent has no join token" in tokenless.stderr and "does not exist" not in tokenless.stderr
    deleted = subprocess.run(
        [sys.executable, "-m", "pliant", "job", "delete", "j1", "--coordinator", server.address, "--tls-dir", admin],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert deleted.returncode == 0, deleted.stderr


def _token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TEST_JOIN_TOKEN + "\n")
    return path
