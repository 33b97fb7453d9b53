"""`pliant status` rendering: pure functions over JobInfo, time passed in."""

from __future__ import annotations

import json

from pliant.coordinator.contract import (
    Generation,
    GenerationMember,
    JobInfo,
    JobSpec,
    JobState,
    JobStatus,
    Member,
    MemberProgress,
)
from pliant.coordinator.convert import job_info_from_pb, job_info_to_pb
from pliant.coordinator.status import render_json, render_table

NOW = 1_000_000.0


def _job() -> JobInfo:
    spec = JobSpec("train", min_nodes=1, max_nodes=3, nproc_per_node=2)
    members = (
        Member("n0", "10.0.0.1:5000", 2, NOW - 100),
        Member("n1", "10.0.0.2:5000", 2, NOW - 50),
        Member("spare", "10.0.0.3:5000", 2, NOW - 10),
    )
    gen = Generation(
        "train",
        4,
        (GenerationMember("n0", 0, 0, 2, "10.0.0.1:5000"), GenerationMember("n1", 1, 2, 2, "10.0.0.2:5000")),
        "join",
        1,
        NOW - 40,
    )
    progress = {"n0": MemberProgress(1.0, 120, NOW - 3), "n1": MemberProgress(0.0, 118, NOW - 4)}
    return JobInfo(spec, JobStatus(JobState.RUNNING, NOW - 40), gen, members, progress)


def test_table_shows_job_generation_and_members() -> None:
    text = render_table([_job()], NOW)
    lines = text.splitlines()
    assert lines[0] == "job train: running, since 40s ago"
    assert "generation 4 (join), world size 4, nodes 3 (min 1, max 3), restarts used 1" in lines[1]
    assert lines[2].split() == ["NODE", "ADDRESS", "RANKS", "HEARTBEAT", "STEP", "STEP", "SEEN"]
    assert lines[3].split() == ["n0", "10.0.0.1:5000", "0-1", "1s", "ago", "120", "3s", "ago"]
    assert lines[4].split()[:3] == ["n1", "10.0.0.2:5000", "2-3"]
    assert lines[5].split() == ["spare", "10.0.0.3:5000", "spare", "-", "-", "-"]


def test_json_is_stable_for_scripts() -> None:
    data = json.loads(render_json([_job()]))
    (job,) = data["jobs"]
    assert (job["job_id"], job["state"], job["generation"], job["world_size"]) == ("train", "running", 4, 4)
    n0, n1, spare = job["members"]
    assert n0 == {
        "node_id": "n0",
        "address": "10.0.0.1:5000",
        "slots": 2,
        "joined_at": NOW - 100,
        "in_generation": True,
        "node_rank": 0,
        "ranks": [0, 1],
        "heartbeat_age_s": 1.0,
        "step": 120,
        "step_at": NOW - 3,
        "strikes": 0,
        "goodput_s": {},
    }
    assert n1["ranks"] == [2, 3]
    assert spare["in_generation"] is False and spare["heartbeat_age_s"] is None and spare["step"] is None


def test_progress_survives_the_protobuf_round_trip() -> None:
    info = job_info_from_pb(job_info_to_pb(_job()))
    assert info.progress["n0"] == MemberProgress(1.0, 120, NOW - 3)
    assert info.progress["spare"] == MemberProgress()
    struck = _job()
    struck.progress["spare"] = MemberProgress(0.0, 0, 0.0, strikes=3)
    assert job_info_from_pb(job_info_to_pb(struck)).progress["spare"].strikes == 3


def test_a_spare_held_back_for_its_strikes_says_so() -> None:
    job = _job()
    job.progress["spare"] = MemberProgress(0.0, 0, 0.0, strikes=2)
    job.progress["n1"] = MemberProgress(0.0, 118, NOW - 4, strikes=1)  # in the world: nothing to say
    lines = render_table([job], NOW).splitlines()
    assert lines[5].split()[:6] == ["spare", "10.0.0.3:5000", "spare", "(2", "strikes:", "held"]
    assert "strikes" not in lines[4]
    assert json.loads(render_json([job]))["jobs"][0]["members"][2]["strikes"] == 2


def test_the_jobs_goodput_is_its_live_nodes_time_by_what_it_went_to() -> None:
    job = _job()
    assert json.loads(render_json([job]))["jobs"][0]["goodput"] is None  # nobody reported: no line
    assert "goodput" not in render_table([job], NOW)
    job.progress["n0"] = MemberProgress(1.0, 120, NOW - 3, goodput={"productive": 7000.0, "failure": 160.0})
    job.progress["n1"] = MemberProgress(0.0, 118, NOW - 4, goodput={"productive": 6500.0, "rescale": 50.0})
    job.progress["spare"] = MemberProgress(0.0, 0, 0.0, goodput={"waiting": 290.0, "redone": 0.1})
    lines = render_table([job], NOW).splitlines()
    assert lines[2] == (
        "  goodput 96.4% over 3h 53m of node time; badput: waiting 2.1%, failure 1.1%, rescale 0.4% (the live nodes')"
    )
    goodput = json.loads(render_json([job]))["jobs"][0]["goodput"]
    assert goodput["productive_s"] == 13500.0 and goodput["node_seconds"] == 14000.1
    assert goodput["badput_s"] == {"failure": 160.0, "redone": 0.1, "rescale": 50.0, "waiting": 290.0}
    assert job_info_from_pb(job_info_to_pb(job)).progress["n1"].goodput == {"productive": 6500.0, "rescale": 50.0}


def test_a_callers_goodput_report_is_bounded_before_it_is_recorded() -> None:
    """An agent certificate's worst holder reports its own node's goodput: it can make that figure wrong, never grow
    the record without bound."""
    from pliant.coordinator.convert import GOODPUT_CAUSES_MAX, goodput_from_pb
    from pliant.v1 import coordinator_pb2 as pb

    flood = pb.Goodput(productive_s=1.0, badput_s={f"c{i}": 1.0 for i in range(GOODPUT_CAUSES_MAX + 1)})
    assert goodput_from_pb(flood) == {}
    odd = pb.Goodput(
        productive_s=float("nan"), badput_s={"failure": -1.0, "Bad Name": 1.0, "x" * 40: 1.0, "start": 2.0}
    )
    assert goodput_from_pb(odd) == {"start": 2.0}
    assert goodput_from_pb(pb.Goodput()) == {}


def test_no_jobs() -> None:
    assert render_table([], NOW) == "no jobs"
    assert json.loads(render_json([])) == {"jobs": []}


def test_unreadable_jobs_are_listed_with_the_fix() -> None:
    why = "etcd record /pliant/v1/jobs/bad/state cannot be read (KeyError: 'state'); ... (etcdctl del ...)"
    text = render_table([_job()], NOW, {"bad": why})
    assert text.splitlines()[0] == f"job bad: UNREADABLE, skipped by the coordinator: {why}"
    assert "job train: running" in text
    assert render_table([], NOW, {"bad": why}).startswith("job bad: UNREADABLE")
    assert json.loads(render_json([_job()], {"bad": why}))["unreadable"] == {"bad": why}
    assert "unreadable" not in json.loads(render_json([_job()]))
