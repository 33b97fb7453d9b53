"""Fan-out of generations to WatchGenerations streams: one etcd watch per job per replica, however many subscribers.

A subscriber asks for generations from number N. It is registered first and then catches up from etcd's history under
its own lock, so nothing published meanwhile is lost or sent out of order: every subscriber receives each generation
number once, ascending, and every change of the job's state.
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
    """One stream's view: a queue of :class:`WatchEvent` in order, without duplicates."""

    def __init__(self, feed: _Feed, first: int) -> None:
        self._feed = feed
        self.first = first
        self.events: queue.Queue[WatchEvent] = queue.Queue()
        self.lock = threading.Lock()
        self._last: Generation | None = None
        self._status: JobStatus | None = None

    def offer(self, generations: list[Generation], status: JobStatus) -> None:
        """Queue what this subscriber has not seen yet (call with ``lock`` held)."""
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
    """The per-job watcher: re-reads new generations on every change and offers them to subscribers."""

    def __init__(self, hub: WatchHub, store: EtcdStore, job: str) -> None:
        self.hub, self.store, self.job = hub, store, job
        self.subs: set[Subscription] = set()
        self.lock = threading.Lock()
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
        """Send ``sub`` what etcd's history holds from its first number on (registered, its lock held)."""
        gens, status = self.store.generations_since(self.job, sub.first)
        if sub.first == 0:
            gens = gens[-1:]  # 0 means "from the current generation"
            sub.first = gens[0].number if gens else 0
        sub.offer(gens, status)

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
            try:
                gens, status = self.store.generations_since(self.job, self.last_number + 1)
            except CoordinatorError as exc:
                logger.debug("feed %s: %s", self.job, exc)
                self.dirty.set()
                self.stopped.wait(0.2)
                continue
            if gens:
                self.last_number = gens[-1].number
            with self.lock:
                subs = list(self.subs)
            for sub in subs:
                with sub.lock:
                    sub.offer(gens, status)


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
            sub.lock.acquire()  # the feed may offer only after the catch-up below
            with feed.lock:
                feed.subs.add(sub)
        try:
            feed.catch_up(sub)
        except CoordinatorError:
            sub.lock.release()
            sub.close()
            raise
        sub.lock.release()
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
