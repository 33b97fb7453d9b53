"""Conversions between the coordinator's domain dataclasses and the pliant.v1 protobuf messages (both directions)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from pliant.coordinator.contract import (
    FailureCause,
    Generation,
    GenerationMember,
    JobInfo,
    JobSpec,
    JobState,
    JobStatus,
    Member,
    MemberProgress,
    Outcome,
)
from pliant.coordinator.seats import SeatAnswer
from pliant.v1 import coordinator_pb2 as pb

__all__ = [
    "cause_from_pb",
    "cause_to_pb",
    "generation_from_pb",
    "generation_to_pb",
    "goodput_from_pb",
    "goodput_to_pb",
    "job_info_from_pb",
    "job_info_to_pb",
    "outcome_from_pb",
    "outcome_to_pb",
    "spec_from_pb",
    "spec_to_pb",
    "state_from_pb",
    "state_to_pb",
    "without_addresses",
]

_STATE_TO_PB = {
    JobState.WAITING: pb.JOB_STATE_WAITING,
    JobState.RUNNING: pb.JOB_STATE_RUNNING,
    JobState.SUCCEEDED: pb.JOB_STATE_SUCCEEDED,
    JobState.FAILED: pb.JOB_STATE_FAILED,
}
_STATE_FROM_PB = {v: k for k, v in _STATE_TO_PB.items()}


_CAUSE_TO_PB = {
    FailureCause.EXITED: pb.FAILURE_CAUSE_EXITED,
    FailureCause.HUNG: pb.FAILURE_CAUSE_HUNG,
    FailureCause.WAITING: pb.FAILURE_CAUSE_WAITING,
    FailureCause.NOT_ARRIVED: pb.FAILURE_CAUSE_NOT_ARRIVED,
    FailureCause.START_FAILED: pb.FAILURE_CAUSE_START_FAILED,
    FailureCause.FENCED: pb.FAILURE_CAUSE_FENCED,
}
_CAUSE_FROM_PB = {v: k for k, v in _CAUSE_TO_PB.items()}


def cause_to_pb(cause: FailureCause) -> int:
    return _CAUSE_TO_PB[cause]


def cause_from_pb(value: int, exit_code: int) -> FailureCause:
    """A report's cause; an agent that sends none (``FAILURE_CAUSE_UNSPECIFIED``) meant it by its exit code."""
    cause = _CAUSE_FROM_PB.get(value)
    return cause if cause is not None else FailureCause.of_legacy_code(exit_code)


def state_to_pb(state: JobState) -> int:
    return _STATE_TO_PB[state]


def state_from_pb(value: int) -> JobState:
    return _STATE_FROM_PB.get(value, JobState.WAITING)


def spec_to_pb(spec: JobSpec) -> pb.JobSpec:
    return pb.JobSpec(
        job_id=spec.job_id,
        min_nodes=spec.min_nodes,
        max_nodes=spec.max_nodes,
        nproc_per_node=spec.nproc_per_node,
        heartbeat_ttl_s=spec.heartbeat_ttl_s,
        join_grace_s=spec.join_grace_s,
        max_restarts=spec.max_restarts,
        min_nodes_timeout_s=spec.min_nodes_timeout_s,
        node_group=spec.node_group,
    )


def spec_from_pb(msg: pb.JobSpec) -> JobSpec:
    """Build a validated spec; unset durations take the defaults (proto3 cannot tell 0 from unset).

    Raises:
        InvalidArgument: a field is out of range.
    """
    defaults = JobSpec("defaults")
    return JobSpec(
        job_id=msg.job_id,
        min_nodes=msg.min_nodes,
        max_nodes=msg.max_nodes,
        nproc_per_node=msg.nproc_per_node,
        heartbeat_ttl_s=msg.heartbeat_ttl_s or defaults.heartbeat_ttl_s,
        join_grace_s=msg.join_grace_s if msg.HasField("join_grace_s") else defaults.join_grace_s,
        max_restarts=msg.max_restarts,
        min_nodes_timeout_s=msg.min_nodes_timeout_s or defaults.min_nodes_timeout_s,
        node_group=msg.node_group or defaults.node_group,
    )


def generation_to_pb(gen: Generation) -> pb.Generation:
    return pb.Generation(
        job_id=gen.job_id,
        number=gen.number,
        members=[
            pb.GenerationMember(
                node_id=m.node_id, node_rank=m.node_rank, rank_offset=m.rank_offset, nproc=m.nproc, address=m.address
            )
            for m in gen.members
        ],
        world_size=gen.world_size,
        store_address=gen.store_address,
        reason=gen.reason,
        restarts_used=gen.restarts_used,
        created_at=gen.created_at,
        incarnation=gen.incarnation,
        warrant=gen.warrant,
        refused=[pb.RefusedWorld(world_size=size, error=error) for size, error in gen.refused],
        excluded=[pb.Exclusion(node_id=node, failures=count, error=error) for node, count, error in gen.excluded],
    )


def generation_from_pb(msg: pb.Generation) -> Generation:
    members = tuple(GenerationMember(m.node_id, m.node_rank, m.rank_offset, m.nproc, m.address) for m in msg.members)
    return Generation(
        msg.job_id,
        msg.number,
        members,
        msg.reason,
        msg.restarts_used,
        msg.created_at,
        msg.incarnation,
        warrant=msg.warrant,
        refused=tuple((r.world_size, r.error) for r in msg.refused),
        excluded=tuple((e.node_id, e.failures, e.error) for e in msg.excluded),
    )


def _member_to_pb(m: Member, progress: MemberProgress) -> pb.Member:
    return pb.Member(
        node_id=m.node_id,
        address=m.address,
        slots=m.slots,
        joined_at=m.joined_at,
        heartbeat_age_s=progress.heartbeat_age_s,
        step=progress.step,
        step_at=progress.step_at,
        strikes=progress.strikes,
        goodput=goodput_to_pb(progress.goodput),
    )


def goodput_to_pb(seconds: Mapping[str, float]) -> pb.Goodput:
    """A node's seconds by what they went to (``productive`` and the badput causes) as the wire's ``Goodput``."""
    return pb.Goodput(
        productive_s=seconds.get("productive", 0.0),
        badput_s={cause: spent for cause, spent in seconds.items() if cause != "productive"},
    )


GOODPUT_CAUSES_MAX = 16
"""The most badput causes a node's report may carry (the agents send six); a report with more is dropped whole."""
_CAUSE = re.compile(r"[a-z_]{1,32}")


def goodput_from_pb(msg: pb.Goodput) -> dict[str, float]:
    """The wire's ``Goodput`` as seconds by what they went to; empty when the node reported none, or reported more
    than :data:`GOODPUT_CAUSES_MAX` causes (a record a caller could otherwise grow without bound in etcd). A cause
    that is not a short lower-case name, and seconds that are not finite and >= 0, are left out."""
    if (not msg.productive_s and not msg.badput_s) or len(msg.badput_s) > GOODPUT_CAUSES_MAX:
        return {}
    seconds = {"productive": msg.productive_s, **dict(msg.badput_s.items())}
    return {k: v for k, v in seconds.items() if _CAUSE.fullmatch(k) and math.isfinite(v) and v >= 0}


def outcome_to_pb(outcome: Outcome | None) -> str:
    return outcome.value if outcome is not None else ""


def outcome_from_pb(text: str) -> Outcome | None:
    """The outcome a message names (None: none, or one this version does not know)."""
    try:
        return Outcome(text) if text else None
    except ValueError:
        return None


def job_info_to_pb(info: JobInfo) -> pb.JobStatus:
    msg = pb.JobStatus(
        spec=spec_to_pb(info.spec),
        state=state_to_pb(info.status.state),
        reason=info.status.reason,
        state_since=info.status.since,
        outcome=outcome_to_pb(info.status.outcome),
        members=[_member_to_pb(m, info.progress.get(m.node_id, MemberProgress())) for m in info.members],
    )
    if info.generation is not None:
        msg.generation.CopyFrom(generation_to_pb(info.generation))
    return msg


def job_info_from_pb(msg: pb.JobStatus) -> JobInfo:
    return JobInfo(
        spec=spec_from_pb(msg.spec),
        status=JobStatus(state_from_pb(msg.state), msg.state_since, msg.reason, outcome_from_pb(msg.outcome)),
        generation=generation_from_pb(msg.generation) if msg.HasField("generation") else None,
        members=tuple(Member(m.node_id, m.address, m.slots, m.joined_at) for m in msg.members),
        progress={
            m.node_id: MemberProgress(m.heartbeat_age_s, m.step, m.step_at, m.strikes, goodput_from_pb(m.goodput))
            for m in msg.members
        },
    )


def without_addresses(msg: pb.JobStatus) -> pb.JobStatus:
    """A copy of ``msg`` with every node address removed (what a non-admin caller may see of a job)."""
    out = pb.JobStatus()
    out.CopyFrom(msg)
    for member in out.members:
        member.address = ""
    if out.HasField("generation"):
        for member in out.generation.members:
            member.address = ""
        out.generation.store_address = ""
    return out


def seat_answer_to_pb(answer: SeatAnswer) -> pb.ClaimSeatResponse:
    return pb.ClaimSeatResponse(
        granted=answer.granted,
        reason=answer.reason,
        initial_cluster=answer.initial_cluster,
        member_name=answer.member_name,
        etcd_endpoints=list(answer.etcd_endpoints),
        ca_cert_pem=answer.ca_cert_pem,
        ca_key_pem=answer.ca_key_pem,
        etcd_ca_cert_pem=answer.etcd_ca_cert_pem,
        etcd_ca_key_pem=answer.etcd_ca_key_pem,
        seal_root=answer.seal_root,
        leader_ttl_s=answer.leader_ttl_s,
        seat_proof=answer.seat_proof,
    )


def seat_answer_from_pb(msg: pb.ClaimSeatResponse) -> SeatAnswer:
    return SeatAnswer(
        granted=msg.granted,
        reason=msg.reason,
        initial_cluster=msg.initial_cluster,
        member_name=msg.member_name,
        etcd_endpoints=tuple(msg.etcd_endpoints),
        ca_cert_pem=msg.ca_cert_pem,
        ca_key_pem=msg.ca_key_pem,
        etcd_ca_cert_pem=msg.etcd_ca_cert_pem,
        etcd_ca_key_pem=msg.etcd_ca_key_pem,
        seal_root=msg.seal_root,
        leader_ttl_s=msg.leader_ttl_s,
        seat_proof=msg.seat_proof,
    )
