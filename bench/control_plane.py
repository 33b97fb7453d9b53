"""Control-plane benchmark: a real etcd, two coordinator replicas (subprocesses), simulated agents (gRPC clients).

Measures, in one run:
- lease expiry -> new generation (an agent stops heartbeating);
- leader kill -9 -> next generation published by the other replica;
- N agents joining at once -> one generation (time from the first Join to the generation, and how many were published);
- heartbeat RPC latency p50/p99 with M agents heartbeating at their interval, and etcd writes per heartbeat;
- all of it with mutual TLS on (every simulated agent has its own agent certificate) and off (``--insecure``), in the
  same run, and the cost of TLS as ratios.

Simulated agents are asyncio tasks on grpc.aio, one connection each, so the benchmark client stays cheap next to the
coordinator and etcd on the same machine. The replicas' own metrics (``--metrics-port``) split each figure into
server-side RPC time, etcd time and reconciler passes.

Usage: ``.venv/bin/python bench/control_plane.py [--join-agents 100 500 1000] [--heartbeat-agents 100 500 1000]
[--seconds 10] [--tls both|on|off]`` (about two minutes with both).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import psutil
from common import PLIANT, percentile
from grpc_health.v1 import health_pb2, health_pb2_grpc
from loadgen import Failures, SwarmError, Swarms

from pliant.coordinator.client import CoordinatorClient
from pliant.coordinator.contract import CoordinatorError, Generation, JobSpec
from pliant.coordinator.etcd_server import EtcdServer
from pliant.coordinator.store import EtcdStore
from pliant.net import free_port
from pliant.security.credentials import channel_credentials
from pliant.security.identity import Role
from pliant.security.issuance import IssuedCert, LocalCA
from pliant.security.tlsdir import TlsMaterial


class Security:
    """TLS on (a CA, a certificate per simulated agent) or off (plaintext, ``--insecure``) for one suite."""

    def __init__(self, ca: LocalCA | None) -> None:
        self.ca = ca
        self._creds: dict[str, grpc.ChannelCredentials] = {}

    @property
    def on(self) -> bool:
        return self.ca is not None

    def replica_flags(self) -> list[str]:
        if self.ca is None:
            return ["--insecure"]
        tls = self.ca.issue("coordinator", Role.COORDINATOR, "bench", ["127.0.0.1"])
        return ["--tls-dir", str(Path(tls.cert).parent)]

    @property
    def issuer(self) -> IssuedCert | None:
        """The CA the simulated agents' certificates are issued from (None: plaintext)."""
        return None if self.ca is None else self.ca.ca

    def material(self, who: str) -> TlsMaterial | None:
        """``who``: "admin" or a node id."""
        if self.ca is None:
            return None
        role = Role.ADMIN if who == "admin" else Role.AGENT
        return self.ca.issue(f"{role.value}-{who}", role, who).load()

    def creds(self, who: str) -> grpc.ChannelCredentials:
        if who not in self._creds:
            self._creds[who] = channel_credentials(self.material(who))  # type: ignore[arg-type,assignment]
        return self._creds[who]

    def channel(self, address: str, who: str = "admin") -> grpc.Channel:
        return grpc.insecure_channel(address) if self.ca is None else grpc.secure_channel(address, self.creds(who))

    def aio_channel(self, address: str, who: str) -> grpc.aio.Channel:
        if self.ca is None:
            return grpc.aio.insecure_channel(address)
        return grpc.aio.secure_channel(address, self.creds(who))

    def client(self, addresses: list[str], **kwargs: object) -> CoordinatorClient:
        return CoordinatorClient(addresses, self.material("admin"), **kwargs)  # type: ignore[arg-type]


def start_replica(
    etcd: str, prefix: str, name: str, log_dir: Path, leader_ttl_s: float, security: Security
) -> tuple[subprocess.Popen, str, str]:
    """A coordinator replica subprocess; returns (process, gRPC address, metrics URL)."""
    address, metrics_port = f"127.0.0.1:{free_port()}", free_port()
    with open(log_dir / f"coordinator-{name}.log", "wb") as log:
        proc = subprocess.Popen(
            [
                *PLIANT,
                "coordinator",
                "--etcd",
                etcd,
                "--listen",
                address,
                "--prefix",
                prefix,
                "--leader-ttl",
                str(leader_ttl_s),
                "--replica-id",
                name,
                "--metrics-port",
                str(metrics_port),
                *security.replica_flags(),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 30
    with security.channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5).status == 1:
                    return proc, address, f"http://127.0.0.1:{metrics_port}/metrics"
            except grpc.RpcError:
                time.sleep(0.05)
    raise SystemExit(f"replica {name} did not become healthy; see {log_dir}")


def wait_generation(client: CoordinatorClient, job: str, number: int, timeout_s: float = 30) -> Generation | None:
    """Follow the job's watch until generation ``number`` arrives; None when it has not within ``timeout_s`` (the
    watch runs in a thread of its own, so a stream that brings nothing never holds the benchmark)."""
    found: list[Generation] = []
    done = threading.Event()

    def follow() -> None:
        try:
            for event in client.watch(job, number):
                if event.generation is not None and event.generation.number >= number:
                    found.append(event.generation)
                    return
        except CoordinatorError:
            return
        finally:
            done.set()

    threading.Thread(target=follow, name=f"watch {job}", daemon=True).start()
    done.wait(timeout_s)
    return found[0] if found else None


def _generation(client: CoordinatorClient, job: str, number: int) -> Generation:
    """:func:`wait_generation` for the small scenarios, whose generations come within seconds or never."""
    gen = wait_generation(client, job, number)
    if gen is None:
        raise ScenarioFailed(f"generation {number} of job {job} did not come within 30 s")
    return gen


class ScenarioFailed(Exception):
    """A scenario could not measure what it measures; the benchmark reports why and goes on."""


def _scenario(run: Any, *args: Any) -> Any:
    """``run(*args)``, or the :class:`ScenarioFailed` that says why it could not measure."""
    try:
        return run(*args)
    except SwarmError as exc:
        raise ScenarioFailed(str(exc)) from exc


def lease_expiry(client: CoordinatorClient, ttl_s: float) -> float:
    _info, _created, token = client.create_job(JobSpec("expiry", 1, 2, heartbeat_ttl_s=ttl_s, join_grace_s=0.1))
    keep = client.join("expiry", "keeper", "127.0.0.1:1", join_token=token)
    lost = client.join("expiry", "lost", "127.0.0.1:2", join_token=token)
    _generation(client, "expiry", 1)
    stop = threading.Event()

    def keepalive() -> None:
        while not stop.wait(ttl_s / 4):
            client.heartbeat("expiry", "keeper", keep.lease_id)

    threading.Thread(target=keepalive, daemon=True).start()
    client.heartbeat("expiry", "lost", lost.lease_id)
    last = time.monotonic()
    _generation(client, "expiry", 2)
    took = time.monotonic() - last
    stop.set()
    return took


def leader_kill(client: CoordinatorClient, store: EtcdStore, procs: dict[str, subprocess.Popen]) -> tuple[float, str]:
    _info, _created, token = client.create_job(JobSpec("failover", 1, 4, heartbeat_ttl_s=30, join_grace_s=0))
    client.join("failover", "n1", "127.0.0.1:1", join_token=token)
    _generation(client, "failover", 1)
    leader = store.leader()[0]
    os.killpg(procs[leader].pid, signal.SIGKILL)
    killed = time.monotonic()
    client.join("failover", "n2", "127.0.0.1:2", join_token=token)
    _generation(client, "failover", 2)
    return time.monotonic() - killed, leader


def _retire(store: EtcdStore, admin: CoordinatorClient, job: str, leases: list[int]) -> None:
    """End a scenario's job and revoke its simulated agents' leases now, so that they do not expire in the middle of
    the next scenario's measurement."""
    admin.finish_job(job, True, "benchmark scenario done")
    for lease_id in leases:
        with contextlib.suppress(grpc.RpcError):  # gone with the finished job already
            store.client.revoke_lease(lease_id)


def replica_cpu_s(pids: list[int]) -> float:
    """CPU seconds the coordinator replicas have used so far (user + system), to split the service's own cost from
    the simulated agents' on a shared machine."""
    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            continue
    return total


def join_burst(
    addresses: list[str], store: EtcdStore, n: int, metrics: list[str], security: Security, pids: list[int], args
) -> tuple[float | None, int, list[str], float, float, Failures]:
    """N agents join at once (spread over ``--load-processes`` processes). Returns (seconds to the generation, None
    when not every agent joined; generations published; a timeline of where the time went; seconds the N connections
    took to open (TLS handshakes included); the replicas' CPU milliseconds per Join; the Joins that failed)."""
    job = f"burst{n}"
    with security.client(addresses) as admin:
        _info, _created, token = admin.create_job(JobSpec(job, n, n, heartbeat_ttl_s=30, join_grace_s=0.5))
        with Swarms(addresses, n, args.load_processes, security.issuer, address_base=10000) as swarms:
            connect = swarms.connect()
            server_before, cpu = _scrape(metrics), replica_cpu_s(pids)
            start = time.monotonic() + 0.2
            wall0 = time.time() + (start - time.monotonic())
            leases, returned, failures = swarms.join(job, token, start)
            cpu = replica_cpu_s(pids) - cpu
            joined = [lease for lease in leases if lease]
            first, last = min(returned, default=start), max(returned, default=start)
            if failures:  # the job needs all n: no generation comes
                _retire(store, admin, job, joined)
                timeline = [f"  {len(joined)} of {n} Joins returned, by +{last - start:.3f} s; failed: {failures}"]
                return None, 0, timeline, connect, 1e3 * cpu / n, failures
            gen = wait_generation(admin, job, 1, timeout_s=120)
            seen = time.monotonic()
            if gen is None:
                _retire(store, admin, job, joined)
                timeline = [f"  every Join returned by +{last - start:.3f} s; no generation within 120 s (see logs)"]
                return None, 0, timeline, connect, 1e3 * cpu / n, failures
            time.sleep(1.0)  # anything else published would show up now
            published = admin.get_job(job).generation.number
            server = _delta(_scrape(metrics), server_before)
            _retire(store, admin, job, joined)
    assert gen.world_size == n
    created = gen.created_at - wall0  # the reconciler's clock (wall) relative to the start
    timeline = [
        f"  first Join returned   +{first - start:.3f} s",
        f"  last Join returned    +{last - start:.3f} s  (server-side Join mean {_mean(server, 'Join'):.1f} ms; "
        f"etcd 'join' operation mean {_mean(server, 'join', 'etcd'):.1f} ms)",
        f"  generation planned    +{created:.3f} s  (reconciler passes: {server.get('plans', 0):.0f}, "
        f"mean {server.get('plan_read_ms', 0.0):.1f} ms etcd read per pass)",
        f"  watch delivered it    +{seen - start:.3f} s",
    ]
    return seen - start, published, timeline, connect, 1e3 * cpu / n, failures


def _scrape(urls: list[str]) -> dict[str, float]:
    """Every sample of the replicas' metrics, summed over the replicas."""
    out: dict[str, float] = {}
    for url in urls:
        with urllib.request.urlopen(url, timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if line[:1] != "#":
                    name, value = line.rsplit(" ", 1)
                    out[name] = out.get(name, 0.0) + float(value)
    return out


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    out = {k: v - before.get(k, 0.0) for k, v in after.items()}
    out["plans"] = out.get("pliant_coordinator_plan_duration_seconds_count", 0.0)
    reads = out.get('pliant_coordinator_etcd_operation_duration_seconds_count{operation="read_job"}', 0.0)
    total = out.get('pliant_coordinator_etcd_operation_duration_seconds_sum{operation="read_job"}', 0.0)
    out["plan_read_ms"] = 1e3 * total / reads if reads else 0.0
    return out


def _mean(delta: dict[str, float], name: str, kind: str = "rpc") -> float:
    if kind == "rpc":
        key = f'pliant_coordinator_rpc_duration_seconds_{{}}{{{{method="{name}"}}}}'
    else:
        key = f'pliant_coordinator_etcd_operation_duration_seconds_{{}}{{{{operation="{name}"}}}}'
    count = delta.get(key.format("count"), 0.0)
    return 1e3 * delta.get(key.format("sum"), 0.0) / count if count else 0.0


def heartbeats(
    addresses: list[str],
    store: EtcdStore,
    agents: int,
    metrics: list[str],
    security: Security,
    pids: list[int],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Each simulated agent joins, then heartbeats every TTL/4 with an advancing step, as a training agent does;
    latencies are measured in a window of ``--seconds`` once every agent has joined and is in its rhythm."""
    job, ttl = f"hb{agents}", args.heartbeat_ttl
    interval = ttl / 4
    with security.client(addresses) as admin:
        _info, _created, token = admin.create_job(JobSpec(job, 1, agents, heartbeat_ttl_s=ttl, join_grace_s=1))
    with Swarms(addresses, agents, args.load_processes, security.issuer) as swarms:
        swarms.connect()
        start = time.monotonic() + 0.2
        leases, returned, join_failures = swarms.join(job, token, start)
        join_seconds = max(returned, default=start) - start
        window = (time.monotonic() + interval * 1.5, 0.0)  # every agent is in its rhythm by then
        window = (window[0], window[0] + args.seconds)
        swarms.begin_beats(job, interval, window, window[1] + 0.2)
        time.sleep(max(0.0, window[0] - time.monotonic()))
        cpu, load_cpu = replica_cpu_s(pids), replica_cpu_s(swarms.pids)
        rev_before = store.client.status().raft_index
        server_before = _scrape(metrics)
        time.sleep(max(0.0, window[1] - time.monotonic()))
        cpu, load_cpu = replica_cpu_s(pids) - cpu, replica_cpu_s(swarms.pids) - load_cpu
        server = _delta(_scrape(metrics), server_before)
        writes = store.client.status().raft_index - rev_before
        latencies, beat_failures = swarms.end_beats()
    joined = [lease for lease in leases if lease]
    with security.client(addresses) as admin:
        _retire(store, admin, job, joined)
    calls = max(1, len(latencies))
    return {
        "joined": len(joined),
        "join_failures": join_failures,
        "beat_failures": beat_failures,
        "calls": len(latencies),
        "p50": percentile(latencies, 0.5),
        "p99": percentile(latencies, 0.99),
        "writes": writes / calls,
        "join_s": join_seconds,
        "server_mean_ms": _mean(server, "Heartbeat"),
        "cpu_us": 1e6 * cpu / calls,
        "load_cpu_us": 1e6 * load_cpu / calls,
        "cpu_cores": cpu / args.seconds,
    }


def run_suite(
    args: argparse.Namespace, security: Security, log_dir: Path
) -> tuple[list[tuple[str, str]], list[str], dict[str, float]]:
    """Every scenario against fresh etcd and replicas. Returns (rows, timelines, key figures for the TLS ratios)."""
    rows: list[tuple[str, str]] = []
    timelines: list[str] = []
    figures: dict[str, float] = {}
    mode = "tls" if security.on else "plain"
    with EtcdServer(log_path=str(log_dir / f"etcd-{mode}.log")) as etcd:
        prefix = "/bench"
        procs, addresses, metrics = {}, [], []
        for name in ("A", "B"):
            procs[name], address, url = start_replica(etcd.endpoint, prefix, name, log_dir, args.leader_ttl, security)
            addresses.append(address)
            metrics.append(url)
        store = EtcdStore([etcd.endpoint], prefix)
        pids = [proc.pid for proc in procs.values()]
        try:
            with security.client(addresses, retry_for_s=30) as client:
                try:
                    took = lease_expiry(client, args.ttl)
                    rows.append((f"lease expiry -> new generation (TTL {args.ttl:g}s)", f"{took:.2f} s"))
                except ScenarioFailed as exc:
                    rows.append((f"lease expiry -> new generation (TTL {args.ttl:g}s)", f"failed: {exc}"))
                # Simulated agents spread over both replicas; the leader (A, elected first) also reconciles. Joins
                # and plans are timed by the replicas' own metrics.
                for n in args.join_agents:
                    try:
                        took, published, timeline, connect, cpu_ms, _failures = _scenario(
                            join_burst, addresses, store, n, metrics, security, pids, args
                        )
                    except ScenarioFailed as exc:
                        rows.append((f"{n} agents join -> one generation", f"failed: {exc}"))
                        continue
                    outcome = (
                        f"{took:.3f} s ({published} published, replicas' CPU {cpu_ms:.2f} ms per Join)"
                        if took is not None
                        else f"no generation: {timeline[-1].strip()}"
                    )
                    rows.append((f"{n} agents join -> one generation", outcome))
                    figures[f"cpujoin{n}"] = cpu_ms
                    rows.append((f"{n} agents open their connections", f"{connect:.3f} s"))
                    timelines.append(f"[{mode}] {n} agents joining at once:\n" + "\n".join(timeline))
                    figures[f"join{n}"], figures[f"connect{n}"] = took if took is not None else float("nan"), connect
                for n in args.heartbeat_agents:
                    try:
                        hb = _scenario(heartbeats, addresses, store, n, metrics, security, pids, args)
                    except ScenarioFailed as exc:
                        rows.append((f"heartbeat RPC, {n} agents", f"failed: {exc}"))
                        continue
                    rows.append(
                        (
                            f"heartbeat RPC, {n} agents ({hb['calls']:.0f} calls in {args.seconds:g}s)",
                            f"p50 {hb['p50'] * 1e3:.1f} ms, p99 {hb['p99'] * 1e3:.1f} ms (server-side mean "
                            f"{hb['server_mean_ms']:.2f} ms)",
                        )
                    )
                    rows.append((f"etcd raft entries per heartbeat, {n} agents", f"{hb['writes']:.3f}"))
                    rows.append(
                        (
                            f"CPU per heartbeat, {n} agents",
                            f"replicas {hb['cpu_us']:.0f} us ({hb['cpu_cores']:.2f} cores), simulated agents "
                            f"{hb['load_cpu_us']:.0f} us",
                        )
                    )
                    figures[f"cpuhb{n}"] = hb["cpu_us"] / 1e3
                    joined = f"{hb['join_s']:.2f} s" + (
                        f" ({hb['joined']} of {n}; failed: {hb['join_failures']})" if hb["join_failures"] else ""
                    )
                    rows.append((f"{n} agents all joined (concurrent Joins)", joined))
                    if hb["beat_failures"]:
                        rows.append((f"heartbeats that failed, {n} agents", str(hb["beat_failures"])))
                    figures[f"p50_{n}"], figures[f"p99_{n}"] = hb["p50"], hb["p99"]
                try:
                    took, killed = leader_kill(client, store, procs)
                    outcome = f"{took:.2f} s (killed {killed})"
                except ScenarioFailed as exc:
                    outcome = f"failed: {exc}"
                rows.append((f"leader kill -9 -> next generation (leader TTL {args.leader_ttl:g}s)", outcome))
        finally:
            store.close()
            for proc in procs.values():
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(10)
    return rows, timelines, figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--join-agents", type=int, nargs="+", default=[100, 500, 1000])
    parser.add_argument("--heartbeat-agents", type=int, nargs="+", default=[100, 500, 1000])
    parser.add_argument("--seconds", type=float, default=10.0, help="heartbeat measurement window")
    parser.add_argument("--ttl", type=float, default=2.0, help="heartbeat TTL of the expiry scenario")
    parser.add_argument("--leader-ttl", type=float, default=2.0)
    parser.add_argument(
        "--heartbeat-ttl",
        type=float,
        default=10.0,
        help="heartbeat TTL of the heartbeat scenarios' jobs; agents beat every quarter of it (default 10)",
    )
    parser.add_argument(
        "--load-processes",
        type=int,
        default=4,
        help="processes the simulated agents are spread over (default 4)",
    )
    parser.add_argument(
        "--tls",
        choices=["both", "on", "off"],
        default="both",
        help="mutual TLS on, off (--insecure), or both in one run with their ratios (default)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="with --tls both: suites per mode, in the order off, on, on, off, ... so that drift on a "
        "shared machine cancels; the ratios compare the modes' means (default 2)",
    )
    args = parser.parse_args()

    log_dir = Path(tempfile.mkdtemp(prefix="pliant-bench-"))
    if args.tls == "both":
        modes = [m for r in range(args.rounds) for m in ([False, True] if r % 2 == 0 else [True, False])]
    else:
        modes = [args.tls == "on"]
    results: dict[bool, tuple[list[tuple[str, str]], list[str], dict[str, float]]] = {}
    all_figures: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for tls in modes:
        security = Security(LocalCA(log_dir / "pki") if tls else None)
        results[tls] = run_suite(args, security, log_dir)
        all_figures[tls].append(results[tls][2])
    for tls, rows_timelines_figures in results.items():
        results[tls] = (
            *rows_timelines_figures[:2],
            {k: statistics.mean(f[k] for f in all_figures[tls]) for k in all_figures[tls][0]},
        )
    for tls, (rows, timelines, _figures) in results.items():
        width = max(len(r[0]) for r in rows)
        print(f"\n{'mutual TLS' if tls else 'plaintext (--insecure)'}\n{'scenario':<{width}}  result")
        for name, value in rows:
            print(f"{name:<{width}}  {value}")
        for timeline in timelines:
            print(timeline)
    if len(results) == 2:
        plain, tls_on = results[False][2], results[True][2]
        print(
            f"\ncost of mutual TLS (TLS / plaintext, same run, mean of {args.rounds} suites each; goal < 1.20; the "
            f"tables above are each mode's last suite):"
        )
        for key in sorted(plain):
            if key in tls_on and plain[key] > 0:
                unit, scale = {"p": ("ms", 1e3), "c": ("ms", 1.0)}.get(key[0], ("s", 1.0))
                if key.startswith("connect"):
                    unit, scale = "s", 1.0
                print(
                    f"  {key:<14} {plain[key] * scale:9.3f} -> {tls_on[key] * scale:9.3f} {unit}"
                    f"   {tls_on[key] / plain[key]:.2f}x"
                )
    print(f"(logs in {log_dir})")


if __name__ == "__main__":
    main()
