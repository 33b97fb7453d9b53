"""The waits between retries: exponential up to a cap, with jitter, so that the many clients that retry one server
after its outage (a thousand agents re-joining, every replica's watches re-arming) spread out instead of arriving
together. It is the one backoff of the project: the coordinator client's fail-over between replicas and its
generation watch, the etcd watches' re-arming, the election, the reconciler's passes, and the agent's re-join and
reports.

Decision: "equal jitter" (AWS's name): the n-th wait is uniform in [c/2, c], with c = min(cap, first x 2^n), so a
retry never comes sooner than half its ceiling (no hot loop at the first attempts) and retries drawn together drift
apart. A loop asks :meth:`Backoff.next` after each failure and :meth:`Backoff.reset` after a success.
"""

from __future__ import annotations

import random

__all__ = ["Backoff"]


class Backoff:
    """The waits of one retry loop.

    Threads: owned by the thread that runs the loop.

    Args:
        first_s: the first wait's ceiling.
        cap_s: the longest ceiling.
        rng: the source of jitter (tests pass a seeded one).
    """

    def __init__(self, first_s: float, cap_s: float, rng: random.Random | None = None) -> None:
        if not 0 < first_s <= cap_s:
            raise ValueError(f"a backoff needs 0 < first_s <= cap_s, not {first_s:g} and {cap_s:g}")
        self.first_s, self.cap_s = first_s, cap_s
        self._rng = rng or random.Random()
        self._failures = 0

    @property
    def failing(self) -> bool:
        """Whether a failure came since the last success (a loop says the first one, and is quiet about the rest)."""
        return self._failures > 0

    def next(self) -> float:
        """The wait after one more failure."""
        ceiling = min(self.cap_s, self.first_s * 2 ** min(self._failures, 62))
        self._failures += 1
        return self._rng.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        """A success: the next failure waits the first wait again."""
        self._failures = 0
