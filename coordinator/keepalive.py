"""Lease keepalives multiplexed on one long-lived etcd LeaseKeepAlive stream per replica.

python-etcd3's ``refresh_lease`` opens a new bidirectional stream for every keepalive. With a thousand agents
heartbeating every TTL/4 that is hundreds of stream setups per second; etcd's own Go client instead keeps one stream
and sends each keepalive as a message on it. :class:`KeepAliveStream` does the same: callers queue a request and wait
for the response carrying their lease id (etcd answers each request in order on the stream). A broken stream fails
every waiting caller with the gRPC error and is reopened by the next call.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import etcd3.exceptions
import grpc
from etcd3.etcdrpc import rpc_pb2

__all__ = ["KeepAliveStream"]

logger = logging.getLogger(__name__)

_END = object()


class KeepAliveStream:
    """One LeaseKeepAlive stream shared by every heartbeat a replica serves.

    Args:
        stub: returns the etcd Lease stub to open the stream on (the client's current endpoint).
    """

    def __init__(self, stub: Callable[[], Any]) -> None:
        self._stub = stub
        self._lock = threading.Lock()
        self._pending: dict[int, list[Future[int]]] = {}
        self._requests: queue.SimpleQueue[object] | None = None
        self._closed = False

    def refresh(self, lease_id: int, timeout_s: float) -> int:
        """Keep ``lease_id`` alive; returns its new TTL in seconds (<= 0: the lease is gone).

        Raises:
            grpc.RpcError: the stream broke. etcd3.exceptions.ConnectionTimeoutError: no answer within ``timeout_s``.
        """
        future: Future[int] = Future()
        with self._lock:
            if self._closed:
                raise etcd3.exceptions.ConnectionFailedError("the keepalive stream is closed")
            if self._requests is None:
                self._open()
            assert self._requests is not None
            self._pending.setdefault(lease_id, []).append(future)
            self._requests.put(rpc_pb2.LeaseKeepAliveRequest(ID=lease_id))
        try:
            return future.result(timeout_s)
        except FutureTimeout:
            with self._lock:
                waiting = self._pending.get(lease_id, [])
                if future in waiting:
                    waiting.remove(future)
            raise etcd3.exceptions.ConnectionTimeoutError(f"no keepalive answer for lease {lease_id:x}") from None

    def _open(self) -> None:
        requests: queue.SimpleQueue[object] = queue.SimpleQueue()

        def outgoing() -> Iterator[Any]:
            while (item := requests.get()) is not _END:
                yield item

        responses = self._stub().LeaseKeepAlive(outgoing())
        self._requests = requests
        threading.Thread(target=self._read, args=(responses, requests), name="lease-keepalive", daemon=True).start()
        logger.debug("lease keepalive stream opened")

    def _read(self, responses: Any, requests: queue.SimpleQueue[object]) -> None:
        error: Exception = etcd3.exceptions.ConnectionFailedError("the keepalive stream ended")
        try:
            for response in responses:
                with self._lock:
                    waiting = self._pending.get(response.ID)
                    future = waiting.pop(0) if waiting else None
                    if waiting == []:
                        del self._pending[response.ID]
                if future is not None and not future.done():
                    future.set_result(int(response.TTL))
        except grpc.RpcError as exc:
            error = exc
        with self._lock:
            if self._requests is requests:
                self._requests = None
            pending, self._pending = self._pending, {}
        requests.put(_END)
        if pending and not self._closed:
            logger.warning(
                "lease keepalive stream broke (%s); %d heartbeats fail and are retried",
                error,
                sum(map(len, pending.values())),
            )
        for futures in pending.values():
            for future in futures:
                if not future.done():
                    future.set_exception(error)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._requests is not None:
                self._requests.put(_END)
                self._requests = None
