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


def test_an_in_place_rescale_recuts_the_step_in_flight_and_the_rest_of_the_epoch() -> None:
    """Ranks 0 and 1 of a world of 2 yield step 3, then the world re-forms in place as 3 ranks before running it:
    the step is rewound and cut again for the new world (the same samples), and the running iterations continue from
    the cursor for the new world. Every sample of the epoch is used once by the steps that ran."""
    n = 53
    used: list[int] = []
    loaders = [ElasticLoader(Indices(n), ElasticSampler(n, 12, 5, seed=3), rank, 2, max_steps=5) for rank in range(2)]
    iters = [iter(loader) for loader in loaders]
    for _ in range(3):
        for it in iters:
            used += [int(i) for micro in next(it).micro_batches for i in micro]
    in_flight = [next(it) for it in iters]  # step 3, planned for 2 ranks, never run
    assert {b.step for b in in_flight} == {3} and in_flight[0].plan.world_size == 2
    planned = sorted(int(i) for b in in_flight for micro in b.micro_batches for i in micro)
    newcomer = ElasticLoader(Indices(n), ElasticSampler(n, 12, 5, seed=3), 2, 3, max_steps=5)
    for rank, (loader, batch) in enumerate(zip(loaders, in_flight, strict=True)):
        loader.rewind(batch)
        loader.moved(rank, 3)
        loader.refetch(batch)  # the step in flight, re-cut for 3 ranks, in place
    newcomer.load_position(in_flight[0].plan.epoch, in_flight[0].plan.start, 3)  # what the survivors send
    newcomer_it = iter(newcomer)
    again = [*in_flight, next(newcomer_it)]
    assert [b.plan.world_size for b in again] == [3, 3, 3] and {b.step for b in again} == {3}
    recut = sorted(int(i) for b in again for micro in b.micro_batches for i in micro)
    assert recut == planned, "the same global batch, dealt to the new world"
    used += recut
    for it in [*iters, newcomer_it]:
        batch = next(it)  # step 4: the survivors' iterations re-planned from the cursor
        assert (batch.step, batch.plan.world_size) == (4, 3)
        used += [int(i) for micro in batch.micro_batches for i in micro]
    assert sorted(used) == list(range(n)), "every sample of the epoch once (5 steps of 12, the last of 5)"
