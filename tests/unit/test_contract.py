"""The coordinator contract: spec validation messages, JSON round trips, and the error <-> status-code table."""

from __future__ import annotations

import grpc
import pytest

from pliant.coordinator.contract import (
    AlreadyExists,
    CoordinatorError,
    FailedPrecondition,
    Generation,
    InvalidArgument,
    JobFinished,
    JobSpec,
    JobState,
    JobStatus,
    Member,
    NotFound,
    Outcome,
    Unavailable,
    error_for_status,
    status_for_error,
    validate_address,
    validate_id,
)
from pliant.coordinator.convert import generation_from_pb, generation_to_pb, spec_from_pb, spec_to_pb
from pliant.coordinator.planner import assign_ranks


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"min_nodes": 3, "max_nodes": 2}, "min_nodes=3 is greater than max_nodes=2"),
        ({"min_nodes": 0}, "min_nodes=0 must be an integer >= 1"),
        ({"max_nodes": 0}, "max_nodes=0 must be an integer >= 1"),
        ({"nproc_per_node": 0}, "nproc_per_node=0"),
        ({"max_restarts": -1}, "max_restarts=-1"),
        ({"heartbeat_ttl_s": 1}, "heartbeat_ttl_s=1 must be between 2 and 3600"),
        ({"join_grace_s": -1}, "join_grace_s=-1"),
        ({"min_nodes_timeout_s": 0}, "min_nodes_timeout_s=0"),
    ],
)
def test_spec_rejects_bad_values_naming_them(kwargs: dict, needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle):
        JobSpec("job", **kwargs)


@pytest.mark.parametrize("bad", ["", "-x", "a/b", "a b", "x" * 129, "ü"])
def test_ids_are_validated(bad: str) -> None:
    with pytest.raises(InvalidArgument, match="job_id"):
        validate_id(bad, "job_id")


@pytest.mark.parametrize("bad", ["", "host", "host:", ":80", "host:0", "host:70000", "host:http"])
def test_addresses_are_validated(bad: str) -> None:
    with pytest.raises(InvalidArgument, match="HOST:PORT"):
        validate_address(bad)
    assert validate_address("10.0.0.5:29500") == "10.0.0.5:29500"


def test_json_round_trips() -> None:
    spec = JobSpec("job", 1, 3, 2, 4.0, 0.5, 7, 30.0)
    assert JobSpec.from_json(spec.to_json()) == spec
    for status in (JobStatus(JobState.FAILED, 12.5, "why", Outcome.FAILED), JobStatus(JobState.RUNNING, 1.0)):
        assert JobStatus.from_json(status.to_json()) == status
    member = Member("n", "h:1", 2, 3.0, order=9, lease_id=11)
    assert Member.from_json(member.to_json(), order=9) == member
    gen = Generation(
        "job",
        4,
        assign_ranks(spec, [member]),
        "join",
        1,
        5.0,
        refused=((4, "ValueError: no"),),
        excluded=(("m", 4, "RuntimeError: x"),),
    )
    assert Generation.from_json(gen.to_json()) == gen
    assert generation_from_pb(generation_to_pb(gen)) == gen  # what agents are told of refusals and exclusions


def test_spec_differences_name_fields() -> None:
    assert JobSpec("j", 1, 2).differences(JobSpec("j", 1, 3)) == ["max_nodes: 2 != 3"]


def test_proto_conversions_round_trip() -> None:
    spec = JobSpec("job", 2, 4, 8, 3.0, 0.0, 5, 90.0)
    assert spec_from_pb(spec_to_pb(spec)) == spec  # join_grace_s=0 survives (optional field)
    gen = Generation("job", 3, assign_ranks(spec, [Member("a", "h:1"), Member("b", "h:2", 2)]), "leave", 1, 9.0)
    assert generation_from_pb(generation_to_pb(gen)) == gen


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
        (NotFound, grpc.StatusCode.NOT_FOUND),
        (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
        (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
        (Unavailable, grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_errors_map_to_status_codes_and_back(error: type[CoordinatorError], code: grpc.StatusCode) -> None:
    assert status_for_error(error("x")) == code
    back = error_for_status(code, "msg")
    assert type(back) is error
    assert str(back) == "msg"


def test_a_finished_job_travels_as_failed_precondition_and_comes_back_with_its_state() -> None:
    """A late node learns how the job ended (its exit code follows it), also when the refusal is quoted in another
    message (the bootstrap join's)."""
    sent = JobFinished("job-1", JobState.SUCCEEDED, "every worker exited 0 (a) rank (1)")
    assert status_for_error(sent) == grpc.StatusCode.FAILED_PRECONDITION
    back = error_for_status(grpc.StatusCode.FAILED_PRECONDITION, str(sent))
    assert isinstance(back, JobFinished) and isinstance(back, FailedPrecondition)
    assert (back.job, back.state, str(back)) == ("job-1", JobState.SUCCEEDED, str(sent))
    quoted = JobFinished.parse(f"bootstrap join at h:1 refused: {JobFinished('j', JobState.FAILED)}")
    assert quoted is not None and (quoted.job, quoted.state) == ("j", JobState.FAILED)
    assert type(error_for_status(grpc.StatusCode.FAILED_PRECONDITION, "another")) is FailedPrecondition


def test_unknown_codes_become_the_base_error() -> None:
    assert status_for_error(CoordinatorError("x")) == grpc.StatusCode.INTERNAL
    assert type(error_for_status(grpc.StatusCode.INTERNAL, "boom")) is CoordinatorError
    assert isinstance(error_for_status(grpc.StatusCode.DEADLINE_EXCEEDED, ""), Unavailable)
