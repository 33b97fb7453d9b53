"""When the ranks vote on a rescale: one schedule for :mod:`pliant.worker`'s rescale protocol and for the framework
integrations (:mod:`pliant.integration`). Pure: no collective, no clock.

Under a pliant agent a rescale is asked of a worker with a signal (:data:`pliant.env.RESCALE_SIGNAL`); the ranks learn
that some rank was asked through a vote, an all-reduce (max) of a few integers that every rank reaches at the same
step boundary: "my agent asked", this rank's last step time in microseconds (:func:`ballot_us`), and what else the
caller votes on. A vote costs a collective and, on a GPU, a synchronisation with the device, so the ranks do not vote
at every step: from the slowest rank's last step time, every rank computes the same next vote
(:func:`votes_apart`: about every :data:`VOTE_WITHIN_S`, every step for long steps, at least every
:data:`MAX_VOTE_EVERY` steps). The first step of a job, or of a new world, votes.
"""

from __future__ import annotations

__all__ = ["MAX_VOTE_EVERY", "VOTE_WITHIN_S", "VoteSchedule", "ballot_us", "votes_apart"]

VOTE_WITHIN_S = 0.1
"""The ranks vote about this often ..."""
MAX_VOTE_EVERY = 32
"""... but at least every this many steps."""
_MAX_INT = 2**31 - 1  # the vote's integers fit an int32


def votes_apart(slowest_s: float) -> int:
    """Steps from one vote to the next when the slowest rank's last step took ``slowest_s`` (0: none yet)."""
    return min(MAX_VOTE_EVERY, max(1, int(VOTE_WITHIN_S / slowest_s))) if slowest_s > 0 else 1


def ballot_us(step_s: float) -> int:
    """A step time as the vote carries it: whole microseconds, within an int32."""
    return min(int(step_s * 1e6), _MAX_INT)


class VoteSchedule:
    """The step of the next vote, the same on every rank (each derives it from the same all-reduced integer).

    Threads: the training loop's only.

    Attributes:
        next_vote: the step (0-based) whose boundary votes next.
    """

    def __init__(self) -> None:
        self.next_vote = 0

    def due(self, step: int) -> bool:
        """Whether the boundary of ``step`` votes."""
        return step >= self.next_vote

    def agreed(self, step: int, slowest_us: int) -> None:
        """The vote of ``step`` gave the slowest rank's last step time: set the next vote's step."""
        self.next_vote = step + votes_apart(slowest_us / 1e6)

    def restart(self, step: int) -> None:
        """A new world starts at ``step``: it votes in its first step."""
        self.next_vote = step
