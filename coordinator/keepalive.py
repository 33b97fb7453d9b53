"""Lease keepalives multiplexed on one long-lived etcd LeaseKeepAlive stream, served by an event loop of its own.

python-etcd3's ``refresh_lease`` opens a new bidirectional stream for every keepalive; etcd's own Go client keeps one
stream and sends each keepalive as a message on it. :class:`KeepAliveStream` does the same, on gRPC's asyncio API in a
thread of its own: a message there costs the replica about half the CPU of the synchronous API's, whose request
iterator and response reader take a thread hand-off each per message, and keepalives are most of what a replica sends
etcd (one per member heartbeat). Callers on any thread hand it a batch of lease ids and wait for the answers, which
etcd sends in order on the stream, one per request, carrying the lease id. A broken stream fails every waiting caller
with the gRPC error and is reopened, on the etcd endpoint the store's client uses then, by the next call.

Threads: the ``etcd-keepalive`` thread runs the event loop, which owns the channel, the call, the pending answers and
the reader task; ``_lock`` guards starting and closing that thread.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Collection
from typing import Any

import etcd3.exceptions
import grpc
from etcd3.etcdrpc import rpc_pb2, rpc_pb2_grpc

__all__ = ["KeepAliveStream"]

logger = logging.getLogger(__name__)

Target = Callable[[], tuple[str, "grpc.ChannelCredentials | None"]]
"""Returns the etcd endpoint to open the stream on: HOST:PORT, and its channel credentials (None: plaintext)."""


class KeepAliveStream:
    """One LeaseKeepAlive stream shared by every keepalive a replica sends on it.

    Args:
        target: where to open the stream (called again each time it is reopened).
    """

    def __init__(self, target: Target) -> None:
        self._target = target
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        # Owned by the loop:
        self._channel: grpc.aio.Channel | None = None
        self._call: Any = None
        self._pending: dict[int, collections.deque[asyncio.Future[int]]] = {}
        self._writing: asyncio.Lock | None = None
        self._tasks: set[asyncio.Future[Any]] = set()

    def refresh(self, lease_id: int, timeout_s: float) -> int:
        """Keep ``lease_id`` alive; returns its new TTL in seconds (<= 0: the lease is gone).

        Raises:
            grpc.RpcError: the stream broke. etcd3.exceptions.ConnectionTimeoutError: no answer within ``timeout_s``.
        """
        answer = self.refresh_many([lease_id], timeout_s)[lease_id]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def refresh_many(self, lease_ids: Collection[int], timeout_s: float) -> dict[int, int | Exception]:
        """Keep every lease of ``lease_ids`` alive, their requests sent back to back; returns each lease's new TTL
        (<= 0: the lease is gone), or the error it met: the gRPC error of a broken stream, or
        ``etcd3.exceptions.ConnectionTimeoutError`` for a lease with no answer within ``timeout_s`` of the call."""
        loop = self._running_loop()
        if loop is None:
            closed = etcd3.exceptions.ConnectionFailedError("the keepalive stream is closed")
            return {lease_id: closed for lease_id in lease_ids}
        batch = asyncio.run_coroutine_threadsafe(self._refresh(list(lease_ids), timeout_s), loop)
        try:
            return batch.result(timeout_s + 1.0)
        except concurrent.futures.TimeoutError:
            batch.cancel()
            late = etcd3.exceptions.ConnectionTimeoutError("the keepalive stream did not answer in time")
            return {lease_id: late for lease_id in lease_ids}

    def close(self) -> None:
        """Close the stream and stop its thread."""
        with self._lock:
            self._closed = True
            loop, self._loop = self._loop, None
        if loop is not None:
            asyncio.run_coroutine_threadsafe(self._shut(), loop).result(5.0)
            loop.call_soon_threadsafe(loop.stop)

    def _running_loop(self) -> asyncio.AbstractEventLoop | None:
        with self._lock:
            if self._closed:
                return None
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="etcd-keepalive", daemon=True).start()
                self._loop = loop
            return self._loop

    async def _refresh(self, lease_ids: list[int], timeout_s: float) -> dict[int, int | Exception]:
        loop = asyncio.get_running_loop()
        waiting: dict[int, asyncio.Future[int]] = {}
        if self._writing is None:
            self._writing = asyncio.Lock()
        try:
            async with self._writing:  # one writer on the stream at a time
                call = self._open()
                for lease_id in lease_ids:
                    waiting[lease_id] = answer = loop.create_future()
                    self._pending.setdefault(lease_id, collections.deque()).append(answer)
                    await call.write(rpc_pb2.LeaseKeepAliveRequest(ID=lease_id))
        except Exception as exc:  # the stream broke, or no etcd endpoint is available to open it on
            self._broken(exc)
        done, _ = await asyncio.wait(waiting.values(), timeout=timeout_s) if waiting else (set(), set())
        answers: dict[int, int | Exception] = {}
        for lease_id in lease_ids:
            answer = waiting.get(lease_id)
            if answer is None:
                answers[lease_id] = etcd3.exceptions.ConnectionFailedError("the keepalive stream broke")
            elif answer in done:
                error = answer.exception()
                answers[lease_id] = error if isinstance(error, Exception) else answer.result()
            else:
                answer.cancel()
                answers[lease_id] = etcd3.exceptions.ConnectionTimeoutError(
                    f"no keepalive answer for lease {lease_id:x}"
                )
        return answers

    def _open(self) -> Any:
        """The stream, opened on the store's current endpoint if there is none (runs on the loop)."""
        if self._call is None:
            address, credentials = self._target()
            if self._channel is not None:
                self._background(self._channel.close())
            self._channel = (
                grpc.aio.insecure_channel(address)
                if credentials is None
                else grpc.aio.secure_channel(address, credentials)
            )
            self._call = rpc_pb2_grpc.LeaseStub(self._channel).LeaseKeepAlive()
            self._background(self._read(self._call))
            logger.debug("lease keepalive stream opened on %s", address)
        return self._call

    def _background(self, work: Any) -> None:
        """Run ``work`` on the loop, holding the task until it ends (runs on the loop)."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _read(self, call: Any) -> None:
        error: Exception = etcd3.exceptions.ConnectionFailedError("the keepalive stream ended")
        try:
            async for response in call:
                waiting = self._pending.get(response.ID)
                while waiting:
                    answer = waiting.popleft()
                    if not answer.done():
                        answer.set_result(int(response.TTL))
                        break
                if waiting is not None and not waiting:
                    del self._pending[response.ID]
        except grpc.RpcError as exc:
            error = exc
        except asyncio.CancelledError:
            return
        if call is self._call:
            self._broken(error)

    def _broken(self, error: Exception) -> None:
        """Fail every waiting caller with ``error``; the next call reopens the stream (runs on the loop)."""
        call, self._call = self._call, None
        if call is not None:
            call.cancel()
        pending, self._pending = self._pending, {}
        failed = sum(1 for answers in pending.values() for answer in answers if not answer.done())
        if failed and not self._closed:
            logger.warning("lease keepalive stream broke (%s); %d keepalives fail and are retried", error, failed)
        for answers in pending.values():
            for answer in answers:
                if not answer.done():
                    answer.set_exception(error)

    async def _shut(self) -> None:
        self._broken(etcd3.exceptions.ConnectionFailedError("the keepalive stream is closed"))
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
