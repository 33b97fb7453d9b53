"""The store's contract (tests/store_contract.py) on the etcd store, against a real etcd, fenced by a real leader
election: the same assertions the fake store passes in the unit tests."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pliant.coordinator.contract import JobSpec, Member
from pliant.coordinator.election import LeaderElection
from pliant.coordinator.store import EtcdStore
from tests.store_contract import JobStoreContract

pytestmark = pytest.mark.timeout(60)

TOKEN = "test-join-token-0123456789"


class _EtcdBackend:
    def __init__(self, endpoint: str, prefix: str) -> None:
        self.store = EtcdStore([endpoint], prefix)
        self._names = itertools.count(1)
        self._ports = itertools.count(1)
        self.election = self._elect()

    def _elect(self) -> LeaderElection:
        election = LeaderElection(self.store, f"leader-{next(self._names)}", ttl_s=2).start()
        assert election.wait_for(True, 10), "no leadership within 10s"
        return election

    @property
    def fence(self) -> Any:
        return self.election.fence

    def add_job(self, spec: JobSpec) -> None:
        self.store.create_job(spec, time.time(), TOKEN)

    def join(self, job: str, node: str) -> None:
        self.store.join(job, Member(node, f"127.0.0.1:{next(self._ports)}", 0, time.time()), TOKEN)

    def depose(self) -> Any:
        old = self.election.fence
        self.election.stop(resign=True)
        self.election = self._elect()
        return old

    def close(self) -> None:
        self.election.stop()
        self.store.close()


class TestEtcdStore(JobStoreContract):
    @pytest.fixture
    def backend(self, etcd: Any, prefix: str) -> Iterator[_EtcdBackend]:
        made = _EtcdBackend(etcd.endpoint, prefix)
        try:
            yield made
        finally:
            made.close()
