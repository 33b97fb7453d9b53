"""The env contract: one dataclass builds and parses every variable a worker gets."""

from __future__ import annotations

import pytest

from pliant.env import WorkerEnv
from pliant.errors import ConfigError


def test_round_trip() -> None:
    env = WorkerEnv(
        rank=5,
        local_rank=1,
        world_size=6,
        local_world_size=2,
        node_rank=2,
        num_nodes=3,
        master_addr="10.0.0.1",
        master_port=29500,
        job_id="job",
        generation=4,
        max_restarts=3,
        node_id="n2",
        agent_store="10.0.0.3:4000",
        checkpoint_dir="/ckpt",
        incarnation="u1",
        checkpoint_key="ab" * 32,
        progress_file="/tmp/p",
        allow_fresh_start=True,
        snapshot_every=16,
    )
    variables = env.to_env()
    assert variables["RANK"] == "5" and variables["GROUP_RANK"] == "2" and variables["GROUP_WORLD_SIZE"] == "3"
    assert variables["TORCHELASTIC_RESTART_COUNT"] == "3", "restart count is generation - 1"
    assert variables["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert variables["TORCHELASTIC_RUN_ID"] == "job"
    assert all(isinstance(v, str) for v in variables.values())
    assert WorkerEnv.from_env(variables) == env


def test_under_torchrun_without_pliant_variables() -> None:
    torchrun = {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "29400",
        "TORCHELASTIC_RUN_ID": "rdzv",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "5",
    }
    env = WorkerEnv.from_env(torchrun)
    assert (env.rank, env.world_size, env.num_nodes, env.job_id, env.generation) == (1, 4, 2, "rdzv", 3)
    assert env.agent_store == "" and env.max_restarts == 5


def test_a_single_process_needs_no_variables() -> None:
    env = WorkerEnv.from_env({})
    assert (env.rank, env.world_size, env.local_rank, env.generation) == (0, 1, 0, 1)
    assert env.snapshot_every is None  # automatic: from the snapshots' measured cost


def test_the_automatic_snapshot_interval_round_trips() -> None:
    env = WorkerEnv()
    assert env.to_env()["PLIANT_SNAPSHOT_EVERY"] == "auto"
    assert WorkerEnv.from_env(env.to_env()) == env


@pytest.mark.parametrize(
    ("variables", "needle"),
    [
        ({"RANK": "x"}, "RANK='x' is not an integer"),
        ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK=4 is outside WORLD_SIZE=4"),
        ({"WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=2 is outside"),
        ({"PLIANT_SNAPSHOT_EVERY": "0"}, "PLIANT_SNAPSHOT_EVERY=0 must be 'auto' or at least 1"),
        ({"PLIANT_SNAPSHOT_EVERY": "often"}, "PLIANT_SNAPSHOT_EVERY 'often' must be 'auto' or a whole number"),
    ],
)
def test_bad_values_are_named(variables: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        WorkerEnv.from_env(variables)


def test_progress_files(tmp_path) -> None:
    from pliant.progress import ProgressFile, read_progress, read_record

    path = str(tmp_path / "rank-0")
    assert read_progress(path) is None
    progress = ProgressFile(path)
    progress.write(0, "start")
    assert read_progress(path) == (0, "start")
    progress.write(12345, "step", 3)  # a step names the generation it completed in
    assert read_progress(path) == (12345, "step") and read_record(path) == (12345, "step", 3)
    with progress.saving():
        assert read_progress(path) == (12345, "save")
    assert read_record(path) == (12345, "step", 3)
    progress.write(12346, "wait", 7)  # a failure names the generation it happened in
    assert read_progress(path) == (12346, "wait") and read_record(path) == (12346, "wait", 7)
    progress.write(12346, "wait", 8)  # waiting again, in the generation handed since (its ranks did not all meet)
    assert read_record(path) == (12346, "wait", 8)
    progress.close()
    ProgressFile("").write(1, "step")  # no agent watches: a no-op


def test_a_checkpoint_key_that_is_not_one_is_refused_with_its_variable() -> None:
    with pytest.raises(ConfigError, match="PLIANT_CHECKPOINT_KEY must be 64 hex digits"):
        WorkerEnv.from_env({"PLIANT_CHECKPOINT_KEY": "not-hex"})
