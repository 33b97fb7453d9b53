"""The planner: a pure function from a job snapshot and the time to a decision (no I/O, time passed in).

Rules (see docs/architecture.md):
- Survivors keep their relative order, so the node of rank 0 keeps rank 0 while it lives; new nodes are appended in
  join order (their etcd create revision). At most ``max_nodes`` nodes (and MAX_WORLD_SIZE processes) train; later
  joiners wait as spares.
- Scale-ups that arrive within ``join_grace_s`` of each other are batched into one generation; reaching
  ``max_nodes`` publishes at once. There is no fixed "last call".
- A lost node (lease expired) or a graceful leave publishes a new generation at once, with every live node. A node
  of the generation whose live membership has another address (its agent restarted and joined again before its old
  lease was evicted) is lost too, and rejoins as a newcomer: the generation's agent store on the old address is gone,
  so that world can never form.
- Below ``min_nodes`` the job waits: if it was running, an empty generation stops every worker; after
  ``min_nodes_timeout_s`` in that state the job fails with a reason naming the nodes it has.
- A node whose readmission failed (evicted from the generation that admitted it, named unreachable by a member
  older than it: :func:`pliant.coordinator.policy.struck`; each member records ``since``, the generation from which
  it has trained in the world without a break) waits as a spare while its strikes hold it back at that address
  (:func:`pliant.coordinator.policy.held_back`): a cut between two nodes that does not heal then costs the world a
  failed try per backoff, not one a minute.
- A report whose named nodes are not corroborated yet, from the smaller side of a cut, or a newcomer's against
  older members (:func:`pliant.coordinator.policy.reported_evictions`), evicts nobody at once; while it waits for the
  nodes it named to report or fall silent, the planner waits too, and the executor evicts them when it comes due.
- Reports of a peer's failure, not of the node's own (:func:`broken_by_a_peer`: workers that wait in place after a
  peer failed, :attr:`FailureCause.WAITING`, or that died of a collective's error saying a peer went away,
  :func:`pliant.errorfile.peer_gone`), give the failure's cause :data:`pliant.coordinator.policy.REPORT_GRACE_S` to
  be reported (a worker's own exit, or a peer named unreachable, whose eviction spends nothing) before they restart
  the generation: in a cut between two of three nodes, the third node, which reaches both, otherwise spent a restart
  and re-formed the same world again and again.
- A worker failure reported for the current generation restarts it and is charged to the nodes whose failure it is:
  those whose reports are not :func:`broken_by_a_peer` (a script's exception or a worker killed on one node breaks its
  peers' collectives, and they are not charged for it), or, when every report is one, the nodes that reported. Each node
  has ``max_restarts`` failures of its own. A node charged more than that is excluded (it waits as a spare for the rest
  of the job), and the job fails only when fewer than ``min_nodes`` nodes remain that are not: one member reporting
  failures again and again excludes itself, never spends the others' budget. The generation names each excluded node
  with its count and last error (``Generation.excluded``), so its agent says why it waits. Scaling events are never
  charged; failures in a generation that also lost a node are attributed to that loss and charged to nobody.
- A failure is the *world's* when every node of a world of two nodes or more reports a worker's exit with one and the
  same error (the exception's type and message, :func:`world_error`; never a peer's going away, which every node of a
  world may report alike): a script that cannot train at that world size (a batch that does not divide, a validation
  interval longer than the epoch). Nobody is charged, and the job refuses that world size for the rest of its life
  (``Generation.refused``): every world it publishes from then on is the longest prefix of its nodes, in rank order,
  whose size it does not refuse (the nodes left out wait), and it fails when no such world reaches ``min_nodes``. A
  first report that carries an error waits up to :data:`pliant.coordinator.policy.REPORT_GRACE_S` for the other nodes'
  reports while every report so far is the same error. A one-node world's failure cannot be told apart from its node's:
  it is the node's.

- Nodes of a group (``JobSpec.node_group``, an hsdp replica cut over several nodes) train only together: a world holds
  the previous world's groups that are whole, in their order, then the other nodes cut into new groups
  (:func:`grouped`); a node whose group lost a node waits as a spare until a newcomer completes a group with it.

Generation reasons: ``start`` (first world), ``join``, ``leave``, ``failure`` (a node lost), ``restart`` (a worker
failed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from pliant.coordinator.contract import (
    MAX_WORLD_SIZE,
    Decision,
    FailJob,
    FailureCause,
    FailureReport,
    Generation,
    GenerationMember,
    JobSnapshot,
    JobSpec,
    JobState,
    Keep,
    Member,
    NewGeneration,
    WaitUntil,
)
from pliant.coordinator.policy import REPORT_GRACE_S, SILENCE_POLL_S, held_back, reported_evictions
from pliant.errorfile import peer_gone

__all__ = ["assign_ranks", "grouped", "plan", "refused_note", "world_error"]

Refused = tuple[tuple[int, str], ...]  # (world size, error), sorted: the world sizes a job no longer takes


def assign_ranks(spec: JobSpec, nodes: Sequence[Member]) -> tuple[GenerationMember, ...]:
    """Give ``nodes`` (already in rank order) their node ranks and global rank offsets."""
    out: list[GenerationMember] = []
    offset = 0
    for node_rank, member in enumerate(nodes):
        nproc = member.slots or spec.nproc_per_node
        out.append(GenerationMember(member.node_id, node_rank, offset, nproc, member.address))
        offset += nproc
    return tuple(out)


def _admit(spec: JobSpec, survivors: Sequence[Member], newcomers: Sequence[Member]) -> list[Member]:
    """Newcomers (in join order) that fit under ``max_nodes`` and the largest world size; the rest wait as spares."""
    world = sum(m.slots or spec.nproc_per_node for m in survivors)
    room = max(spec.max_nodes - len(survivors), 0)
    admitted: list[Member] = []
    for member in newcomers:
        nproc = member.slots or spec.nproc_per_node
        if len(admitted) >= room or world + nproc > MAX_WORLD_SIZE:
            break
        admitted.append(member)
        world += nproc
    return admitted


def _publish(
    snap: JobSnapshot,
    nodes: Sequence[Member],
    reason: str,
    restarts: int,
    now: float,
    charged: dict[str, int] | None = None,
    refused: Refused | None = None,
    errors: Mapping[str, str] | None = None,
) -> NewGeneration:
    """The next generation with ``nodes``; ``charged``: the failures charged to each node, ``refused``: the world
    sizes refused (default: both unchanged); ``errors``: the error of each node charged now (what an exclusion
    names)."""
    gen = snap.generation
    number = (gen.number if gen else 0) + 1
    since = {m.node_id: m.since for m in gen.members} if gen else {}
    members = tuple(
        dataclasses.replace(m, since=since.get(m.node_id) or number) for m in assign_ranks(snap.spec, nodes)
    )
    counts = _charged(snap) if charged is None else charged
    last = {node: error for node, _count, error in gen.excluded} if gen else {}
    last.update(errors or {})
    excluded = tuple(
        (node, count, last.get(node, "")) for node, count in sorted(counts.items()) if count > snap.spec.max_restarts
    )
    generation = Generation(
        snap.spec.job_id,
        number,
        members,
        reason,
        restarts,
        now,
        snap.incarnation,
        tuple(sorted(counts.items())),
        refused=_refused(snap) if refused is None else refused,
        excluded=excluded,
    )
    return NewGeneration(generation, JobState.RUNNING if members else JobState.WAITING)


def _charged(snap: JobSnapshot) -> dict[str, int]:
    return dict(snap.generation.charged) if snap.generation else {}


def _refused(snap: JobSnapshot) -> Refused:
    return snap.generation.refused if snap.generation else ()


def refused_note(refused: Refused) -> str:
    """The world sizes ``refused``, with their errors, in a person's words ("" for none)."""
    return "; ".join(f"world {size} fails on every node with {error}" for size, error in refused)


def _allowed(spec: JobSpec, nodes: Sequence[Member], refused: Refused) -> list[Member]:
    """The longest prefix of ``nodes`` (in rank order) of whole node groups whose world size the job does not refuse
    (empty: none)."""
    sizes = {size for size, _error in refused}
    for count in range(len(nodes) - len(nodes) % spec.node_group, 0, -spec.node_group):
        if sum(m.slots or spec.nproc_per_node for m in nodes[:count]) not in sizes:
            return list(nodes[:count])
    return []


def grouped(nodes: Sequence[Member], previous: Sequence[str], size: int) -> list[Member]:
    """``nodes`` (in rank order) as whole groups of ``size``: first the groups of the ``previous`` world (its node ids
    in rank order, cut into groups of ``size``) whose nodes are all in ``nodes``, in their order, then the other nodes
    of ``nodes`` in their order, cut into new groups; the last new group, if short, is left out (its nodes wait).
    A group that lost a node is broken up: its other nodes go with the others, so a newcomer completes a group with
    them."""
    if size == 1:
        return list(nodes)
    by_id = {m.node_id: m for m in nodes}
    old = [previous[i : i + size] for i in range(0, len(previous) - len(previous) % size, size)]
    whole = [by_id[n] for group in old if all(n in by_id for n in group) for n in group]
    kept = {m.node_id for m in whole}
    rest = [m for m in nodes if m.node_id not in kept]
    return whole + rest[: len(rest) - len(rest) % size]


NOT_THE_WORLDS = ("RescaleError:",)
"""The errors of pliant's own re-formation in place (its workers exit and the restart path follows): every node of a
world reports them alike, and they say nothing of the world size."""


def broken_by_a_peer(report: FailureReport) -> bool:
    """Whether ``report`` is of a peer's failure, not of its node's own: its workers wait in place after a peer failed,
    or a worker died of a collective's error saying a peer went away (:func:`pliant.errorfile.peer_gone`)."""
    return report.cause is FailureCause.WAITING or (report.cause is FailureCause.EXITED and peer_gone(report.error))


def _not_the_worlds(error: str) -> bool:
    """``error`` says nothing of the world size: pliant's own re-formation (:data:`NOT_THE_WORLDS`), or a peer's going
    away."""
    return error.startswith(NOT_THE_WORLDS) or peer_gone(error)


def world_error(gen: Generation, failures: Sequence[FailureReport]) -> str:
    """The error every node of ``gen``'s world failed with, when the failure is the world's: a world of two nodes or
    more, each of whose nodes reported a worker's exit with the same error, one that says something of the world size
    (not :func:`_not_the_worlds`; "" otherwise: a node's failure)."""
    errors = {f.node_id: f.error for f in failures if f.cause is FailureCause.EXITED}
    if len(gen.members) < 2 or set(errors) != set(gen.node_ids) or len(set(errors.values())) != 1:
        return ""
    error = next(iter(errors.values()))
    return "" if _not_the_worlds(error) else error


def _may_be_world_error(gen: Generation, failures: Sequence[FailureReport]) -> bool:
    """Every report so far is a worker's exit with one and the same error, and some node of the world (of two or more)
    has not reported yet: the failure may yet prove the world's."""
    if len(gen.members) < 2 or not failures:
        return False
    if any(f.cause is not FailureCause.EXITED or not f.error or _not_the_worlds(f.error) for f in failures):
        return False
    return len({f.error for f in failures}) == 1 and {f.node_id for f in failures} < set(gen.node_ids)


def _waiting_or_fail(snap: JobSnapshot, have: Sequence[Member], now: float) -> Decision:
    """Below min nodes: wait until the min-nodes timeout (counted from entering WAITING), then fail."""
    spec = snap.spec
    deadline = snap.status.since + spec.min_nodes_timeout_s
    refused = refused_note(_refused(snap))
    why = f" ({refused}: the job no longer takes that size)" if refused else ""
    if now >= deadline:
        names = ", ".join(m.node_id for m in have) or "none"
        return FailJob(
            f"job {spec.job_id!r} waited {spec.min_nodes_timeout_s:g}s with {len(have)} of the {spec.min_nodes} "
            f"nodes it needs{why} (live: {names}); start more agents, or lower the minimum (--nnodes MIN:MAX) or "
            f"raise min_nodes_timeout_s"
        )
    return WaitUntil(
        deadline, f"{len(have)} of min {spec.min_nodes} nodes{why}", JobState.WAITING, replan_at_members=spec.min_nodes
    )


def _held(decision: Decision, held: dict[str, float]) -> Decision:
    """``decision``, or a wait until the first hold ends when nodes are held back (the job is then planned again)."""
    if not held or isinstance(decision, FailJob):
        return decision
    until = min(held.values())
    if isinstance(decision, WaitUntil) and decision.deadline <= until:
        return decision
    state = decision.state if isinstance(decision, WaitUntil) else JobState.RUNNING
    names = ", ".join(sorted(held))
    return WaitUntil(until, f"holding back {names}: its readmission failed (strikes)", state)


def plan(snap: JobSnapshot, now: float) -> Decision:
    """Decide what the job needs next.

    Args:
        snap: the job read from etcd at one revision.
        now: the leader's clock, the same clock as ``Member.joined_at`` and ``JobStatus.since`` in ``snap`` (the
            reconciler passes its :class:`pliant.coordinator.policy.LeaderClock` view, never times another replica
            wrote).

    Returns:
        Keep, NewGeneration, WaitUntil or FailJob.
    """
    spec, gen = snap.spec, snap.generation
    if snap.status.state.terminal:
        return Keep()

    live = sorted(snap.members, key=lambda m: (m.order, m.node_id))
    live_by_id = {m.node_id: m for m in live}
    placed = {m.node_id: m.address for m in gen.members} if gen else {}
    current_ids = gen.node_ids if gen else ()
    survivors = [live_by_id[n] for n in current_ids if n in live_by_id and live_by_id[n].address == placed[n]]
    kept = {m.node_id for m in survivors}
    removed = [n for n in current_ids if n not in kept]
    held = held_back(snap.strikes, [m for m in live if m.node_id not in kept], now)  # never a member of the world
    charged = _charged(snap)
    excluded = {n for n, count in charged.items() if count > spec.max_restarts}  # their own failures: for good
    newcomers = [m for m in live if m.node_id not in kept and m.node_id not in held and m.node_id not in excluded]
    target = _allowed(
        spec, grouped(survivors + _admit(spec, survivors, newcomers), current_ids, spec.node_group), _refused(snap)
    )
    admitted = [m for m in target if m.node_id not in kept]
    running = bool(gen and gen.members)
    restarts = gen.restarts_used if gen else 0

    if running and removed:
        # Failures reported in a generation that also lost a node are attributed to the loss (peers of a dead node
        # fail their collectives): no restart is spent.
        reason = "leave" if all(n in snap.departed for n in removed) else "failure"
        return _publish(snap, target if len(target) >= spec.min_nodes else (), reason, restarts, now)

    failures = [f for f in snap.failures if gen is not None and f.generation == gen.number]
    failed_nodes = sorted({f.node_id for f in failures})
    if running and gen is not None:
        reported = reported_evictions(gen, failures, list(live_by_id), snap.silent, spec.heartbeat_ttl_s, now)
        if reported.evicted or reported.pending is not None:  # the executor evicts what is due before it plans
            named = sorted({n for f in failures for n in f.unreachable if n in live_by_id})
            doubted = f"; {', '.join(reported.doubted)} not silent yet" if reported.doubted else ""
            return WaitUntil(
                reported.pending if reported.pending is not None else now + SILENCE_POLL_S,
                f"{', '.join(named)} named unreachable by a report that did not evict them at once "
                f"(not corroborated yet, the smaller side of a cut, or a newcomer's word); waiting for "
                f"their reports or their silence{doubted}",
                JobState.RUNNING,
            )
    if running and failures and all(broken_by_a_peer(f) for f in failures):
        # Only reports of a peer's failure: its cause (a worker's own exit, a peer named unreachable, whose eviction
        # costs no restart) is usually reported within moments; give it REPORT_GRACE_S.
        until = min(f.reported_at for f in failures) + REPORT_GRACE_S
        if now < until:
            return WaitUntil(
                until, f"{', '.join(failed_nodes)} failed after a peer failed; waiting for the cause", JobState.RUNNING
            )
    if running and gen is not None and _may_be_world_error(gen, failures):
        # A worker's exception: the other nodes may fail with the same one (the world's failure, charged to nobody).
        until = min(f.reported_at for f in failures) + REPORT_GRACE_S
        if now < until:
            return WaitUntil(
                until,
                f"{', '.join(failed_nodes)} failed; waiting whether every node fails the same way",
                JobState.RUNNING,
            )
    if running and gen is not None and failed_nodes:
        error = world_error(gen, failures)
        if error:  # the world's failure: no node is charged, and the job no longer takes this world size
            refused = tuple(sorted({*_refused(snap), (gen.world_size, error)}))
            nodes = _allowed(spec, target, refused)
            if len(nodes) < spec.min_nodes:
                return FailJob(
                    f"job {spec.job_id!r} cannot train at any world size its nodes allow: {refused_note(refused)}; "
                    f"this is the script's error at that size (see any node's worker log): fix the script, or "
                    f"run with --nnodes that avoid those sizes"
                )
            return _publish(snap, nodes, "restart", restarts + 1, now, refused=refused)
        culprits = sorted({f.node_id for f in failures if not broken_by_a_peer(f)}) or failed_nodes
        for node in culprits:
            charged[node] = charged.get(node, 0) + 1
        errors = {f.node_id: f.error or f.message for f in failures if f.node_id in culprits}
        over = [n for n in culprits if charged[n] > spec.max_restarts]
        healthy = grouped([m for m in target if m.node_id not in over], current_ids, spec.node_group)
        if over and len(healthy) < spec.min_nodes:
            refused = refused_note(_refused(snap))
            return FailJob(
                f"job {spec.job_id!r} spent its restart budget: a worker failed again on {', '.join(over)}, more "
                f"than max_restarts={spec.max_restarts} times on that node ({errors[over[0]] or 'no error given'}), "
                f"and {len(healthy)} other node(s) remain of the {spec.min_nodes} it needs"
                f"{f' ({refused})' if refused else ''}; see those nodes' worker logs, then fix the script or raise "
                f"--max-restarts"
            )
        return _publish(snap, healthy, "restart", restarts + 1, now, charged, errors=errors)

    if len(target) < spec.min_nodes:
        return _held(_waiting_or_fail(snap, target, now), held)

    if running and not admitted:
        return _held(Keep(), held)

    # A first world, a world after waiting, or a scale-up: batch joiners that arrive within the grace window.
    fresh = admitted if running else target
    deadline = max(m.joined_at for m in fresh) + spec.join_grace_s
    if len(target) >= spec.max_nodes or now >= deadline:
        return _publish(snap, target, "join" if gen else "start", restarts, now)
    state = JobState.RUNNING if running else JobState.WAITING
    # Another arrival only moves the deadline later, until the job is full.
    batching = WaitUntil(
        deadline, f"batching joins of {', '.join(m.node_id for m in fresh)}", state, replan_at_members=spec.max_nodes
    )
    return _held(batching, held)
