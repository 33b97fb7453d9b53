"""The bootstrap join with a standalone control plane, as an operator runs it from the README: a CA made with
``pliant certs``, a ``pliant coordinator`` replica given the CA's key (``--signing-ca-dir``), a job made with
``pliant job create``, and an agent that has nothing but the coordinator's address, the token and the fingerprint.
Its certificates are short-lived here (10 s), so it renews them while the job runs, and keeps heartbeating past the
first certificate's expiry."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from pliant.agent.contract import ExitCode
from pliant.ports import free_api_port
from tests.conftest import wait_for
from tests.integration.harness import SCRIPT, read_steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

PLIANT = [sys.executable, "-m", "pliant"]


def _pliant(*argv: str) -> str:
    done = subprocess.run([*PLIANT, *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_standalone_replica_signs_and_the_agent_renews_while_it_trains(etcd, prefix, spawn, tmp_path) -> None:
    certs = tmp_path / "certs"
    _pliant("certs", "create-ca", "--certs-dir", str(certs))
    _pliant("certs", "create-coordinator", "127.0.0.1", "--certs-dir", str(certs))
    _pliant("certs", "create-admin", "alice", "--certs-dir", str(certs))
    pin = _pliant("certs", "fingerprint", "--certs-dir", str(certs)).strip()
    address = f"127.0.0.1:{free_api_port()}"
    coordinator = spawn(
        [
            *PLIANT,
            "coordinator",
            "--etcd",
            etcd.endpoint,
            "--listen",
            address,
            "--prefix",
            prefix,
            "--tls-dir",
            str(certs / "coordinator-coordinator"),
            "--signing-ca-dir",
            str(certs),
            "--agent-cert-lifetime",
            "10",
            "--leader-ttl",
            "2",
        ],
        name="coordinator",
    )
    wait_for(
        lambda: "bootstrap join on" in coordinator.output() or coordinator.proc.poll() is not None,
        30,
        "the coordinator's bootstrap port",
    )
    assert f"--ca-cert-hash {pin}" in coordinator.output(), coordinator.output()[-2000:]
    token_file = tmp_path / "token"
    token_file.write_text("a-token-of-the-operators-choice-0123\n")
    _pliant(
        "job",
        "create",
        "j1",
        "--coordinator",
        address,
        "--tls-dir",
        str(certs / "admin-alice"),
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "1",
        "--heartbeat-ttl",
        "3",
        "--join-token-file",
        str(token_file),
    )

    # The agent knows the coordinator's address, the job, its token and the CA's fingerprint: nothing else.
    joining = [*PLIANT, "agent", "--coordinator", address, "--job", "j1", "--join-token-file", str(token_file)]
    # A wrong pin: refused before the token is sent, in one line.
    wrong_pin = ["--ca-cert-hash", "sha256:" + "0" * 64, str(SCRIPT)]
    wrong = subprocess.run([*joining, *wrong_pin], capture_output=True, text=True, timeout=60)
    assert wrong.returncode == ExitCode.ERROR and "not sending the join token" in wrong.stderr, wrong.stderr[-2000:]

    events = tmp_path / "events.jsonl"
    script = [str(SCRIPT), "--steps", "120", "--step-time", "0.1", "--events", str(events)]
    agent = spawn([*joining, "--ca-cert-hash", pin, "--nnodes", "1:2", "--nproc-per-node", "1", *script], name="agent")
    wait_for(lambda: agent.proc.poll() is not None, 120, "the job to finish")
    output = agent.output()
    assert agent.proc.returncode == 0, output[-3000:]
    assert sorted(s.step for s in read_steps(events)) == list(range(120))
    renewals = re.findall(r"certificate renewed, valid until", output)
    assert len(renewals) >= 1, output[-3000:]
    assert "heartbeat failed" not in output, "every call after a renewal used the new certificate"
