"""What one caller may hold of a replica: calls in flight per caller, and calls per second per source address.

gRPC's synchronous server gives every call a worker thread as soon as it starts, and a unary handler's thread waits
there for the request message, before any code of pliant's runs. A caller that opens calls and never sends their
messages would hold every thread of the replica (and so starve every other job's heartbeats). :class:`CallerLimits`
is a server interceptor that takes each unary-request method as the request-streaming method it is on the wire (one
message, then the half-close): the handler then runs at once, sees who the caller is, and takes one of the caller's
:attr:`CallerLimits.per_caller` slots before it waits for the message. A caller past its slots is answered
RESOURCE_EXHAUSTED at once and holds nothing; the slot is given back when the call ends, however it ends.

Who a caller is (:func:`certificate_key`, :func:`address_key`): on the API port, the identity of its client
certificate (role, name and, for an agent, its job: the two certificates of a node renewing are one caller); on the
bootstrap port, where callers have no certificate, its IP address. A plaintext server (``--insecure``) has no
identities: it limits nothing per caller.

:class:`RateLimit` is a token bucket per key (the bootstrap port's source addresses, a node's renewals), holding at most
``max_keys`` keys: the least recently seen are forgotten first, so its state stays bounded whoever calls.

Each served method's wrapped handler is built once, on its first call, and reused: a call costs its slot and nothing
more.

Threads: every method runs on gRPC's worker threads; ``_held``, the writes of ``_wrapped`` (read without it: one dict
lookup) and the buckets are guarded by their ``_lock``.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from pliant.security.identity import identity_from_pem

__all__ = ["CallerLimits", "RateLimit", "address_key", "certificate_key"]

MAX_METHODS = 256
"""Wrapped handlers kept, one per served method (a server's services have far fewer)."""

Key = Callable[[grpc.ServicerContext], str]
Observer = Callable[[str, grpc.StatusCode, float], None]


@functools.lru_cache(maxsize=4096)
def _identity(pem: bytes) -> str:
    identity = identity_from_pem(pem)
    return str(identity) if identity is not None else "certificate " + hashlib.sha256(pem).hexdigest()[:16]


def certificate_key(context: grpc.ServicerContext) -> str:
    """The caller as its verified client certificate names it ("": no certificate, a plaintext channel)."""
    pems = context.auth_context().get("x509_pem_cert")
    return _identity(pems[0]) if pems else ""


def address_key(context: grpc.ServicerContext) -> str:
    """The caller's IP address (``ipv4:10.0.0.5:41234`` -> ``10.0.0.5``; ``ipv6:[::1]:5`` -> ``::1``)."""
    peer = context.peer()
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        host = rest.rpartition(":")[0]
        return host.strip("[]")
    return peer


def _method(details: grpc.HandlerCallDetails) -> str:
    return details.method.rpartition("/")[2]


class CallerLimits(grpc.ServerInterceptor):
    """At most ``per_caller`` calls in flight per caller (``key``; "" limits nothing).

    Args:
        per_caller: calls one caller may have in flight on this server, streams included.
        key: who the caller of a call is.
        what: how a refusal names the caller's kind ("certificate", "address").
        observe: called with (method, RESOURCE_EXHAUSTED, 0.0) for each call refused here.
    """

    def __init__(self, per_caller: int, key: Key, what: str, observe: Observer | None = None) -> None:
        self.per_caller = per_caller
        self._key = key
        self._what = what
        self._observe = observe or (lambda method, code, seconds: None)
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}
        # method path -> the handler wrapped in a slot, built on the method's first call
        self._wrapped: dict[str, Any] = {}

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any], details: grpc.HandlerCallDetails
    ) -> Any:
        wrapped = self._wrapped.get(details.method)
        if wrapped is not None:
            return wrapped
        handler = continuation(details)
        if handler is None or handler.request_streaming:
            return handler
        wrapped = self._wrap(handler, _method(details))
        with self._lock:
            if len(self._wrapped) < MAX_METHODS:  # only served methods get here: the services' methods
                self._wrapped[details.method] = wrapped
        return wrapped

    def _wrap(self, handler: Any, method: str) -> Any:
        """``handler`` as a request-streaming handler that takes one of the caller's slots before it reads the
        request."""
        if handler.response_streaming:
            stream = handler.unary_stream

            def streaming(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
                with self._slot(method, context):
                    yield from stream(self._first(requests, context, method), context)

            return grpc.stream_stream_rpc_method_handler(
                streaming, handler.request_deserializer, handler.response_serializer
            )
        unary = handler.unary_unary

        def single(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            with self._slot(method, context):
                return unary(self._first(requests, context, method), context)

        return grpc.stream_unary_rpc_method_handler(single, handler.request_deserializer, handler.response_serializer)

    @staticmethod
    def _first(requests: Iterator[Any], context: grpc.ServicerContext, method: str) -> Any:
        request = next(requests, None)
        if request is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method} takes one request message; none came")
        return request

    @contextlib.contextmanager
    def _slot(self, method: str, context: grpc.ServicerContext) -> Iterator[None]:
        """One of the caller's slots for this call, given back when the call ends (however it ends); past its slots
        the call is RESOURCE_EXHAUSTED at once."""
        key = self._key(context)
        if key:
            with self._lock:
                held = self._held.get(key, 0)
                taken = held < self.per_caller
                if taken:
                    self._held[key] = held + 1
            if not taken:
                self._observe(method, grpc.StatusCode.RESOURCE_EXHAUSTED, 0.0)
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{method} refused: this {self._what} ({key[:120]}) has {self.per_caller} calls in flight on this "
                    f"replica, the most one caller may; finish or cancel some (an agent needs a few)",
                )
        try:
            yield
        finally:
            if key:
                with self._lock:
                    left = self._held.get(key, 1) - 1
                    if left > 0:
                        self._held[key] = left
                    else:
                        self._held.pop(key, None)


class RateLimit:
    """A token bucket per key: ``burst`` calls at once, then ``per_s`` a second; at most ``max_keys`` keys remembered
    (the least recently seen forgotten first: a forgotten key starts with a full bucket).

    Args:
        burst: the bucket's size.
        per_s: its refill rate.
        max_keys: keys kept at most.
        clock: monotonic seconds (injected for tests).
    """

    def __init__(
        self, burst: float, per_s: float, max_keys: int = 10_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.burst, self.per_s, self.max_keys = burst, per_s, max_keys
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()

    def take(self, key: str, cost: float = 1.0) -> float:
        """Take ``cost`` from ``key``'s bucket: 0.0 when it had it, else the seconds until it will (nothing taken)."""
        now = self._clock()
        with self._lock:
            tokens, at = self._buckets.pop(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.per_s)
            wait = 0.0 if tokens >= cost else (cost - tokens) / self.per_s
            if not wait:
                tokens -= cost
            self._buckets[key] = (tokens, now)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
            return wait

    def peek(self, key: str, cost: float = 1.0) -> float:
        """The seconds until ``key``'s bucket holds ``cost`` (0.0: it does now); nothing is taken."""
        now = self._clock()
        with self._lock:
            tokens, at = self._buckets.get(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.per_s)
            return 0.0 if tokens >= cost else (cost - tokens) / self.per_s

    def __len__(self) -> int:
        with self._lock:
            return len(self._buckets)
