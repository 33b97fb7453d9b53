"""Fan-out of generations to WatchGenerations streams: one etcd watch per job per replica, however many subscribers.

A subscriber asks for generations from number N. It is registered first and then catches up from etcd's history. Each
read of etcd and the offers of what it read happen under the feed's read lock, and a subscriber takes the feed's offers
only from its catch-up on, so nothing published meanwhile is lost and no older read reaches it after a newer one: every
subscriber receives each generation number once, ascending, and the job's state as each read finds it, in the order of
the reads (a state that a newer one replaced before any read saw it is not sent: the newer one is).
"""

from __future__ import annotations

import logging
import queue
import threading

from pliant.coordinator.contract import CoordinatorError, Generation, JobStatus, WatchEvent
from pliant.coordinator.etcd_watch import PrefixWatch
from pliant.coordinator.store import EtcdStore

__all__ = ["Subscription", "WatchHub"]

logger = logging.getLogger(__name__)


class Subscription:
    """One stream's view: a queue of :class:`WatchEvent` in order, without duplicates.

    Threads: ``first``, ``ready`` and the last generation and status sent are written only under the feed's ``reading``
    lock (by the subscribing thread's catch-up, then by the feed thread); ``events`` is the queue the stream's thread
    reads.
    """

    def __init__(self, feed: _Feed, first: int) -> None:
        self._feed = feed
        self.first = first
        self.ready = False
        self.events: queue.Queue[WatchEvent] = queue.Queue()
        self._last: Generation | None = None
        self._status: JobStatus | None = None

    def offer(self, generations: list[Generation], status: JobStatus) -> None:
        """Queue what this subscriber has not seen yet (call with the feed's ``reading`` lock held)."""
        for gen in generations:
            if gen.number >= self.first and (self._last is None or gen.number > self._last.number):
                self._last = gen
                self._status = status
                self.events.put(WatchEvent(gen, status))
        if status != self._status:
            self._status = status
            self.events.put(WatchEvent(self._last, status))

    def get(self, timeout_s: float) -> WatchEvent | None:
        try:
            return self.events.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def close(self) -> None:
        self._feed.unsubscribe(self)


class _Feed:
    """The per-job watcher: re-reads new generations on every change and offers them to subscribers.

    Threads: ``subs`` is guarded by ``lock``; ``reading`` is held across each read of etcd and the offers of what it
    read (the feed thread's and each subscriber's catch-up), so offers reach a subscriber in the order of the reads;
    ``last_number`` is the feed thread's.
    """

    def __init__(self, hub: WatchHub, store: EtcdStore, job: str) -> None:
        self.hub, self.store, self.job = hub, store, job
        self.subs: set[Subscription] = set()
        self.lock = threading.Lock()
        self.reading = threading.Lock()
        self.last_number = 0
        self.dirty = threading.Event()
        self.stopped = threading.Event()
        prefix = store.job_key(job) + "/"
        keys = (store.job_key(job, "generation"), store.job_key(job, "state"))
        self.watch = PrefixWatch(store, prefix, self.dirty.set, key_filter=lambda k: k in keys)
        self.thread = threading.Thread(target=self._run, name=f"feed {job}", daemon=True)

    def start(self) -> None:
        self.watch.start()
        self.thread.start()

    def catch_up(self, sub: Subscription) -> None:
        """Send ``sub`` (registered) what etcd's history holds from its first number on; from then on the feed's
        reads reach it too.

        Raises:
            NotFound: no such job. Unavailable: etcd did not answer.
        """
        with self.reading:
            gens, status = self.store.generations_since(self.job, sub.first)
            if sub.first == 0:
                gens = gens[-1:]  # 0 means "from the current generation"
                sub.first = gens[0].number if gens else 0
            sub.offer(gens, status)
            sub.ready = True

    def unsubscribe(self, sub: Subscription) -> None:
        with self.lock:
            self.subs.discard(sub)
            empty = not self.subs
        if empty:
            self.hub._drop(self)

    def stop(self) -> None:
        self.stopped.set()
        self.dirty.set()
        self.watch.stop()

    def _run(self) -> None:
        while not self.stopped.is_set():
            self.dirty.wait(1.0)
            if self.stopped.is_set():
                return
            self.dirty.clear()
            with self.reading:
                try:
                    gens, status = self.store.generations_since(self.job, self.last_number + 1)
                except CoordinatorError as exc:
                    logger.debug("feed %s: %s", self.job, exc)
                    self.dirty.set()
                    failed = True
                else:
                    failed = False
                    if gens:
                        self.last_number = gens[-1].number
                    with self.lock:
                        subs = [sub for sub in self.subs if sub.ready]
                    for sub in subs:
                        sub.offer(gens, status)
            if failed:
                self.stopped.wait(0.2)


class WatchHub:
    """Per-replica registry of job feeds, created on first subscription and dropped with the last."""

    def __init__(self, store: EtcdStore) -> None:
        self._store = store
        self._feeds: dict[str, _Feed] = {}
        self._lock = threading.Lock()

    def subscribe(self, job: str, first: int) -> Subscription:
        """Subscribe to ``job``'s generations numbered >= ``first`` (0: from the current one).

        Raises:
            NotFound: no such job. Unavailable: etcd did not answer.
        """
        with self._lock:
            feed = self._feeds.get(job)
            if feed is None:
                feed = self._feeds[job] = _Feed(self, self._store, job)
                feed.start()
            sub = Subscription(feed, first)
            with feed.lock:
                feed.subs.add(sub)  # the feed offers to it once its catch-up below is done
        try:
            feed.catch_up(sub)
        except CoordinatorError:
            sub.close()
            raise
        return sub

    def _drop(self, feed: _Feed) -> None:
        with self._lock:
            with feed.lock:
                if feed.subs or self._feeds.get(feed.job) is not feed:
                    return
            del self._feeds[feed.job]
        feed.stop()

    def close(self) -> None:
        with self._lock:
            feeds, self._feeds = list(self._feeds.values()), {}
        for feed in feeds:
            feed.stop()
