"""CLI flag handling: bad flags give a clear error naming the value and the fix."""

from __future__ import annotations

import socket

import pytest

from pliant.cli import main
from pliant.coordinator.server import CoordinatorConfig
from pliant.errors import ConfigError
from pliant.net import cannot_listen, parse_host_port


def test_coordinator_requires_etcd(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("PLIANT_ETCD", raising=False)
    with pytest.raises(SystemExit, match="--etcd is required"):
        main(["coordinator", "--listen", "127.0.0.1:0"])


def test_bad_listen_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["coordinator", "--etcd", "http://127.0.0.1:2379", "--listen", "nowhere", "--insecure"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--listen 'nowhere' is not HOST:PORT" in err


def test_max_workers_reaches_the_replica_and_bounds_its_watch_streams(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["coordinator", "--etcd", "http://127.0.0.1:2379", "--insecure", "--max-workers", "3"])
    assert code == 2
    assert "--max-workers 3 must be at least 4" in capsys.readouterr().err
    config = CoordinatorConfig(etcd_endpoints=("http://127.0.0.1:2379",), insecure=True, max_workers=5500)
    assert (config.max_watch_streams, config.max_concurrent_rpcs) == (4950, 55000)


def test_unknown_flag_exits_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["coordinator", "--bogus"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"etcd_endpoints": ()}, "no etcd endpoint"),
        ({"etcd_endpoints": ("http://h:x",)}, "--etcd endpoint 'http://h:x'"),
        ({"prefix": "pliant"}, "--prefix 'pliant' must start with '/'"),
        ({"leader_ttl_s": 1}, "--leader-ttl 1"),
        ({"max_workers": 2}, "--max-workers 2 must be at least 4"),
    ],
)
def test_config_validation(kwargs: dict, needle: str) -> None:
    args = {"etcd_endpoints": ("http://127.0.0.1:2379",), "insecure": True, **kwargs}
    with pytest.raises(ConfigError, match=needle):
        CoordinatorConfig(**args)


def test_parse_host_port() -> None:
    assert parse_host_port("http://10.0.0.1:2379") == ("10.0.0.1", 2379)
    assert parse_host_port("[::1]:80") == ("::1", 80)
    assert parse_host_port("0.0.0.0:0", allow_zero=True) == ("0.0.0.0", 0)
    with pytest.raises(ConfigError, match="'h:0'"):
        parse_host_port("h:0")


def test_cannot_listen_names_what_is_in_the_way() -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        assert cannot_listen("127.0.0.1", port) == "Address already in use"
    assert cannot_listen("127.0.0.1", port) == ""
    assert cannot_listen("127.0.0.1", 70000) == "70000 is not a port (1-65535)"


def test_env_is_the_default_for_flags(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PLIANT_ETCD", "http://127.0.0.1:2379")
    monkeypatch.setenv("PLIANT_LISTEN", "bad-listen")
    assert main(["coordinator", "--insecure"]) == 2
    assert "'bad-listen'" in capsys.readouterr().err
