"""torchrun-compatible launch flags become an AgentConfig; bad values are named with the fix."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from unittest import mock

import pytest

from pliant.agent.launch_flags import add_launch_flags
from pliant.agent.launcher import config_from_args
from pliant.agent.workers import WorkerCommand, worker_base_env
from pliant.errors import ConfigError

SCRIPT = str(Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py")


def parse(mode: str, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_launch_flags(parser, mode)
    return parser.parse_args(["--insecure", *argv])


def test_torchrun_spellings_are_accepted() -> None:
    args = parse(
        "run",
        "--nnodes=1:3",
        "--nproc_per_node=2",
        "--rdzv_id=j7",
        "--rdzv-endpoint",
        "h:29400",
        "--max_restarts",
        "5",
        "--rdzv-backend",
        "c10d",
        "--rdzv-conf",
        "join_timeout=90,last_call=5",
        "--monitor-interval",
        "1",
        SCRIPT,
        "--lr",
        "0.1",
    )
    config = config_from_args(args, ["h:29400"], embedded=False)
    spec = config.spec
    assert (spec.job_id, spec.min_nodes, spec.max_nodes, spec.nproc_per_node, spec.max_restarts) == ("j7", 1, 3, 2, 5)
    assert spec.min_nodes_timeout_s == 90.0, "torchrun's join_timeout sets the min-nodes timeout"
    assert config.coordinator == ("h:29400",)
    assert config.command == (SCRIPT, "--lr", "0.1")


def test_module_and_no_python_commands() -> None:
    module = config_from_args(parse("run", "-m", "pkg.train", "--x"), ["h:1"], embedded=True)
    assert WorkerCommand.from_launch(module.command, module.no_python) == WorkerCommand(("pkg.train", "--x"), True)
    plain = config_from_args(parse("run", "--no-python", "echo", "hi"), ["h:1"], embedded=True)
    cmd = WorkerCommand.from_launch(plain.command, plain.no_python)
    assert cmd.cold() == ["echo", "hi"]


def test_the_preload_is_read_from_the_script_unless_named_or_turned_off() -> None:
    assert config_from_args(parse("run", SCRIPT), ["h:1"], embedded=True).preload is None
    named = config_from_args(parse("run", "--preload", "transformers, datasets", SCRIPT), ["h:1"], embedded=True)
    assert named.preload == ("transformers", "datasets")
    assert config_from_args(parse("run", "--no-preload", SCRIPT), ["h:1"], embedded=True).preload == ()
    with pytest.raises(SystemExit):  # argparse: not allowed with each other
        parse("run", "--preload", "x", "--no-preload", SCRIPT)


def test_host_defaults_to_loopback_with_the_embedded_control_plane() -> None:
    assert config_from_args(parse("run", SCRIPT), ["h:1"], embedded=True).host == "127.0.0.1"


def test_the_snapshot_interval_is_automatic_unless_fixed() -> None:
    assert config_from_args(parse("run", SCRIPT), ["h:1"], embedded=True).snapshot_every is None
    fixed = config_from_args(parse("run", "--snapshot-every", "16", SCRIPT), ["h:1"], embedded=True)
    assert fixed.snapshot_every == 16


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (("--nnodes", "0"), "--nnodes '0' must have 1 <= MIN <= MAX"),
        (("--nnodes", "2:x"), "--nnodes '2:x' must be N or MIN:MAX"),
        (("--nproc-per-node", "many"), "--nproc-per-node 'many'"),
        (("--metrics-port", "70000"), "--metrics-port 70000 must be in 0..65535"),
        (("--snapshot-every", "0"), "--snapshot-every 0 must be 'auto' or at least 1"),
        (("--snapshot-every", "often"), "--snapshot-every 'often' must be 'auto' or a whole number"),
        (("--preload", "transformers,my-pkg"), "'my-pkg' is not a module name"),
        (("--preload", " , "), "names no module; pass e.g. --preload transformers, or --no-preload"),
    ],
)
def test_bad_values(argv: tuple[str, ...], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        config_from_args(parse("run", *argv, SCRIPT), ["h:1"], embedded=True)


def test_workers_get_one_openmp_thread_when_sharing_a_node() -> None:
    assert worker_base_env(2, {})["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in worker_base_env(1, {})
    assert worker_base_env(4, {"OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3", "the user's choice wins"


def test_workers_never_hold_the_agents_credentials() -> None:
    """The join token and the seat key stay with the agent: a worker runs the user's code."""
    env = worker_base_env(1, {"PLIANT_JOIN_TOKEN": "t" * 43, "PLIANT_SEAT_KEY": "k" * 43, "HOME": "/h"})
    assert "PLIANT_JOIN_TOKEN" not in env and "PLIANT_SEAT_KEY" not in env and env["HOME"] == "/h"


def test_workers_get_huge_pages_for_large_host_tensors_unless_the_user_chose() -> None:
    assert worker_base_env(1, {})["THP_MEM_ALLOC_ENABLE"] == "1"
    assert worker_base_env(2, {"THP_MEM_ALLOC_ENABLE": "0"})["THP_MEM_ALLOC_ENABLE"] == "0"


PIN = "sha256:" + "ab" * 32


def test_the_printed_join_command_names_no_file_of_this_machine_but_the_shared_checkpoint_dir() -> None:
    import shlex
    import sys

    from pliant.agent.commands import _join_command

    args = parse("run", "--checkpoint-dir", "shared/ckpt", "--nnodes", "1:2", SCRIPT, "--steps", "5")
    command = _join_command(args, "10.0.0.1:29400", PIN, "-TOKEN")
    assign, *argv = shlex.split(command)
    assert assign == "PLIANT_JOIN_TOKEN=-TOKEN", "the token is in the environment, off the command line ps shows"
    assert argv[0] == "pliant" or argv[:3] == [sys.executable, "-m", "pliant"], argv
    rest = argv[argv.index("run") + 1 :]
    expected = ["--coordinator", "10.0.0.1:29400", "--ca-cert-hash", PIN, "--job", "default"]
    assert rest[:6] == expected and "-TOKEN" not in rest
    assert "--tls-dir" not in rest
    assert f"--checkpoint-dir {Path('shared/ckpt').resolve()}" in command and command.endswith("--steps 5")
    # Pasted, it parses back to the same token, even one that starts with "-" (as a URL-safe token may).
    with mock.patch.dict(os.environ, {"PLIANT_JOIN_TOKEN": assign.split("=", 1)[1]}):
        parsed = parse("run", *rest)
    assert parsed.join_token == "-TOKEN" and parsed.ca_cert_hash == PIN
    insecure = shlex.split(_join_command(args, "10.0.0.1:29400", "", "T" * 20))
    assert "--insecure" in insecure and insecure[0] == "PLIANT_JOIN_TOKEN=" + "T" * 20


def test_a_bootstrap_join_needs_a_token_and_a_well_formed_pin() -> None:
    agent = ("--coordinator", "10.0.0.1:29400")
    upper = PIN.upper().replace("SHA", "sha")
    flags = parse("run", *agent, "--ca-cert-hash", upper, "--join-token=" + "t" * 22, SCRIPT)
    config = config_from_args(flags, ["10.0.0.1:29400"], embedded=False)
    assert config.ca_cert_hash == PIN and config.bootstrap == ("10.0.0.1:29401",) and config.tls is None
    with pytest.raises(ConfigError, match="needs the job's join token"):
        config_from_args(parse("run", *agent, "--ca-cert-hash", PIN, SCRIPT), ["10.0.0.1:29400"], embedded=False)
    md5 = parse("run", *agent, "--ca-cert-hash", "md5:00", "--join-token=" + "t" * 22, SCRIPT)
    with pytest.raises(ConfigError, match="is not sha256:<64 hex digits>"):
        config_from_args(md5, ["10.0.0.1:29400"], embedded=False)


def test_the_advertised_address_is_the_listen_address_or_the_route_to_the_coordinator() -> None:
    assert config_from_args(parse("run", SCRIPT), ["h:1"], embedded=True).host == "127.0.0.1"
    assert config_from_args(parse("run", "--listen", "127.0.0.3:0", SCRIPT), ["h:1"], embedded=True).host == "127.0.0.3"
    wildcard = config_from_args(parse("run", "--listen", "0.0.0.0:29400", SCRIPT), ["h:1"], embedded=True).host
    assert wildcard and wildcard != "0.0.0.0"
    joined = config_from_args(parse("agent", "--coordinator", "127.0.0.1:9", SCRIPT), ["127.0.0.1:9"], embedded=False)
    assert joined.host == "127.0.0.1", "the route to a coordinator on this machine is loopback"
    given = parse("run", "--host", "10.1.2.3", SCRIPT)
    assert config_from_args(given, ["h:1"], embedded=True).host == "10.1.2.3"


def test_metrics_port_flag_and_env(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert config_from_args(parse("run", SCRIPT), ["h:1"], embedded=True).metrics_port is None
    assert config_from_args(parse("run", "--metrics-port", "9400", SCRIPT), ["h:1"], embedded=True).metrics_port == 9400
    monkeypatch.setenv("PLIANT_METRICS_PORT", "0")
    assert config_from_args(parse("agent", "--coordinator", "h:1", SCRIPT), ["h:1"], embedded=False).metrics_port == 0
    monkeypatch.setenv("PLIANT_METRICS_PORT", "nine")
    with pytest.raises(SystemExit):
        parse("run", SCRIPT)
    assert "--metrics-port: PLIANT_METRICS_PORT='nine' (from the environment) is not a port number" in (
        capsys.readouterr().err
    )
