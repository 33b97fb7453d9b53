"""The lifecycle transitions the agent's core makes are the ones agent/contract.py declares, both ways: the core is
driven through random event sequences (seeded), every lifecycle change it makes is in ``TRANSITIONS``, and every
declared transition is made by some sequence."""

from __future__ import annotations

import random
import signal

import pytest

from pliant.agent import actions, core, events
from pliant.agent.contract import TRANSITIONS, AgentState, GroupResult
from pliant.agent.stopping import Graces, StopStage
from pliant.coordinator.contract import Generation, GenerationMember, JobState
from pliant.env import RESCALE_EXIT_CODE

pytestmark = pytest.mark.timeout(60)

NODES = ("a", "b", "c")


def _generation(rng: random.Random, number: int) -> Generation:
    nodes = [n for n in NODES if rng.random() < 0.6]
    rng.shuffle(nodes)
    members = tuple(GenerationMember(n, i, i * 2, 2, f"{n}:1") for i, n in enumerate(nodes))
    return Generation("job", number, members, rng.choice(("join", "leave", "failure")))


def _event(rng: random.Random, state: core.CoreState, number: int) -> tuple[events.Event, int]:
    """A random event the executor could deliver in ``state`` (``number``: the newest generation so far)."""
    group = state.group.number if state.group is not None else number
    choice = rng.randrange(16)
    if choice == 0:
        return events.GenerationSeen(_generation(rng, number + 1)), number + 1
    if choice == 1:
        codes = rng.choice(({0: 0, 1: 0}, {0: -9, 1: 0}, {0: RESCALE_EXIT_CODE, 1: RESCALE_EXIT_CODE}, {0: 1}))
        result = GroupResult(rng.choice((group, group - 1)), codes, stopped=rng.random() < 0.1)
        return events.GroupExited(result, "", alive=rng.choice((0, 1))), number
    if choice == 2:
        return events.StorePortRead(number, rng.choice((7000, 7000, 0)), "no port"), number
    if choice == 3:
        return events.GroupStopped(group), number
    if choice == 4:
        return events.StopStarted(StopStage.TERM), number
    if choice == 5:
        ready = rng.random() < 0.7
        phase = rng.choice(("step", "step", "wait", "start"))
        return events.Tick({0: (rng.randrange(5), phase, number), 1: (rng.randrange(5), phase, number)}, None, ready), (
            number
        )
    if choice == 6:
        return events.SignalReceived(signal.SIGTERM), number
    if choice == 7:
        return events.JobFinished(rng.choice(list(JobState)), "the job ended"), number
    if choice == 8:
        return events.LeaseLost("evicted"), number
    if choice == 9:
        return events.Joined(3.0), number
    if choice == 10:
        return rng.choice((events.HeartbeatOk(), events.HeartbeatFailed())), number
    if choice == 11:
        return events.PeersProbed(rng.choice((-1.0, 20.0)), rng.choice((-1, number, number + 1))), number
    if choice == 12:
        return events.ArrivalsRead(number, rng.randrange(6)), number
    if choice == 13:
        return events.NewcomersProbed(number, rng.randrange(6), frozenset(rng.sample(NODES, rng.randrange(2)))), number
    if choice == 14:
        return events.StartFailed(group, "cannot start"), number
    return events.Tick(), number


def _explore(seed: int) -> set[tuple[AgentState, AgentState]]:
    rng = random.Random(seed)
    config = core.CoreConfig(rescale_in_place=rng.random() < 0.7, hang_timeout_s=5.0, graces=Graces(rescale_s=3.0))
    state = core.CoreState("a", config=config)
    now, number, seen = 0.0, 0, set()
    for _ in range(60):
        event, number = _event(rng, state, number)
        now += rng.choice((0.0, 0.1, 1.0, 6.0))
        before = state.lifecycle
        state, done = core.decide(state, event, now)
        assert all(isinstance(action, actions.Action.__args__) for action in done)  # type: ignore[attr-defined]
        if state.lifecycle is not before:
            seen.add((before, state.lifecycle))
        if before in (AgentState.SUCCEEDED, AgentState.FAILED, AgentState.LEFT):
            assert state.lifecycle is before, "terminal states are terminal"
    return seen


def test_the_core_makes_exactly_the_declared_transitions() -> None:
    seen: set[tuple[AgentState, AgentState]] = set()
    for seed in range(4000):
        seen |= _explore(seed)
    assert seen <= TRANSITIONS, f"undeclared transitions: {sorted((a.value, b.value) for a, b in seen - TRANSITIONS)}"
    assert seen >= TRANSITIONS, f"declared, never made: {sorted((a.value, b.value) for a, b in TRANSITIONS - seen)}"
