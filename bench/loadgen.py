"""Simulated agents in several processes, so that thousands of them are not one event loop's bottleneck.

Each process (a :class:`Swarm`) owns a slice of the agents: one connection each (mutual TLS with an agent certificate of
its own, issued in the process from the CA's key, or plaintext), spread over the replicas as agents behind a Kubernetes
Service are. The parent drives every swarm through the same steps, in lock step, over a pipe:

1. ``connect``: open every connection (TLS handshakes included); answers the seconds it took;
2. ``join`` at a monotonic time shared by all swarms: every agent joins at once and, like a real agent's client,
   retries UNAVAILABLE with backoff for up to :data:`JOIN_RETRY_S`; answers each agent's lease (0: it failed), the
   times the Joins returned and the failures by status code;
3. ``beat``: every joined agent heartbeats every ``interval_s`` (spread over the interval, reporting an advancing
   step as a training agent does) until ``stop_at``; answers the latencies of the calls started within the window and
   the failures by status code;
4. ``close``.

Times are ``time.monotonic()``, which every process on a machine shares.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import multiprocessing.connection
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from pliant.security.identity import Role
from pliant.security.issuance import IssuedCert, issue_cert
from pliant.v1 import coordinator_pb2 as pb
from pliant.v1 import coordinator_pb2_grpc as pb_grpc

__all__ = ["JOIN_RETRY_S", "Failures", "Swarm", "SwarmError", "Swarms"]

JOIN_RETRY_S = 10.0
"""How long a simulated agent retries an UNAVAILABLE Join (the coordinator client's default ``retry_for_s``)."""


@dataclass
class Failures:
    """Calls that failed, by status code, with the first one's details."""

    counts: dict[str, int] = field(default_factory=dict)
    first: dict[str, str] = field(default_factory=dict)

    def record(self, code: str, details: str) -> None:
        self.counts[code] = self.counts.get(code, 0) + 1
        self.first.setdefault(code, details[:160])

    def merge(self, other: Failures) -> None:
        for code, n in other.counts.items():
            self.counts[code] = self.counts.get(code, 0) + n
            self.first.setdefault(code, other.first[code])

    def __bool__(self) -> bool:
        return bool(self.counts)

    def __str__(self) -> str:
        return "; ".join(f"{code} x{n} ({self.first[code]})" for code, n in sorted(self.counts.items())) or "none"


@dataclass(frozen=True)
class Swarm:
    """One process's slice of the agents: ``a{first}`` .. ``a{first + count - 1}``.

    Args:
        addresses: the replicas; agent i calls ``addresses[i % len(addresses)]``.
        first: the first agent's number.
        count: how many agents.
        ca: the CA that issues each agent its certificate (None: plaintext).
        address_base: agent i says it listens on ``127.0.0.1:{address_base + i}``.
    """

    addresses: tuple[str, ...]
    first: int
    count: int
    ca: IssuedCert | None
    address_base: int = 20000


def _credentials(ca: IssuedCert, node: str) -> grpc.ChannelCredentials:
    issued = issue_cert(ca, Role.AGENT, node)
    return grpc.ssl_channel_credentials(ca.cert_pem, issued.key_pem, issued.cert_pem)


class _Agents:
    """The event loop of one swarm process (runs in that process only)."""

    def __init__(self, swarm: Swarm) -> None:
        self.swarm = swarm
        self.channels: list[grpc.aio.Channel] = []
        self.stubs: list[pb_grpc.CoordinatorStub] = []
        self.leases: list[int] = []

    async def connect(self) -> float:
        swarm, started = self.swarm, time.monotonic()
        for i in range(swarm.first, swarm.first + swarm.count):
            address = swarm.addresses[i % len(swarm.addresses)]
            channel = (
                grpc.aio.insecure_channel(address)
                if swarm.ca is None
                else grpc.aio.secure_channel(address, _credentials(swarm.ca, f"a{i}"))
            )
            self.channels.append(channel)
        await asyncio.gather(*(asyncio.wait_for(c.channel_ready(), 120) for c in self.channels))
        self.stubs = [pb_grpc.CoordinatorStub(c) for c in self.channels]
        return time.monotonic() - started

    async def join(self, job: str, token: str, at: float) -> tuple[list[int], list[float], Failures]:
        failures, returned = Failures(), []
        await asyncio.sleep(max(0.0, at - time.monotonic()))

        async def one(k: int) -> int:
            i = self.swarm.first + k
            request = pb.JoinRequest(
                job_id=job, node_id=f"a{i}", address=f"127.0.0.1:{self.swarm.address_base + i}", join_token=token
            )
            deadline, delay = time.monotonic() + JOIN_RETRY_S, 0.2
            while True:
                try:
                    lease = (await self.stubs[k].Join(request, timeout=120)).lease_id
                    returned.append(time.monotonic())
                    return lease
                except grpc.aio.AioRpcError as exc:
                    if exc.code() is grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline:
                        await asyncio.sleep(delay * random.uniform(0.5, 1.5))
                        delay = min(2 * delay, 5.0)
                        continue
                    failures.record(exc.code().name, exc.details() or "")
                    return 0

        self.leases = list(await asyncio.gather(*(one(k) for k in range(self.swarm.count))))
        return self.leases, returned, failures

    async def beat(
        self, job: str, interval_s: float, window: tuple[float, float], stop_at: float
    ) -> tuple[list[float], Failures]:
        latencies: list[float] = []
        failures = Failures()

        async def agent(k: int) -> None:
            i, lease = self.swarm.first + k, self.leases[k]
            if not lease:
                return
            await asyncio.sleep(interval_s * random.random())  # agents drift apart over the interval
            step = 0
            while (t0 := time.monotonic()) < stop_at:
                step += 1
                request = pb.HeartbeatRequest(job_id=job, node_id=f"a{i}", lease_id=lease, step=step)
                try:
                    await self.stubs[k].Heartbeat(request, timeout=30)
                    if window[0] <= t0 < window[1]:
                        latencies.append(time.monotonic() - t0)
                except grpc.aio.AioRpcError as exc:
                    failures.record(exc.code().name, exc.details() or "")
                await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - t0)))

        await asyncio.gather(*(agent(k) for k in range(self.swarm.count)))
        return latencies, failures

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()


def _serve(swarm: Swarm, conn: multiprocessing.connection.Connection) -> None:
    """A swarm process: answers the parent's steps until ``close``."""

    async def main() -> None:
        agents = _Agents(swarm)
        loop = asyncio.get_running_loop()
        while True:
            step, *args = await loop.run_in_executor(None, conn.recv)
            if step == "close":
                await agents.close()
                conn.send(None)
                return
            try:
                conn.send(await getattr(agents, step)(*args))
            except Exception as exc:  # told to the parent, which reports it: a step never hangs the benchmark
                conn.send(SwarmError(f"{step} in swarm a{swarm.first}..: {type(exc).__name__}: {exc}"))

    asyncio.run(main())


class SwarmError(Exception):
    """A swarm's step failed (its agents could not connect, say); the scenario reports it and the benchmark goes on."""


def _answer(answer: Any) -> Any:
    if isinstance(answer, SwarmError):
        raise answer
    return answer


class Swarms:
    """Simulated agents ``a0``.. ``a{agents - 1}`` in ``processes`` processes (fewer when there are few agents).

    Args:
        addresses: the replicas.
        agents: how many agents.
        processes: how many swarm processes.
        ca: the CA that issues the agents' certificates (None: plaintext).
        address_base: the port agent 0 says it listens on.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        agents: int,
        processes: int,
        ca: IssuedCert | None,
        address_base: int = 20000,
    ) -> None:
        context = multiprocessing.get_context("spawn")  # the parent holds gRPC channels: never fork it
        processes = max(1, min(processes, agents // 50 or 1))
        bounds = [agents * p // processes for p in range(processes + 1)]
        self.pipes: list[multiprocessing.connection.Connection] = []
        self.procs: list[Any] = []
        for p in range(processes):
            parent, child = context.Pipe()
            swarm = Swarm(tuple(addresses), bounds[p], bounds[p + 1] - bounds[p], ca, address_base)
            proc = context.Process(target=_serve, args=(swarm, child), daemon=True, name=f"swarm-{p}")
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def _ask(self, step: str, *args: object) -> list[Any]:
        for pipe in self.pipes:
            pipe.send((step, *args))
        return [_answer(pipe.recv()) for pipe in self.pipes]

    def connect(self) -> float:
        """Open every connection; returns the seconds the slowest swarm took."""
        return max(self._ask("connect"))

    def join(self, job: str, token: str, at: float) -> tuple[list[int], list[float], Failures]:
        """Every agent joins at monotonic time ``at``. Returns each agent's lease (0: it failed), the times the Joins
        returned, and the failures."""
        leases: list[int] = []
        returned: list[float] = []
        failures = Failures()
        for swarm_leases, swarm_returned, swarm_failures in self._ask("join", job, token, at):
            leases.extend(swarm_leases)
            returned.extend(swarm_returned)
            failures.merge(swarm_failures)
        return leases, returned, failures

    def begin_beats(self, job: str, interval_s: float, window: tuple[float, float], stop_at: float) -> None:
        """Every joined agent heartbeats every ``interval_s`` until ``stop_at`` (:meth:`end_beats` collects)."""
        for pipe in self.pipes:
            pipe.send(("beat", job, interval_s, window, stop_at))

    def end_beats(self) -> tuple[list[float], Failures]:
        """Wait for the heartbeats to stop; returns the latencies of the calls started within the window, and the
        failures."""
        latencies: list[float] = []
        failures = Failures()
        for pipe in self.pipes:
            swarm_latencies, swarm_failures = _answer(pipe.recv())
            latencies.extend(swarm_latencies)
            failures.merge(swarm_failures)
        return latencies, failures

    def close(self) -> None:
        with contextlib.suppress(EOFError, OSError):
            self._ask("close")
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()

    def __enter__(self) -> Swarms:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
