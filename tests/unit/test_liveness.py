"""Heartbeats answered from a replica's memory (pliant.coordinator.liveness): when a heartbeat may skip etcd, the
upper bound of a lease's age a replica's own keepalives give, and the pump's batches against a fake keepalive stream
on a fake clock."""

from __future__ import annotations

import threading
from collections.abc import Collection

import pytest

from pliant.coordinator.liveness import HeartbeatPump, age_bound, answers_from_memory
from tests.conftest import wait_for

pytestmark = pytest.mark.timeout(10)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Stream:
    """A keepalive stream whose answers the test sets: a lease in ``gone`` is answered TTL 0, others TTL 60; each
    batch advances the clock by ``takes_s`` (etcd's answer comes that much after the batch was sent)."""

    def __init__(self, clock: _Clock, takes_s: float = 0.0) -> None:
        self.clock = clock
        self.takes_s = takes_s
        self.gone: set[int] = set()
        self.batches: list[set[int]] = []
        self.sent = threading.Event()

    def refresh_many(self, lease_ids: Collection[int], timeout_s: float) -> dict[int, int | Exception]:
        self.batches.append(set(lease_ids))
        self.clock.now += self.takes_s
        self.sent.set()
        return {lease: 0 if lease in self.gone else 60 for lease in lease_ids}


def test_a_heartbeat_skips_etcd_only_within_half_a_ttl_of_its_last_confirmed_keepalive() -> None:
    assert not answers_from_memory(None, 10.0, 5.0)
    assert answers_from_memory(0.0, 10.0, 4.99)
    assert not answers_from_memory(0.0, 10.0, 5.0)


def test_an_age_bound_is_given_only_while_it_is_under_half_a_ttl() -> None:
    assert age_bound(None, 10.0, 5.0) is None, "never confirmed here: looked up"
    assert age_bound(2.0, 10.0, 5.0) == pytest.approx(3.0)
    assert age_bound(2.0, 10.0, 7.0) is None, "half a TTL old: the node may beat elsewhere now, so it is looked up"
    assert age_bound(5.0, 10.0, 4.0) == 0.0, "never negative"


def test_a_confirmation_is_dated_when_its_keepalive_was_sent() -> None:
    """A batch etcd answers late still dates its leases at the send, so the bound is never below the age in etcd;
    a call's own refresh likewise; a lease a batch finds gone has no bound (and is reported lost)."""
    clock = _Clock()
    stream = _Stream(clock, takes_s=1.5)
    lost: list[int] = []
    pump = HeartbeatPump(stream, lambda writes: None, lost.extend, period_s=0.01, clock=clock)  # type: ignore[arg-type]
    try:
        pump.refresh_now(7, lambda: None)  # the lease's first heartbeat here: refreshed in the call
        pump.refresh_now(8, lambda: None)
        assert pump.age_bounds([7, 8, 9], 10.0) == {7: 0.0, 8: 0.0}, "9 was never confirmed here"
        stream.gone.add(8)
        sent_at = clock.now
        assert pump.beat(7, 10.0) and pump.beat(8, 10.0)
        wait_for(lambda: lost == [8], 5, "the batch")
        assert pump.age_bounds([7, 8], 10.0) == {7: pytest.approx(clock.now - sent_at)}
        assert clock.now - sent_at == pytest.approx(1.5), "etcd answered 1.5 s after the send: the bound counts it"
        clock.now += 4.0
        assert pump.age_bounds([7], 10.0) == {}, "half a TTL after the send: looked up again"
        assert not pump.beat(7, 10.0), "and its heartbeat goes to etcd"
    finally:
        pump.close()


def test_a_refresh_that_fails_confirms_nothing() -> None:
    clock = _Clock()
    pump = HeartbeatPump(_Stream(clock), lambda writes: None, lambda leases: None, clock=clock)  # type: ignore[arg-type]

    def refused() -> None:
        raise RuntimeError("lease not found")

    with pytest.raises(RuntimeError):
        pump.refresh_now(7, refused)
    assert pump.age_bounds([7], 10.0) == {} and not pump.beat(7, 10.0)
    pump.close()
