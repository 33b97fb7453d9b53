"""A failure report says what happened as a typed cause (pliant.coordinator.contract.FailureCause), on the wire and in
etcd, never as a negative exit code: a worker killed by SIGINT (exit -2) is a worker's exit, not a rank waiting in
place, and reports from agents that send no cause, or records stored before causes, are still read as they meant."""

from __future__ import annotations

import json

import pytest

from pliant.coordinator.contract import FailureCause, FailureReport
from pliant.coordinator.convert import cause_from_pb, cause_to_pb
from pliant.v1 import coordinator_pb2 as pb


@pytest.mark.parametrize("cause", list(FailureCause))
def test_every_cause_crosses_the_wire_and_etcd_unchanged(cause: FailureCause) -> None:
    assert cause_from_pb(cause_to_pb(cause), exit_code=-2) is cause
    report = FailureReport("a", 3, -2, "boom", 1.5, ("b",), True, cause)
    assert FailureReport.from_json(report.to_json()) == report


def test_a_worker_killed_by_a_signal_is_an_exit_whatever_its_code() -> None:
    for code in (-1, -2, -3, -9):
        assert cause_from_pb(pb.FAILURE_CAUSE_EXITED, code) is FailureCause.EXITED


def test_an_agent_that_sends_no_cause_and_an_old_record_are_read_by_their_exit_code() -> None:
    legacy = {-1: FailureCause.HUNG, -2: FailureCause.WAITING, -3: FailureCause.FENCED, 1: FailureCause.EXITED}
    for code, cause in legacy.items():
        assert cause_from_pb(pb.FAILURE_CAUSE_UNSPECIFIED, code) is cause
        stored = json.dumps({"node_id": "a", "generation": 3, "exit_code": code, "message": "", "unreachable": []})
        assert FailureReport.from_json(stored).cause is cause
