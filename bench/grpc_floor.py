"""What gRPC itself costs per heartbeat on this machine: servers that do nothing, clients shaped like the simulated
agents of ``bench/control_plane.py``, no pliant code on the call's path.

A server answers every message at once (after reading the caller's certificate, as every pliant call does); the
clients open one mutual-TLS connection per agent, spread over several processes, and send one small message per agent
every ``agents / rate`` seconds for ``--seconds``. Measured after every connection is open: the server's and the
clients' CPU per message (psutil, both processes' whole CPU: gRPC's threads, the kernel's share included) and the
round trip's p50/p99.

Server kinds:

- ``sync-unary``: gRPC's synchronous server with a thread pool, a unary method (the coordinator's server);
- ``aio-unary``: gRPC's asyncio server, a unary method answered in the event loop;
- ``aio-stream``: the asyncio server, one bidirectional stream per agent carrying its heartbeats (no call set-up per
  heartbeat).

The sum of the two CPU figures times the heartbeat rate is what the control plane's machine spends before any of
pliant's own work (the heartbeat's logic, the etcd keepalive, the leader): the floor under the replicas' and the
simulated agents' CPU that ``bench/control_plane.py`` reports.

Usage: ``.venv/bin/python bench/grpc_floor.py [--agents 4000] [--rate 1600] [--seconds 15] [--processes 4]
[--servers sync-unary aio-unary aio-stream]`` (about a minute per server kind at 4,000 agents).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import tempfile
import time
from concurrent import futures

import grpc
import psutil
from common import percentile

from pliant.security.identity import Role
from pliant.security.issuance import LocalCA
from pliant.security.tlsdir import TlsConfig

SERVERS = ("sync-unary", "aio-unary", "aio-stream")
METHOD = "/floor.Floor/Beat"


def _same(data: bytes) -> bytes:
    return data


def _serve(kind: str, tls: TlsConfig, ready: multiprocessing.Queue) -> None:
    """Serve ``kind`` on a free loopback port; put the port on ``ready``; run until killed."""
    files = tls.load(need_role=False)
    credentials = grpc.ssl_server_credentials(
        [(files.key_pem, files.cert_pem)], root_certificates=files.ca_pem, require_client_auth=True
    )
    options = [("grpc.so_reuseport", 0), ("grpc.server.max_pending_requests", 1 << 20)]

    def unary(request: bytes, context: grpc.ServicerContext) -> bytes:
        context.auth_context()
        return b"ok"

    async def async_unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        context.auth_context()
        return b"ok"

    async def async_stream(requests, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        context.auth_context()
        async for _request in requests:
            yield b"ok"

    handler = {
        "sync-unary": grpc.unary_unary_rpc_method_handler(unary, _same, _same),
        "aio-unary": grpc.unary_unary_rpc_method_handler(async_unary, _same, _same),
        "aio-stream": grpc.stream_stream_rpc_method_handler(async_stream, _same, _same),
    }[kind]
    service = grpc.method_handlers_generic_handler("floor.Floor", {"Beat": handler})
    if kind == "sync-unary":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=64), options=options)
        server.add_generic_rpc_handlers((service,))
        ready.put(server.add_secure_port("127.0.0.1:0", credentials))
        server.start()
        server.wait_for_termination()
        return

    async def main() -> None:
        server = grpc.aio.server(options=options)
        server.add_generic_rpc_handlers((service,))
        ready.put(server.add_secure_port("127.0.0.1:0", credentials))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


async def _agents(kind: str, port: int, tls: TlsConfig, agents: int, rate: float, start_at: float, seconds: float):  # type: ignore[no-untyped-def]
    """Open ``agents`` connections, wait for ``start_at`` (wall clock), then beat; returns (latencies, CPU seconds)."""
    files = tls.load(need_role=False)
    credentials = grpc.ssl_channel_credentials(files.ca_pem, files.key_pem, files.cert_pem)
    channels = [grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) for _ in range(agents)]
    await asyncio.gather(*(channel.channel_ready() for channel in channels))
    await asyncio.sleep(max(0.0, start_at - time.time()))
    me, latencies = psutil.Process(), []
    cpu = sum(me.cpu_times()[:2])
    interval, stop = agents / rate, time.time() + seconds

    async def agent(i: int, channel: grpc.aio.Channel) -> None:
        await asyncio.sleep(interval * i / agents)
        stream = channel.stream_stream(METHOD, _same, _same)() if kind == "aio-stream" else None
        beat = channel.unary_unary(METHOD, _same, _same)
        due = time.monotonic()
        while time.time() < stop:
            sent = time.monotonic()
            if stream is not None:
                await stream.write(b"beat")
                await stream.read()
            else:
                await beat(b"beat")
            latencies.append(time.monotonic() - sent)
            due += interval
            await asyncio.sleep(max(0.0, due - time.monotonic()))
        if stream is not None:
            await stream.done_writing()

    await asyncio.gather(*(agent(i, channel) for i, channel in enumerate(channels)))
    cpu = sum(me.cpu_times()[:2]) - cpu
    await asyncio.gather(*(channel.close() for channel in channels))
    return latencies, cpu


def _swarm(
    kind: str, port: int, tls: TlsConfig, agents: int, rate: float, start_at: float, seconds: float, out
) -> None:  # type: ignore[no-untyped-def]
    out.put(asyncio.run(_agents(kind, port, tls, agents, rate, start_at, seconds)))


def measure(
    kind: str, server_tls: TlsConfig, agent_tls: TlsConfig, agents: int, rate: float, seconds: float, processes: int
) -> str:
    """One server kind's row."""
    spawn = multiprocessing.get_context("spawn")
    ready, out = spawn.Queue(), spawn.Queue()
    server = spawn.Process(target=_serve, args=(kind, server_tls, ready), daemon=True)
    server.start()
    try:
        port = ready.get(timeout=60)
        start_at = time.time() + 5 + agents / 400  # every connection open (TLS handshakes) before the window
        swarms = [
            spawn.Process(
                target=_swarm,
                args=(kind, port, agent_tls, agents // processes, rate / processes, start_at, seconds, out),
            )
            for _ in range(processes)
        ]
        for swarm in swarms:
            swarm.start()
        time.sleep(max(0.0, start_at - time.time()))
        serving = psutil.Process(server.pid)
        cpu = sum(serving.cpu_times()[:2])
        results = [out.get(timeout=seconds + 120) for _ in swarms]
        cpu = sum(serving.cpu_times()[:2]) - cpu
        for swarm in swarms:
            swarm.join(30)
    finally:
        server.kill()
        server.join(10)
    latencies = [latency for result in results for latency in result[0]]
    calls, clients = len(latencies), sum(result[1] for result in results)
    p50, p99 = percentile(latencies, 0.5) * 1e3, percentile(latencies, 0.99) * 1e3
    return (
        f"{kind:<11} {calls / seconds:>6.0f}/s  server {cpu / calls * 1e6:>4.0f} us ({cpu / seconds:.2f} cores)  "
        f"clients {clients / calls * 1e6:>4.0f} us ({clients / seconds:.2f} cores)  p50 {p50:.1f} ms  p99 {p99:.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=4000)
    parser.add_argument("--rate", type=float, default=1600, help="heartbeats a second, all agents together")
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--processes", type=int, default=4, help="processes the agents are spread over")
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pliant-bench-floor-") as directory:
        ca = LocalCA(directory)
        server_tls = ca.issue("server", Role.COORDINATOR, "floor", ["127.0.0.1"])
        agent_tls = ca.issue("agent", Role.AGENT, "floor-agent")
        print(f"{args.agents} agents, {args.rate:g} heartbeats/s, mutual TLS, {args.processes} client processes")
        for kind in args.servers:
            print(
                measure(kind, server_tls, agent_tls, args.agents, args.rate, args.seconds, args.processes), flush=True
            )


if __name__ == "__main__":
    main()
