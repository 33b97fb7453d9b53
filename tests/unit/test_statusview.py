"""A node's view of its job for ``pliant status``: written by its agent, found by job, removed when it exits."""

from __future__ import annotations

import os
import stat

import pytest

from pliant.errors import ConfigError
from pliant.statusview import find_view, remove_view, write_view
from pliant.tls import TlsMaterial

TLS = TlsMaterial(b"CA", b"CERT", b"KEY", None)


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    return tmp_path


def test_the_newest_view_of_a_job_names_its_coordinators_and_certificate() -> None:
    with pytest.raises(ConfigError, match="no pliant agent runs on this machine"):
        find_view(None)
    older = write_view("job", "node-a", TLS, ["10.0.0.1:29400"])
    os.utime(older / "coordinators", (1, 1))
    newer = write_view("job", "node-b", TLS, ["10.0.0.2:29400", "10.0.0.3:29400"])
    view = find_view(None)
    assert (view.job, view.coordinators, view.tls_dir) == ("job", "10.0.0.2:29400,10.0.0.3:29400", newer)
    assert (newer / "tls.key").read_bytes() == b"KEY"
    assert stat.S_IMODE((newer / "tls.key").stat().st_mode) == 0o600
    assert stat.S_IMODE(newer.stat().st_mode) == 0o700
    with pytest.raises(ConfigError, match="no pliant agent of job 'other' runs"):
        find_view("other")
    write_view("other", "node-c", TLS, ["10.0.0.4:29400"])
    with pytest.raises(ConfigError, match=r"several jobs \(job, other\); name one with --job"):
        find_view(None)
    assert find_view("other").coordinators == "10.0.0.4:29400"
    remove_view("job", "node-b")
    assert find_view("job").tls_dir == older
    remove_view("job", "node-a")
    assert find_view(None).job == "other"
