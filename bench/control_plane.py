"""Control-plane benchmark: a real etcd, two coordinator replicas (subprocesses), simulated agents (gRPC clients).

Measures, in one run:
- lease expiry -> new generation (an agent stops heartbeating);
- leader kill -9 -> next generation published by the other replica;
- N agents joining at once -> one generation (time from the first Join to the generation, and how many were published);
- heartbeat RPC latency p50/p99 with M agents heartbeating at their interval, and etcd writes per heartbeat.

Usage: ``.venv/bin/python bench/control_plane.py [--join-agents 8] [--heartbeat-agents 200] [--seconds 10]``
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pliant.coordinator.client import CoordinatorClient
from pliant.coordinator.contract import Generation, JobSpec
from pliant.coordinator.etcd_server import EtcdServer
from pliant.coordinator.store import EtcdStore
from pliant.net import free_port


def start_replica(
    etcd: str, prefix: str, name: str, log_dir: Path, leader_ttl_s: float
) -> tuple[subprocess.Popen, str]:
    address = f"127.0.0.1:{free_port()}"
    with open(log_dir / f"coordinator-{name}.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pliant", "coordinator", "--etcd", etcd, "--listen", address, "--prefix", prefix,
             "--leader-ttl", str(leader_ttl_s), "--replica-id", name],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 30
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=0.5).status == 1:
                    return proc, address
            except grpc.RpcError:
                time.sleep(0.05)
    raise SystemExit(f"replica {name} did not become healthy; see {log_dir}")


def wait_generation(client: CoordinatorClient, job: str, number: int, timeout_s: float = 30) -> Generation:
    """Follow the job's watch until generation ``number`` arrives."""
    deadline = time.monotonic() + timeout_s
    for event in client.watch(job, number):
        if event.generation is not None and event.generation.number >= number:
            return event.generation
        if time.monotonic() > deadline:
            break
    raise SystemExit(f"generation {number} of {job} never came")


def lease_expiry(client: CoordinatorClient, ttl_s: float) -> float:
    client.create_job(JobSpec("expiry", 1, 2, heartbeat_ttl_s=ttl_s, join_grace_s=0.1))
    keep = client.join("expiry", "keeper", "127.0.0.1:1")
    lost = client.join("expiry", "lost", "127.0.0.1:2")
    wait_generation(client, "expiry", 1)
    stop = threading.Event()

    def keepalive() -> None:
        while not stop.wait(ttl_s / 4):
            client.heartbeat("expiry", "keeper", keep.lease_id)

    threading.Thread(target=keepalive, daemon=True).start()
    client.heartbeat("expiry", "lost", lost.lease_id)
    last = time.monotonic()
    wait_generation(client, "expiry", 2)
    took = time.monotonic() - last
    stop.set()
    return took


def leader_kill(client: CoordinatorClient, store: EtcdStore, procs: dict[str, subprocess.Popen]) -> tuple[float, str]:
    client.create_job(JobSpec("failover", 1, 4, heartbeat_ttl_s=30, join_grace_s=0))
    client.join("failover", "n1", "127.0.0.1:1")
    wait_generation(client, "failover", 1)
    leader = store.leader()[0]
    os.killpg(procs[leader].pid, signal.SIGKILL)
    killed = time.monotonic()
    client.join("failover", "n2", "127.0.0.1:2")
    wait_generation(client, "failover", 2)
    return time.monotonic() - killed, leader


def join_burst(address: str, n: int) -> tuple[float, int]:
    job = f"burst{n}"
    with CoordinatorClient(address) as admin:
        admin.create_job(JobSpec(job, n, n, heartbeat_ttl_s=30, join_grace_s=0.5))
        clients = [CoordinatorClient(address) for _ in range(n)]
        start = time.monotonic()
        with ThreadPoolExecutor(min(n, 64)) as pool:
            list(pool.map(lambda i: clients[i].join(job, f"a{i}", f"127.0.0.1:{10000 + i}"), range(n)))
        gen = wait_generation(admin, job, 1)
        took = time.monotonic() - start
        time.sleep(1.0)  # anything else published would show up now
        published = admin.get_job(job).generation.number
        for c in clients:
            c.close()
        assert gen.world_size == n
        return took, published


def heartbeats(address: str, store: EtcdStore, agents: int, seconds: float) -> tuple[list[float], float, float]:
    """Each simulated agent joins, then heartbeats every TTL/4 like a real one; latencies are measured in a window of
    ``seconds`` once every agent has joined. Returns (latencies, raft entries per heartbeat, join seconds)."""
    job, ttl = f"hb{agents}", 10.0
    interval = ttl / 4
    with CoordinatorClient(address) as admin:
        admin.create_job(JobSpec(job, 1, agents, heartbeat_ttl_s=ttl, join_grace_s=1))
    clients = [CoordinatorClient(address) for _ in range(agents)]
    joined = threading.Barrier(agents + 1)
    window: dict[str, float] = {}
    calls: list[tuple[float, float]] = []
    lock = threading.Lock()
    stop = threading.Event()

    def agent(i: int) -> None:
        grant = clients[i].join(job, f"a{i}", f"127.0.0.1:{20000 + i}")
        joined.wait()
        time.sleep(interval * i / agents)  # agents drift apart over the interval
        while not stop.is_set():
            t0 = time.perf_counter()
            clients[i].heartbeat(job, f"a{i}", grant.lease_id)
            with lock:
                calls.append((t0, time.perf_counter() - t0))
            stop.wait(max(0.0, interval - (time.perf_counter() - t0)))

    with ThreadPoolExecutor(agents) as pool:
        started = time.perf_counter()
        futures = [pool.submit(agent, i) for i in range(agents)]
        joined.wait()
        join_seconds = time.perf_counter() - started
        time.sleep(interval)  # every agent is in its rhythm
        window["start"] = time.perf_counter()
        rev_before = store.client.status().raft_index
        time.sleep(seconds)
        window["end"] = time.perf_counter()
        writes = store.client.status().raft_index - rev_before
        stop.set()
        for future in futures:
            future.result()
    for c in clients:
        c.close()
    latencies = [dt for t0, dt in calls if window["start"] <= t0 < window["end"]]
    return latencies, writes / max(1, len(latencies)), join_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--join-agents", type=int, nargs="+", default=[8])
    parser.add_argument("--heartbeat-agents", type=int, nargs="+", default=[200])
    parser.add_argument("--seconds", type=float, default=10.0, help="heartbeat measurement window")
    parser.add_argument("--ttl", type=float, default=2.0, help="heartbeat TTL of the expiry scenario")
    parser.add_argument("--leader-ttl", type=float, default=2.0)
    args = parser.parse_args()

    rows: list[tuple[str, str]] = []
    log_dir = Path(tempfile.mkdtemp(prefix="pliant-bench-"))
    with EtcdServer(log_path=str(log_dir / "etcd.log")) as etcd:
        prefix = "/bench"
        procs, addresses = {}, []
        for name in ("A", "B"):
            procs[name], address = start_replica(etcd.endpoint, prefix, name, log_dir, args.leader_ttl)
            addresses.append(address)
        store = EtcdStore([etcd.endpoint], prefix)
        try:
            with CoordinatorClient(addresses, retry_for_s=30) as client:
                took = lease_expiry(client, args.ttl)
                rows.append((f"lease expiry -> new generation (TTL {args.ttl:g}s)", f"{took:.2f} s"))
                for n in args.join_agents:
                    took, published = join_burst(addresses[1], n)
                    rows.append((f"{n} agents join -> one generation", f"{took:.3f} s ({published} published)"))
                for n in args.heartbeat_agents:
                    lat, per, join_s = heartbeats(addresses[1], store, n, args.seconds)
                    q = statistics.quantiles(lat, n=100)
                    rows.append((f"heartbeat RPC, {n} agents ({len(lat)} calls in {args.seconds:g}s)",
                                 f"p50 {q[49] * 1e3:.1f} ms, p99 {q[98] * 1e3:.1f} ms"))  # fmt: skip
                    rows.append((f"etcd raft entries per heartbeat, {n} agents", f"{per:.2f}"))
                    rows.append((f"{n} agents all joined (concurrent Joins)", f"{join_s:.2f} s"))
                took, killed = leader_kill(client, store, procs)
                rows.append((f"leader kill -9 -> next generation (leader TTL {args.leader_ttl:g}s)",
                             f"{took:.2f} s (killed {killed})"))  # fmt: skip
        finally:
            store.close()
            for proc in procs.values():
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(10)
    width = max(len(r[0]) for r in rows)
    print(f"\n{'scenario':<{width}}  result")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print(f"(logs in {log_dir})")


if __name__ == "__main__":
    main()
