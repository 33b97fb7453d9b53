"""When a generation handed over in place waits for its newcomers, and when it gives up on them: pure rules, time
passed in, which :func:`pliant.agent.core.decide` applies (the executor reads the arrivals and probes the agents when
it asks).

A generation that admits new nodes is handed to this node's running workers only once the newcomers' workers have
counted themselves in at the generation's store (node rank 0's), so that the survivors train on while the newcomers
start, instead of waiting in a meeting. Meanwhile this node probes the newcomers' agents (a TCP connect to the store
port each agent holds from before it joined; the executor runs it in the background, one probe at a time) every
:data:`PROBE_EVERY_S`:

- a newcomer whose agent failed :data:`PROBES_FAILED` probes in a row cannot reach this node either (a cut, or it
  died): this node reports the generation's failure naming it, instead of handing the generation over. The workers
  train on in their generation, the coordinator evicts the newcomer (a strike: it never arrived) and the survivors
  re-form in the next generation, without waiting out the rescale grace;
- once every newcomer counted in, or the rescale grace ran out, one last probe decides: counting in at node rank 0's
  store proves nothing to this node, which may not reach a newcomer that node rank 0 does (a cut in a world of
  three), and whose workers would then wait in a meeting that cannot form.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace

__all__ = ["PROBES_FAILED", "PROBE_EVERY_S", "HandOver", "Verdict", "probe_due", "probed"]

PROBE_EVERY_S = 1.0  # a pending hand-over probes its newcomers' agents this often ...
PROBES_FAILED = 2  # ... and reports a newcomer whose agent failed this many probes in a row


@dataclass(frozen=True)
class HandOver:
    """A hand-over waiting for newcomers.

    Attributes:
        newcomers: node ids of the newcomers.
        needed: how many workers must count themselves in (the newcomers' processes).
        deadline: when the rescale grace runs out (the executor's monotonic clock).
        probed_at: when the newcomers were last probed.
        failed: per newcomer, the probes in a row its agent failed.
        probing: a probe is out (the executor runs it in the background); no second one until it answers.
    """

    newcomers: tuple[str, ...]
    needed: int
    deadline: float
    probed_at: float = float("-inf")
    failed: tuple[tuple[str, int], ...] = ()
    probing: bool = False


@dataclass(frozen=True)
class Verdict:
    """What a pending hand-over does after a probe: hand the generation over, report ``cut`` (with ``message``), or
    wait (neither)."""

    hand: bool = False
    cut: tuple[str, ...] = ()
    message: str = ""


def probe_due(pending: HandOver, arrived: int, now: float) -> bool:
    """Whether to probe the newcomers now: no probe is out, and every one counted in, the grace ran out, or the last
    probe is :data:`PROBE_EVERY_S` old."""
    if pending.probing:
        return False
    return arrived >= pending.needed or now >= pending.deadline or now - pending.probed_at >= PROBE_EVERY_S


def probed(
    pending: HandOver, arrived: int, unreachable: Collection[str], now: float, grace_s: float
) -> tuple[HandOver, Verdict]:
    """The hand-over after a probe found ``unreachable`` newcomers (``arrived`` workers counted in by then).

    Args:
        pending: the hand-over.
        arrived: workers counted in at the generation's store.
        unreachable: newcomers whose agents did not answer this probe.
        now: the executor's monotonic clock.
        grace_s: the rescale grace (for the message).

    Returns:
        (the hand-over with this probe counted, what to do).
    """
    before = dict(pending.failed)
    failed = tuple((n, before.get(n, 0) + 1 if n in unreachable else 0) for n in pending.newcomers)
    pending = replace(pending, probed_at=now, failed=failed, probing=False)
    final = arrived >= pending.needed or now >= pending.deadline
    cut = tuple(n for n, count in failed if count and (final or count >= PROBES_FAILED))
    if not cut:
        return pending, Verdict(hand=final)
    if arrived >= pending.needed:
        why, how = "counted themselves in", ""
    elif final:
        why, how = f"did not arrive within the rescale grace ({grace_s:g}s)", ""
    else:
        why, how = "have not arrived yet", f" ({PROBES_FAILED} probes {PROBE_EVERY_S:g}s apart)"
    message = f"newcomers {', '.join(cut)} {why} and their agents are unreachable from this node{how}"
    return pending, Verdict(cut=cut, message=message)
