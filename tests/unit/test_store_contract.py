"""The store's contract (tests/store_contract.py) on the unit tests' fake store, which the reconciler's tests rely on
to refuse what the etcd store refuses."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pliant.coordinator.contract import JobSpec
from tests.store_contract import JobStoreContract
from tests.unit.fake_store import FakeStore

pytestmark = pytest.mark.timeout(10)


class _FakeBackend:
    def __init__(self) -> None:
        self.store = FakeStore()

    @property
    def fence(self) -> Any:
        return self.store.fence

    def add_job(self, spec: JobSpec) -> None:
        self.store.add_job(spec)

    def join(self, job: str, node: str) -> None:
        self.store.join(job, node)

    def depose(self) -> Any:
        old, self.store.fence = self.store.fence, f"{self.store.fence}+1"
        return old


class TestFakeStore(JobStoreContract):
    @pytest.fixture
    def backend(self) -> Iterator[_FakeBackend]:
        yield _FakeBackend()
