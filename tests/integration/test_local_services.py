"""The node's local services are closed to other local users: the embedded etcd of ``pliant run`` and ``pliant etcd``
serve mutual TLS from a CA of their own, so no client without the coordinator's etcd certificate reads or writes a
key (not even one holding an agent certificate of the run)."""

from __future__ import annotations

import re
import stat
import sys
from pathlib import Path

import etcd3
import psutil
import pytest

from tests.conftest import wait_for
from tests.integration.harness import PLIANT, SCRIPT, first_node, read_steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _refused(host: str, port: int, **tls: str) -> str:
    """What etcd answers a client with ``tls`` files (none: plaintext); "" if it served the request."""
    client = etcd3.client(host=host, port=port, timeout=3, **tls)
    try:
        client.get("/pliant/v1/seal-root")
    except Exception as exc:  # the handshake or the call fails: refused
        return f"{type(exc).__name__}: {exc}"[:200] or type(exc).__name__
    finally:
        client.close()
    return ""


def test_the_embedded_etcd_serves_only_the_coordinator(spawn, tmp_path: Path) -> None:
    events, certs = tmp_path / "events.jsonl", tmp_path / "certs"
    run = spawn(first_node("1", certs, events), name="run")
    endpoint = wait_for(lambda: re.search(r"embedded etcd https://([\d.]+):(\d+)", run.output()), 60, "etcd's URL")
    wait_for(lambda: read_steps(events), 60, "training through the TLS etcd")
    host, port = endpoint.group(1), int(endpoint.group(2))  # type: ignore[union-attr]
    assert _refused(host, port), "plaintext was served"
    assert _refused(host, port, ca_cert=str(certs / "etcd" / "ca.crt")), "a client without a certificate was served"
    agent = certs / "self"  # the run's own agent certificate: another CA's, not etcd's
    assert _refused(
        host,
        port,
        ca_cert=str(certs / "etcd" / "ca.crt"),
        cert_cert=str(agent / "tls.crt"),
        cert_key=str(agent / "tls.key"),
    ), "an agent certificate opened etcd"
    client = certs / "etcd" / "client"
    assert not _refused(
        host, port, ca_cert=str(client / "ca.crt"), cert_cert=str(client / "tls.crt"), cert_key=str(client / "tls.key")
    ), "the coordinator's etcd certificate was refused"
    for key in (client / "tls.key", certs / "etcd" / "server" / "tls.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    assert stat.S_IMODE((certs / "etcd").stat().st_mode) == 0o700
    run.kill(15)
    wait_for(lambda: run.proc.poll() is not None, 30, "the run to stop")


def test_pliant_etcd_serves_mutual_tls_and_prints_the_coordinators_flags(spawn, tmp_path: Path) -> None:
    from pliant.net import free_port

    port = free_port()
    etcd = spawn(
        [sys.executable, "-m", "pliant", "etcd", "--port", str(port), "--certs-dir", str(tmp_path / "c")], name="etcd"
    )
    flags = wait_for(
        lambda: re.search(r"--etcd (\S+) --etcd-cacert (\S+) --etcd-cert (\S+) --etcd-key (\S+)", etcd.output()),
        60,
        "the coordinator's flags",
    )
    url, ca, cert, key = flags.groups()  # type: ignore[union-attr]
    assert url == f"https://127.0.0.1:{port}"
    assert _refused("127.0.0.1", port)
    assert not _refused("127.0.0.1", port, ca_cert=ca, cert_cert=cert, cert_key=key)
    etcd.kill(15)
    wait_for(lambda: etcd.proc.poll() is not None, 30, "etcd to stop")


def test_what_a_killed_run_leaves_is_removed_by_the_next_one(spawn, tmp_path: Path) -> None:
    """``pliant run`` killed with kill -9 leaves its scratch directories (the embedded etcd's data, over 100 MB; the
    run's certificates; the agent's progress, metrics and buddy-copy folders); the next run on the machine removes
    them at its start, and its own stay while it runs."""
    scratch_dir = tmp_path / "tmp"
    scratch_dir.mkdir()
    env = {"TMPDIR": str(scratch_dir)}
    argv = [*PLIANT, "run", "--nproc-per-node", "1", "--snapshot-dir", str(scratch_dir)]
    argv += [str(SCRIPT), "--steps", "100000", "--step-time", "0.03"]
    first = spawn([*argv, "--events", str(tmp_path / "first.jsonl")], name="first", env=env)
    wait_for(lambda: read_steps(tmp_path / "first.jsonl"), 60, "the first run training")
    left = _pliant_dirs(scratch_dir)
    kinds = ("pliant-etcd-", "pliant-certs-", "pliant-progress-", "pliant-metrics-", "pliant-snapshots-")
    assert all(any(name.startswith(kind) for name in left) for kind in kinds), left
    first.kill(9)
    wait_for(lambda: not _running_in(scratch_dir), 30, "the first run's etcd and workers to die with it")
    assert _pliant_dirs(scratch_dir) == left, "kill -9 removes nothing"

    second = spawn([*argv, "--events", str(tmp_path / "second.jsonl")], name="second", env=env)
    wait_for(lambda: read_steps(tmp_path / "second.jsonl"), 60, "the second run training")
    now = _pliant_dirs(scratch_dir)
    assert not set(now) & set(left), f"the killed run's directories stayed: {set(now) & set(left)}"
    assert all(any(name.startswith(kind) for name in now) for kind in kinds), now
    second.kill(15)
    wait_for(lambda: second.proc.poll() is not None, 30, "the second run to stop")
    assert not _pliant_dirs(scratch_dir), "a run that ends removes its own"


def _pliant_dirs(directory: Path) -> list[str]:
    """What pliant made in ``directory`` (torch keeps a compile cache there too)."""
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("pliant-"))


def _running_in(directory: Path) -> list[int]:
    """Processes whose command line names ``directory`` (the killed run's etcd, zygote and workers)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if str(directory) in " ".join(proc.info["cmdline"] or []):
            found.append(proc.info["pid"])
    return found
