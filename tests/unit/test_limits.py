"""What one caller may hold (pliant.coordinator.limits): token buckets on a fake clock, bounded whoever calls, and who
a caller is."""

from __future__ import annotations

import pytest

from pliant.coordinator.limits import RateLimit, address_key

pytestmark = pytest.mark.timeout(10)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_gives_its_burst_then_its_rate() -> None:
    clock = _Clock()
    limit = RateLimit(3, 0.5, clock=clock)
    assert [limit.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limit.take("a") == pytest.approx(2.0), "empty: one token in 2 s"
    assert limit.peek("a") == pytest.approx(2.0) and limit.take("b") == 0.0, "each key its own bucket"
    clock.now = 2.0
    assert limit.peek("a") == 0.0 and limit.take("a") == 0.0 and limit.take("a") > 0
    clock.now = 100.0
    assert [limit.take("a") for _ in range(4)][-1] > 0, "refilled to its burst, never past it"


def test_a_bucket_keeps_bounded_state_forgetting_the_least_recent() -> None:
    limit = RateLimit(1, 0.001, max_keys=100, clock=_Clock())
    for i in range(10_000):
        limit.take(f"caller-{i}")
    assert len(limit) == 100
    assert limit.take("caller-9999") > 0, "the most recent is remembered"
    assert limit.take("caller-0") == 0.0, "the least recent was forgotten: a full bucket again"


class _Context:
    def __init__(self, peer: str) -> None:
        self._peer = peer

    def peer(self) -> str:
        return self._peer


def test_a_caller_without_a_certificate_is_its_address() -> None:
    assert address_key(_Context("ipv4:10.0.0.5:41234")) == "10.0.0.5"
    assert address_key(_Context("ipv6:[::1]:5")) == "::1"
    assert address_key(_Context("unix:/tmp/s")) == "unix:/tmp/s"


class _Details:
    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


def test_a_methods_handler_is_wrapped_once_and_unknown_methods_are_not_kept() -> None:
    """The wrapped handler of a served method is built on its first call and reused; a path no service serves is
    passed through (gRPC answers UNIMPLEMENTED) and never kept, whatever a caller sends."""
    import grpc

    from pliant.coordinator.limits import CallerLimits

    built: list[str] = []

    def continuation(details: _Details) -> object:
        built.append(details.method)
        if details.method.endswith("/Heartbeat"):
            return grpc.unary_unary_rpc_method_handler(lambda request, context: request)
        return None

    limits = CallerLimits(2, lambda context: "", "certificate")
    first = limits.intercept_service(continuation, _Details("/pliant.v1.Coordinator/Heartbeat"))
    again = limits.intercept_service(continuation, _Details("/pliant.v1.Coordinator/Heartbeat"))
    assert first is again and first.request_streaming and not first.response_streaming
    assert first.stream_unary(iter(["ping"]), object()) == "ping"
    for i in range(1000):
        assert limits.intercept_service(continuation, _Details(f"/x.Y/Nope{i}")) is None
    assert built.count("/pliant.v1.Coordinator/Heartbeat") == 1 and len(limits._wrapped) == 1
