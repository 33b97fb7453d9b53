"""The agent's console: world lines, the summary, and the status line of a long wait (pliant.statusline)."""

from __future__ import annotations

import io
import logging
import re

import pytest

from pliant.agent.console import SHOW_WAIT_AFTER_S, Summary, WaitLine, awaited, unreachable
from pliant.agent.core import CoreState, Group, HandingOver, RankProgress, Running, Waiting
from pliant.agent.handover import HandOver
from pliant.coordinator.contract import Generation, GenerationMember, JobState
from pliant.statusline import OFF_TERMINAL_EVERY_S, ConsoleHandler, StatusLine

pytestmark = pytest.mark.timeout(10)


def _gen(number: int, *nodes: str, reason: str = "join") -> Generation:
    members = tuple(GenerationMember(node, i, i, 1, f"10.0.0.{i}:1") for i, node in enumerate(nodes))
    return Generation("job", number, members, reason)


def test_world_lines_name_who_joined_and_left_and_the_summary_counts_them() -> None:
    summary = Summary(started_at=0.0)
    first = _gen(1, "a", reason="start")
    summary.seen(first, 0.0)
    assert re.fullmatch(
        r"generation 1 \(start\): world 1, ranks 0\.\.0 on this node, 1 worker started in 0\.5s",
        summary.started(first, first.members[0], 0.5),
    )
    grown = _gen(2, "a", "b", "c")
    summary.seen(grown, 1.0)
    summary.seen(grown, 2.0)  # seen again: the first time counts
    assert re.fullmatch(
        r"generation 2 \(join\): world 1 -> 3 \(b, c joined\) in place in 2\.0s, 1 worker kept, 0 started",
        summary.handed(grown, 1, 0, 3.0),
    )
    shrunk = _gen(3, "a", "c", reason="failure")
    assert "world 3 -> 2 (b left) in place" in summary.handed(shrunk, 1, 0, 4.0)
    swapped = _gen(4, "a", "d", reason="failure")
    assert "world 2 (d joined; c left), ranks 0..0 on this node, 1 worker started" in summary.started(
        swapped, swapped.members[0], 5.0
    )
    assert re.fullmatch(
        r"job job succeeded: 9\.0s on this node; world sizes 1 -> 3 -> 2; 1 rescale and 2 recoveries from "
        r"failures, 2 of them in place",
        summary.line("job", "succeeded", 9.0),
    )


def test_what_a_node_waits_for_in_a_persons_words() -> None:
    waiting = CoreState("a", phase=Waiting())
    assert awaited(waiting, JobState.WAITING, "", 2, 0.0) == ("waiting for nodes: the job needs 2", "")
    spare = CoreState("a", phase=Waiting(), reason="spare: the job is at max nodes")
    assert awaited(spare, JobState.RUNNING, "", 1, 0.0)[0] == "waiting as a spare: the job is at max nodes"
    pending = HandOver(newcomers=("b", "c"), needed=2, deadline=40.0)
    handing = CoreState("a", phase=HandingOver(Group(1), _gen(2, "a", "b", "c"), None, pending))
    assert awaited(handing, JobState.RUNNING, "", 1, 10.0) == (
        "generation 2: waiting for b, c to start their workers",
        "30s to go",
    )
    moving = CoreState("a", phase=Running(Group(2, progress=((0, RankProgress(9, "transfer", 1.0, 2)),))))
    assert awaited(moving, JobState.RUNNING, "", 1, 5.0) == (
        "generation 2: moving the state into the new world",
        "1 rank(s) here",
    )
    training = CoreState("a", phase=Running(Group(1)))
    assert awaited(training, JobState.RUNNING, "", 1, 0.0) == ("", "")
    assert awaited(CoreState("a", phase=Waiting(), reason="joined"), JobState.RUNNING, "", 1, 0.0) == ("", "")


def test_off_a_terminal_a_wait_is_a_line_when_it_changes_and_every_so_often() -> None:
    out = io.StringIO()
    wait = WaitLine(StatusLine(out, terminal=False))
    wait.update("waiting for nodes: 1 of min 2 nodes", "", 0.0)
    wait.update("waiting for nodes: 1 of min 2 nodes", "", SHOW_WAIT_AFTER_S - 0.1)
    assert out.getvalue() == "", "a short wait is not shown"
    for now in (SHOW_WAIT_AFTER_S, SHOW_WAIT_AFTER_S + 1, SHOW_WAIT_AFTER_S + 10):
        wait.update("waiting for nodes: 1 of min 2 nodes", "", now)
    assert out.getvalue() == "pliant: waiting for nodes: 1 of min 2 nodes (5s so far)\n"
    wait.update("waiting for nodes: 1 of min 2 nodes", "", SHOW_WAIT_AFTER_S + OFF_TERMINAL_EVERY_S)
    assert out.getvalue().splitlines()[-1] == "pliant: waiting for nodes: 1 of min 2 nodes (35s so far)"
    wait.update("waiting for nodes: 2 of min 3 nodes", "", 40.0)
    wait.update("waiting for nodes: 2 of min 3 nodes", "", 40.0 + SHOW_WAIT_AFTER_S)
    assert out.getvalue().splitlines()[-1] == "pliant: waiting for nodes: 2 of min 3 nodes (5s so far)"
    assert len(out.getvalue().splitlines()) == 3
    line = wait.line
    with_record = io.StringIO()
    handler = ConsoleHandler(with_record)
    import pliant.statusline as statusline

    statusline._line, saved = line, statusline._line
    try:  # a record in between: off a terminal nothing was drawn, so nothing is written again
        handler.handle(logging.makeLogRecord({"msg": "a record", "levelno": logging.WARNING}))
    finally:
        statusline._line = saved
    wait.update("waiting for nodes: 2 of min 3 nodes", "", 46.0)
    assert len(out.getvalue().splitlines()) == 3


def test_on_a_terminal_the_line_updates_in_place_and_other_output_erases_it_first() -> None:
    out = io.StringIO()
    line = StatusLine(out, terminal=True)
    line.show("waiting for nodes: 1 of min 2 nodes", "5s so far", 5.0)
    line.show("waiting for nodes: 1 of min 2 nodes", "5s so far", 5.5)  # at most once a second
    line.show("waiting for nodes: 1 of min 2 nodes", "6s so far", 6.0)
    assert out.getvalue() == (
        "\r\x1b[Kpliant: waiting for nodes: 1 of min 2 nodes (5s so far)"
        "\r\x1b[Kpliant: waiting for nodes: 1 of min 2 nodes (6s so far)"
    )
    out.seek(0)
    out.truncate()
    handler = ConsoleHandler(out)
    handler.setFormatter(logging.Formatter("pliant: %(message)s"))
    import pliant.statusline as statusline

    statusline._line, saved = line, statusline._line
    try:
        handler.handle(logging.makeLogRecord({"msg": "generation 2 (join): world 1 -> 2", "levelno": logging.INFO}))
    finally:
        statusline._line = saved
    assert out.getvalue() == "\r\x1b[Kpliant: generation 2 (join): world 1 -> 2\n", "erased, then the record"
    line.show("waiting for nodes: 1 of min 2 nodes", "6s so far", 6.1)
    assert out.getvalue().endswith("\r\x1b[Kpliant: waiting for nodes: 1 of min 2 nodes (6s so far)"), "drawn again"
    line.clear()
    assert out.getvalue().endswith("(6s so far)\r\x1b[K")


def test_the_line_of_a_control_plane_gone_names_the_nodes_that_held_it_never_a_guess() -> None:
    # all nodes on one host: an address names no node; the control plane's own list of its seats does
    one = unreachable("b", ("127.0.0.1:29400",), ("a",), down_s=10.4)
    assert "at 127.0.0.1:29400 (embedded in node a's `pliant run`) has been unreachable for 10s" in one
    assert "Restart `pliant run` on node a" in one and "the workers keep training" in one
    assert "README: Guarantees and limits" in one
    seats = unreachable("b", ("10.0.0.0:1", "10.0.0.1:1", "10.0.0.2:1"), ("a", "c", "d"), down_s=12)
    assert "(an embedded control plane on 3 nodes (a, c, d): its etcd needs 2 of them)" in seats
    assert "each takes its seat back from its saved state" in seats
    standalone = unreachable("b", ("coord:29400",), (), down_s=10)
    assert "(its replicas)" in standalone and "Check that a coordinator replica runs" in standalone
