"""Members' heartbeats answered from a replica's memory; what etcd must learn from them sent in batches.

A heartbeat tells the control plane two things etcd must record: the node's lease is younger (a keepalive: the leader
judges liveness from the lease's age, see :mod:`pliant.coordinator.policy`), and now and then the node's training
step (its progress key). Neither has to be on the heartbeat's path. :class:`HeartbeatPump` keeps, per lease, when
etcd last confirmed a keepalive this replica sent for it, and decides with :func:`answers_from_memory`:

- a heartbeat whose lease etcd confirmed here within half the job's heartbeat TTL is answered at once. Its keepalive
  joins the next batch, sent within ``period_s``: the batch's keepalives go back to back on the replica's one
  LeaseKeepAlive stream (:mod:`pliant.coordinator.keepalive`), a lease that beat twice in one period is refreshed
  once, and the progress writes queued meanwhile go in one transaction per :data:`WRITES_PER_TXN` keys;
- any other heartbeat (a lease this replica has not had confirmed lately: the node's first here, its first after a
  gap, after its member key was deleted, or while etcd answers no batch) makes its keepalive in the call, so that an
  expired or revoked lease fails it with NotFound and an etcd that does not answer fails it with UNAVAILABLE.

A confirmation is dated when its keepalive was sent, so ``now`` less that date is never less than the lease's age in
etcd (a later keepalive from another replica only makes the lease younger). The leader uses that bound, for leases its
own replica confirmed within half a TTL, in place of a lookup of their age (:func:`age_bound`).

What holds:

- a lease's age in etcd lags the node's last heartbeat by at most ``period_s`` and etcd's answer;
- a heartbeat is never answered from memory more than half a TTL after its lease's last confirmed keepalive was sent;
- an age bound is at least the lease's age in etcd, and is given only within half a TTL of that keepalive;
- a lease a batch finds gone (expired, revoked) is forgotten, and so is the lease of a member key the replica's watch
  sees deleted (a leave, an eviction, the job's deletion): that node's next heartbeat goes to etcd and fails NotFound.

Threads: :meth:`HeartbeatPump.beat`, :meth:`~HeartbeatPump.refresh_now`, :meth:`~HeartbeatPump.write` and
:meth:`~HeartbeatPump.forget` run on RPC threads and the member watch's, :meth:`~HeartbeatPump.age_bounds` on the
reconciler's; the pump thread (started by the first queued heartbeat) sends the batches.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple

from pliant.coordinator.keepalive import KeepAliveStream

__all__ = ["WRITES_PER_TXN", "HeartbeatPump", "ProgressWrite", "age_bound", "answers_from_memory"]

logger = logging.getLogger(__name__)

WRITES_PER_TXN = 100
"""Progress writes per etcd transaction (etcd refuses more than ``--max-txn-ops``, 128 by default)."""

FORGET_AFTER_S = 600.0
"""A lease not confirmed for this long is dropped from the pump's memory (its node left or moved to another replica)."""


class ProgressWrite(NamedTuple):
    """A node's progress key, its value, and the lease it is attached to."""

    key: str
    value: str
    lease_id: int


def answers_from_memory(confirmed_at: float | None, ttl_s: float, now: float) -> bool:
    """Whether a heartbeat of a lease whose last keepalive etcd confirmed was sent at ``confirmed_at`` (None: none,
    here) may be answered without asking etcd: only within half the job's heartbeat TTL of that keepalive."""
    return confirmed_at is not None and now - confirmed_at < ttl_s / 2


def age_bound(confirmed_at: float | None, ttl_s: float, now: float) -> float | None:
    """An upper bound of the age of a lease whose last keepalive etcd confirmed was sent at ``confirmed_at`` (None:
    none, here), or None when it is unknown or half the job's heartbeat TTL or more: a bound that large could name a
    live node silent (its agent may beat on another replica now), so its age is looked up instead."""
    if confirmed_at is None:
        return None
    age = max(0.0, now - confirmed_at)
    return age if age < ttl_s / 2 else None


class HeartbeatPump:
    """Heartbeats answered from memory, their keepalives and progress writes sent in batches by one thread.

    Args:
        stream: the replica's members' keepalive stream.
        write: writes a batch of progress keys (one transaction per :data:`WRITES_PER_TXN`); its errors are logged.
        on_lost: called from the pump thread with the leases a batch found gone.
        period_s: how long the pump gathers heartbeats before it sends a batch.
        timeout_s: how long a batch waits for etcd's answers.
        clock: monotonic seconds.

    Fields: ``_lock`` guards ``_confirmed``, ``_due``, ``_writes`` and ``_thread``; ``_wake`` and ``_stop`` are
    events; ``_failing`` and ``_pruned_at`` belong to the pump thread.
    """

    def __init__(
        self,
        stream: KeepAliveStream,
        write: Callable[[Sequence[ProgressWrite]], None],
        on_lost: Callable[[list[int]], None],
        period_s: float = 0.05,
        timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stream = stream
        self._write = write
        self._on_lost = on_lost
        self.period_s = period_s
        self.timeout_s = timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._confirmed: dict[int, float] = {}  # lease id -> when its last keepalive etcd confirmed was sent from here
        self._due: set[int] = set()  # leases whose heartbeats since the last batch await its keepalive
        self._writes: dict[str, ProgressWrite] = {}  # progress key -> the latest write awaiting the next batch
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._failing = False
        self._pruned_at = clock()

    def beat(self, lease_id: int, ttl_s: float) -> bool:
        """Queue ``lease_id``'s keepalive for the next batch when the heartbeat may be answered from memory; False
        when it may not (the caller refreshes the lease itself, with :meth:`refresh_now`)."""
        with self._lock:
            if not answers_from_memory(self._confirmed.get(lease_id), ttl_s, self._clock()):
                return False
            self._due.add(lease_id)
            self._start()
        self._wake.set()
        return True

    def refresh_now(self, lease_id: int, refresh: Callable[[], object]) -> None:
        """Refresh ``lease_id`` in the caller's thread with ``refresh`` (which raises when etcd does not confirm it);
        once it returns, its keepalive counts as confirmed."""
        sent = self._clock()
        refresh()
        self._confirm({lease_id: sent})

    def age_bounds(self, lease_ids: Collection[int], ttl_s: float) -> dict[int, float]:
        """Upper bounds of the ages of those of ``lease_ids`` whose keepalives this replica sent lately (see
        :func:`age_bound`); the others are left out."""
        now, bounds = self._clock(), {}
        with self._lock:
            for lease_id in lease_ids:
                bound = age_bound(self._confirmed.get(lease_id), ttl_s, now)
                if bound is not None:
                    bounds[lease_id] = bound
        return bounds

    def _confirm(self, sent: dict[int, float]) -> None:
        """etcd confirmed the keepalives of these leases, sent at these times."""
        with self._lock:
            for lease_id, at in sent.items():
                self._confirmed[lease_id] = max(at, self._confirmed.get(lease_id, at))

    def write(self, progress: ProgressWrite) -> None:
        """Write ``progress`` with the next batch (a later write of the same key replaces it)."""
        with self._lock:
            self._writes[progress.key] = progress
            self._start()
        self._wake.set()

    def forget(self, lease_ids: Collection[int] | None = None) -> None:
        """Answer the next heartbeat of each of ``lease_ids`` (None: of every lease) from etcd."""
        with self._lock:
            if lease_ids is None:
                self._confirmed.clear()
                self._due.clear()
                return
            for lease_id in lease_ids:
                self._confirmed.pop(lease_id, None)
                self._due.discard(lease_id)

    def close(self) -> None:
        """Send what is queued, then stop the pump thread."""
        self._stop.set()
        self._wake.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(self.timeout_s + 1)

    def _start(self) -> None:
        """Start the pump thread (call with ``_lock`` held)."""
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._run, name="heartbeat-pump", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            stopping = self._stop.wait(self.period_s)
            self._wake.clear()
            with self._lock:
                due, self._due = self._due, set()
                writes, self._writes = list(self._writes.values()), {}
            if due:
                self._refresh(due)
            if writes:
                try:
                    self._write(writes)
                except Exception as exc:  # progress is advisory: the node's next step is written again
                    logger.warning("%d progress writes failed: %s", len(writes), exc)
            self._prune()
            if stopping:
                return

    def _refresh(self, due: set[int]) -> None:
        sent = self._clock()
        answers = self._stream.refresh_many(due, self.timeout_s)
        lost, errors = [], []
        with self._lock:
            for lease_id, answer in answers.items():
                if isinstance(answer, Exception):
                    errors.append(answer)
                elif answer <= 0:
                    lost.append(lease_id)
                    self._confirmed.pop(lease_id, None)
                elif lease_id in self._confirmed:  # not forgotten meanwhile
                    self._confirmed[lease_id] = max(sent, self._confirmed[lease_id])
        if errors and not self._failing:
            logger.warning(
                "etcd answered no keepalive for %d of %d heartbeats (%s); until it does, heartbeats go to etcd "
                "themselves once their lease's last confirmation is half a TTL old",
                len(errors),
                len(due),
                errors[0],
            )
        elif not errors and self._failing:
            logger.info("etcd answers the heartbeats' keepalives again")
        self._failing = bool(errors)
        if lost:
            self._on_lost(lost)

    def _prune(self) -> None:
        now = self._clock()
        if now - self._pruned_at < FORGET_AFTER_S / 10:
            return
        self._pruned_at = now
        with self._lock:
            stale = [lease for lease, at in self._confirmed.items() if now - at > FORGET_AFTER_S]
            for lease_id in stale:
                del self._confirmed[lease_id]
