"""Leader election through etcd: a leased leader key won by a create-if-absent transaction.

The winner's fencing token is the create revision of the leader key (:class:`Fence`); every generation write compares
it, so a replica that lost leadership (paused, partitioned, its lease expired) can never publish even if it still
believes it leads. The campaign loop never dies silently: an unreachable etcd is a warning when it starts, again
every :data:`UNREACHABLE_SAID_EVERY_S` while it lasts (with how long), and when etcd answers again, and is retried
with backoff; a leader whose keepalives fail for most of its TTL steps down, and another replica takes over when the
lease expires. Health is honest: the replica reports SERVING as soon as etcd answers (leader or not) and NOT_SERVING
while it does not, or after a fault (an unexpected error in the reconciler or this loop), which makes it resign and
pause for one TTL before it campaigns again.

States (ElectionState): FOLLOWER -> LEADER (won the key) -> FOLLOWER (lost it, keepalive failed, or resigned);
any -> STOPPED.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable

from pliant.backoff import Backoff
from pliant.coordinator.contract import CoordinatorError, NotFound
from pliant.coordinator.store import EtcdStore, Fence

__all__ = ["ElectionState", "LeaderElection"]

logger = logging.getLogger(__name__)

UNREACHABLE_SAID_EVERY_S = 30.0
"""While etcd stays unreachable, how often a replica says so again."""


class ElectionState(enum.Enum):
    """FOLLOWER <-> LEADER; either -> STOPPED (terminal)."""

    FOLLOWER = "follower"
    LEADER = "leader"
    STOPPED = "stopped"


class LeaderElection:
    """Campaign for leadership in a background thread.

    Args:
        store: the etcd store.
        replica_id: this replica's name, written as the leader key's value.
        ttl_s: leader lease TTL; a dead leader is replaced within about this long.
        on_etcd_health: called with False when etcd stops answering (or after a fault) and True when it answers again.
        clock: monotonic clock (injected for tests).
    """

    def __init__(
        self,
        store: EtcdStore,
        replica_id: str,
        ttl_s: float = 5.0,
        on_etcd_health: Callable[[bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self.replica_id = replica_id
        self.ttl_s = max(2.0, float(ttl_s))
        self._on_etcd_health = on_etcd_health or (lambda ok: None)
        self._clock = clock
        self._state = ElectionState.FOLLOWER
        self._fence: Fence | None = None
        self._lease_id = 0
        self._healthy: bool | None = None
        self._fault = ""  # set by fault(): resign, pause, campaign again
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"election {replica_id}", daemon=True)

    # -- public --------------------------------------------------------------------------------------------------------

    @property
    def state(self) -> ElectionState:
        return self._state

    @property
    def fence(self) -> Fence | None:
        """The fencing token while this replica leads, else None."""
        return self._fence

    @property
    def is_leader(self) -> bool:
        return self._state is ElectionState.LEADER

    def start(self) -> LeaderElection:
        self._thread.start()
        return self

    def wait_for(self, leader: bool, timeout_s: float) -> bool:
        """Block until this replica is (or is not) the leader; False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: self.is_leader == leader, timeout_s)

    def fault(self, why: str) -> None:
        """An unexpected error in this replica's leader work: step down (resign, so another replica takes over at
        once), report NOT_SERVING, and campaign again after one TTL."""
        logger.error("replica %s: fault (%s); resigning leadership", self.replica_id, why)
        self._fault = why
        fence, lease_id = self._fence, self._lease_id
        self._set(ElectionState.FOLLOWER, None)
        self._health(False)
        if fence is not None:
            try:
                self._store.resign(fence, lease_id)
            except Exception as exc:
                logger.warning(
                    "replica %s could not resign (%s); its lease expires in %gs", self.replica_id, exc, self.ttl_s
                )

    def stop(self, resign: bool = True) -> None:
        """Stop campaigning; with ``resign`` delete the leader key (if still ours) so another replica takes over now."""
        self._stop.set()
        self._thread.join(self.ttl_s + 5)
        if resign and self._fence is not None:
            try:
                self._store.resign(self._fence, self._lease_id)
                logger.info("replica %s resigned leadership", self.replica_id)
            except Exception as exc:
                logger.warning(
                    "replica %s could not resign (%s); its lease expires in %gs", self.replica_id, exc, self.ttl_s
                )
        self._set(ElectionState.STOPPED, None)

    # -- internals -----------------------------------------------------------------------------------------------------

    def _set(self, state: ElectionState, fence: Fence | None) -> None:
        with self._changed:
            if state is not self._state:
                logger.info(
                    "replica %s: %s -> %s%s",
                    self.replica_id,
                    self._state.value,
                    state.value,
                    f" (fencing revision {fence.revision})" if fence else "",
                )
            self._state, self._fence = state, fence
            self._changed.notify_all()

    def _health(self, ok: bool) -> None:
        if ok is not self._healthy:
            self._healthy = ok
            self._on_etcd_health(ok)

    def _run(self) -> None:
        backoff = Backoff(0.1, 2.0)
        down_since = said_at = 0.0  # the unreachable streak's start, and when it was last said (this thread)
        while not self._stop.is_set():
            if self._fault:
                self._stop.wait(self.ttl_s)  # let another replica take over; then try again
                logger.info("replica %s: campaigning again after its fault", self.replica_id)
                self._fault = ""
            try:
                won = self._campaign()
                if backoff.failing:
                    logger.warning(
                        "replica %s reaches etcd again after %.0fs", self.replica_id, time.monotonic() - down_since
                    )
                backoff.reset()
                self._health(True)  # etcd answers: serving, whether or not this replica leads
                if won:
                    self._lead()
                else:
                    self._stop.wait(min(0.25, self.ttl_s / 8))
            except CoordinatorError as exc:
                if self.is_leader:
                    self._set(ElectionState.FOLLOWER, None)
                now = time.monotonic()
                if not backoff.failing:
                    down_since = said_at = now
                    logger.warning(
                        "replica %s: election paused, etcd unreachable (%s); retrying with backoff",
                        self.replica_id,
                        exc,
                    )
                elif now - said_at >= UNREACHABLE_SAID_EVERY_S:
                    said_at = now
                    logger.warning(
                        "replica %s: etcd still unreachable after %.0fs (%s): no job's world can change and no node "
                        "can join until it answers (workers train on); check that etcd runs and that this replica "
                        "reaches it (--etcd)",
                        self.replica_id,
                        now - down_since,
                        exc,
                    )
                self._health(False)
                self._stop.wait(backoff.next())
            except Exception as exc:
                self.fault(f"election: {type(exc).__name__}: {exc}")

    def _campaign(self) -> bool:
        """Try once to take the leader key. True if won."""
        if self._stop.is_set():
            return False
        won = self._store.campaign(self.replica_id, self.ttl_s)
        if won is None:
            return False
        fence, self._lease_id = won
        self._set(ElectionState.LEADER, fence)
        return True

    def _lead(self) -> None:
        """Keep the lease alive while leading; return (as follower) when leadership is lost."""
        fence = self._fence
        assert fence is not None
        last_ok = self._clock()
        interval = self.ttl_s / 4
        while not self._stop.wait(interval):
            if self._fault or self._fence is not fence:
                return
            try:
                self._store.refresh_lease(self._lease_id, own=True)
                if self._store.leader()[1] != fence.revision:
                    logger.warning("replica %s: leader key was taken over; stepping down", self.replica_id)
                    break
                last_ok = self._clock()
            except NotFound:
                logger.warning("replica %s: leader lease expired; stepping down", self.replica_id)
                break
            except CoordinatorError as exc:
                if self._clock() - last_ok > self.ttl_s * 0.75:
                    logger.warning(
                        "replica %s: no keepalive for %.1fs (%s); stepping down",
                        self.replica_id,
                        self._clock() - last_ok,
                        exc,
                    )
                    break
        if not self._stop.is_set():
            self._set(ElectionState.FOLLOWER, None)
