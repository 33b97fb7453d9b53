"""A leaving node's hand-over of its control-plane seat (:mod:`pliant.coordinator.seats`), run by the node's
``pliant run`` once its agent left the job (Ctrl-C, SIGTERM, a drained pod) and before it stops its replica and its
etcd member.

The steps, each waited for up to one deadline (:data:`HANDOVER_WAIT_S` in all):

1. name a live node that stands by (it joined with the seat key while the seats were full; the latest of them) and
   holds no seat in the seats record's hand-over; none: nothing to hand over, and the control plane goes on with the
   other seats, or ends with this node;
2. wait until that node's etcd member votes (its agent took the seat on its next heartbeat, its member joined as a
   learner, and the leader promoted it once it started);
3. answer heartbeats a few seconds more (:data:`LISTED_FOR_S`: each answer lists the named node's replica, which every
   agent calls from then on), then stop this node's replica, which gives up the lead: a replica of the named node
   leads, and its upkeep removes this node's member and seat (etcd allows it once the two members have been
   connected for its health interval, 5 s);
4. wait until this node's etcd member exits: etcd ends a member once the cluster removed it.

A hand-over that runs out of time, or that a second signal cuts short, leaves the control plane as it stands: with a
voting member on each node, losing this one costs the quorum, and the line says so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pliant.coordinator.contract import CoordinatorError
from pliant.coordinator.etcd_cluster import EtcdClusterError
from pliant.coordinator.etcd_server import EtcdServer
from pliant.coordinator.seat_keeper import SeatKeeper
from pliant.coordinator.server import CoordinatorServer

__all__ = ["HANDOVER_WAIT_S", "hand_over"]

logger = logging.getLogger(__name__)

HANDOVER_WAIT_S = 60.0  # the whole hand-over: the named node's learner starts, syncs and is promoted within it
LISTED_FOR_S = 3.0  # the leaving replica answers this long once the named node votes: agents learn its replica
_POLL_S = 0.5


def hand_over(
    server: CoordinatorServer,
    etcd: EtcdServer,
    node: str,
    say: Callable[[str], None],
    wait_s: float = HANDOVER_WAIT_S,
) -> bool:
    """Hand ``node``'s seat (``server``'s, whose etcd member is ``etcd``) to a live member of a job, and stop
    ``server`` (see the module docstring).

    Returns:
        True when another node holds the control plane now (``server`` stopped); False when there was nobody to hand
        it to (``server`` left running for the caller to stop), or the hand-over did not complete (``server``
        stopped).

    Raises:
        KeyboardInterrupt: a second signal cut the hand-over short (``server`` is left running for the caller to stop).
    """
    keeper = server.seats
    if keeper is None:
        return False
    deadline = time.monotonic() + wait_s
    try:
        store = server.store
        seats = keeper.seats()
        live = {m.node_id for job in store.list_job_ids() for m in store.read_job(job).members}
        seated = {seat.node for seat in seats.seats} if seats is not None else set()
        # A node the operator gave the seat key, that stands by, is live and holds no seat: the latest to claim.
        ready = [n for n in (seats.standby if seats is not None else ()) if n in live and n not in seated | {node}]
        if not ready:
            if live - {node}:
                rest = "it goes on with its other seats" if len(seated - {node}) else "it ends with this node"
                say(
                    f"no node stands by to take this node's control-plane seat (one joined with the seat line does); "
                    f"{rest}"
                )
            return False
        if not keeper.hand_over(node, ready[-1], wait_s):
            return False
    except CoordinatorError as exc:
        say(f"this node's control-plane seat could not be handed over ({exc}); the control plane ends with this node")
        return False
    to = ready[-1]
    say(
        f"handing this node's control-plane seat to {to} before this node leaves (up to {wait_s:.0f}s; a second "
        f"Ctrl-C leaves at once, and the control plane then ends with this node)"
    )
    if _voting_endpoint(keeper, to, deadline) is None:
        server.stop()
        say(f"{to} did not take the control-plane seat within {wait_s:.0f}s; the control plane ends with this node")
        return False
    keeper.forget()  # the heartbeats' answers list the named node's replica from now on ...
    time.sleep(LISTED_FOR_S)  # ... for every agent's next beats, before this replica goes
    server.stop()  # gives up the lead: the named node's replica removes this node's member and seat
    while time.monotonic() < deadline:
        if etcd.proc is None or etcd.proc.poll() is not None:  # etcd exits once the cluster removed its member
            say(f"{to} holds the control plane now; other nodes join with the line {to} prints")
            return True
        time.sleep(_POLL_S)
    say(f"{to} took the seat, but this node's etcd member was not removed within {wait_s:.0f}s; leaving anyway")
    return False


def _voting_endpoint(keeper: SeatKeeper, to: str, deadline: float) -> str | None:
    """The client URL of ``to``'s etcd member once it votes and has started (None: not by ``deadline``)."""
    while time.monotonic() < deadline:
        try:
            seats = keeper.seats()
            seat = seats.holder(to) if seats is not None else None
            if seat is not None:
                member = next((m for m in keeper.members() if seat.etcd_peer in m.peer_urls), None)
                if member is not None and member.started and not member.learner:
                    return seat.etcd_client
        except (CoordinatorError, EtcdClusterError) as exc:
            logger.debug("the hand-over's seat not readable yet: %s", exc)
        time.sleep(_POLL_S)
    return None
