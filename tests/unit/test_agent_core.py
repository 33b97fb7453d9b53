"""The agent's decisions (pliant.agent.core) with a fake clock and fake workers: no processes, no network."""

from __future__ import annotations

import signal

import pytest

from pliant.agent import actions as act
from pliant.agent import core, events, stopping
from pliant.agent.contract import AgentState, GroupResult
from pliant.coordinator.contract import FailureCause, Generation, GenerationMember, JobState
from pliant.env import RESCALE_EXIT_CODE
from pliant.fence import Fence
from pliant.fence import Warranted as W

pytestmark = pytest.mark.timeout(10)


def _gen(number: int, *nodes: str, reason: str = "join") -> Generation:
    members = tuple(GenerationMember(n, i, i * 2, 2, f"{n}:1") for i, n in enumerate(nodes))
    return Generation("job", number, members, reason)


PORT = 7000  # the store port every generation's store listens on in these tests


class Agent:
    """Drives decide() like the executor does, recording the actions. With ``instant_stops`` (the default) its
    groups stop at once: a :class:`act.Stop` is answered with :class:`events.GroupStopped` in the same call, and
    what waited for it follows in the returned actions. With ``instant_ports`` (the default) a store port's open or
    read is answered with :data:`PORT` in the same call. With ``instant_warmups`` (the default) a join by the restart
    path finds its newcomers warm at once: its count and its probe are answered in the same call, and the probe is
    not among the returned actions."""

    def __init__(
        self,
        node: str = "a",
        instant_stops: bool = True,
        instant_ports: bool = True,
        instant_warmups: bool = True,
        **config: object,
    ):
        graces = {
            name: config.pop(f"{name}_grace_s")
            for name in ("rescale", "stop", "finish", "abort")
            if f"{name}_grace_s" in config
        }
        config["graces"] = stopping.Graces(**{f"{name}_s": value for name, value in graces.items()})
        self.state = core.CoreState(node, config=core.CoreConfig(**config))  # type: ignore[arg-type]
        self.now = 100.0
        self.actions: list[act.Action] = []
        self.instant_stops = instant_stops
        self.instant_ports = instant_ports
        self.instant_warmups = instant_warmups

    def on(self, event: events.Event, after: float = 0.0) -> list[act.Action]:
        self.now += after
        self.state, done = core.decide(self.state, event, self.now)
        answers = list(done)
        while answers or self._warming():
            if not answers:  # a join by the restart path: its newcomers are warm, and answer the probe
                handing = self.state.handing
                assert handing is not None and handing.handover is not None
                count = handing.handover.needed
                self.state, probe = core.decide(
                    self.state, events.ArrivalsRead(handing.generation.number, count), self.now
                )
                assert [type(a) for a in probe] == [act.ProbeNewcomers], probe
                self.state, more = core.decide(
                    self.state, events.NewcomersProbed(handing.generation.number, count), self.now
                )
                done, answers = [*done, *more], [*answers, *more]
                continue
            action = answers.pop(0)
            if self.instant_stops and isinstance(action, act.Stop):
                reply: events.Event | None = events.GroupStopped(0)
            elif self.instant_ports and isinstance(action, (act.Prepare, act.ReadStorePort)):
                reply = events.StorePortRead(action.generation.number, PORT)
            else:
                reply = None
            if reply is not None:
                self.state, more = core.decide(self.state, reply, self.now)
                done, answers = [*done, *more], [*answers, *more]
        self.actions += done
        return done

    def _warming(self) -> bool:
        handing = self.state.handing
        return self.instant_warmups and handing is not None and handing.restart and handing.port is not None

    def kinds(self, actions: list[act.Action]) -> list[str]:
        return [type(a).__name__ for a in actions]


def test_a_generation_starts_the_group_and_a_newer_one_rescales_it() -> None:
    agent = Agent()
    agent.on(events.Joined(10.0))
    assert agent.state.lifecycle is AgentState.WAITING
    first = agent.on(events.GenerationSeen(_gen(1, "a")))
    assert agent.kinds(first) == ["Prepare", "Start"] and agent.state.lifecycle is AgentState.RUNNING
    assert agent.on(events.GenerationSeen(_gen(1, "a"))) == []  # a repeat changes nothing
    second = agent.on(events.GenerationSeen(_gen(2, "b", "a")))  # now node rank 1: its store port is read
    gen = _gen(2, "b", "a")
    assert second == [act.ReadStorePort(gen), act.Stop(rescale=True), act.Start(gen, PORT)]
    assert agent.on(events.GenerationSeen(_gen(3, "b"))) == [act.Stop(rescale=True)]
    assert agent.state.lifecycle is AgentState.WAITING and agent.state.group is None


def test_node_rank_0_opens_the_store_before_it_stops_its_old_group() -> None:
    agent = Agent()
    agent.on(events.GenerationSeen(_gen(1, "a")))
    actions = agent.on(events.GenerationSeen(_gen(2, "a", "b")))
    assert agent.kinds(actions) == ["Prepare", "Stop", "Start"]


def test_outcomes_of_a_group() -> None:
    agent = Agent()
    agent.on(events.GenerationSeen(_gen(1, "a", "b")))
    done = agent.on(events.GroupExited(GroupResult(1, {0: 0, 1: 0})))
    assert done == [act.Stop(), act.Send(act.Report("success", 1))]
    agent.on(events.GenerationSeen(_gen(2, "a", "b")))
    assert agent.on(events.GroupExited(GroupResult(2, {0: RESCALE_EXIT_CODE, 1: 0}))) == [act.Stop()]
    agent.on(events.GenerationSeen(_gen(3, "a", "b")))
    why = "local rank 1 (rank 1) exited with code -9"
    failed = agent.on(events.GroupExited(GroupResult(3, {0: 0, 1: -9}), why))
    assert failed == [act.Send(act.Report("failure", 3, -9, why)), act.Stop(failed=True)]
    assert agent.on(events.GroupExited(GroupResult(3, {0: 1}))) == [act.Stop()]  # not the running group: reap only


def test_a_node_reports_its_worker_that_failed_of_its_own_not_the_one_its_failure_broke() -> None:
    """Local rank 1 raised; local rank 0, whose collective that broke, died of gloo's error before the agent looked:
    the report is local rank 1's, its code and its error."""
    peer = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4121"
    own = "RuntimeError: the disk of node-b is full"
    result = GroupResult(3, {0: 1, 1: 2}).blame({0: peer, 1: own})
    assert result.first_failure == (1, 2)
    assert GroupResult(3, {0: 1, 1: -9}).blame({0: peer}).first_failure == (1, -9)  # a kill has no error, its own
    assert GroupResult(3, {0: 1, 1: 1}).blame({0: peer, 1: peer}).first_failure == (0, 1)  # none its own: the first
    assert GroupResult(3, {0: 0, 1: 1}).blame({}).first_failure == (1, 1)
    agent = Agent()
    agent.on(events.GenerationSeen(_gen(3, "a", "b")))
    why = f"local rank 1 (rank 1) exited with code 2: {own}"
    failed = agent.on(events.GroupExited(result, why, error=own))
    assert failed == [act.Send(act.Report("failure", 3, 2, why, error=own)), act.Stop(failed=True)]


def test_the_coordinator_away_changes_nothing() -> None:
    agent = Agent()
    agent.on(events.Joined(10.0))
    agent.on(events.GenerationSeen(_gen(1, "a")))  # a single-node world: no peer to ask
    for _ in range(100):
        assert agent.on(events.HeartbeatFailed(), after=1.0) == []
        assert agent.on(events.Tick({0: (1, "start"), 1: (1, "start")}), after=0.0) == []
    assert agent.state.lifecycle is AgentState.RUNNING
    # Workers finish during the outage: the success is sent (the executor retries it until the coordinator answers).
    done = agent.on(events.GroupExited(GroupResult(1, {0: 0, 1: 0})))
    assert done == [act.Stop(), act.Send(act.Report("success", 1))]
    assert agent.state.lifecycle is AgentState.WAITING


def test_an_agent_cut_off_while_its_peers_renew_fences_itself() -> None:
    agent = Agent()
    agent.on(events.Joined(10.0))
    agent.on(events.GenerationSeen(_gen(1, "a", "b")))
    assert agent.on(events.HeartbeatFailed(), after=14.0) == []  # within 1.5 TTL: nothing to ask yet
    assert agent.on(events.HeartbeatFailed(), after=1.5) == [act.ProbePeers()]
    assert agent.on(events.HeartbeatFailed(), after=1.0) == []  # asked at most once per half TTL
    # Peers cannot renew either: the control plane is down for everyone; keep training.
    assert agent.on(events.PeersProbed(streak_s=-1.0)) == []
    # A peer renews again, but only since the control plane came back: it has not yet given everyone its grace.
    assert agent.on(events.Tick(), after=5.0) == [act.ProbePeers()]
    assert agent.on(events.PeersProbed(streak_s=12.0)) == []
    assert agent.state.lifecycle is AgentState.RUNNING
    # A peer has renewed for long enough, but its world is still generation 1, this node's: nobody evicted it (a
    # leader that took over, or got etcd back, waits a TTL before it evicts anyone), so its workers are still needed.
    assert agent.on(events.Tick(), after=5.0) == [act.ProbePeers()]
    assert agent.on(events.PeersProbed(streak_s=16.0, newest=1)) == []
    assert agent.state.lifecycle is AgentState.RUNNING
    assert agent.on(events.Tick(), after=5.0) == [act.ProbePeers()]
    assert agent.on(events.PeersProbed(streak_s=21.0, newest=2)) == [act.Stop()]  # a world without it: evicted
    assert agent.state.lifecycle is AgentState.WAITING and "fenced" in agent.state.reason
    assert "seen generation 2" in agent.state.reason
    agent.on(events.LeaseLost("evicted"))
    assert agent.state.lifecycle is AgentState.JOINING
    agent.on(events.Joined(10.0))
    assert agent.kinds(agent.on(events.GenerationSeen(_gen(2, "b", "a")))) == ["ReadStorePort", "Start"]


def test_an_agent_fences_itself_when_its_peers_do_not_say_which_generation_they_see() -> None:
    """Peers of an older version publish only their streak (and a peer that has seen no generation says 0): the fence
    falls back to the streak alone."""
    for newest in (-1, 0):
        agent = Agent()
        agent.on(events.Joined(10.0))
        agent.on(events.GenerationSeen(_gen(1, "a", "b")))
        assert agent.on(events.HeartbeatFailed(), after=16.0) == [act.ProbePeers()]
        assert agent.on(events.PeersProbed(streak_s=16.0, newest=newest)) == [act.Stop()], newest


def test_a_rank_without_progress_is_hung() -> None:
    agent = Agent(hang_timeout_s=5.0, start_timeout_s=30.0)
    agent.on(events.GenerationSeen(_gen(1, "a")))
    agent.on(events.Tick({0: (0, "start"), 1: (0, "start")}))
    for step in range(1, 6):
        assert agent.on(events.Tick({0: (step, "step"), 1: (step, "step")}), after=0.5) == []
    assert agent.on(events.Tick({0: (6, "step"), 1: (5, "step")}), after=4.0) == []
    actions = agent.on(events.Tick({0: (7, "step"), 1: (5, "step")}), after=1.5)  # rank 1: 5.5 s since step 5
    assert agent.kinds(actions) == ["Dump", "Stop", "Send"]
    report = actions[-1].report  # type: ignore[union-attr]
    assert report.kind == "failure" and report.cause is FailureCause.HUNG
    assert "local rank 1 made no progress for 6s after step 5" in report.message
    assert agent.state.group is None


def test_a_slow_start_or_save_is_not_a_hang_before_the_start_timeout() -> None:
    agent = Agent(hang_timeout_s=5.0, start_timeout_s=30.0)
    agent.on(events.GenerationSeen(_gen(1, "a")))
    assert agent.on(events.Tick({0: (0, "start")}), after=0.0) == []
    assert agent.on(events.Tick({0: (0, "start")}), after=29.0) == []  # imports, compile, restore
    assert agent.on(events.Tick({0: (1, "step")}), after=0.5) == []
    assert agent.on(events.Tick({0: (1, "save")}), after=0.5) == []
    assert agent.on(events.Tick({0: (1, "save")}), after=25.0) == []  # a long checkpoint save
    assert agent.on(events.Tick({0: (2, "step")}), after=1.0) == []
    actions = agent.on(events.Tick({0: (2, "save")}), after=0.1) + agent.on(events.Tick({0: (2, "save")}), after=31.0)
    assert agent.kinds(actions) == ["Dump", "Stop", "Send"]
    assert "checkpoint save after step 2" in actions[-1].report.message  # type: ignore[union-attr]


def test_a_long_state_transfer_in_place_is_not_a_hang_before_the_start_timeout() -> None:
    agent = Agent(hang_timeout_s=5.0, start_timeout_s=30.0)
    agent.on(events.GenerationSeen(_gen(1, "a")))
    assert agent.on(events.Tick({0: (4, "step")}), after=0.5) == []
    assert agent.on(events.Tick({0: (4, "transfer", 2)}), after=0.5) == []
    assert agent.on(events.Tick({0: (4, "transfer", 2)}), after=25.0) == []  # a big state moving
    actions = agent.on(events.Tick({0: (4, "transfer", 2)}), after=6.0)
    assert agent.kinds(actions) == ["Dump", "Stop", "Send"]
    assert "moving the state into generation 2 after step 4" in actions[-1].report.message  # type: ignore[union-attr]


def test_workers_that_write_no_progress_are_not_watched() -> None:
    agent = Agent(hang_timeout_s=1.0, start_timeout_s=2.0)
    agent.on(events.GenerationSeen(_gen(1, "a")))
    assert agent.on(events.Tick({}), after=1000.0) == []


def test_the_automatic_hang_timeout_follows_the_step_time() -> None:
    agent = Agent()
    agent.on(events.GenerationSeen(_gen(1, "a")))
    assert core.hang_timeout(agent.state) == core.HANG_FLOOR_S
    for step in range(1, 20):
        agent.on(events.Tick({0: (step, "step")}), after=30.0)  # 30 s steps
    assert core.hang_timeout(agent.state) == pytest.approx(core.HANG_MULTIPLE * 30.0)


def test_job_end_signal_and_start_failure() -> None:
    agent = Agent()
    agent.on(events.GenerationSeen(_gen(1, "a", "b")))
    assert agent.on(events.StartFailed(1, "store port")) == [
        act.Stop(),
        act.Send(act.Report("failure", 1, 0, "store port", cause=FailureCause.START_FAILED)),
    ]
    agent.on(events.GenerationSeen(_gen(2, "a", "b")))
    assert agent.on(events.JobFinished(JobState.RUNNING, "")) == []
    assert agent.on(events.JobFinished(JobState.SUCCEEDED, "done")) == [act.Stop(finish=True), act.Exit(0, "done")]
    assert agent.on(events.GenerationSeen(_gen(3, "a"))) == []  # terminal: nothing more

    failed = Agent()
    assert failed.on(events.JobFinished(JobState.FAILED, "budget spent")) == [act.Exit(1, "budget spent")]

    alone = Agent()
    assert alone.on(events.SignalReceived(signal.SIGTERM)) == [act.Leave(), act.Exit(143)]  # no workers: at once


def test_a_graceful_leave_stops_the_workers_once_the_world_without_the_node_is_published() -> None:
    """The node leaves first; its workers get SIGTERM when every other node's do: as the world without it comes."""
    leaving = Agent("b")
    leaving.on(events.Joined(10.0))
    leaving.on(events.GenerationSeen(_gen(1, "a", "b")))
    assert leaving.on(events.SignalReceived(signal.SIGTERM)) == [act.Leave()]
    assert leaving.state.lifecycle is AgentState.LEAVING
    assert leaving.on(events.Tick({}), after=1.0) == []  # the workers train on meanwhile
    assert leaving.on(events.HeartbeatOk()) == []
    assert leaving.on(events.GenerationSeen(_gen(2, "a"))) == [act.Stop(rescale=True), act.Exit(143)]
    assert leaving.state.lifecycle is AgentState.LEFT

    unheard = Agent("b")  # the control plane does not answer: the workers stop after LEAVE_WAIT_S all the same
    unheard.on(events.Joined(10.0))
    unheard.on(events.GenerationSeen(_gen(1, "a", "b")))
    unheard.on(events.SignalReceived(signal.SIGINT))
    assert unheard.on(events.Tick({}), after=core.LEAVE_WAIT_S - 0.1) == []
    assert unheard.on(events.Tick({}), after=0.2) == [act.Stop(rescale=True), act.Exit(130)]

    impatient = Agent("b")  # a second Ctrl-C stops them at once
    impatient.on(events.Joined(10.0))
    impatient.on(events.GenerationSeen(_gen(1, "a", "b")))
    impatient.on(events.SignalReceived(signal.SIGINT))
    assert impatient.on(events.SignalReceived(signal.SIGINT)) == [act.Stop(rescale=True), act.Exit(130)]

    cut_off = Agent("b")  # heartbeats fail: no world without this node will be published, so no wait
    cut_off.on(events.Joined(10.0))
    cut_off.on(events.GenerationSeen(_gen(1, "a", "b")))
    cut_off.on(events.HeartbeatFailed())
    assert cut_off.on(events.SignalReceived(signal.SIGINT)) == [act.Stop(rescale=True), act.Leave(), act.Exit(130)]

    finished = Agent("b")  # the job ended meanwhile: it ends as the job did
    finished.on(events.Joined(10.0))
    finished.on(events.GenerationSeen(_gen(1, "a", "b")))
    finished.on(events.SignalReceived(signal.SIGTERM))
    assert finished.on(events.JobFinished(JobState.SUCCEEDED, "done")) == [act.Stop(finish=True), act.Exit(0, "done")]


def test_a_newer_world_in_the_checkpoint_directory_fences_a_lone_node_and_says_so() -> None:
    agent = Agent()
    gen = Generation("job", 4, (GenerationMember("a", 0, 0, 2, "a:1"),), "join", incarnation="u7")
    agent.on(events.GenerationSeen(gen))
    assert agent.on(events.Tick({}, fence=Fence("job", W("u7", 4)))) == []  # its own world's fence
    assert (
        agent.on(events.Tick({}, fence=Fence("job", W("u3", 9)))) == []
    )  # an earlier incarnation: this one takes over
    other = Fence("other", W("u8", 9), (W("u7", 1),))
    assert agent.on(events.Tick({}, fence=other)) == []  # another job's: its worker refuses
    actions = agent.on(events.Tick({}, fence=Fence("job", W("u7", 5))))
    assert actions[0] == act.Stop() and isinstance(actions[1], act.Send)
    assert actions[1].report.kind == "failure" and actions[1].report.cause is FailureCause.FENCED
    assert "fenced: generation 5 owns the checkpoint directory" in agent.state.reason
    assert agent.state.reason in actions[1].report.message


def test_a_world_of_an_incarnation_that_was_taken_over_is_fenced() -> None:
    agent = Agent()
    gen = Generation("job", 12, (GenerationMember("a", 0, 0, 2, "a:1"),), "join", incarnation="old")
    agent.on(events.GenerationSeen(gen))
    actions = agent.on(events.Tick({}, fence=Fence("job", W("new", 1), (W("old", 3),))))
    assert actions[0] == act.Stop()
    assert "another incarnation of job job" in agent.state.reason


def test_the_renewal_streak_peers_read() -> None:
    agent = Agent()
    agent.on(events.Joined(10.0))
    assert core.renewal_streak(agent.state, agent.now) == 0.0
    for _ in range(8):
        agent.on(events.HeartbeatOk(), after=2.5)
    assert core.renewal_streak(agent.state, agent.now) == 20.0
    assert core.renewal_streak(agent.state, agent.now + 11) == -1.0  # silent for more than the TTL
    agent.on(events.HeartbeatOk(), after=30.0)  # back after an outage: a new streak
    assert core.renewal_streak(agent.state, agent.now) == 0.0
    agent.on(events.HeartbeatFailed(), after=1.0)
    assert core.renewal_streak(agent.state, agent.now) == -1.0


# -- in-place rescale --------------------------------------------------------------------------------------------------


def _ready(agent: Agent, ready: bool = True) -> None:
    """The workers announced (or not) that they re-form in place; the executor reads it on a tick."""
    agent.on(events.Tick({0: (3, "step"), 1: (3, "step")}, ready=ready), after=0.1)


def test_a_ready_group_is_handed_the_next_generation_in_place() -> None:
    agent = Agent(rescale_in_place=True)
    agent.on(events.GenerationSeen(_gen(1, "a", "b")))
    _ready(agent)
    actions = agent.on(events.GenerationSeen(_gen(2, "a", "b", reason="failure")))  # no newcomer: handed at once
    assert actions == [
        act.Prepare(_gen(2, "a", "b", reason="failure")),
        act.Reconfigure(_gen(2, "a", "b", reason="failure"), PORT),
    ]  # no Stop, no Start
    assert agent.state.group.number == 2 and agent.state.lifecycle is AgentState.RUNNING
    assert "in place" in agent.state.reason
    # As node rank 1 of the next world, it reads the store's port from node rank 0.
    third = _gen(3, "b", "a")
    assert agent.on(events.GenerationSeen(third)) == [act.ReadStorePort(third), act.Reconfigure(third, PORT)]


def test_a_generation_with_newcomers_is_handed_over_once_they_arrived_and_answer() -> None:
    """The survivors train on while the newcomers start: the hand-over waits for their workers to count themselves
    in at the generation's store (read on every tick), and a last probe of their agents decides."""
    agent = Agent(rescale_in_place=True, rescale_grace_s=30.0)
    agent.on(events.Joined(10.0))
    agent.on(events.GenerationSeen(_gen(1, "a")))
    _ready(agent)
    gen = _gen(2, "a", "b")
    assert agent.on(events.GenerationSeen(gen)) == [act.Prepare(gen)], "no hand-over before b's workers arrive"
    assert agent.state.group.number == 2 and "once b arrive" in agent.state.reason
    assert agent.kinds(agent.on(events.Tick({0: (4, "step"), 1: (4, "step")}, ready=True), after=0.02)) == [
        "ReadArrivals"
    ]
    assert agent.on(events.ArrivalsRead(2, 1)) == [act.ProbeNewcomers(gen, ("b",), 1)], "the first probe is due at once"
    assert agent.on(events.ArrivalsRead(2, 2), after=1.5) == [], "a probe runs in the background: one at a time"
    assert agent.on(events.NewcomersProbed(2, 1)) == [], "b answers; one of its 2 workers counted in: wait"
    assert agent.on(events.ArrivalsRead(2, 1), after=0.5) == [], "the next probe is a second after the last"
    assert agent.on(events.ArrivalsRead(2, 2), after=0.1) == [act.ProbeNewcomers(gen, ("b",), 2)], "all arrived"
    assert agent.on(events.NewcomersProbed(2, 2)) == [act.Reconfigure(gen, PORT)]
    assert agent.state.handing is None and agent.state.group.members == ("a", "b")
    assert agent.kinds(agent.on(events.Tick({0: (5, "step"), 1: (5, "step")}, ready=True), after=0.02)) == []
    assert agent.on(events.ArrivalsRead(2, 2)) == [], "a late answer of a finished hand-over changes nothing"


def test_a_newcomer_this_node_cannot_reach_is_reported_instead_of_handed_over() -> None:
    agent = Agent(rescale_in_place=True, rescale_grace_s=30.0)
    agent.on(events.GenerationSeen(_gen(1, "a")))
    _ready(agent)
    gen = _gen(2, "a", "b")
    agent.on(events.GenerationSeen(gen))
    agent.on(events.ArrivalsRead(2, 0))
    assert agent.on(events.NewcomersProbed(2, 0, frozenset({"b"}))) == [], "one failed probe is not enough"
    agent.on(events.ArrivalsRead(2, 0), after=1.0)
    actions = agent.on(events.NewcomersProbed(2, 0, frozenset({"b"})))
    assert agent.kinds(actions) == ["Send"], "the workers train on in their generation; the report brings the next"
    report = actions[0].report  # type: ignore[union-attr]
    assert (report.kind, report.generation) == ("failure", 2) and "newcomers b have not arrived yet" in report.message
    assert agent.state.handing is None and "not handed over" in agent.state.reason
    assert agent.state.group.members == ("a",), "the group's world is still generation 1's"


def test_a_waiting_hand_over_gives_way_to_a_newer_generation() -> None:
    agent = Agent(rescale_in_place=True)
    agent.on(events.GenerationSeen(_gen(1, "a")))
    _ready(agent)
    agent.on(events.GenerationSeen(_gen(2, "a", "b")))
    newer = _gen(3, "a", "b", "c")
    assert agent.on(events.GenerationSeen(newer)) == [act.Prepare(newer)]
    assert agent.state.handing.generation == newer and agent.state.handing.handover is not None
    assert agent.state.handing.handover.newcomers == ("b", "c") and agent.state.handing.handover.needed == 4, (
        "against gen 1's world"
    )
    assert agent.on(events.ArrivalsRead(2, 2)) == [], "the superseded generation's arrivals are ignored"


def test_without_readiness_or_with_rescale_restart_the_restart_path_applies() -> None:
    not_ready = Agent(rescale_in_place=True)
    not_ready.on(events.GenerationSeen(_gen(1, "a")))
    _ready(not_ready, False)  # a worker still starting, or a script without pliant.worker
    assert not_ready.kinds(not_ready.on(events.GenerationSeen(_gen(2, "a", "b")))) == ["Prepare", "Stop", "Start"]
    restart = Agent(rescale_in_place=False)
    restart.on(events.GenerationSeen(_gen(1, "a")))
    _ready(restart)
    assert restart.kinds(restart.on(events.GenerationSeen(_gen(2, "a", "b")))) == ["Prepare", "Stop", "Start"]
    # A generation without this node stops the group even in place; its ranks leave at the step boundary (they hand
    # over what only they hold), so the others re-form in place without a restart.
    evicted = Agent(rescale_in_place=True)
    evicted.on(events.GenerationSeen(_gen(1, "a", "b")))
    _ready(evicted)
    assert evicted.on(events.GenerationSeen(_gen(2, "b"))) == [act.Stop(rescale=True, leave=True)]
    # Unless every local rank waits after a failed step: their world broke, the next goes on without them, so there
    # is no boundary to hand over at, and they may be meeting a peer they cannot reach (up to MEET_S): stopped at once.
    stranded = Agent(rescale_in_place=True)
    stranded.on(events.GenerationSeen(_gen(1, "a", "b")))
    _ready(stranded)
    stranded.on(events.Tick({0: (40, "wait", 1), 1: (40, "wait", 1)}, ready=True))
    assert stranded.on(events.GenerationSeen(_gen(2, "b"))) == [act.Stop()]
    assert "waited after a failed step" in stranded.state.reason
    one_waits = Agent(rescale_in_place=True)  # one rank still steps: the boundary is still ahead, as before
    one_waits.on(events.GenerationSeen(_gen(1, "a", "b")))
    _ready(one_waits)
    one_waits.on(events.Tick({0: (40, "wait", 1), 1: (40, "step", 1)}, ready=True))
    assert one_waits.on(events.GenerationSeen(_gen(2, "b"))) == [act.Stop(rescale=True, leave=True)]
    # A generation with no one (the job below its minimum, or done): the group checkpoints and exits.
    emptied = Agent(rescale_in_place=True)
    emptied.on(events.GenerationSeen(_gen(1, "a")))
    _ready(emptied)
    assert emptied.on(events.GenerationSeen(_gen(2))) == [act.Stop(rescale=True)]


def test_a_dead_worker_in_place_is_reported_and_the_others_wait() -> None:
    agent = Agent(rescale_in_place=True)
    agent.on(events.GenerationSeen(_gen(1, "a", "b")))
    _ready(agent)
    why = "local rank 1 (rank 1) exited with code -9"
    actions = agent.on(events.GroupExited(GroupResult(1, {1: -9}), why, alive=1))
    assert actions == [act.Send(act.Report("failure", 1, -9, why))]  # no Stop: local rank 0 keeps its process
    assert agent.state.group.number == 1 and agent.state.lifecycle is AgentState.RUNNING
    assert agent.on(events.GenerationSeen(_gen(2, "a", "b")), after=0.5) == [
        act.Prepare(_gen(2, "a", "b")),
        act.Reconfigure(_gen(2, "a", "b"), PORT),
    ]
    # Every worker dead: the restart path.
    lost = Agent(rescale_in_place=True)
    lost.on(events.GenerationSeen(_gen(1, "a")))
    _ready(lost)
    assert lost.kinds(lost.on(events.GroupExited(GroupResult(1, {0: -9, 1: -9}), "", alive=0))) == ["Send", "Stop"]


def test_a_group_that_dies_before_a_pending_hand_over_reports_the_handed_generation() -> None:
    """Handed generation 2 in place, the executor waits for newcomers before the workers re-form; the only worker
    exits meanwhile (its re-forming failed). The failure is generation 2's: one of generation 1 would be stale, and
    the agent would wait forever with no workers."""
    agent = Agent(rescale_in_place=True)
    agent.on(events.GenerationSeen(_gen(1, "a", "b")))
    _ready(agent)
    agent.on(events.GenerationSeen(_gen(2, "a", "b", "c")), after=0.5)
    why = "local rank 0 (rank 0) exited with code 1"
    actions = agent.on(events.GroupExited(GroupResult(1, {0: 1}), why, alive=0))
    assert actions == [act.Send(act.Report("failure", 2, 1, why)), act.Stop(failed=True)]
    assert agent.state.group is None and agent.state.lifecycle is AgentState.WAITING
    # A group of an earlier generation, replaced by a fresh start (not handed in place), is only reaped.
    fresh = Agent(rescale_in_place=False)
    fresh.on(events.GenerationSeen(_gen(1, "a")))
    fresh.on(events.GenerationSeen(_gen(2, "a", "b")))
    assert fresh.on(events.GroupExited(GroupResult(1, {0: 1}), "", alive=0)) == [act.Stop()]


def test_a_rank_that_saw_a_peer_fail_is_reported_once() -> None:
    agent = Agent(rescale_in_place=True)
    agent.on(events.GenerationSeen(_gen(1, "a", "b")))
    _ready(agent)
    actions = agent.on(events.Tick({0: (4, "wait"), 1: (4, "step")}, ready=True), after=0.2)
    assert agent.kinds(actions) == ["Send"]
    report = actions[0].report  # type: ignore[union-attr]
    assert (report.kind, report.generation, report.cause) == ("failure", 1, FailureCause.WAITING)
    assert "saw a peer fail mid-step" in report.message
    assert agent.on(events.Tick({0: (4, "wait"), 1: (4, "wait")}, ready=True), after=0.2) == [
        act.Send(act.Report("failure", 1, 0, report.message.replace("rank 0", "rank 1"), cause=FailureCause.WAITING))
    ]  # local rank 1 entered "wait" now
    assert agent.on(events.Tick({0: (4, "wait"), 1: (4, "wait")}, ready=True), after=0.2) == []  # still waiting
    agent.on(events.GenerationSeen(_gen(2, "a", "b")))
    assert agent.on(events.Tick({0: (4, "wait"), 1: (4, "wait")}, ready=True), after=0.2) == []  # the same wait
    # Handed generation 2, local rank 0 could not meet its ranks there: it waits again, now in generation 2.
    assert agent.on(events.Tick({0: (4, "wait", 2), 1: (4, "wait")}, ready=True), after=0.2) == [
        act.Send(act.Report("failure", 2, 0, report.message, cause=FailureCause.WAITING))
    ]
    # Waiting longer than the start timeout is a hang like a slow start.
    hung = agent.on(events.Tick({0: (4, "wait"), 1: (4, "wait")}, ready=True), after=700.0)
    assert agent.kinds(hung) == ["Dump", "Stop", "Send"]


def test_workers_that_finish_the_job_before_their_newcomers_arrive_report_the_generation_untrained() -> None:
    """A generation handed in place waits for its newcomers while the survivors train on; survivors whose script ends
    meanwhile complete it without a step in it: their success says so, and the coordinator does not wait for the
    newcomers. Workers that trained in the generation say nothing of the kind."""
    agent = Agent(rescale_in_place=True, rescale_grace_s=30.0)
    agent.on(events.GenerationSeen(_gen(1, "a")))
    _ready(agent)
    agent.on(events.Tick({0: (4, "step", 1), 1: (4, "step", 1)}, ready=True), after=0.2)
    agent.on(events.GenerationSeen(_gen(2, "a", "b")))
    assert agent.state.handing is not None, "the hand-over waits for b"
    done = agent.on(events.GroupExited(GroupResult(1, {0: 0, 1: 0})), after=0.2)
    assert act.Send(act.Report("success", 2, untrained=True)) in done
    trained = Agent(rescale_in_place=True)
    trained.on(events.GenerationSeen(_gen(1, "a")))
    _ready(trained)
    trained.on(events.GenerationSeen(_gen(2, "a")))  # no newcomer: handed over at once
    trained.on(events.Tick({0: (5, "step", 2), 1: (5, "step", 2)}, ready=True), after=0.2)
    assert act.Send(act.Report("success", 2)) in trained.on(events.GroupExited(GroupResult(2, {0: 0, 1: 0})))


def test_a_failure_report_says_whether_its_generation_trained_a_step() -> None:
    """A step's progress record names the generation it completed in. A failure report of a generation in which a
    worker of this node completed a step says that every member arrived (the coordinator strikes no newcomer of it);
    one of a generation handed in place that never met says not."""
    agent = Agent(rescale_in_place=True)
    agent.on(events.GenerationSeen(_gen(1, "a", "b")))
    _ready(agent)
    agent.on(events.Tick({0: (4, "step", 1), 1: (4, "step", 1)}, ready=True), after=0.2)
    agent.on(events.GenerationSeen(_gen(2, "a", "b", "c")), after=0.5)  # c never arrives
    actions = agent.on(events.Tick({0: (5, "step", 1), 1: (5, "wait", 2)}, ready=True), after=0.2)
    assert [a.report.arrived for a in actions if isinstance(a, act.Send)] == [False]
    met = Agent(rescale_in_place=True)
    met.on(events.GenerationSeen(_gen(1, "a", "b")))
    _ready(met)
    met.on(events.Tick({0: (4, "step", 1), 1: (4, "step", 1)}, ready=True), after=0.2)
    why = "local rank 1 (rank 1) exited with code -9"
    assert met.on(events.GroupExited(GroupResult(1, {1: -9}), why, alive=1)) == [
        act.Send(act.Report("failure", 1, -9, why, arrived=True))
    ]


def test_an_in_place_leave_tells_the_coordinator_first() -> None:
    agent = Agent(rescale_in_place=True)
    agent.on(events.GenerationSeen(_gen(1, "a", "b")))
    _ready(agent)
    assert agent.on(events.SignalReceived(signal.SIGTERM)) == [
        act.Leave(),
        act.Stop(rescale=True, leave=True),
        act.Exit(143),  # left on SIGTERM: the job goes on, and a supervisor starts the node again
    ]


def test_a_world_that_took_the_restart_path_after_a_hand_over_starts_fresh_workers() -> None:
    agent = Agent(rescale_in_place=True)
    agent.on(events.GenerationSeen(_gen(1, "a")))
    _ready(agent)
    agent.on(events.GenerationSeen(_gen(2, "a", "b")))  # handed in place...
    saved = GroupResult(2, {0: RESCALE_EXIT_CODE, 1: RESCALE_EXIT_CODE})  # ...but the world checkpointed and exited
    assert agent.on(events.GroupExited(saved)) == [
        act.Prepare(_gen(2, "a", "b")),
        act.Stop(),
        act.Start(_gen(2, "a", "b"), PORT),
    ]
    assert agent.state.group.number == 2 and agent.state.lifecycle is AgentState.RUNNING


def test_workers_done_and_no_control_plane_for_long_ends_the_agent_cleanly() -> None:
    agent = Agent()
    agent.on(events.Joined(3.0))
    agent.on(events.GenerationSeen(_gen(1, "a", "b")))
    agent.on(events.GroupExited(GroupResult(1, {0: 0, 1: 0})))  # the success report is queued
    agent.on(events.HeartbeatFailed(), after=1.0)
    assert agent.on(events.Tick(), after=core.DONE_UNHEARD_S - 2) == [], "not yet"
    assert agent.on(events.Tick(), after=3.0) == [act.Exit(0)]
    assert agent.state.lifecycle is AgentState.SUCCEEDED and "cannot be recorded" in agent.state.reason


def test_workers_done_with_the_control_plane_there_wait_for_the_jobs_end() -> None:
    agent = Agent()
    agent.on(events.Joined(3.0))
    agent.on(events.GenerationSeen(_gen(1, "a", "b")))
    agent.on(events.GroupExited(GroupResult(1, {0: 0, 1: 0})))
    for _ in range(10):
        agent.on(events.HeartbeatOk(), after=core.DONE_UNHEARD_S)
        assert agent.on(events.Tick()) == [], "heard from the control plane: the job's end will come"
    # A new world that includes this node again forgets that its workers were done.
    agent.on(events.GenerationSeen(_gen(2, "a", "b")))
    agent.on(events.HeartbeatFailed())
    assert act.Exit(0) not in agent.on(events.Tick(), after=10 * core.DONE_UNHEARD_S)


# -- stopping is a state (pliant.agent.stopping): the executor never waits ---------------------------------------------


def _stopping(agent: Agent) -> core.StopStage | None:
    return agent.state.stopping.stage if agent.state.stopping is not None else None


def _tick(agent: Agent, after: float) -> list[act.Action]:
    """A tick ``after`` seconds on, its membership renewed meanwhile (no fencing in these tests)."""
    agent.on(events.HeartbeatOk(), after=after)
    return agent.on(events.Tick())


def test_a_rescale_stop_holds_the_next_group_until_the_old_one_is_gone() -> None:
    agent = Agent(instant_stops=False, rescale_grace_s=30.0, stop_grace_s=5.0)
    agent.on(events.GenerationSeen(_gen(1, "a")))
    gen = _gen(2, "b", "a")
    assert agent.on(events.GenerationSeen(gen)) == [act.ReadStorePort(gen), act.Stop(rescale=True)]  # the Start waits
    assert _stopping(agent) is core.StopStage.RESCALE and agent.state.group.number == 2
    assert _tick(agent, 29.0) == []  # the workers save within the rescale grace
    assert agent.on(events.GroupStopped(1), after=0.5) == [act.Start(_gen(2, "b", "a"), PORT)]
    assert agent.state.stopping is None


def test_a_stop_escalates_on_ticks_dump_term_kill_and_gives_up_after_sigkill() -> None:
    agent = Agent(instant_stops=False, rescale_grace_s=30.0, stop_grace_s=5.0)
    agent.on(events.GenerationSeen(_gen(1, "a")))
    agent.on(events.GenerationSeen(_gen(2, "b", "a")))
    assert _tick(agent, 30.0) == [act.Escalate(core.StopStage.DUMP)]
    assert _tick(agent, 0.2) == []
    assert _tick(agent, 0.3) == [act.Escalate(core.StopStage.TERM)]
    assert _tick(agent, 4.9) == []
    assert _tick(agent, 0.1) == [act.Escalate(core.StopStage.KILL)]
    given_up = _tick(agent, 10.0)  # a worker that outlived SIGKILL: not waited for longer
    assert given_up == [act.Escalate(core.StopStage.GONE), act.Start(_gen(2, "b", "a"), PORT)]
    assert agent.state.stopping is None
    assert agent.on(events.GroupStopped(1)) == []  # a late report of the same group changes nothing


def test_hung_workers_stacks_get_their_time_before_sigterm() -> None:
    """A hang asks for the workers' stacks and begins the stop with the dump stage: SIGTERM follows once the dumps had
    :data:`stopping.DUMP_S` to reach the logs, and the executor never sleeps for them."""
    agent = Agent(instant_stops=False, hang_timeout_s=5.0, stop_grace_s=5.0)
    agent.on(events.GenerationSeen(_gen(1, "a")))
    agent.on(events.Tick({0: (1, "step")}, ready=True))
    actions = agent.on(events.Tick({0: (1, "step")}, ready=True), after=6.0)
    assert agent.kinds(actions) == ["Dump", "Stop"] and actions[1] == act.Stop(hung=True)  # the report waits
    assert _stopping(agent) is core.StopStage.DUMP
    assert _tick(agent, stopping.DUMP_S - 0.1) == []
    assert _tick(agent, 0.1) == [act.Escalate(core.StopStage.TERM)]
    assert _tick(agent, 5.0) == [act.Escalate(core.StopStage.KILL)]
    assert agent.kinds(agent.on(events.GroupStopped(1))) == ["Send"]


def test_a_rescale_no_worker_takes_is_sigterm_at_once_and_sigkill_after_the_stop_grace() -> None:
    agent = Agent(instant_stops=False, rescale_grace_s=30.0, stop_grace_s=5.0)
    agent.on(events.GenerationSeen(_gen(1, "a")))
    agent.on(events.GenerationSeen(_gen(2, "b", "a")))
    assert agent.on(events.StopStarted(core.StopStage.TERM), after=0.01) == []  # a plain script: torchrun's SIGTERM
    assert _tick(agent, 5.0) == [act.Escalate(core.StopStage.KILL)]


def test_a_worker_failure_aborts_the_rest_of_the_group_sigkill_after_the_abort_grace() -> None:
    """The other workers of a world whose worker died wait in collectives that never complete: they get SIGTERM at
    once and SIGKILL after the abort grace, not the stop grace; the failure is reported at once, so that the other
    nodes abort their workers of that world meanwhile."""
    agent = Agent(instant_stops=False, stop_grace_s=5.0, abort_grace_s=0.5)
    agent.on(events.GenerationSeen(_gen(1, "a")))
    failed = agent.on(events.GroupExited(GroupResult(1, {0: -9}), "killed", alive=1))
    assert agent.kinds(failed) == ["Send", "Stop"] and failed[1] == act.Stop(failed=True)
    assert _stopping(agent) is core.StopStage.ABORT
    assert _tick(agent, 0.4) == []
    assert _tick(agent, 0.1) == [act.Escalate(core.StopStage.KILL)]
    assert agent.on(events.GroupStopped(1), after=0.05) == []


@pytest.mark.parametrize(
    ("reason", "stop"),
    [
        ("restart", act.Stop(failed=True)),
        ("failure", act.Stop(failed=True)),
        ("join", act.Stop(rescale=True)),
        ("leave", act.Stop(rescale=True)),
    ],
)
def test_a_world_replaced_after_a_failure_is_aborted_and_one_replaced_by_a_rescale_saves(
    reason: str, stop: act.Stop
) -> None:
    """A generation published because the world before it failed (a worker died elsewhere, a node was lost) aborts
    this node's workers of that world, whose collectives cannot complete; a join or a leave asks them to save."""
    agent = Agent(instant_stops=False)
    agent.on(events.GenerationSeen(_gen(1, "a", "b")))
    gen = _gen(2, "a", "b", reason=reason) if reason in ("restart", "join") else _gen(2, "a", reason=reason)
    actions = agent.on(events.GenerationSeen(gen))
    assert [a for a in actions if isinstance(a, act.Stop)] == [stop]
    assert _stopping(agent) is (core.StopStage.ABORT if stop.failed else core.StopStage.RESCALE)


def _warming_join(**config: object) -> tuple[Agent, Generation]:
    """An agent on the restart path whose world of one (node a) is joined by node b (2 workers): waiting for b's
    warm-up, its group still running generation 1."""
    agent = Agent(instant_warmups=False, rescale_in_place=False, **config)
    agent.on(events.GenerationSeen(_gen(1, "a")))
    gen = _gen(2, "a", "b")
    assert agent.on(events.GenerationSeen(gen)) == [act.Prepare(gen)]  # the store opens; the workers train on
    handing = agent.state.handing
    assert handing is not None and handing.restart and agent.state.group.number == 1
    assert agent.state.lifecycle is AgentState.RUNNING
    return agent, gen


def test_a_join_by_the_restart_path_stops_the_survivors_once_the_newcomers_workers_are_forked() -> None:
    """The survivors pause for the save and the restart only: their workers train on while the newcomer imports and
    forks its workers (its agent counts them in at the new generation's store), then save and restart."""
    agent, gen = _warming_join()
    assert act.ReadArrivals(gen, PORT, warm=True) in agent.on(events.Tick())
    assert agent.on(events.ArrivalsRead(2, 0)) == [act.ProbeNewcomers(gen, ("b",), 0)]  # the first probe at once
    assert agent.on(events.NewcomersProbed(2, 0)) == []  # b answers, and has forked nothing yet: wait
    assert agent.on(events.ArrivalsRead(2, 2), after=0.1) == [act.ProbeNewcomers(gen, ("b",), 2)]
    assert agent.on(events.NewcomersProbed(2, 2)) == [act.Stop(rescale=True), act.Start(gen, PORT)]
    assert agent.state.group.number == 2 and agent.state.handing is None


def test_a_join_by_the_restart_path_goes_ahead_after_the_rescale_grace_without_its_newcomers() -> None:
    agent, gen = _warming_join(rescale_grace_s=30.0)
    agent.on(events.ArrivalsRead(2, 0))
    agent.on(events.NewcomersProbed(2, 0))
    assert agent.on(events.ArrivalsRead(2, 0), after=30.0) == [act.ProbeNewcomers(gen, ("b",), 0)]
    assert agent.on(events.NewcomersProbed(2, 0)) == [act.Stop(rescale=True), act.Start(gen, PORT)]


def test_a_join_that_comes_while_one_waits_waits_for_every_newcomer_to_the_running_world() -> None:
    agent, _ = _warming_join()
    gen = _gen(3, "a", "b", "c")
    assert agent.on(events.GenerationSeen(gen)) == [act.Prepare(gen)]  # still no stop: the workers train on
    handing = agent.state.handing
    assert handing is not None and handing.restart and handing.generation == gen and agent.state.group.number == 1
    assert handing.handover is not None and handing.handover.newcomers == ("b", "c") and handing.handover.needed == 4


def test_a_newcomer_that_never_arrived_breaks_nothing_the_survivors_save() -> None:
    """A restart-path join whose newcomer cannot be reached is reported; the generation that drops the newcomer has
    reason ``failure``, but the running world never had it: its workers save for the rescale, not aborted."""
    agent, _ = _warming_join()
    agent.on(events.ArrivalsRead(2, 0))
    agent.on(events.NewcomersProbed(2, 0, frozenset({"b"})))
    agent.on(events.ArrivalsRead(2, 0), after=1.0)
    assert agent.kinds(agent.on(events.NewcomersProbed(2, 0, frozenset({"b"})))) == ["Send"]  # b: not arrived
    assert agent.state.group.number == 1 and agent.state.handing is None
    dropped = _gen(3, "a", reason="failure")
    assert act.Stop(rescale=True) in agent.on(events.GenerationSeen(dropped))


def test_a_group_that_ends_while_its_join_waits_ends_as_the_new_generation() -> None:
    """Saved for a rescale (another node went ahead and its request reached every rank), the join goes ahead; a
    failure or the job's last step is the generation the coordinator runs now, the newcomers untrained in it."""
    saved, gen = _warming_join()
    assert saved.on(events.GroupExited(GroupResult(1, {0: RESCALE_EXIT_CODE, 1: RESCALE_EXIT_CODE}))) == [
        act.Stop(rescale=True),
        act.Start(gen, PORT),
    ]
    failed, _ = _warming_join()
    why = "local rank 0 (rank 0) exited with code 1"
    assert failed.on(events.GroupExited(GroupResult(1, {0: 1}), why, alive=1)) == [
        act.Send(act.Report("failure", 2, 1, why)),
        act.Stop(failed=True),
    ]
    done, _ = _warming_join()
    assert done.on(events.GroupExited(GroupResult(1, {0: 0, 1: 0}))) == [
        act.Stop(),
        act.Send(act.Report("success", 2, untrained=True)),
    ]


def test_the_jobs_end_lets_workers_finish_then_sigterms_and_exits_once_they_are_gone() -> None:
    agent = Agent(instant_stops=False, finish_grace_s=10.0)
    agent.on(events.GenerationSeen(_gen(1, "a")))
    assert agent.on(events.JobFinished(JobState.SUCCEEDED, "done")) == [act.Stop(finish=True)]  # Exit(0) waits
    assert agent.state.lifecycle is AgentState.SUCCEEDED
    assert _tick(agent, 10.0) == [act.Escalate(core.StopStage.TERM)]  # escalated in a final phase
    assert agent.on(events.GroupStopped(1), after=0.1) == [act.Exit(0, "done")]


def test_decisions_made_while_a_group_stops_wait_for_it_and_a_newer_generation_replaces_the_planned() -> None:
    agent = Agent(instant_stops=False)
    agent.on(events.GenerationSeen(_gen(1, "a")))
    agent.on(events.GenerationSeen(_gen(2, "b", "a")))  # stopping group 1; group 2 planned
    newer = agent.on(events.GenerationSeen(_gen(3, "a", "b")))  # node rank 0 now: the store opens at once
    assert newer == [act.Prepare(_gen(3, "a", "b"))]  # no second stop: group 2 never started
    assert agent.state.stopping is not None and agent.state.stopping.then == (act.Start(_gen(3, "a", "b"), PORT),)
    leaving = agent.on(events.SignalReceived(signal.SIGTERM))
    assert leaving == []  # leave and exit wait for the stop too; the planned group never starts
    assert agent.on(events.GroupStopped(1)) == [act.Leave(), act.Exit(143)]


def test_a_group_starts_once_its_store_port_is_read_and_a_port_never_read_fails_the_start() -> None:
    agent = Agent(instant_ports=False)
    gen = _gen(1, "b", "a")
    assert agent.on(events.GenerationSeen(gen)) == [act.ReadStorePort(gen)]
    assert agent.state.lifecycle is AgentState.RUNNING and core.wants_port(agent.state, 1)
    assert agent.on(events.StorePortRead(1, PORT)) == [act.Start(gen, PORT)]
    assert not core.wants_port(agent.state, 1)
    assert agent.on(events.StorePortRead(1, PORT)) == [], "a second answer changes nothing"
    second = _gen(2, "b", "a")
    agent.on(events.GenerationSeen(second))
    failed = agent.on(events.StorePortRead(2, 0, "node rank 0 did not publish it"))
    assert agent.kinds(failed) == ["Stop", "Send"]
    report = failed[1].report  # type: ignore[union-attr]
    assert report.cause is FailureCause.START_FAILED and "did not publish" in report.message
    assert agent.state.lifecycle is AgentState.WAITING and agent.state.group is None


def test_a_port_read_for_a_superseded_generation_is_ignored() -> None:
    agent = Agent(instant_ports=False)
    agent.on(events.GenerationSeen(_gen(1, "b", "a")))
    agent.on(events.GenerationSeen(_gen(2, "b")))  # a world without this node: the planned group is dropped
    assert not core.wants_port(agent.state, 1)
    assert agent.on(events.StorePortRead(1, PORT)) == []
    assert agent.on(events.StorePortRead(1, 0, "superseded")) == []
    assert agent.state.lifecycle is AgentState.WAITING


def test_a_hand_over_in_place_waits_for_its_store_port() -> None:
    agent = Agent(rescale_in_place=True, instant_ports=False)
    first = _gen(1, "b", "a")
    agent.on(events.GenerationSeen(first))
    agent.on(events.StorePortRead(1, PORT))
    _ready(agent)
    second = _gen(2, "b", "a")
    assert agent.on(events.GenerationSeen(second)) == [act.ReadStorePort(second)]
    assert agent.state.handing is not None and agent.state.handing.port is None
    assert agent.on(events.Tick({0: (3, "step"), 1: (3, "step")}, ready=True)) == [], "nothing to read yet"
    assert agent.on(events.StorePortRead(2, PORT)) == [act.Reconfigure(second, PORT)]
    assert agent.state.handing is None and agent.state.group.number == 2
