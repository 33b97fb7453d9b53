"""Each credential tried as its worst holder would use it, against a real ``pliant run`` (its embedded etcd and
coordinator, mutual TLS, a control plane that wants three seats): what the workers' join line admits is one agent of
the job, never a seat of the control plane, its CA keys or the sealing root; the job trains on through every refusal."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pliant.bootstrap import bootstrap_address, request_certificate
from pliant.coordinator.client import CoordinatorClient
from pliant.coordinator.contract import PermissionDenied
from pliant.coordinator.etcd_cluster import EtcdMembers
from pliant.security.tlsdir import TlsConfig
from tests.conftest import wait_for
from tests.integration.harness import first_node, read_steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

JOB = "default"


def _stepping_after(events: Path, step: int) -> None:
    wait_for(lambda: any(s.step > step for s in read_steps(events)), 60, f"the job stepping past step {step}")


def _newest(events: Path) -> int:
    return max((s.step for s in read_steps(events)), default=0)


def test_the_join_line_takes_no_seat_and_no_key(spawn, tmp_path: Path) -> None:
    """A holder of the printed join line (token, CA pin, address) bootstraps an agent certificate and joins, then
    asks for a seat without a key, with a made-up key, and naming the first seat's own etcd peer URL; and asks for a
    seat key itself. Each is PERMISSION_DENIED, etcd's membership is as it was, and the job trains on. A seat key an
    admin makes with `pliant seat-key` does admit a seat, with the keys a seat holds."""
    events, certs = tmp_path / "events.jsonl", tmp_path / "certs"
    first = spawn(first_node("1:3", certs, events), name="first")
    output = first.output
    line = wait_for(lambda: re.search(r"other nodes join with:\n  (\S+ .*run .*)\n", output()), 60, "the join line")
    seat_line = wait_for(lambda: re.search(r"join instead with .*:\n  (\S+ .*run .*)\n", output()), 10, "seat line")
    join, seat = line.group(1), seat_line.group(1)  # type: ignore[union-attr]
    assert "PLIANT_SEAT_KEY" not in join, "the workers' line holds no seat key"
    assert seat.startswith("PLIANT_SEAT_KEY=") and seat.endswith(join), seat
    words = dict(w.split("=", 1) for w in shlex.split(join) if w.startswith("PLIANT_"))
    token = words["PLIANT_JOIN_TOKEN"]
    coordinator = re.search(r"--coordinator (\S+)", join).group(1)  # type: ignore[union-attr]
    pin = re.search(r"--ca-cert-hash (\S+)", join).group(1)  # type: ignore[union-attr]
    wait_for(lambda: read_steps(events), 60, "the first node stepping")

    material = request_certificate(bootstrap_address(coordinator), pin, JOB, "mallory", token)
    etcd_endpoint = re.search(r"embedded etcd (\S+)\)", output()).group(1)  # type: ignore[union-attr]
    members = EtcdMembers([etcd_endpoint], TlsConfig.from_dir(certs / "etcd" / "client"))
    before = members.list()
    [seat0] = before
    peer_port = int(seat0.peer_urls[0].rsplit(":", 1)[1])
    with CoordinatorClient([coordinator], material, retry_for_s=5.0) as mallory:
        grant = mallory.join(JOB, "mallory", "127.0.0.1:1", join_token=token)
        attempts = {
            "no key": dict(ports=(40001, 40002, 40003)),
            "a made-up key": dict(ports=(40001, 40002, 40003), seat_key="m" * 43),
            "the first seat's URL": dict(ports=(40001, 40002, peer_port)),
            "the first seat's URL and a made-up proof": dict(ports=(40001, 40002, peer_port), seat_proof=b"p" * 32),
        }
        for what, kwargs in attempts.items():
            with pytest.raises(PermissionDenied) as refused:
                mallory.claim_seat(JOB, "mallory", "127.0.0.1", **kwargs)  # type: ignore[arg-type]
            assert "seat refused to node mallory" in str(refused.value), (what, refused.value)
        with pytest.raises(PermissionDenied, match="CreateSeatKey needs an admin certificate"):
            mallory.create_seat_key()
        assert [(m.id, m.peer_urls, m.learner) for m in members.list()] == [
            (m.id, m.peer_urls, m.learner) for m in before
        ], "a refused claim added no etcd member"
        mallory.leave(JOB, "mallory", grant.lease_id)
    _stepping_after(events, _newest(events) + 5)  # the job trains on

    # An admin's `pliant seat-key` makes a key that does admit a seat (whoever the admin gives it to).
    made = subprocess.run(
        [sys.executable, "-m", "pliant", "seat-key", "--coordinator", coordinator, "--tls-dir", str(certs / "admin")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    key = re.search(r"PLIANT_SEAT_KEY=(\S+)", made.stdout).group(1)  # type: ignore[union-attr]
    chosen = request_certificate(bootstrap_address(coordinator), pin, JOB, "chosen", token)
    with CoordinatorClient([coordinator], chosen, retry_for_s=5.0) as node:
        node.join(JOB, "chosen", "127.0.0.1:2", join_token=token)
        answer = wait_for(
            lambda: (a := node.claim_seat(JOB, "chosen", "127.0.0.1", (40011, 40012, 40013), key)).granted and a,
            30,
            "a seat for the key's holder",
        )
        assert answer.ca_key_pem and answer.seal_root and len(answer.seat_proof) == 32
    first.kill(15)
    wait_for(lambda: first.proc.poll() is not None, 30, "the first node to stop")
