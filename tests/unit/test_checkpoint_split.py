"""The split of replicated state between ranks for async checkpoints (pure: no process group)."""

from __future__ import annotations

import pytest
import torch

from pliant.worker.checkpoint import split_replicas

pytestmark = pytest.mark.timeout(30)


def _state() -> dict:
    model = {f"layer{i}.weight": torch.zeros(10 * (i + 1)) for i in range(7)} | {"scale": torch.zeros(3)}
    optim = {"state": {f"layer{i}.weight": {"momentum_buffer": torch.zeros(10 * (i + 1)), "step": torch.tensor(4.0)}
                       for i in range(7)},
             "param_groups": [{"lr": 0.1, "params": [f"layer{i}.weight" for i in range(7)]}]}  # fmt: skip
    return {"model": model, "optim": optim, "zero_shard": {"state": {"own": torch.zeros(5)}}, "epoch": 2}


def _leaves(tree: dict, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], object]:
    out: dict[tuple[str, ...], object] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= _leaves(value, (*path, key))
        else:
            out[(*path, key)] = value
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_each_replicated_tensor_is_kept_by_exactly_one_rank_and_the_rest_by_all(world: int) -> None:
    state = _state()
    full = _leaves(state)
    parts = [_leaves(split_replicas(state, ("model", "optim"), rank, world)) for rank in range(world)]
    replicated = {p for p, v in full.items() if p[0] in ("model", "optim") and isinstance(v, torch.Tensor)}
    for path, value in full.items():
        holders = [rank for rank, part in enumerate(parts) if path in part]
        if path in replicated:
            assert len(holders) == 1, (path, holders)
            assert parts[holders[0]][path] is value, "the tensor itself, not a copy"
        else:  # this rank's own shard, and values that are not tensors (lists, numbers)
            assert holders == list(range(world)), (path, holders)
    loads = [sum(v.numel() * v.element_size() for p, v in part.items() if p in replicated) for part in parts]
    largest = max(full[p].numel() * full[p].element_size() for p in replicated)  # type: ignore[attr-defined]
    assert max(loads) - min(loads) <= largest, loads


def test_every_rank_computes_the_same_split_and_the_input_is_left_whole() -> None:
    first = [sorted(_leaves(split_replicas(_state(), ("model", "optim"), r, 3))) for r in range(3)]
    again = [sorted(_leaves(split_replicas(_state(), ("model", "optim"), r, 3))) for r in range(3)]
    assert first == again
    state = _state()
    split_replicas(state, ("model", "optim"), 1, 3)
    assert _leaves(state).keys() == _leaves(_state()).keys()


def test_no_replicated_sections_keeps_everything() -> None:
    assert _leaves(split_replicas(_state(), (), 0, 4)).keys() == _leaves(_state()).keys()
