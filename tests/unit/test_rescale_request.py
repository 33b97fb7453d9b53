"""The framework integrations' rescale request (pliant.integration): the ranks vote at the same step boundaries, on
pliant.worker's schedule (pliant.rescale_vote: about every VOTE_WITHIN_S at the slowest rank's pace), and a request is
seen at the next vote. One process, no group: the vote is this rank's alone, its schedule the same."""

from __future__ import annotations

import pytest

from pliant.integration import RescaleRequest
from pliant.rescale_vote import MAX_VOTE_EVERY, votes_apart


def test_the_steps_between_votes_take_about_a_tenth_of_a_second() -> None:
    assert votes_apart(0.0) == 1, "an unknown pace votes at the next step"
    assert votes_apart(0.5) == 1 and votes_apart(0.01) == 10
    assert votes_apart(1e-6) == MAX_VOTE_EVERY


def test_outside_an_agent_nothing_is_asked_and_nothing_votes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PLIANT_AGENT_STORE", raising=False)
    request = RescaleRequest()
    request._asked = True
    assert not request.under_agent and not request.agreed("cpu", now=1.0)


def test_a_request_is_seen_at_the_next_vote(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLIANT_AGENT_STORE", "127.0.0.1:1")
    request = RescaleRequest()
    assert request.under_agent
    assert not request.agreed("cpu", now=10.0), "the first boundary votes: nothing asked"
    assert not request.agreed("cpu", now=10.01), "the second votes too (the pace was unknown): 10 ms a step"
    request._on_signal(0, None)  # the agent's rescale signal
    seen = [request.agreed("cpu", now=10.01 + 0.01 * i) for i in range(1, 11)]
    assert seen == [False] * 9 + [True], "the vote 10 steps (0.1 s) later sees it, not before"
