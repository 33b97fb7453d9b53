"""A prefix watch on etcd that survives etcd restarts: it re-arms itself with backoff and pokes its owner after every
re-arm, since events may have been missed while it was down. Owners re-read state on a poke; they never rely on the
content of events."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

from etcd3.etcdrpc import rpc_pb2

from pliant.backoff import Backoff
from pliant.coordinator.store import EtcdStore

__all__ = ["PrefixWatch"]

logger = logging.getLogger(__name__)


class PrefixWatch:
    """Call ``on_change()`` whenever a key under ``prefix`` changes (and after each re-arm).

    Args:
        store: the etcd store whose client is used.
        prefix: the key prefix to watch.
        on_change: called from the watch thread; keep it short (set an event).
        key_filter: if given, only changes of keys for which it returns True poke the owner.
        on_keys: if given, called (from the watch thread, before ``on_change``) with the keys each response changed.
        on_rearm: if given, called (before ``on_change``) after each re-arm: anything may have changed meanwhile.
        deletes_only: etcd sends deletions only (a watch filter), not the puts.
    """

    def __init__(
        self,
        store: EtcdStore,
        prefix: str,
        on_change: Callable[[], None],
        key_filter: Callable[[str], bool] | None = None,
        on_keys: Callable[[list[str]], None] | None = None,
        on_rearm: Callable[[], None] | None = None,
        deletes_only: bool = False,
    ) -> None:
        self._store = store
        self._prefix = prefix
        self._on_change = on_change
        self._key_filter = key_filter
        self._on_keys = on_keys
        self._on_rearm = on_rearm
        self._filters = [rpc_pb2.WatchCreateRequest.NOPUT] if deletes_only else None
        self._stop = threading.Event()
        self._broken = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watch {prefix}", daemon=True)

    def start(self) -> PrefixWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._broken.set()
        self._thread.join(5)

    def _callback(self, response: object) -> None:
        if isinstance(response, Exception):
            self._broken.set()
            return
        keys = [e.key.decode() for e in getattr(response, "events", ())]
        if self._key_filter is not None:
            keys = [k for k in keys if self._key_filter(k)]
            if not keys:
                return
        if self._on_keys is not None:
            self._on_keys(keys)
        self._on_change()

    def _run(self) -> None:
        backoff = Backoff(0.05, 1.0)
        while not self._stop.is_set():
            self._broken.clear()
            watch_id = None
            try:
                watch_id = self._store.client.add_watch_prefix_callback(
                    self._prefix, self._callback, filters=self._filters
                )
                if backoff.failing:
                    logger.info("watch on %s re-armed", self._prefix)
                backoff.reset()
                if self._on_rearm is not None:
                    self._on_rearm()
                self._on_change()  # anything may have changed while the watch was down
                self._broken.wait()
            except Exception as exc:
                if not backoff.failing:
                    logger.warning(
                        "watch on %s broke (%s: %s); re-arming with backoff", self._prefix, type(exc).__name__, exc
                    )
                self._stop.wait(backoff.next())
            finally:
                if watch_id is not None:
                    with contextlib.suppress(Exception):  # the watcher may already be gone
                        self._store.client.cancel_watch(watch_id)
