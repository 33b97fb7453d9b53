"""The agent's decisions (pliant.agent.core) with a fake clock and fake workers: no processes, no network."""

from __future__ import annotations

import signal

import pytest

from pliant.agent import core, stopping
from pliant.agent.contract import AgentState, GroupResult
from pliant.coordinator.contract import FailureCause, Generation, GenerationMember, JobState
from pliant.env import RESCALE_EXIT_CODE
from pliant.fence import Fence
from pliant.fence import Warranted as W

pytestmark = pytest.mark.timeout(10)


def _gen(number: int, *nodes: str, reason: str = "join") -> Generation:
    members = tuple(GenerationMember(n, i, i * 2, 2, f"{n}:1") for i, n in enumerate(nodes))
    return Generation("job", number, members, reason)


class Agent:
    """Drives decide() like the executor does, recording the actions. With ``instant_stops`` (the default) its
    groups stop at once: a :class:`core.Stop` is answered with :class:`core.GroupStopped` in the same call, and what
    waited for it follows in the returned actions."""

    def __init__(self, node: str = "a", instant_stops: bool = True, **config: object) -> None:
        self.state = core.CoreState(node, config=core.CoreConfig(**config))  # type: ignore[arg-type]
        self.now = 100.0
        self.actions: list[core.Action] = []
        self.instant_stops = instant_stops

    def on(self, event: core.Event, after: float = 0.0) -> list[core.Action]:
        self.now += after
        self.state, actions = core.decide(self.state, event, self.now)
        if self.instant_stops and any(isinstance(a, core.Stop) for a in actions):
            self.state, then = core.decide(self.state, core.GroupStopped(0), self.now)
            actions = [*actions, *then]
        self.actions += actions
        return actions

    def kinds(self, actions: list[core.Action]) -> list[str]:
        return [type(a).__name__ for a in actions]


def test_a_generation_starts_the_group_and_a_newer_one_rescales_it() -> None:
    agent = Agent()
    agent.on(core.Joined(10.0))
    assert agent.state.phase is AgentState.WAITING
    first = agent.on(core.GenerationSeen(_gen(1, "a")))
    assert agent.kinds(first) == ["Prepare", "Start"] and agent.state.phase is AgentState.RUNNING
    assert agent.on(core.GenerationSeen(_gen(1, "a"))) == []  # a repeat changes nothing
    second = agent.on(core.GenerationSeen(_gen(2, "b", "a")))  # now node rank 1: no store to open
    assert second == [core.Stop(rescale=True), core.Start(_gen(2, "b", "a"))]
    assert agent.on(core.GenerationSeen(_gen(3, "b"))) == [core.Stop(rescale=True)]
    assert agent.state.phase is AgentState.WAITING and agent.state.group is None


def test_node_rank_0_opens_the_store_before_it_stops_its_old_group() -> None:
    agent = Agent()
    agent.on(core.GenerationSeen(_gen(1, "a")))
    actions = agent.on(core.GenerationSeen(_gen(2, "a", "b")))
    assert agent.kinds(actions) == ["Prepare", "Stop", "Start"]


def test_outcomes_of_a_group() -> None:
    agent = Agent()
    agent.on(core.GenerationSeen(_gen(1, "a", "b")))
    done = agent.on(core.GroupExited(GroupResult(1, {0: 0, 1: 0})))
    assert done == [core.Stop(), core.Send(core.Report("success", 1))]
    agent.on(core.GenerationSeen(_gen(2, "a", "b")))
    assert agent.on(core.GroupExited(GroupResult(2, {0: RESCALE_EXIT_CODE, 1: 0}))) == [core.Stop()]
    agent.on(core.GenerationSeen(_gen(3, "a", "b")))
    why = "local rank 1 (rank 1) exited with code -9"
    failed = agent.on(core.GroupExited(GroupResult(3, {0: 0, 1: -9}), why))
    assert failed == [core.Stop(), core.Send(core.Report("failure", 3, -9, why))]
    assert agent.on(core.GroupExited(GroupResult(3, {0: 1}))) == [core.Stop()]  # not the running group: reap only


def test_the_coordinator_away_changes_nothing() -> None:
    agent = Agent()
    agent.on(core.Joined(10.0))
    agent.on(core.GenerationSeen(_gen(1, "a")))  # a single-node world: no peer to ask
    for _ in range(100):
        assert agent.on(core.HeartbeatFailed(), after=1.0) == []
        assert agent.on(core.Tick({0: (1, "start"), 1: (1, "start")}), after=0.0) == []
    assert agent.state.phase is AgentState.RUNNING
    # Workers finish during the outage: the success is sent (the executor retries it until the coordinator answers).
    done = agent.on(core.GroupExited(GroupResult(1, {0: 0, 1: 0})))
    assert done == [core.Stop(), core.Send(core.Report("success", 1))]
    assert agent.state.phase is AgentState.WAITING


def test_an_agent_cut_off_while_its_peers_renew_fences_itself() -> None:
    agent = Agent()
    agent.on(core.Joined(10.0))
    agent.on(core.GenerationSeen(_gen(1, "a", "b")))
    assert agent.on(core.HeartbeatFailed(), after=14.0) == []  # within 1.5 TTL: nothing to ask yet
    assert agent.on(core.HeartbeatFailed(), after=1.5) == [core.ProbePeers()]
    assert agent.on(core.HeartbeatFailed(), after=1.0) == []  # asked at most once per half TTL
    # Peers cannot renew either: the control plane is down for everyone; keep training.
    assert agent.on(core.PeersProbed(streak_s=-1.0)) == []
    # A peer renews again, but only since the control plane came back: it has not yet given everyone its grace.
    assert agent.on(core.Tick(), after=5.0) == [core.ProbePeers()]
    assert agent.on(core.PeersProbed(streak_s=12.0)) == []
    assert agent.state.phase is AgentState.RUNNING
    # A peer has renewed for long enough, but its world is still generation 1, this node's: nobody evicted it (a
    # leader that took over, or got etcd back, waits a TTL before it evicts anyone), so its workers are still needed.
    assert agent.on(core.Tick(), after=5.0) == [core.ProbePeers()]
    assert agent.on(core.PeersProbed(streak_s=16.0, newest=1)) == []
    assert agent.state.phase is AgentState.RUNNING
    assert agent.on(core.Tick(), after=5.0) == [core.ProbePeers()]
    assert agent.on(core.PeersProbed(streak_s=21.0, newest=2)) == [core.Stop()]  # a world without it: evicted
    assert agent.state.phase is AgentState.WAITING and "fenced" in agent.state.reason
    assert "seen generation 2" in agent.state.reason
    agent.on(core.LeaseLost("evicted"))
    assert agent.state.phase is AgentState.JOINING
    agent.on(core.Joined(10.0))
    assert agent.kinds(agent.on(core.GenerationSeen(_gen(2, "b", "a")))) == ["Start"]


def test_an_agent_fences_itself_when_its_peers_do_not_say_which_generation_they_see() -> None:
    """Peers of an older version publish only their streak (and a peer that has seen no generation says 0): the fence
    falls back to the streak alone."""
    for newest in (-1, 0):
        agent = Agent()
        agent.on(core.Joined(10.0))
        agent.on(core.GenerationSeen(_gen(1, "a", "b")))
        assert agent.on(core.HeartbeatFailed(), after=16.0) == [core.ProbePeers()]
        assert agent.on(core.PeersProbed(streak_s=16.0, newest=newest)) == [core.Stop()], newest


def test_a_rank_without_progress_is_hung() -> None:
    agent = Agent(hang_timeout_s=5.0, start_timeout_s=30.0)
    agent.on(core.GenerationSeen(_gen(1, "a")))
    agent.on(core.Tick({0: (0, "start"), 1: (0, "start")}))
    for step in range(1, 6):
        assert agent.on(core.Tick({0: (step, "step"), 1: (step, "step")}), after=0.5) == []
    assert agent.on(core.Tick({0: (6, "step"), 1: (5, "step")}), after=4.0) == []
    actions = agent.on(core.Tick({0: (7, "step"), 1: (5, "step")}), after=1.5)  # rank 1: 5.5 s since step 5
    assert agent.kinds(actions) == ["Dump", "Stop", "Send"]
    report = actions[-1].report  # type: ignore[union-attr]
    assert report.kind == "failure" and report.cause is FailureCause.HUNG
    assert "local rank 1 made no progress for 6s after step 5" in report.message
    assert agent.state.group is None


def test_a_slow_start_or_save_is_not_a_hang_before_the_start_timeout() -> None:
    agent = Agent(hang_timeout_s=5.0, start_timeout_s=30.0)
    agent.on(core.GenerationSeen(_gen(1, "a")))
    assert agent.on(core.Tick({0: (0, "start")}), after=0.0) == []
    assert agent.on(core.Tick({0: (0, "start")}), after=29.0) == []  # imports, compile, restore
    assert agent.on(core.Tick({0: (1, "step")}), after=0.5) == []
    assert agent.on(core.Tick({0: (1, "save")}), after=0.5) == []
    assert agent.on(core.Tick({0: (1, "save")}), after=25.0) == []  # a long checkpoint save
    assert agent.on(core.Tick({0: (2, "step")}), after=1.0) == []
    actions = agent.on(core.Tick({0: (2, "save")}), after=0.1) + agent.on(core.Tick({0: (2, "save")}), after=31.0)
    assert agent.kinds(actions) == ["Dump", "Stop", "Send"]
    assert "checkpoint save after step 2" in actions[-1].report.message  # type: ignore[union-attr]


def test_a_long_state_transfer_in_place_is_not_a_hang_before_the_start_timeout() -> None:
    agent = Agent(hang_timeout_s=5.0, start_timeout_s=30.0)
    agent.on(core.GenerationSeen(_gen(1, "a")))
    assert agent.on(core.Tick({0: (4, "step")}), after=0.5) == []
    assert agent.on(core.Tick({0: (4, "transfer", 2)}), after=0.5) == []
    assert agent.on(core.Tick({0: (4, "transfer", 2)}), after=25.0) == []  # a big state moving
    actions = agent.on(core.Tick({0: (4, "transfer", 2)}), after=6.0)
    assert agent.kinds(actions) == ["Dump", "Stop", "Send"]
    assert "moving the state into generation 2 after step 4" in actions[-1].report.message  # type: ignore[union-attr]


def test_workers_that_write_no_progress_are_not_watched() -> None:
    agent = Agent(hang_timeout_s=1.0, start_timeout_s=2.0)
    agent.on(core.GenerationSeen(_gen(1, "a")))
    assert agent.on(core.Tick({}), after=1000.0) == []


def test_the_automatic_hang_timeout_follows_the_step_time() -> None:
    agent = Agent()
    agent.on(core.GenerationSeen(_gen(1, "a")))
    assert core.hang_timeout(agent.state) == core.HANG_FLOOR_S
    for step in range(1, 20):
        agent.on(core.Tick({0: (step, "step")}), after=30.0)  # 30 s steps
    assert core.hang_timeout(agent.state) == pytest.approx(core.HANG_MULTIPLE * 30.0)


def test_job_end_signal_and_start_failure() -> None:
    agent = Agent()
    agent.on(core.GenerationSeen(_gen(1, "a", "b")))
    assert agent.on(core.StartFailed(1, "store port")) == [
        core.Stop(),
        core.Send(core.Report("failure", 1, 0, "store port", cause=FailureCause.START_FAILED)),
    ]
    agent.on(core.GenerationSeen(_gen(2, "a", "b")))
    assert agent.on(core.JobFinished(JobState.RUNNING, "")) == []
    assert agent.on(core.JobFinished(JobState.SUCCEEDED, "done")) == [core.Stop(finish=True), core.Exit(0, "done")]
    assert agent.on(core.GenerationSeen(_gen(3, "a"))) == []  # terminal: nothing more

    failed = Agent()
    assert failed.on(core.JobFinished(JobState.FAILED, "budget spent")) == [core.Exit(1, "budget spent")]

    alone = Agent()
    assert alone.on(core.SignalReceived(signal.SIGTERM)) == [core.Leave(), core.Exit(143)]  # no workers: at once


def test_a_graceful_leave_stops_the_workers_once_the_world_without_the_node_is_published() -> None:
    """The node leaves first; its workers get SIGTERM when every other node's do: as the world without it comes."""
    leaving = Agent("b")
    leaving.on(core.Joined(10.0))
    leaving.on(core.GenerationSeen(_gen(1, "a", "b")))
    assert leaving.on(core.SignalReceived(signal.SIGTERM)) == [core.Leave()]
    assert leaving.state.phase is AgentState.LEAVING
    assert leaving.on(core.Tick({}), after=1.0) == []  # the workers train on meanwhile
    assert leaving.on(core.HeartbeatOk()) == []
    assert leaving.on(core.GenerationSeen(_gen(2, "a"))) == [core.Stop(rescale=True), core.Exit(143)]
    assert leaving.state.phase is AgentState.LEFT

    unheard = Agent("b")  # the control plane does not answer: the workers stop after LEAVE_WAIT_S all the same
    unheard.on(core.Joined(10.0))
    unheard.on(core.GenerationSeen(_gen(1, "a", "b")))
    unheard.on(core.SignalReceived(signal.SIGINT))
    assert unheard.on(core.Tick({}), after=core.LEAVE_WAIT_S - 0.1) == []
    assert unheard.on(core.Tick({}), after=0.2) == [core.Stop(rescale=True), core.Exit(130)]

    impatient = Agent("b")  # a second Ctrl-C stops them at once
    impatient.on(core.Joined(10.0))
    impatient.on(core.GenerationSeen(_gen(1, "a", "b")))
    impatient.on(core.SignalReceived(signal.SIGINT))
    assert impatient.on(core.SignalReceived(signal.SIGINT)) == [core.Stop(rescale=True), core.Exit(130)]

    cut_off = Agent("b")  # heartbeats fail: no world without this node will be published, so no wait
    cut_off.on(core.Joined(10.0))
    cut_off.on(core.GenerationSeen(_gen(1, "a", "b")))
    cut_off.on(core.HeartbeatFailed())
    assert cut_off.on(core.SignalReceived(signal.SIGINT)) == [core.Stop(rescale=True), core.Leave(), core.Exit(130)]

    finished = Agent("b")  # the job ended meanwhile: it ends as the job did
    finished.on(core.Joined(10.0))
    finished.on(core.GenerationSeen(_gen(1, "a", "b")))
    finished.on(core.SignalReceived(signal.SIGTERM))
    assert finished.on(core.JobFinished(JobState.SUCCEEDED, "done")) == [core.Stop(finish=True), core.Exit(0, "done")]


def test_a_newer_world_in_the_checkpoint_directory_fences_a_lone_node_and_says_so() -> None:
    agent = Agent()
    gen = Generation("job", 4, (GenerationMember("a", 0, 0, 2, "a:1"),), "join", incarnation="u7")
    agent.on(core.GenerationSeen(gen))
    assert agent.on(core.Tick({}, fence=Fence("job", W("u7", 4)))) == []  # its own world's fence
    assert agent.on(core.Tick({}, fence=Fence("job", W("u3", 9)))) == []  # an earlier incarnation: this one takes over
    other = Fence("other", W("u8", 9), (W("u7", 1),))
    assert agent.on(core.Tick({}, fence=other)) == []  # another job's: its worker refuses
    actions = agent.on(core.Tick({}, fence=Fence("job", W("u7", 5))))
    assert actions[0] == core.Stop() and isinstance(actions[1], core.Send)
    assert actions[1].report.kind == "failure" and actions[1].report.cause is FailureCause.FENCED
    assert "fenced: generation 5 owns the checkpoint directory" in agent.state.reason
    assert agent.state.reason in actions[1].report.message


def test_a_world_of_an_incarnation_that_was_taken_over_is_fenced() -> None:
    agent = Agent()
    gen = Generation("job", 12, (GenerationMember("a", 0, 0, 2, "a:1"),), "join", incarnation="old")
    agent.on(core.GenerationSeen(gen))
    actions = agent.on(core.Tick({}, fence=Fence("job", W("new", 1), (W("old", 3),))))
    assert actions[0] == core.Stop()
    assert "another incarnation of job job" in agent.state.reason


def test_the_renewal_streak_peers_read() -> None:
    agent = Agent()
    agent.on(core.Joined(10.0))
    assert core.renewal_streak(agent.state, agent.now) == 0.0
    for _ in range(8):
        agent.on(core.HeartbeatOk(), after=2.5)
    assert core.renewal_streak(agent.state, agent.now) == 20.0
    assert core.renewal_streak(agent.state, agent.now + 11) == -1.0  # silent for more than the TTL
    agent.on(core.HeartbeatOk(), after=30.0)  # back after an outage: a new streak
    assert core.renewal_streak(agent.state, agent.now) == 0.0
    agent.on(core.HeartbeatFailed(), after=1.0)
    assert core.renewal_streak(agent.state, agent.now) == -1.0


# -- in-place rescale --------------------------------------------------------------------------------------------------


def _ready(agent: Agent, ready: bool = True) -> None:
    """The workers announced (or not) that they re-form in place; the executor reads it on a tick."""
    agent.on(core.Tick({0: (3, "step"), 1: (3, "step")}, ready=ready), after=0.1)


def test_a_ready_group_is_handed_the_next_generation_in_place() -> None:
    agent = Agent(rescale_in_place=True)
    agent.on(core.GenerationSeen(_gen(1, "a", "b")))
    _ready(agent)
    actions = agent.on(core.GenerationSeen(_gen(2, "a", "b", reason="failure")))  # no newcomer: handed at once
    assert actions == [
        core.Prepare(_gen(2, "a", "b", reason="failure")),
        core.Reconfigure(_gen(2, "a", "b", reason="failure")),
    ]  # no Stop, no Start
    assert agent.state.group == 2 and agent.state.phase is AgentState.RUNNING
    assert "in place" in agent.state.reason
    # As node rank 1 of the next world, there is no store to open.
    assert agent.on(core.GenerationSeen(_gen(3, "b", "a"))) == [core.Reconfigure(_gen(3, "b", "a"))]


def test_a_generation_with_newcomers_is_handed_over_once_they_arrived_and_answer() -> None:
    """The survivors train on while the newcomers start: the hand-over waits for their workers to count themselves
    in at the generation's store (read on every tick), and a last probe of their agents decides."""
    agent = Agent(rescale_in_place=True, rescale_grace_s=30.0)
    agent.on(core.Joined(10.0))
    agent.on(core.GenerationSeen(_gen(1, "a")))
    _ready(agent)
    gen = _gen(2, "a", "b")
    assert agent.on(core.GenerationSeen(gen)) == [core.Prepare(gen)], "no hand-over before b's workers arrive"
    assert agent.state.group == 2 and "once b arrive" in agent.state.reason
    assert agent.kinds(agent.on(core.Tick({0: (4, "step"), 1: (4, "step")}, ready=True), after=0.02)) == [
        "ReadArrivals"
    ]
    assert agent.on(core.ArrivalsRead(2, 1)) == [core.ProbeNewcomers(gen, ("b",), 1)], "the first probe is due at once"
    assert agent.on(core.ArrivalsRead(2, 2), after=1.5) == [], "a probe runs in the background: one at a time"
    assert agent.on(core.NewcomersProbed(2, 1)) == [], "b answers; one of its 2 workers counted in: wait"
    assert agent.on(core.ArrivalsRead(2, 1), after=0.5) == [], "the next probe is a second after the last"
    assert agent.on(core.ArrivalsRead(2, 2), after=0.1) == [core.ProbeNewcomers(gen, ("b",), 2)], "all arrived"
    assert agent.on(core.NewcomersProbed(2, 2)) == [core.Reconfigure(gen)]
    assert agent.state.handing is None and agent.state.members == ("a", "b")
    assert agent.kinds(agent.on(core.Tick({0: (5, "step"), 1: (5, "step")}, ready=True), after=0.02)) == []
    assert agent.on(core.ArrivalsRead(2, 2)) == [], "a late answer of a finished hand-over changes nothing"


def test_a_newcomer_this_node_cannot_reach_is_reported_instead_of_handed_over() -> None:
    agent = Agent(rescale_in_place=True, rescale_grace_s=30.0)
    agent.on(core.GenerationSeen(_gen(1, "a")))
    _ready(agent)
    gen = _gen(2, "a", "b")
    agent.on(core.GenerationSeen(gen))
    agent.on(core.ArrivalsRead(2, 0))
    assert agent.on(core.NewcomersProbed(2, 0, frozenset({"b"}))) == [], "one failed probe is not enough"
    agent.on(core.ArrivalsRead(2, 0), after=1.0)
    actions = agent.on(core.NewcomersProbed(2, 0, frozenset({"b"})))
    assert agent.kinds(actions) == ["Send"], "the workers train on in their generation; the report brings the next"
    report = actions[0].report  # type: ignore[union-attr]
    assert (report.kind, report.generation) == ("failure", 2) and "newcomers b have not arrived yet" in report.message
    assert agent.state.handing is None and "not handed over" in agent.state.reason
    assert agent.state.members == ("a",), "the group's world is still generation 1's"


def test_a_waiting_hand_over_gives_way_to_a_newer_generation() -> None:
    agent = Agent(rescale_in_place=True)
    agent.on(core.GenerationSeen(_gen(1, "a")))
    _ready(agent)
    agent.on(core.GenerationSeen(_gen(2, "a", "b")))
    newer = _gen(3, "a", "b", "c")
    assert agent.on(core.GenerationSeen(newer)) == [core.Prepare(newer)]
    assert agent.state.handing == newer and agent.state.handover is not None
    assert agent.state.handover.newcomers == ("b", "c") and agent.state.handover.needed == 4, "against gen 1's world"
    assert agent.on(core.ArrivalsRead(2, 2)) == [], "the superseded generation's arrivals are ignored"


def test_without_readiness_or_with_rescale_restart_the_restart_path_applies() -> None:
    not_ready = Agent(rescale_in_place=True)
    not_ready.on(core.GenerationSeen(_gen(1, "a")))
    _ready(not_ready, False)  # a worker still starting, or a script without pliant.worker
    assert not_ready.kinds(not_ready.on(core.GenerationSeen(_gen(2, "a", "b")))) == ["Prepare", "Stop", "Start"]
    restart = Agent(rescale_in_place=False)
    restart.on(core.GenerationSeen(_gen(1, "a")))
    _ready(restart)
    assert restart.kinds(restart.on(core.GenerationSeen(_gen(2, "a", "b")))) == ["Prepare", "Stop", "Start"]
    # A generation without this node stops the group even in place; its ranks leave at the step boundary (they hand
    # over what only they hold), so the others re-form in place without a restart.
    evicted = Agent(rescale_in_place=True)
    evicted.on(core.GenerationSeen(_gen(1, "a", "b")))
    _ready(evicted)
    assert evicted.on(core.GenerationSeen(_gen(2, "b"))) == [core.Stop(rescale=True, leave=True)]
    # Unless every local rank waits after a failed step: their world broke, the next goes on without them, so there
    # is no boundary to hand over at, and they may be meeting a peer they cannot reach (up to MEET_S): stopped at once.
    stranded = Agent(rescale_in_place=True)
    stranded.on(core.GenerationSeen(_gen(1, "a", "b")))
    _ready(stranded)
    stranded.on(core.Tick({0: (40, "wait", 1), 1: (40, "wait", 1)}, ready=True))
    assert stranded.on(core.GenerationSeen(_gen(2, "b"))) == [core.Stop()]
    assert "waited after a failed step" in stranded.state.reason
    one_waits = Agent(rescale_in_place=True)  # one rank still steps: the boundary is still ahead, as before
    one_waits.on(core.GenerationSeen(_gen(1, "a", "b")))
    _ready(one_waits)
    one_waits.on(core.Tick({0: (40, "wait", 1), 1: (40, "step", 1)}, ready=True))
    assert one_waits.on(core.GenerationSeen(_gen(2, "b"))) == [core.Stop(rescale=True, leave=True)]
    # A generation with no one (the job below its minimum, or done): the group checkpoints and exits.
    emptied = Agent(rescale_in_place=True)
    emptied.on(core.GenerationSeen(_gen(1, "a")))
    _ready(emptied)
    assert emptied.on(core.GenerationSeen(_gen(2))) == [core.Stop(rescale=True)]


def test_a_dead_worker_in_place_is_reported_and_the_others_wait() -> None:
    agent = Agent(rescale_in_place=True)
    agent.on(core.GenerationSeen(_gen(1, "a", "b")))
    _ready(agent)
    why = "local rank 1 (rank 1) exited with code -9"
    actions = agent.on(core.GroupExited(GroupResult(1, {1: -9}), why, alive=1))
    assert actions == [core.Send(core.Report("failure", 1, -9, why))]  # no Stop: local rank 0 keeps its process
    assert agent.state.group == 1 and agent.state.phase is AgentState.RUNNING
    assert agent.on(core.GenerationSeen(_gen(2, "a", "b")), after=0.5) == [
        core.Prepare(_gen(2, "a", "b")),
        core.Reconfigure(_gen(2, "a", "b")),
    ]
    # Every worker dead: the restart path.
    lost = Agent(rescale_in_place=True)
    lost.on(core.GenerationSeen(_gen(1, "a")))
    _ready(lost)
    assert lost.kinds(lost.on(core.GroupExited(GroupResult(1, {0: -9, 1: -9}), "", alive=0))) == ["Stop", "Send"]


def test_a_group_that_dies_before_a_pending_hand_over_reports_the_handed_generation() -> None:
    """Handed generation 2 in place, the executor waits for newcomers before the workers re-form; the only worker
    exits meanwhile (its re-forming failed). The failure is generation 2's: one of generation 1 would be stale, and
    the agent would wait forever with no workers."""
    agent = Agent(rescale_in_place=True)
    agent.on(core.GenerationSeen(_gen(1, "a", "b")))
    _ready(agent)
    agent.on(core.GenerationSeen(_gen(2, "a", "b", "c")), after=0.5)
    why = "local rank 0 (rank 0) exited with code 1"
    actions = agent.on(core.GroupExited(GroupResult(1, {0: 1}), why, alive=0))
    assert actions == [core.Stop(), core.Send(core.Report("failure", 2, 1, why))]
    assert agent.state.group is None and agent.state.phase is AgentState.WAITING
    # A group of an earlier generation, replaced by a fresh start (not handed in place), is only reaped.
    fresh = Agent(rescale_in_place=False)
    fresh.on(core.GenerationSeen(_gen(1, "a")))
    fresh.on(core.GenerationSeen(_gen(2, "a", "b")))
    assert fresh.on(core.GroupExited(GroupResult(1, {0: 1}), "", alive=0)) == [core.Stop()]


def test_a_rank_that_saw_a_peer_fail_is_reported_once() -> None:
    agent = Agent(rescale_in_place=True)
    agent.on(core.GenerationSeen(_gen(1, "a", "b")))
    _ready(agent)
    actions = agent.on(core.Tick({0: (4, "wait"), 1: (4, "step")}, ready=True), after=0.2)
    assert agent.kinds(actions) == ["Send"]
    report = actions[0].report  # type: ignore[union-attr]
    assert (report.kind, report.generation, report.cause) == ("failure", 1, FailureCause.WAITING)
    assert "saw a peer fail mid-step" in report.message
    assert agent.on(core.Tick({0: (4, "wait"), 1: (4, "wait")}, ready=True), after=0.2) == [
        core.Send(core.Report("failure", 1, 0, report.message.replace("rank 0", "rank 1"), cause=FailureCause.WAITING))
    ]  # local rank 1 entered "wait" now
    assert agent.on(core.Tick({0: (4, "wait"), 1: (4, "wait")}, ready=True), after=0.2) == []  # still waiting
    agent.on(core.GenerationSeen(_gen(2, "a", "b")))
    assert agent.on(core.Tick({0: (4, "wait"), 1: (4, "wait")}, ready=True), after=0.2) == []  # the same wait
    # Handed generation 2, local rank 0 could not meet its ranks there: it waits again, now in generation 2.
    assert agent.on(core.Tick({0: (4, "wait", 2), 1: (4, "wait")}, ready=True), after=0.2) == [
        core.Send(core.Report("failure", 2, 0, report.message, cause=FailureCause.WAITING))
    ]
    # Waiting longer than the start timeout is a hang like a slow start.
    hung = agent.on(core.Tick({0: (4, "wait"), 1: (4, "wait")}, ready=True), after=700.0)
    assert agent.kinds(hung) == ["Dump", "Stop", "Send"]


def test_workers_that_finish_the_job_before_their_newcomers_arrive_report_the_generation_untrained() -> None:
    """A generation handed in place waits for its newcomers while the survivors train on; survivors whose script ends
    meanwhile complete it without a step in it: their success says so, and the coordinator does not wait for the
    newcomers. Workers that trained in the generation say nothing of the kind."""
    agent = Agent(rescale_in_place=True, rescale_grace_s=30.0)
    agent.on(core.GenerationSeen(_gen(1, "a")))
    _ready(agent)
    agent.on(core.Tick({0: (4, "step", 1), 1: (4, "step", 1)}, ready=True), after=0.2)
    agent.on(core.GenerationSeen(_gen(2, "a", "b")))
    assert agent.state.handing is not None, "the hand-over waits for b"
    done = agent.on(core.GroupExited(GroupResult(1, {0: 0, 1: 0})), after=0.2)
    assert core.Send(core.Report("success", 2, untrained=True)) in done
    trained = Agent(rescale_in_place=True)
    trained.on(core.GenerationSeen(_gen(1, "a")))
    _ready(trained)
    trained.on(core.GenerationSeen(_gen(2, "a")))  # no newcomer: handed over at once
    trained.on(core.Tick({0: (5, "step", 2), 1: (5, "step", 2)}, ready=True), after=0.2)
    assert core.Send(core.Report("success", 2)) in trained.on(core.GroupExited(GroupResult(2, {0: 0, 1: 0})))


def test_a_failure_report_says_whether_its_generation_trained_a_step() -> None:
    """A step's progress record names the generation it completed in. A failure report of a generation in which a
    worker of this node completed a step says that every member arrived (the coordinator strikes no newcomer of it);
    one of a generation handed in place that never met says not."""
    agent = Agent(rescale_in_place=True)
    agent.on(core.GenerationSeen(_gen(1, "a", "b")))
    _ready(agent)
    agent.on(core.Tick({0: (4, "step", 1), 1: (4, "step", 1)}, ready=True), after=0.2)
    agent.on(core.GenerationSeen(_gen(2, "a", "b", "c")), after=0.5)  # c never arrives
    actions = agent.on(core.Tick({0: (5, "step", 1), 1: (5, "wait", 2)}, ready=True), after=0.2)
    assert [a.report.arrived for a in actions if isinstance(a, core.Send)] == [False]
    met = Agent(rescale_in_place=True)
    met.on(core.GenerationSeen(_gen(1, "a", "b")))
    _ready(met)
    met.on(core.Tick({0: (4, "step", 1), 1: (4, "step", 1)}, ready=True), after=0.2)
    why = "local rank 1 (rank 1) exited with code -9"
    assert met.on(core.GroupExited(GroupResult(1, {1: -9}), why, alive=1)) == [
        core.Send(core.Report("failure", 1, -9, why, arrived=True))
    ]


def test_an_in_place_leave_tells_the_coordinator_first() -> None:
    agent = Agent(rescale_in_place=True)
    agent.on(core.GenerationSeen(_gen(1, "a", "b")))
    _ready(agent)
    assert agent.on(core.SignalReceived(signal.SIGTERM)) == [
        core.Leave(),
        core.Stop(rescale=True, leave=True),
        core.Exit(143),  # left on SIGTERM: the job goes on, and a supervisor starts the node again
    ]


def test_a_world_that_took_the_restart_path_after_a_hand_over_starts_fresh_workers() -> None:
    agent = Agent(rescale_in_place=True)
    agent.on(core.GenerationSeen(_gen(1, "a")))
    _ready(agent)
    agent.on(core.GenerationSeen(_gen(2, "a", "b")))  # handed in place...
    saved = GroupResult(2, {0: RESCALE_EXIT_CODE, 1: RESCALE_EXIT_CODE})  # ...but the world checkpointed and exited
    assert agent.on(core.GroupExited(saved)) == [core.Stop(), core.Start(_gen(2, "a", "b"))]
    assert agent.state.group == 2 and agent.state.phase is AgentState.RUNNING


def test_workers_done_and_no_control_plane_for_long_ends_the_agent_cleanly() -> None:
    agent = Agent()
    agent.on(core.Joined(3.0))
    agent.on(core.GenerationSeen(_gen(1, "a", "b")))
    agent.on(core.GroupExited(GroupResult(1, {0: 0, 1: 0})))  # the success report is queued
    agent.on(core.HeartbeatFailed(), after=1.0)
    assert agent.on(core.Tick(), after=core.DONE_UNHEARD_S - 2) == [], "not yet"
    assert agent.on(core.Tick(), after=3.0) == [core.Exit(0)]
    assert agent.state.phase is AgentState.SUCCEEDED and "cannot be recorded" in agent.state.reason


def test_workers_done_with_the_control_plane_there_wait_for_the_jobs_end() -> None:
    agent = Agent()
    agent.on(core.Joined(3.0))
    agent.on(core.GenerationSeen(_gen(1, "a", "b")))
    agent.on(core.GroupExited(GroupResult(1, {0: 0, 1: 0})))
    for _ in range(10):
        agent.on(core.HeartbeatOk(), after=core.DONE_UNHEARD_S)
        assert agent.on(core.Tick()) == [], "heard from the control plane: the job's end will come"
    # A new world that includes this node again forgets that its workers were done.
    agent.on(core.GenerationSeen(_gen(2, "a", "b")))
    agent.on(core.HeartbeatFailed())
    assert core.Exit(0) not in agent.on(core.Tick(), after=10 * core.DONE_UNHEARD_S)


# -- stopping is a state (pliant.agent.stopping): the executor never waits ---------------------------------------------


def _stopping(agent: Agent) -> core.StopStage | None:
    return agent.state.stopping.stage if agent.state.stopping is not None else None


def _tick(agent: Agent, after: float) -> list[core.Action]:
    """A tick ``after`` seconds on, its membership renewed meanwhile (no fencing in these tests)."""
    agent.on(core.HeartbeatOk(), after=after)
    return agent.on(core.Tick())


def test_a_rescale_stop_holds_the_next_group_until_the_old_one_is_gone() -> None:
    agent = Agent(instant_stops=False, rescale_grace_s=30.0, stop_grace_s=5.0)
    agent.on(core.GenerationSeen(_gen(1, "a")))
    assert agent.on(core.GenerationSeen(_gen(2, "b", "a"))) == [core.Stop(rescale=True)]  # the Start waits
    assert _stopping(agent) is core.StopStage.RESCALE and agent.state.group == 2
    assert _tick(agent, 29.0) == []  # the workers save within the rescale grace
    assert agent.on(core.GroupStopped(1), after=0.5) == [core.Start(_gen(2, "b", "a"))]
    assert agent.state.stopping is None


def test_a_stop_escalates_on_ticks_dump_term_kill_and_gives_up_after_sigkill() -> None:
    agent = Agent(instant_stops=False, rescale_grace_s=30.0, stop_grace_s=5.0)
    agent.on(core.GenerationSeen(_gen(1, "a")))
    agent.on(core.GenerationSeen(_gen(2, "b", "a")))
    assert _tick(agent, 30.0) == [core.Escalate(core.StopStage.DUMP)]
    assert _tick(agent, 0.2) == []
    assert _tick(agent, 0.3) == [core.Escalate(core.StopStage.TERM)]
    assert _tick(agent, 4.9) == []
    assert _tick(agent, 0.1) == [core.Escalate(core.StopStage.KILL)]
    given_up = _tick(agent, 10.0)  # a worker that outlived SIGKILL: not waited for longer
    assert given_up == [core.Escalate(core.StopStage.GONE), core.Start(_gen(2, "b", "a"))]
    assert agent.state.stopping is None
    assert agent.on(core.GroupStopped(1)) == []  # a late report of the same group changes nothing


def test_hung_workers_stacks_get_their_time_before_sigterm() -> None:
    """A hang asks for the workers' stacks and begins the stop with the dump stage: SIGTERM follows once the dumps had
    :data:`stopping.DUMP_S` to reach the logs, and the executor never sleeps for them."""
    agent = Agent(instant_stops=False, hang_timeout_s=5.0, stop_grace_s=5.0)
    agent.on(core.GenerationSeen(_gen(1, "a")))
    agent.on(core.Tick({0: (1, "step")}, ready=True))
    actions = agent.on(core.Tick({0: (1, "step")}, ready=True), after=6.0)
    assert agent.kinds(actions) == ["Dump", "Stop"] and actions[1] == core.Stop(hung=True)  # the report waits
    assert _stopping(agent) is core.StopStage.DUMP
    assert _tick(agent, stopping.DUMP_S - 0.1) == []
    assert _tick(agent, 0.1) == [core.Escalate(core.StopStage.TERM)]
    assert _tick(agent, 5.0) == [core.Escalate(core.StopStage.KILL)]
    assert agent.kinds(agent.on(core.GroupStopped(1))) == ["Send"]


def test_a_rescale_no_worker_takes_is_sigterm_at_once_and_sigkill_after_the_stop_grace() -> None:
    agent = Agent(instant_stops=False, rescale_grace_s=30.0, stop_grace_s=5.0)
    agent.on(core.GenerationSeen(_gen(1, "a")))
    agent.on(core.GenerationSeen(_gen(2, "b", "a")))
    assert agent.on(core.StopStarted(core.StopStage.TERM), after=0.01) == []  # a plain script: torchrun's SIGTERM
    assert _tick(agent, 5.0) == [core.Escalate(core.StopStage.KILL)]


def test_the_jobs_end_lets_workers_finish_then_sigterms_and_exits_once_they_are_gone() -> None:
    agent = Agent(instant_stops=False, finish_grace_s=10.0)
    agent.on(core.GenerationSeen(_gen(1, "a")))
    assert agent.on(core.JobFinished(JobState.SUCCEEDED, "done")) == [core.Stop(finish=True)]  # Exit(0) waits
    assert agent.state.phase is AgentState.SUCCEEDED
    assert _tick(agent, 10.0) == [core.Escalate(core.StopStage.TERM)]  # escalated in a final phase
    assert agent.on(core.GroupStopped(1), after=0.1) == [core.Exit(0, "done")]


def test_decisions_made_while_a_group_stops_wait_for_it_and_a_newer_generation_replaces_the_planned() -> None:
    agent = Agent(instant_stops=False)
    agent.on(core.GenerationSeen(_gen(1, "a")))
    agent.on(core.GenerationSeen(_gen(2, "b", "a")))  # stopping group 1; group 2 planned
    newer = agent.on(core.GenerationSeen(_gen(3, "a", "b")))  # node rank 0 now: the store opens at once
    assert newer == [core.Prepare(_gen(3, "a", "b"))]  # no second stop: group 2 never started
    assert agent.state.stopping is not None and agent.state.stopping.then == (core.Start(_gen(3, "a", "b")),)
    leaving = agent.on(core.SignalReceived(signal.SIGTERM))
    assert leaving == []  # leave and exit wait for the stop too; the planned group never starts
    assert agent.on(core.GroupStopped(1)) == [core.Leave(), core.Exit(143)]
