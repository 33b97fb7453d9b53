"""The store's policies as pure functions: who is evicted, when, and on which clock. No I/O; time is passed in.

The reconciler (the executor) reads etcd, asks these functions, and writes what they decide, fenced.

**Liveness** is judged by the leader from heartbeats the control plane actually had the chance to receive. A member's
lease is long (``membership_lease_s``, the outage it survives); each heartbeat refreshes it, so the lease's age (its
granted TTL less its remaining TTL, kept by etcd) is the time since the member's last heartbeat on etcd's clock. A
member is overdue when that age passes the job's heartbeat TTL, but only once this leader has been able to hear from
everyone for a full TTL: after it won the election and after etcd answered again. A control-plane outage of any length
(shorter than the lease) therefore evicts nobody who kept trying; a node that died is evicted one TTL after the
control plane came back.

**Unreachable peers** (:func:`reported_evictions`, :func:`evictions`, :func:`corroborated`, :func:`struck`,
:func:`held_back`). An agent whose workers failed names the peers whose agents it cannot reach, and the coordinator
evicts them with the report. Four rules keep a cut between nodes that all still reach the control plane from tearing
the world down, shrinking it to its smaller part, or flapping it forever, and keep one member's word from evicting a
healthy peer:

- no member's word alone evicts a peer: the absence must be *corroborated* (:func:`corroborated`) by the leader's
  own view of the lease (the named node missed two heartbeats: :func:`silent_members`), or by a report from another
  side: another member names it too, or it names the reporter (both sides of a cut report each other). The one
  exception is a newcomer that never arrived, named by an older member: the world never trained with it, so its
  eviction costs the others nothing, and it earns a strike (below). A report whose named nodes are not corroborated
  waits up to :func:`corroboration_s` (half the heartbeat TTL and a little: a node dead by the time of the report is
  silent by then) and is then a failure like any other, charged to its reporter: a member that names a healthy peer
  again and again excludes itself. A cut that only one side reports (the other reaches the first) costs the
  reporting side the same way;
- reports are weighed in the order etcd recorded them, and a report evicts only while its reporter is a live member:
  when both sides of a cut report each other in one generation, the second report corroborates the first, the first
  evicts the other side, and the second, from an evicted node, evicts nobody. On equal sides, the first report
  decides;
- a report evicts at once only when the side it names is not the larger (in processes; the reporter's side is every
  live member it does not name). A node cut off from all its peers names every one of them, and if its report came
  first, the world would shrink to that one node. A newcomer (admitted by this generation) that names an
  older member waits for the older members of its own side to say so: in a cut between two nodes that a third
  reaches, the third counts on both sides, and a readmitted node's report would evict the member that had stayed
  (those older members report the named node themselves when the cut is theirs too). Reports that do not evict at
  once evict :data:`REPORT_GRACE_S` later, and only if none of the nodes they name has reported a failure of the
  generation meanwhile: dead nodes report nothing (the survivors of a loss of most of the world wait those 2 s, and
  for the dead to fall silent), while live ones report, and the larger side's or the older member's report evicts
  the reporter first. A newcomer stops being one once its generation trained a step: a report says whether its
  reporter's workers did (``FailureReport.arrived``), and then every member weighs as an older one;
- a node that came back and could not be reached by the members it was admitted to join gets a *strike*: it is named
  by a member that has trained in the world since an earlier generation, in the generation that admitted it, and
  that generation never trained a step as far as the reporter knows (a readmission that failed: the survivors'
  agents report a newcomer that never arrived, see the agent's hand-over); a node that arrived and trained in the
  generation that admitted it earns none when a cut drops it. Strikes are
  kept in etcd and lapse :data:`STRIKE_WINDOW_S` after the last. A node back at the same address is held back as a
  spare for :func:`backoff_s` of its strikes (:data:`BACKOFF_BASE_S`, doubling up to :data:`BACKOFF_MAX_S`), as
  Kubernetes backs off a crash-looping container: a cut that does not heal costs one try per backoff instead of one
  a minute. The node's agent, a spare, connects to every member's agent on its heartbeats, and what it finds shapes
  the hold. While it cannot reach them all (``Strike.missed``), the hold lasts past its backoff, up to
  :data:`BACKOFF_MAX_S` after the strike: a readmission would fail again, and each try costs the survivors two
  re-formations. When it reaches them all, the cut healed: the hold ends early (``Strike.lifted``), at most once per
  two strikes (:data:`LIFTS_PER_STRIKE`): a connect that succeeds from the node proves nothing about connects to it,
  and a cut that only the node's own connects get through would otherwise cost a try every few seconds forever; and
  a hold past its backoff ends either way. A node evicted while it was an established member (a
  partition, a death, a cut that then heals) gets no strike, so churn the fleet causes never holds anyone back; a node
  back at another address (its agent was restarted, or it was replaced) starts its count again;
- a node that *itself* leaves gracefully a second time within :data:`CHURN_WINDOW_S` gets a strike for it, and one
  for each leave after: one member that leaves and joins again and again is held back ever longer (each such cycle
  costs the others two re-formations), while a spot node preempted once a minute or less never is.

**One clock**: deadlines (join batching, the min-nodes timeout, the finished-job TTL) are measured on the leader's
monotonic clock, from when the leader first saw the record that starts them (identified by its etcd revision), never
from times another replica wrote. A new leader starts those clocks again: it may wait up to one grace longer, never
shorter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence

from pliant.coordinator.contract import (
    FailureReport,
    Generation,
    InvalidArgument,
    JobSnapshot,
    JobStatus,
    Member,
    PermissionDenied,
    Strike,
    quote,
)

__all__ = [
    "AGE_RESOLUTION_S",
    "BACKOFF_BASE_S",
    "BACKOFF_MAX_S",
    "LIFTS_PER_STRIKE",
    "REPORT_GRACE_S",
    "SILENCE_POLL_S",
    "SILENT_FRACTION",
    "STRIKE_WINDOW_S",
    "LeaderClock",
    "Reported",
    "backoff_s",
    "corroborated",
    "corroboration_s",
    "evictions",
    "held_back",
    "may_overwrite",
    "overdue_members",
    "reported_evictions",
    "side",
    "silent_members",
    "struck",
]

STRIKE_WINDOW_S = 600  # a node's strikes lapse this long after its last (etcd's lease on them)
CHURN_WINDOW_S = 60  # a node's second graceful leave within this long earns it a strike, and each after it
REPORT_GRACE_S = 2.0  # reports of workers waiting after a peer failed wait this long for the failure's cause
BACKOFF_BASE_S = 10.0  # the hold after a first strike; doubled for each strike after it ...
BACKOFF_MAX_S = 300.0  # ... up to this
LIFTS_PER_STRIKE = 0.5  # a node's holds are lifted (it reached every member again) at most once per two strikes


def overdue_members(ages: Mapping[str, float], ttl_s: float, heard_since: float, now: float) -> tuple[str, ...]:
    """The members to evict: silent for longer than ``ttl_s`` while the leader could hear them.

    Args:
        ages: node id -> seconds since its last heartbeat (from its lease; a negative age means unknown).
        ttl_s: the job's heartbeat TTL.
        heard_since: leader-clock time since which this leader could receive every heartbeat (it won the election,
            or etcd answered again, whichever is later).
        now: leader-clock time.

    Returns:
        Node ids, sorted; empty during the first TTL after ``heard_since``.
    """
    if now - heard_since < ttl_s:
        return ()
    return tuple(sorted(node for node, age in ages.items() if age > ttl_s))


def side(generation: Generation, nodes: Sequence[str], arrived: bool = False) -> tuple[int, int]:
    """How much of ``generation``'s world ``nodes`` are: (processes of those admitted before it, or of all of them once
    it ``arrived``, all processes)."""
    members = {m.node_id: m for m in generation.members}
    chosen = [members[n] for n in dict.fromkeys(nodes) if n in members]
    return sum(m.nproc for m in chosen if arrived or m.since < generation.number), sum(m.nproc for m in chosen)


def evictions(
    generation: Generation, reporter: str, unreachable: Sequence[str], live: Sequence[str], arrived: bool = False
) -> tuple[str, ...]:
    """The side rule: the nodes a failure report of ``generation`` may evict at once, as far as the sides go (see the
    module docstring); :func:`reported_evictions` evicts only those of them whose absence is also corroborated.

    Args:
        generation: the generation the report is for (the current one).
        reporter: the reporting node (a member of ``generation``).
        unreachable: the nodes whose agents the reporter could not reach.
        live: the nodes that hold a live membership now.
        arrived: the reporter's workers trained a step in ``generation`` (``FailureReport.arrived``): every member
            arrived, and none is a newcomer any more.

    Returns:
        The named live members of ``generation`` other than the reporter, if the reporter's live side has at least as
        many processes; nothing when it has fewer, or when a newcomer names an older member while its side has older
        members too (:func:`reported_evictions` may evict them later), or when the reporter is no longer a live
        member.
    """
    members = {m.node_id for m in generation.members}
    if reporter not in live or reporter not in members:
        return ()
    named = tuple(n for n in dict.fromkeys(unreachable) if n != reporter and n in members and n in live)
    mine = [n for n in members if n in live and n not in named]
    (mine_old, mine_all), (named_old, named_all) = side(generation, mine, arrived), side(generation, named, arrived)
    if side(generation, [reporter], arrived)[0] == 0 and named_old and mine_old:
        return ()  # a newcomer's word against an older member waits for the older members of its side to say so
    return named if mine_all >= named_all else ()


SILENT_FRACTION = 0.5  # a member silent for more than this part of the heartbeat TTL (two heartbeats) is silent
AGE_RESOLUTION_S = 1.0  # etcd gives a lease's TTL left in whole seconds, so an age is known to within this
SILENCE_POLL_S = 0.5  # while a report waits for its named nodes to fall silent, the leader looks this often


def silent_members(ages: Mapping[str, float], ttl_s: float) -> frozenset[str]:
    """The members the leader itself hears nothing from: silent for more than :data:`SILENT_FRACTION` of the
    heartbeat TTL ``ttl_s`` (an agent beats every quarter TTL, so two beats were missed). ``ages``: node id ->
    seconds since its last heartbeat (negative: unknown)."""
    return frozenset(node for node, age in ages.items() if age > ttl_s * SILENT_FRACTION)


def corroboration_s(ttl_s: float) -> float:
    """How long a report waits for the nodes it names to fall silent: a node that died by the time of the report is
    silent by then (its last heartbeat came before the report)."""
    return ttl_s * SILENT_FRACTION + AGE_RESOLUTION_S + SILENCE_POLL_S


def corroborated(
    generation: Generation, report: FailureReport, node: str, reports: Sequence[FailureReport], silent: Collection[str]
) -> bool:
    """Whether ``report``'s word that ``node`` is unreachable is borne out by more than the reporter: the leader hears
    nothing from ``node`` (``silent``), another member names it too, ``node`` names the reporter (both sides of a cut
    report it), or ``node`` is a newcomer that never arrived, named by an older member (the world never trained with
    it: evicting it costs the others nothing, and it earns a strike).

    Args:
        generation: the generation reported.
        report: the report naming ``node``.
        node: a member named unreachable.
        reports: every report of ``generation``.
        silent: the members the leader hears nothing from (:func:`silent_members`).
    """
    if node in silent:
        return True
    for other in reports:
        if other.node_id == node and report.node_id in other.unreachable:
            return True
        if other.node_id not in (node, report.node_id) and node in other.unreachable:
            return True
    since = {m.node_id: m.since for m in generation.members}
    newcomer = since.get(node) == generation.number and since.get(report.node_id, generation.number) < generation.number
    return newcomer and not report.arrived


@dataclasses.dataclass(frozen=True)
class Reported:
    """What the failure reports of a generation evict (:func:`reported_evictions`).

    Attributes:
        evicted: (the report that evicts, the nodes it evicts), in report order.
        pending: the leader-clock time to look again (a grace runs, or named nodes may yet fall silent), or None.
        doubted: live members named by a report and not corroborated yet, whose silence the leader watches.
    """

    evicted: tuple[tuple[FailureReport, tuple[str, ...]], ...] = ()
    pending: float | None = None
    doubted: tuple[str, ...] = ()

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every node evicted, in order."""
        return tuple(dict.fromkeys(n for _report, nodes in self.evicted for n in nodes))


def reported_evictions(
    generation: Generation,
    failures: Sequence[FailureReport],
    live: Sequence[str],
    silent: Collection[str],
    ttl_s: float,
    now: float | None = None,
) -> Reported:
    """What the failure reports of ``generation`` evict, taken in the order they were recorded (see the module
    docstring). For each report whose reporter is still a live member:

    - the sides are weighed on everything it names (:func:`evictions`); when its side is not the smaller, it evicts
      the named nodes whose absence is :func:`corroborated`, at once;
    - when its side is the smaller (or a newcomer named older members), it evicts the corroborated named nodes
      :data:`REPORT_GRACE_S` after the report, unless one of the nodes it names reported a failure meanwhile;
    - a named node not corroborated is evicted by nobody's word alone: the report waits up to
      :func:`corroboration_s` for the node to fall silent (or for another report), and is then a failure like any
      other, charged to its reporter.

    Args:
        generation: the current generation.
        failures: failure reports in the order etcd recorded them (only those of ``generation`` count), with
            ``reported_at`` on the leader's clock.
        live: the nodes that hold a live membership now.
        silent: the members the leader hears nothing from (:func:`silent_members`).
        ttl_s: the job's heartbeat TTL.
        now: the leader's clock; None: only what evicts at once (a report as it is recorded, on no leader's clock).
    """
    reports = [f for f in failures if f.generation == generation.number]
    reported = {f.node_id for f in reports}
    members = set(generation.node_ids)
    remaining = list(dict.fromkeys(live))
    evicted: list[tuple[FailureReport, tuple[str, ...]]] = []
    doubted: list[str] = []
    pending: float | None = None

    def later(at: float) -> None:
        nonlocal pending
        pending = at if pending is None else min(pending, at)

    for report in reports:
        if report.node_id not in remaining:
            continue  # evicted by an earlier report, or gone: its word evicts nobody
        named = [
            n for n in dict.fromkeys(report.unreachable) if n in remaining and n in members and n != report.node_id
        ]
        firm = [n for n in named if corroborated(generation, report, n, reports, silent)]
        allowed = evictions(generation, report.node_id, named, remaining, report.arrived)
        out = [n for n in allowed if n in firm]
        if not allowed and firm and not reported.intersection(named):
            due = report.reported_at + REPORT_GRACE_S
            if now is not None and now >= due:
                out = firm
            else:
                later(due)
        unsure = [n for n in named if n not in firm and n not in reported]
        until = report.reported_at + corroboration_s(ttl_s)
        if unsure and (now is None or now < until):
            doubted += unsure
            later(until if now is None else min(until, now + SILENCE_POLL_S))
        if out:
            evicted.append((report, tuple(out)))
            remaining = [n for n in remaining if n not in out]
    return Reported(tuple(evicted), pending, tuple(dict.fromkeys(n for n in doubted if n in remaining)))


def struck(generation: Generation, reporter: str, evicted: Sequence[str], arrived: bool = False) -> tuple[str, ...]:
    """Of the nodes ``reporter``'s report of ``generation`` evicts, those that earn a strike: admitted by this very
    generation, and named by a member that has trained in the world since an earlier one (a failed readmission); none
    when the generation ``arrived`` (the reporter's workers trained a step in it: the newcomers did arrive)."""
    since = {m.node_id: m.since for m in generation.members}
    if arrived or not since.get(reporter, generation.number) < generation.number:
        return ()
    return tuple(n for n in evicted if since.get(n) == generation.number)


def check_report(job: str, generation: Generation, report: FailureReport) -> None:
    """A failure report of ``generation`` may be recorded: its reporter is a member, and it names no node that is
    not one.

    Raises:
        PermissionDenied: the reporter is not a member of ``generation``.
        InvalidArgument: the report names a node that is not a member.
    """
    if report.node_id not in generation.node_ids:
        raise PermissionDenied(
            f"node {report.node_id!r} is not a member of job {job!r}'s generation {generation.number}; only its "
            f"members report its failures"
        )
    strangers = [n for n in report.unreachable if n not in generation.node_ids]
    if strangers:
        raise InvalidArgument(
            f"unreachable_nodes names {quote(strangers)}, not members of job {job!r}'s generation "
            f"{generation.number}; name only nodes of the generation reported"
        )


@dataclasses.dataclass(frozen=True)
class Judgement:
    """What recording a failure report does at once (:func:`judge_report`).

    Attributes:
        reported: what the generation's reports evict now (:func:`reported_evictions`, on no leader's clock).
        reporters: the reporters whose word evicts: they must still be members when the eviction is written.
        struck: the evicted nodes that earn a strike (:func:`struck`), in order.
    """

    reported: Reported
    reporters: tuple[str, ...]
    struck: tuple[str, ...]

    @property
    def evicted(self) -> tuple[str, ...]:
        return self.reported.nodes


def judge_report(
    generation: Generation, reports: Sequence[FailureReport], live: Sequence[str], silent: Collection[str], ttl_s: float
) -> Judgement:
    """What the reports of ``generation``, the one being recorded last, evict as it is recorded, whose word evicts,
    and who earns a strike (see the module docstring)."""
    reported = reported_evictions(generation, reports, live, silent, ttl_s)
    to_strike = [n for r, nodes in reported.evicted for n in struck(generation, r.node_id, nodes, r.arrived)]
    reporters = tuple(dict.fromkeys(r.node_id for r, _nodes in reported.evicted))
    return Judgement(reported, reporters, tuple(dict.fromkeys(to_strike)))


def next_strike(count: int, address: str, lifts: int, now_at: str) -> tuple[int, int]:
    """A node's strike count and lifted holds after one more strike at address ``now_at``, its record holding
    ``count`` strikes (and ``lifts``) at ``address``: counted on at the same address, from one (and no lifts) at
    another."""
    same = address == now_at
    return (count + 1, lifts) if same else (1, 0)


def backoff_s(count: int) -> float:
    """How long a node with ``count`` strikes is held back: :data:`BACKOFF_BASE_S` for one, doubling per strike up to
    :data:`BACKOFF_MAX_S`; nothing for none."""
    return 0.0 if count < 1 else min(BACKOFF_BASE_S * 2 ** (count - 1), BACKOFF_MAX_S)


def held_back(strikes: Sequence[Strike], members: Sequence[Member], now: float) -> dict[str, float]:
    """Members held back from a generation at ``now``: node id -> leader-clock time its hold ends. A strike holds a
    member back only at the address it was evicted from, and no longer once lifted (the node reached every member);
    while the node's agent, a spare, cannot reach every member (``missed``), up to :data:`BACKOFF_MAX_S` after it."""
    address = {m.node_id: m.address for m in members}
    out = {}
    for strike in strikes:
        until = strike.seen_at + (BACKOFF_MAX_S if strike.missed else backoff_s(strike.count))
        if address.get(strike.node_id) == strike.address and now < until and not strike.lifted:
            out[strike.node_id] = until
    return out


def may_overwrite(current: JobStatus) -> bool:
    """Whether the leader may write a new state over ``current``: never over a terminal one."""
    return not current.state.terminal


class LeaderClock:
    """When this leader first saw each record that starts a deadline, on its own monotonic clock.

    Records are named by etcd revisions (a state record by its mod revision, a member by its key's create revision)
    or by what starts their clock (a strike by its count at its address, which a lift or a miss that rewrites the
    record leaves alone), so a record rewritten by another replica is a new record, and a record's age never depends
    on another machine's clock.
    """

    def __init__(self) -> None:
        self._seen: dict[str, dict[tuple[str, int], float]] = {}

    def view(self, snap: JobSnapshot, now: float) -> JobSnapshot:
        """``snap`` with the state's ``since``, each member's ``joined_at``, each strike's ``seen_at`` and each failure
        report's ``reported_at`` (a node's first for its generation) replaced by the times this leader first saw them
        (leader-clock seconds; pass the same clock's ``now`` to the planner)."""
        job = snap.spec.job_id
        old = self._seen.get(job, {})
        seen: dict[tuple[str, int], float] = {}

        def first(key: tuple[str, int]) -> float:
            seen[key] = old.get(key, now)
            return seen[key]

        since = first(("state", snap.status_mod_revision))
        members = tuple(dataclasses.replace(m, joined_at=first((m.node_id, m.order))) for m in snap.members)
        # a strike's clock starts at the strike (its count at its address), not at a lift or a miss that rewrote it
        strikes = tuple(
            dataclasses.replace(s, seen_at=first((f"strike/{s.node_id}/{s.address}", s.count))) for s in snap.strikes
        )
        failures = tuple(
            dataclasses.replace(f, reported_at=first((f"failure/{f.node_id}", f.generation))) for f in snap.failures
        )
        self._seen[job] = seen  # records no longer in the snapshot are forgotten
        return dataclasses.replace(
            snap,
            status=dataclasses.replace(snap.status, since=since),
            members=members,
            strikes=strikes,
            failures=failures,
        )

    def forget(self, job: str) -> None:
        self._seen.pop(job, None)

    def reset(self) -> None:
        """Forget everything (leadership lost: a later term starts its clocks again)."""
        self._seen.clear()
