"""How a job ended, as one pure function of its last generation: what the state record, ``pliant status``, the
metrics and every agent's last line say.

- **full**: the job succeeded with no world size refused and no node excluded: every node that came trained, at
  every size its nodes allowed.
- **reduced**: the job succeeded, but the job refused world sizes (each failed on every node with one error) or
  excluded nodes (each failed more than ``max_restarts`` times on its own); the reason names each, with its error.
- **failed**: the job failed; its reason says why (the planner's, or an admin's).
"""

from __future__ import annotations

from pliant.coordinator.contract import Generation, Outcome

__all__ = ["outcome_of"]


def outcome_of(succeeded: bool, gen: Generation | None, reason: str) -> tuple[Outcome, str]:
    """How a job whose last generation is ``gen`` ended, and its final reason (``reason``, the planner's or a
    report's words, led by what the outcome names)."""
    if not succeeded:
        return Outcome.FAILED, reason
    if gen is None:
        return Outcome.FULL, reason
    nodes = len(gen.members)
    size = f"world {gen.world_size} ({nodes} node{'' if nodes == 1 else 's'})" if nodes else "no world"
    left = [f"world size {size_} refused (it fails on every node with {error})" for size_, error in gen.refused]
    left += [
        f"node {node} excluded after {count} worker failures ({error or 'no error given'})"
        for node, count, error in gen.excluded
    ]
    if not left:
        return Outcome.FULL, f"finished at full size, {size}: {reason}"
    return Outcome.REDUCED, f"finished at {size}, with {'; '.join(left)}: {reason}"
