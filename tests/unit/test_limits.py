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
