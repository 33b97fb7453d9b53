"""Bad flags and bad environment values, fed to the CLI as a user would: exit 2, the last line names the value (and
the variable it came from) and what it should be, no traceback; no flag is taken by an abbreviation."""

from __future__ import annotations

import socket

import pytest

from pliant.cli import main
from tests.integration.harness import SCRIPT


def _busy_after_a_free_port() -> socket.socket:
    """A listening socket on a port whose predecessor was free a moment ago: this test's own until now, so that no
    other test's connection took it meanwhile (a case names the port before the busy one)."""
    for _ in range(100):
        with socket.create_server(("127.0.0.1", 0)) as below:
            try:
                return socket.create_server(("127.0.0.1", below.getsockname()[1] + 1))
            except OSError:
                continue
    raise AssertionError("no two free ports in a row on 127.0.0.1")


@pytest.mark.parametrize(
    ("env", "argv", "named"),
    [
        (
            {"PLIANT_METRICS_PORT": "abc"},
            ["coordinator", "--etcd", "http://127.0.0.1:1"],
            "PLIANT_METRICS_PORT='abc' (from the environment) is not a port number; set it to a port number or unset",
        ),
        (
            {"PLIANT_MAX_JOBS": "lots"},
            ["coordinator", "--etcd", "http://127.0.0.1:1"],
            "PLIANT_MAX_JOBS='lots' (from the environment) is not an integer",
        ),
        (
            {"PLIANT_LEADER_TTL": "5s"},
            ["coordinator", "--etcd", "http://127.0.0.1:1"],
            "PLIANT_LEADER_TTL='5s' (from the environment) is not a number of seconds",
        ),
        ({}, ["coordinator", "--metrics-port", "x"], "argument --metrics-port: 'x' is not a port number"),
        ({}, ["run", "--nproc-per-nod", "2", "train.py"], "unrecognized arguments: --nproc-per-nod"),
        ({}, ["run", "--node-rank", "0", "train.py"], "--node-rank is not supported by pliant"),
        ({}, ["job", "create", "j", "--nnodes", "3:1", "--insecure"], "--nnodes '3:1' must have 1 <= MIN <= MAX"),
        (
            {},
            ["run", "--checkpoint-dir", "/proc/no/ckpt", "--nnodes", "1", str(SCRIPT)],
            "--checkpoint-dir /proc/no/ckpt: cannot write there",
        ),
        (
            {"PLIANT_JOIN_TOKEN": "abc"},
            ["run", "--coordinator", "127.0.0.1:1", "--ca-cert-hash", "sha256:" + "0" * 64, str(SCRIPT)],
            "--join-token (or PLIANT_JOIN_TOKEN) of 3 characters is not a join token",
        ),
        (
            {},
            ["run", "--listen", "127.0.0.1:{busy}", str(SCRIPT)],
            "--listen: cannot listen on 127.0.0.1:{busy} (Address already in use); stop what uses it",
        ),
        (
            {},
            ["run", "--listen", "127.0.0.1:{busy_minus_1}", str(SCRIPT)],
            "--listen's port + 1 (the bootstrap join's port): cannot listen on 127.0.0.1:{busy}",
        ),
        (
            {},
            ["run", "--metrics-port", "{busy}", str(SCRIPT)],
            "--metrics-port: cannot listen on 127.0.0.1:{busy} (Address already in use)",
        ),
        (
            {},
            ["run", "--store-port", "{busy}", "--host", "127.0.0.1", str(SCRIPT)],
            "--store-port: cannot listen on 127.0.0.1:{busy} (Address already in use)",
        ),
    ],
)
def test_a_bad_value_is_one_line_naming_it_and_exit_2(
    env: dict[str, str],
    argv: list[str],
    named: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with _busy_after_a_free_port() as busy:  # a port something on this machine listens on
        port = busy.getsockname()[1]
        ports = {"busy": port, "busy_minus_1": port - 1}
        argv, named = [arg.format(**ports) for arg in argv], named.format(**ports)
        with pytest.raises(SystemExit) as exited:
            raise SystemExit(main(argv))
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert len(err.strip().splitlines()) == 1 and named in err, err  # one line, not the usage first
    assert "Traceback" not in err


def test_a_bad_environment_value_does_not_break_help_or_another_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PLIANT_LEADER_TTL", "5s")  # read when the parser is built, converted only when it is used
    with pytest.raises(SystemExit) as exited:
        main(["status", "--help"])
    assert exited.value.code == 0 and "--coordinator" in capsys.readouterr().out
