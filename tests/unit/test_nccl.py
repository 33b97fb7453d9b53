"""The CPU-checkable parts of NCCL's handling under the in-place protocol (pliant.worker.inplace.nccl); the step guard's
abort of a communicator runs in tests/integration/test_in_place_nccl.py where a GPU exists."""

from __future__ import annotations

import os

import pytest

from pliant.worker.contract import WorkerError
from pliant.worker.inplace import nccl


def test_nccl_under_an_agent_also_gets_gloo_for_the_protocols_cpu_tensors() -> None:
    assert nccl.backend_for("nccl", under_agent=True) == "cpu:gloo,cuda:nccl"
    assert nccl.backend_for("nccl", under_agent=False) == "nccl"  # torchrun or a plain process: as the user asked
    assert nccl.backend_for("gloo", under_agent=True) == "gloo"


def test_in_place_turns_off_torchs_teardown_on_nccl_errors_unless_the_user_chose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_DUMP_ON_TIMEOUT"):
        monkeypatch.setenv(name, "")  # noted, so that what prepare() sets is undone after the test
        monkeypatch.delenv(name)
    nccl.prepare("gloo", in_place_world=True)
    nccl.prepare("nccl", in_place_world=False)
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    nccl.prepare("nccl", in_place_world=True)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1", "a value the user set wins"


def test_without_a_process_group_there_is_no_nccl_to_abort() -> None:
    assert not nccl.has_nccl()
    assert not nccl.abort_nccl()


def test_the_default_is_nccl_when_every_process_has_a_gpu_of_its_own() -> None:
    assert nccl.plan_device(None, 1, 2, 2) == nccl.DevicePlan("nccl", 1)
    assert nccl.plan_device(None, 0, 1, 8) == nccl.DevicePlan("nccl", 0)


def test_more_processes_than_gpus_train_on_the_cpu_and_say_why() -> None:
    plan = nccl.plan_device(None, 1, 2, 1)
    assert (plan.backend, plan.cuda_index) == ("gloo", None)
    assert "2 processes on 1 GPU(s)" in plan.warning and "--nproc-per-node 1" in plan.warning


def test_no_gpu_is_gloo_on_the_cpu_without_a_word() -> None:
    assert nccl.plan_device(None, 0, 2, 0) == nccl.DevicePlan("gloo", None)
    assert nccl.plan_device("gloo", 0, 1, 4) == nccl.DevicePlan("gloo", None)


def test_nccl_asked_for_with_too_few_gpus_is_refused_with_the_fix() -> None:
    with pytest.raises(WorkerError, match=r"4 processes and sees 2 GPU\(s\); run --nproc-per-node 2"):
        nccl.plan_device("nccl", 3, 4, 2)
