"""The elastic loader's cursor: a world-size change mid-epoch (through state_dict) still feeds every sample of the
epoch exactly once. Each rank's loader runs in this process, as each rank's would in its own."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.data import Dataset

from pliant.worker.contract import DataError
from pliant.worker.data import ElasticLoader, ElasticSampler


class Indices(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def run_world(state: dict | None, world: int, steps: int, n: int = 53, workers: int = 0) -> tuple[list[int], dict]:
    """Run ``steps`` global steps on every rank of a world; return the indices seen and the state after."""
    seen: list[int] = []
    states = []
    for rank in range(world):
        sampler = ElasticSampler(n, global_batch=12, micro_batch=5, seed=3)
        if state is not None:
            sampler.load_state_dict(state)
        loader = ElasticLoader(Indices(n), sampler, rank, world, max_steps=sampler.step + steps, num_workers=workers)
        for batch in loader:
            assert batch.num_samples == batch.plan.size
            seen += [int(i) for micro in batch.micro_batches for i in micro]
        states.append(loader.state_dict())
    assert all(s == states[0] for s in states), "every rank ends at the same cursor"
    return seen, states[0]


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "dataloader-workers"])
def test_a_world_change_mid_epoch_sees_every_sample_once(workers: int) -> None:
    # 53 samples, global batch 12: steps of 12, 12, 12, 12, 5. Two steps at world 3, then world 2, then world 4.
    first, state = run_world(None, world=3, steps=2, workers=workers)
    assert state["epoch"] == 0 and state["cursor"] == 24
    second, state = run_world(state, world=2, steps=2, workers=workers)
    third, state = run_world(state, world=4, steps=1, workers=workers)
    assert state["cursor"] == 53
    counts = Counter(first + second + third)
    assert counts == Counter({i: 1 for i in range(53)})


def test_the_next_epoch_has_a_new_order_and_all_samples() -> None:
    first, state = run_world(None, world=2, steps=5)
    second, state = run_world(state, world=2, steps=5)
    assert state["epoch"] == 1
    assert sorted(first) == sorted(second) == list(range(53))
    assert first != second, "a new permutation per epoch"


def test_the_order_is_deterministic_per_seed_and_epoch() -> None:
    a = ElasticSampler(20, 4, 2, seed=9).order(3)
    b = ElasticSampler(20, 4, 2, seed=9).order(3)
    assert torch.equal(a, b)
    assert not torch.equal(a, ElasticSampler(20, 4, 2, seed=9).order(4))


def test_state_of_another_dataset_is_refused() -> None:
    state = ElasticSampler(20, 4, 2, seed=1).state_dict()
    with pytest.raises(DataError, match="num_samples=20 but this loader has 21"):
        ElasticSampler(21, 4, 2, seed=1).load_state_dict(state)


def test_bad_sizes() -> None:
    with pytest.raises(DataError, match="micro_batch=5 is larger than global_batch=4"):
        ElasticSampler(20, 4, 5)
