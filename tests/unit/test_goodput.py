"""A node's goodput and badput, charged tick by tick on a fake clock: a start, steps, a blocking save, a worker's
kill and the restore from an older checkpoint (a failure's decide, restart and restore phases), a rescale, a wait
below the minimum, and a script that reports no steps."""

from __future__ import annotations

import pytest

from pliant.agent.goodput import CAUSES, PHASES, PRODUCTIVE, Activity, Goodput, classify

TICK = 0.25


class Timeline:
    """Ticks every 0.25 s of fake time, each with what the node does."""

    def __init__(self) -> None:
        self.now = 0.0
        self.goodput = Goodput(self.now)

    def run(self, seconds: float, activity: Activity) -> None:
        for _ in range(round(seconds / TICK)):
            self.now += TICK
            self.goodput.charge(self.now, activity)

    def steps(self, first: int, last: int, ranks: int = 2) -> None:
        """Steps ``first`` to ``last`` completed, one a tick."""
        for step in range(first, last + 1):
            self.run(TICK, Activity(True, {rank: (step, "step") for rank in range(ranks)}))


def _assert_seconds(goodput: Goodput, **expected: float) -> None:
    for category in (PRODUCTIVE, *CAUSES):
        assert goodput.seconds[category] == pytest.approx(expected.get(category, 0.0)), category


def test_a_start_steps_a_save_a_kill_and_redone_steps_are_charged_where_they_went() -> None:
    t = Timeline()
    t.run(2.0, Activity(False))  # joining and waiting for the first world
    t.run(0.5, Activity(True))  # workers forked, no record yet: counted as training until the script reports
    t.run(1.0, Activity(True, {0: (0, "start"), 1: (0, "start")}))  # the session opened: imports, restore
    t.steps(1, 10)  # ten steps
    t.run(0.5, Activity(True, {0: (10, "save"), 1: (10, "step")}))  # a blocking save
    t.steps(11, 12)
    t.goodput.interrupted("failure", decided=False)  # a worker was killed: its group exits
    t.run(0.5, Activity(False))  # the reports and the coordinator's plan
    t.goodput.interrupted("rescale", decided=True)  # the generation that answers it (a join came with it)
    t.run(0.5, Activity(False))  # no workers until the next generation's
    t.run(0.5, Activity(True, {0: (8, "start"), 1: (8, "start")}))  # restored from step 8
    t.steps(9, 15)  # 9..12 again, then new steps
    # Each tick charges what the node was doing at the tick before: the empty group counts as training until its first
    # record (two ticks); the session's are the start's up to step 1; steps 2-10, the save's first tick, step 12 and
    # the kill's first tick are training; the restored group redoes 10-12 and trains 13-15 anew.
    _assert_seconds(
        t.goodput,
        start=2.0 + TICK + 1.0,
        productive=TICK + 9 * TICK + TICK + TICK + TICK + TICK + 3 * TICK,
        checkpoint=2 * TICK,
        failure=0.75 + 0.5 + TICK,
        redone=3 * TICK,
    )
    assert t.goodput.total() == pytest.approx(t.now)
    phases = {phase: t.goodput.phases["failure", phase] for phase in PHASES}
    assert phases == pytest.approx({"decide": 0.5, "restart": 0.5, "restore": 0.5})
    assert sum(t.goodput.phases["rescale", phase] for phase in PHASES) == 0.0


def test_a_job_below_its_minimum_is_waiting_and_a_rescale_is_a_rescale() -> None:
    t = Timeline()
    t.run(1.0, Activity(False, held_out=True))  # the job waits for nodes
    t.steps(1, 4)
    t.goodput.interrupted("rescale", decided=True)  # a join: the group stops for the restart path
    t.run(1.0, Activity(False))
    t.run(0.5, Activity(True, {0: (4, "start")}, held_out=False))
    t.steps(5, 8)
    assert t.goodput.seconds["waiting"] == pytest.approx(1.0)  # the first tick's interval is the start's
    assert t.goodput.seconds["start"] == pytest.approx(TICK)
    assert t.goodput.seconds["rescale"] == pytest.approx(1.5)
    assert t.goodput.phases["rescale", "restart"] == pytest.approx(1.0)  # three ticks without workers, one with
    assert t.goodput.phases["rescale", "restore"] == pytest.approx(0.5)
    assert t.goodput.seconds["redone"] == 0.0


def test_workers_waiting_for_their_agent_after_a_broken_collective_are_a_failures() -> None:
    assert classify(Activity(True, {0: (5, "wait", 3), 1: (5, "step")}), "rescale", True, 5, True) == (
        "failure",
        "decide",
    )
    assert classify(Activity(True, {0: (5, "transfer", 4)}), "rescale", True, 5, True) == ("rescale", "restore")
    assert classify(Activity(True, {0: (5, "step"), 1: (4, "step")}), "start", True, 5, True) == ("redone", "")
    assert classify(Activity(True), "failure", True, 5, reported=True) == ("failure", "restore")
    assert classify(Activity(False), "failure", False, 5, reported=True) == ("failure", "decide")
    assert classify(Activity(True, {0: (0, "start")}), "start", True, -1, True) == ("start", "")


def test_a_script_that_reports_no_steps_counts_its_running_time_as_training() -> None:
    t = Timeline()
    t.run(1.0, Activity(False))
    t.run(3.0, Activity(True))
    assert t.goodput.seconds[PRODUCTIVE] == pytest.approx(3.0 - TICK)
    assert t.goodput.line() == "goodput 68.8% (badput: start 1.2s)"
    assert Goodput(0.0).line() == ""
