"""The step guard's rules: when a step that a newer generation waits for is taken as broken (stalled), and when a
broken step still blocked ends the process (wedged). The guard on real gloo processes: tests/integration/test_guard.py.
"""

from __future__ import annotations

from pliant.worker.inplace.guard import GIVE_UP_S, STALL_S, stalled, wedged


def test_no_step_running_is_never_stalled() -> None:
    assert not stalled(None, 0.0, now=1e6)


def test_a_step_is_stalled_after_the_floor_or_three_last_steps_whichever_is_longer() -> None:
    assert not stalled(100.0, 0.01, now=100.0 + STALL_S - 0.01)
    assert stalled(100.0, 0.01, now=100.0 + STALL_S + 0.01)
    slow = 4.0  # a slow model's step: three of them before a blocked step is broken
    assert not stalled(100.0, slow, now=100.0 + 3 * slow - 0.1)
    assert stalled(100.0, slow, now=100.0 + 3 * slow + 0.1)


def test_a_step_not_broken_is_never_given_up() -> None:
    assert not wedged(None, 0.0, now=1e6)


def test_a_broken_step_is_given_up_after_the_floor_or_three_last_steps_whichever_is_longer() -> None:
    assert not wedged(100.0, 0.01, now=100.0 + GIVE_UP_S - 0.01)
    assert wedged(100.0, 0.01, now=100.0 + GIVE_UP_S + 0.01)
    slow = 5.0  # a slow step's compute runs on after the break until its next collective fails
    assert not wedged(100.0, slow, now=100.0 + 3 * slow - 0.1)
    assert wedged(100.0, slow, now=100.0 + 3 * slow + 0.1)


def test_a_step_of_a_world_of_one_rank_is_never_stalled() -> None:
    """No peer can block it: it is only slow (a newcomer starting on the lone survivor's machine slowed it)."""
    assert not stalled(100.0, 0.01, now=100.0 + 1e6, peers=False)
    assert stalled(100.0, 0.01, now=100.0 + 1e6, peers=True)


def test_the_restart_path_s_guard_takes_every_call_the_step_guard_takes() -> None:
    """The protocol calls either one: their methods must agree (a parameter added to one only broke the restart
    path's every step)."""
    import inspect

    from pliant.worker.inplace.guard import Guard, NoGuard

    for name in ("begin", "end", "check"):
        assert inspect.signature(getattr(NoGuard, name)) == inspect.signature(getattr(Guard, name)), name
