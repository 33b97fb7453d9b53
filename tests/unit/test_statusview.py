"""A node's view of its job for ``pliant status``: served by its agent on a socket that gives the job's status and
nothing else, found by job, gone when the agent stops."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from pliant.coordinator.contract import JobSpec
from pliant.coordinator.convert import spec_to_pb
from pliant.errors import ConfigError
from pliant.statusview import find_view, read_view, serve_view
from pliant.v1 import coordinator_pb2 as pb

pytestmark = pytest.mark.timeout(10)


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    return tmp_path


def _status(job: str) -> bytes:
    return pb.JobStatus(spec=spec_to_pb(JobSpec(job)), reason="running well").SerializeToString()


def test_a_view_answers_with_the_jobs_status_and_goes_with_its_agent(home) -> None:
    with pytest.raises(ConfigError, match="no pliant agent runs on this machine"):
        find_view(None)
    a = serve_view("job", "node-a", lambda: _status("job"))
    assert a is not None
    assert stat.S_IMODE(a.path.parent.stat().st_mode) == 0o700
    name, sockets = find_view(None)
    assert name == "job" and sockets == [a.path]
    assert pb.JobStatus.FromString(read_view(a.path)).reason == "running well"

    def unreachable() -> bytes:
        raise ConnectionError("no coordinator answered at 10.0.0.1:29400 for 10s")

    b = serve_view("job", "node-b", unreachable)
    assert b is not None
    with pytest.raises(ConfigError, match=r"could not be read: no coordinator answered at 10\.0\.0\.1:29400"):
        read_view(b.path)
    other = serve_view("other", "node-c", lambda: _status("other"))
    assert other is not None
    with pytest.raises(ConfigError, match=r"several jobs \(job, other\); name one with --job"):
        find_view(None)
    with pytest.raises(ConfigError, match="no pliant agent of job 'nope' runs"):
        find_view("nope")
    for view in (a, b, other):
        view.close()
    assert not a.path.exists() and not (home / "pliant" / "status" / "job").exists()
    with pytest.raises(ConfigError, match="no pliant agent runs on this machine"):
        find_view(None)


def test_a_view_in_a_state_directory_deeper_than_a_socket_address_is_served_and_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    monkeypatch.setenv("XDG_STATE_HOME", str(deep))
    server = serve_view("job", "node-with-a-long-name", lambda: b"the view")
    assert server is not None and len(str(server.path)) > 108
    try:
        name, sockets = find_view(None)
        assert name == "job" and read_view(sockets[0]) == b"the view"
    finally:
        server.close()
