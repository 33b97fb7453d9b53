"""Shared fixtures: a real etcd on free loopback ports, coordinators in-process and as subprocesses, waiting helpers.

Every process a test starts is registered and killed (with its process group) at teardown; a session-end check fails
the run if any child process is left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.common import PLIANT

ROOT = Path(__file__).resolve().parent.parent
# The processes the tests start log their components' INFO records (quiet is the default): tests read them for what
# happened. A test of the quiet console clears the variable for its own process.
os.environ.setdefault("PLIANT_LOG_LEVEL", "INFO")


POLL_EVERY_S = 0.1  # the longest pause between two polls of a wait that began with shorter ones


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.02) -> object:
    """Poll ``predicate`` until it returns a truthy value; fail the test naming ``what`` after ``timeout_s``.

    The polls begin ``interval_s`` apart and space out to :data:`POLL_EVERY_S` (or ``interval_s`` if longer): a short
    wait ends soon after its condition holds, and a long one does not spend a core re-reading logs and event files.
    """
    deadline = time.monotonic() + timeout_s
    pause, longest = interval_s, max(interval_s, POLL_EVERY_S)
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(pause)
        pause = min(longest, pause * 1.25)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the tests marked ``long`` first (in their order): xdist hands tests out in collection order, and a long
    test that starts last keeps one worker busy after the other has finished."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.fixture(scope="session", autouse=True)
def state_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The user state directory (``XDG_STATE_HOME``) of every ``pliant run`` the tests start: their sealing secret
    (pliant.security.seal) is the session's, not the user's."""
    path = tmp_path_factory.mktemp("state")
    saved = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(path)
    yield path
    if saved is None:
        os.environ.pop("XDG_STATE_HOME", None)
    else:
        os.environ["XDG_STATE_HOME"] = saved


@pytest.fixture(scope="session")
def etcd() -> Iterator[object]:
    """One real etcd server for the session; tests isolate themselves with their own key prefix."""
    from pliant.coordinator.etcd_server import EtcdServer

    server = EtcdServer().start()
    yield server
    server.stop()


@pytest.fixture
def prefix() -> str:
    return f"/test/{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> object:
    """The tests' CA (a :class:`pliant.security.issuance.LocalCA`): coordinator, admin and per-node agent certificates
    on demand."""
    from pliant.security.issuance import LocalCA

    return LocalCA(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def fleet(pki: object) -> Iterator[Callable[..., object]]:
    """``fleet(server_or_addresses, **client_kwargs)``: a :class:`tests.fleet.Fleet` over mutual TLS (plaintext for a
    server started with ``insecure=True``); closed at teardown."""
    from tests.fleet import Fleet

    made: list[Fleet] = []

    def make(target: object, **kwargs: object) -> Fleet:
        insecure = getattr(getattr(target, "config", None), "insecure", False)
        address = getattr(target, "address", target)
        made.append(Fleet(None if insecure else pki, address, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for item in made:
        item.close()


@pytest.fixture
def make_coordinator(etcd: object, prefix: str, pki: object) -> Iterator[Callable[..., object]]:
    """Start in-process coordinator replicas on free ports, with mutual TLS unless ``insecure=True``; all are stopped
    at teardown."""
    from pliant.coordinator.server import CoordinatorConfig, CoordinatorServer
    from tests.fleet import coordinator_tls

    started: list[CoordinatorServer] = []

    def make(replica_id: str = "r0", endpoints: tuple[str, ...] | None = None, **kwargs: object) -> CoordinatorServer:
        kwargs.setdefault("leader_ttl_s", 2.0)
        kwargs.setdefault("resync_s", 1.0)
        kwargs.setdefault("max_workers", 32)
        if not kwargs.get("insecure"):
            kwargs.setdefault("tls", coordinator_tls(pki))  # type: ignore[arg-type]
        config = CoordinatorConfig(
            etcd_endpoints=endpoints or (etcd.endpoint,),  # type: ignore[attr-defined]
            listen=str(kwargs.pop("listen", "127.0.0.1:0")),
            prefix=prefix,
            replica_id=replica_id,
            **kwargs,  # type: ignore[arg-type]
        )
        server = CoordinatorServer(config).start()
        started.append(server)
        return server

    yield make
    for server in reversed(started):
        server.stop(grace_s=0)


class Spawned:
    """A child process started by a test, in its own process group."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env or os.environ.copy()
            )
        self.pid = self.proc.pid

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                return
            if sig == signal.SIGKILL:
                self.proc.wait(10)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Mark an item whose test body failed (``item.failed_call``), so that its fixtures can tell at teardown."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when == "call" and report.failed:
        item.failed_call = True  # type: ignore[attr-defined]


def dump_stacks(children: list[Spawned], settle_s: float = 2.0, tail: int = 30000) -> None:
    """Have the workers (and store hosts) under every live child write their threads' stacks
    (:func:`bench.common.ask_for_stacks`; an agent relays its workers' output to its log), then print the tail of each
    child's log."""
    from bench.common import ask_for_stacks

    asked = sum(ask_for_stacks(child.pid) for child in children if child.proc.poll() is None)
    if asked:
        time.sleep(settle_s)
    for child in children:
        text = child.output()
        print(
            f"\n===== {child.log.name} (last {min(tail, len(text))} of {len(text)} chars; {asked} processes "
            "asked for their stacks) ====="
        )
        print(text[-tail:])


@pytest.fixture
def spawn(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., Spawned]]:
    """Start child processes in their own process groups; SIGKILL every group at teardown, after a failed test has
    had their workers dump their stacks (:func:`dump_stacks`)."""
    children: list[Spawned] = []

    def start(args: list[str], name: str = "proc", env: dict[str, str] | None = None) -> Spawned:
        child = Spawned(args, tmp_path / f"{name}-{len(children)}.log", env)
        children.append(child)
        return child

    yield start
    if getattr(request.node, "failed_call", False):
        dump_stacks(children)
    for child in children:
        child.kill()


def health_serving(address: str, ca: object | None = None) -> bool:
    """True when the gRPC health service at ``address`` answers SERVING (over mutual TLS as an admin with ``ca``)."""
    from tests.fleet import secure_channel

    with secure_channel(ca, address) as channel:  # type: ignore[arg-type]
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=0.5)
        except grpc.RpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING


TEST_JOIN_TOKEN = "integration-test-join-token"


@pytest.fixture
def spawn_agent(spawn: Callable[..., Spawned], pki: object, fleet: Callable[..., object]) -> Callable[..., Spawned]:
    """``spawn_agent(server, argv, name)``: run ``pliant agent`` argv as a real node does against a TLS coordinator.

    The first agent of a job has its job created by an admin (the spec its own flags describe, with a test token);
    every agent gets its own node's certificate (``--tls-dir``) and the token (``--join-token``).
    """
    import argparse

    from pliant.agent.launch_flags import add_launch_flags
    from pliant.agent.launcher import config_from_args
    from tests.fleet import agent_tls

    created: set[tuple[str, str]] = set()

    def start(
        server: object,
        argv: list[str],
        name: str = "agent",
        env: dict[str, str] | None = None,
        node: object | None = None,
    ) -> Spawned:
        """``node``: a :class:`bench.netns.Node` to run the agent in (its namespace; gloo on its interface)."""
        at = argv.index("agent") + 1
        parser = argparse.ArgumentParser()
        add_launch_flags(parser, "agent")
        config = config_from_args(parser.parse_args(["--insecure", *argv[at:]]), ["127.0.0.1:1"], embedded=False)
        key = (server.address, config.spec.job_id)  # type: ignore[attr-defined]
        if key not in created:
            fleet(server).create_job(config.spec, TEST_JOIN_TOKEN)  # type: ignore[attr-defined]
            created.add(key)
        tls_dir = str(Path(agent_tls(pki, config.node_id).cert).parent)  # type: ignore[arg-type]
        args = [*argv[:at], "--tls-dir", tls_dir, "--join-token", TEST_JOIN_TOKEN, *argv[at:]]
        # Every agent is a host of its own to NCCL, which refuses two ranks of one communicator on one GPU of one
        # host: on a one-GPU machine the nodes' ranks share it (over NCCL's network transport). Ignored on CPU.
        # And these nodes share this machine's cores (two tests at a time): one torch thread per worker, where a real
        # node with one worker would use all of its cores (the agent sets 1 only for several workers per node).
        env = {"NCCL_HOSTID": f"pliant-test-{config.node_id}", "OMP_NUM_THREADS": "1", **(env or {})}
        if node is not None:
            args = ["ip", "netns", "exec", node.netns, *args]  # type: ignore[attr-defined]
            env = {**env, "GLOO_SOCKET_IFNAME": node.ifname}  # type: ignore[attr-defined]
        return spawn(args, name=name, env={**os.environ, **env})

    return start


@pytest.fixture
def spawn_coordinator(
    spawn: Callable[..., Spawned], etcd: object, prefix: str, pki: object
) -> Callable[..., tuple[Spawned, str]]:
    """Start a coordinator replica as a real ``python -m pliant coordinator`` process with mutual TLS; returns
    (process, address)."""
    from pliant.net import free_port
    from tests.fleet import coordinator_tls

    tls_dir = str(Path(coordinator_tls(pki).cert).parent)  # type: ignore[arg-type]

    def start(
        replica_id: str, leader_ttl_s: float = 2.0, etcd_url: str | None = None, address: str = ""
    ) -> tuple[Spawned, str]:
        address = address or f"127.0.0.1:{free_port()}"
        args = [
            *PLIANT,
            "coordinator",
            "--etcd",
            etcd_url or etcd.endpoint,  # type: ignore[attr-defined]
            "--listen",
            address,
            "--prefix",
            prefix,
            "--tls-dir",
            tls_dir,
            "--leader-ttl",
            str(leader_ttl_s),
            "--replica-id",
            replica_id,
        ]
        child = spawn(args, name=f"coordinator-{replica_id}")
        wait_for(
            lambda: health_serving(address, pki) or child.proc.poll() is not None, 30, f"replica {replica_id} health"
        )
        assert child.proc.poll() is None, child.output()
        return child, address

    return start


@pytest.fixture(autouse=True, scope="session")
def _no_leftover_processes() -> Iterator[None]:
    """Fail the session if a test left a child process running."""
    yield
    me = psutil.Process()
    deadline = time.monotonic() + 10
    left: list[psutil.Process] = []
    while time.monotonic() < deadline:
        left = [p for p in me.children(recursive=True) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not left:
            return
        time.sleep(0.2)
    names = ", ".join(f"{p.pid} {' '.join(p.cmdline()[:4])}" for p in left)
    for p in left:
        p.kill()
    pytest.fail(f"processes left behind by the tests: {names}")


@pytest.fixture(autouse=True, scope="session")
def _no_leftover_scratch() -> Iterator[None]:
    """Remove the scratch directories of the processes the tests killed (the agents' progress, metrics and snapshot
    folders, the runs' certificates, the etcds' data): a process removes its own when it exits, and the next one's
    start those of dead ones (pliant.scratch); this sweeps what the session's last kills left."""
    yield
    import tempfile

    from pliant import scratch
    from pliant.agent import agent, metrics, runcerts, snapshots
    from pliant.coordinator import etcd_server

    kinds = (agent.PROGRESS_PREFIX, metrics.WORKER_METRICS_PREFIX, runcerts.SCRATCH_KIND, etcd_server.SCRATCH_KIND)
    for kind in kinds:
        scratch.sweep(tempfile.gettempdir(), kind)
    if snapshots.usable(None):
        snapshots.sweep(snapshots.usable(None))
