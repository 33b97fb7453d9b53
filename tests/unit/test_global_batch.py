"""pliant.data: a step's samples are the same at every world size, every sample of a pass is seen once across world
changes and resumes, and the position survives a DataLoader's read-ahead."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch
from torch.utils.data import TensorDataset

from pliant.data import (
    Cursor,
    DataError,
    GlobalBatchLoader,
    GlobalBatchSampler,
    SampleOrder,
    accumulation_for,
    step_ranges,
)

N = 50  # not a multiple of any global batch below: steps cross passes


def _step_samples(order: SampleOrder, position: int, global_batch: int, micro: int, world: int) -> list[list[int]]:
    """Every rank's indices of the step at ``position``, rank by rank."""
    return [
        [
            i
            for start, stop in step_ranges(position, global_batch, micro, world, rank)
            for i in order.indices(start, stop)
        ]
        for rank in range(world)
    ]


def _run(worlds: list[tuple[int, int, int | None]], micro: int = 2) -> dict[int, list[int]]:
    """Train through ``worlds`` ((ranks, steps, fixed global batch or None), one after the other), each world resuming
    from the state the previous one saved at its last step; the samples of each step, all ranks together."""
    trained: dict[int, list[int]] = {}
    state = None
    for world, steps, global_batch in worlds:
        samplers = [
            GlobalBatchSampler(N, micro, global_batch, seed=3, rank=r, world_size=world, step_fn=None)
            for r in range(world)
        ]
        for sampler in samplers:
            if state is not None:
                sampler.load_state_dict(state)
        first = samplers[0].step()
        for step in range(first, first + steps):
            batches = []
            for sampler in samplers:
                sampler.steps_done = step
                batches += [i for batch in _take(sampler, sampler.accumulation) for i in batch]
                sampler.steps_done = step + 1
            trained[step] = batches
        state = samplers[0].state_dict()
    return trained


def _take(sampler: GlobalBatchSampler, count: int) -> list[list[int]]:
    it = iter(sampler)
    return [next(it) for _ in range(count)]


def _passes_once(trained: dict[int, list[int]], seed: int = 3) -> None:
    """Step after step, the samples trained are the stream's next positions, and the stream holds each sample once
    per pass."""
    order, position = SampleOrder(N, seed=seed), 0
    for step in sorted(trained):
        size = len(trained[step])
        assert Counter(trained[step]) == Counter(order.indices(position, position + size)), f"step {step}"
        position += size
    stream = order.indices(0, position)
    for first in range(0, position, N):
        whole = stream[first : first + N]
        assert len(set(whole)) == len(whole), f"the pass at {first} repeats a sample"
    assert position >= 2 * N, "the run covers two passes at least"


def test_a_steps_samples_are_the_same_at_every_world_size() -> None:
    order = SampleOrder(N, seed=1)
    for position in (0, 24, 48, 96):
        static = sorted(_step_samples(order, position, 24, 2, 1)[0])
        for world in (2, 3, 4, 6, 12):
            ranks = _step_samples(order, position, 24, 2, world)
            assert all(len(r) == 24 // world for r in ranks)
            assert sorted(i for r in ranks for i in r) == static


def test_a_fixed_global_batch_through_world_changes_trains_a_static_runs_steps() -> None:
    static = _run([(1, 30, 24)])
    elastic = _run([(1, 4, 24), (2, 5, 24), (3, 7, 24), (4, 6, 24), (6, 4, 24), (2, 4, 24)])
    assert sorted(elastic) == sorted(static) == list(range(30))
    for step in static:
        assert sorted(elastic[step]) == sorted(static[step]), f"step {step} trained other samples"
    _passes_once(elastic)


def test_a_global_batch_that_follows_the_world_sees_every_sample_once() -> None:
    trained = _run([(1, 7, None), (3, 5, None), (2, 9, None), (4, 6, None)])
    _passes_once(trained)
    sizes = [len(trained[s]) for s in sorted(trained)]
    assert sizes == [2] * 7 + [6] * 5 + [4] * 9 + [8] * 6


def test_an_epoch_is_the_steps_that_cover_a_pass_and_an_iteration_ends_with_it() -> None:
    sampler = GlobalBatchSampler(10, 2, 4, shuffle=False, rank=0, world_size=2)
    assert sampler.steps_per_epoch == 3 and len(sampler) == 3
    assert list(sampler) == [[0, 1], [4, 5], [8, 9]]
    sampler.steps_done = 3  # the next epoch starts at position 12: pass 1, offset 2
    assert list(sampler) == [[2, 3], [6, 7], [0, 1]]
    sampler.steps_done = 4  # resumed mid-epoch: the rest of it
    assert list(sampler) == [[6, 7], [0, 1]]
    sampler.from_epoch_start = True  # for a loop that skips the epoch's trained batches itself
    assert list(sampler) == [[2, 3], [6, 7], [0, 1]]


def test_a_world_that_cannot_divide_the_global_batch_is_refused_with_the_numbers() -> None:
    assert accumulation_for(24, 2, 3) == 4
    with pytest.raises(DataError, match=r"global_batch=24 is not a multiple of micro_batch 2 x world size 5 = 10"):
        GlobalBatchSampler(N, 2, 24, rank=0, world_size=5)
    with pytest.raises(DataError, match="micro_batch=0"):
        accumulation_for(24, 0, 1)


def test_a_state_of_another_dataset_or_order_is_refused_and_changes_nothing() -> None:
    saved = GlobalBatchSampler(N, 2, 8, seed=3, rank=0, world_size=1).state_dict()
    other = GlobalBatchSampler(N + 1, 2, 8, seed=3, rank=0, world_size=1)
    with pytest.raises(DataError, match=r"num_samples=50 but this sampler has 51.*same dataset, seed and shuffle"):
        other.load_state_dict(saved)
    assert other.cursor == Cursor(0, 0, 8)
    with pytest.raises(DataError, match="seed=3 but this sampler has 4"):
        GlobalBatchSampler(N, 2, 8, seed=4, rank=0, world_size=1).load_state_dict(saved)
    with pytest.raises(DataError, match=r"not a pliant\.data sampler state"):
        other.load_state_dict({"epoch": 1})
    with pytest.raises(DataError, match="version 7"):
        other.load_state_dict({**saved, "version": 7})


def test_the_loaders_state_is_the_step_the_loop_reached_however_far_its_workers_read() -> None:
    data = TensorDataset(torch.arange(N))
    loader = GlobalBatchLoader(data, 2, 8, seed=5, rank=1, world_size=2, num_workers=2, prefetch_factor=4)
    assert loader.global_batch_sampler.accumulation == 2
    seen = []
    for i, (batch,) in enumerate(loader):
        seen += batch.tolist()
        if i == 5:  # three optimizer steps of two micro-batches each
            break
    state = loader.state_dict()
    assert state["step"] == 3 and state["position"] == 24
    resumed = GlobalBatchLoader(data, 4, 8, seed=5, rank=0, world_size=1)
    resumed.load_state_dict(state)
    order = SampleOrder(N, seed=5)
    (first,) = next(iter(resumed))
    assert first.tolist() == order.indices(24, 28)
    assert Counter(seen) == Counter(
        i for s in range(3) for i in order.indices(8 * s + 2, 8 * s + 4) + order.indices(8 * s + 6, 8 * s + 8)
    )


def test_the_loader_leaves_batching_to_the_sampler() -> None:
    with pytest.raises(DataError, match="drop batch_size, drop_last"):
        GlobalBatchLoader(TensorDataset(torch.arange(4)), 2, batch_size=2, drop_last=True, rank=0, world_size=1)


def test_a_fixed_global_batch_sets_the_frameworks_accumulation_and_says_what_it_replaced(caplog) -> None:
    fixed = GlobalBatchSampler(N, 2, 24, rank=0, world_size=3)
    assert fixed.describe() == "global batch 24 = batch size 2 x accumulation 4 x world 3 (fixed)"
    with caplog.at_level(logging.WARNING, logger="pliant.data"):
        assert fixed.accumulation_for_framework("accumulate_grad_batches", 2) == 4
    assert "accumulate_grad_batches=2 is replaced by 4: global_batch=24 fixes it" in caplog.text
    following = GlobalBatchSampler(N, 2, accumulation=3, rank=0, world_size=2)
    assert following.describe() == "global batch 12 = batch size 2 x accumulation 3 x world 2 (following the world)"
    assert following.accumulation_for_framework("gradient_accumulation_steps", 3) == 3
