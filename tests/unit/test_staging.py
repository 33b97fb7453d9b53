"""How an async checkpoint's state is staged (pure: no process group): the split of the replicated state between
ranks, a save's state taken from a buddy snapshot's host copy, and the write's priority."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex

from pliant.worker.directio import DirectWriter
from pliant.worker.inplace.buddy import BACKGROUND_NICE
from pliant.worker.staging import BackgroundWriter, SnapshotPlanner, from_snapshot, idle_priority, split_replicas

pytestmark = pytest.mark.timeout(30)


def _state() -> dict:
    model = {f"layer{i}.weight": torch.zeros(10 * (i + 1)) for i in range(7)} | {"scale": torch.zeros(3)}
    optim = {
        "state": {
            f"layer{i}.weight": {"momentum_buffer": torch.zeros(10 * (i + 1)), "step": torch.tensor(4.0)}
            for i in range(7)
        },
        "param_groups": [{"lr": 0.1, "params": [f"layer{i}.weight" for i in range(7)]}],
    }
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


def test_a_rank_saves_what_the_engine_says_it_saves_and_the_rest_is_dealt_by_size() -> None:
    state = _state()
    named = {("model", f"layer{i}.weight"): 2 for i in range(7)}  # e.g. ZeRO: the parameters rank 2 owns
    parts = [_leaves(split_replicas(state, ("model",), rank, 3, named)) for rank in range(3)]
    assert all(("model", f"layer{i}.weight") in parts[2] for i in range(7))
    assert ("model", "scale") in parts[0] and ("model", "scale") not in parts[2], "dealt to the least loaded"


def test_a_save_from_a_snapshot_takes_its_views_and_copies_the_rest_at_once() -> None:
    live = {"w": torch.arange(6.0).reshape(2, 3), "m": torch.ones(4), "small": torch.zeros(2)}
    host = torch.zeros(64, dtype=torch.uint8)
    views = {id(live["w"]): host[:24].view(torch.float32).view(2, 3), id(live["m"]): host[32:48].view(torch.float32)}
    state = {
        "train": {"model": {"w": live["w"]}, "optim": {"m": live["m"], "small": live["small"], "lr": [0.1]}},
        "step": 7,
    }
    saved, shards = from_snapshot(state, lambda t: views.get(id(t)))
    assert shards == {}, "no DTensors"
    assert saved["train"]["model"]["w"] is views[id(live["w"])] and saved["train"]["optim"]["m"] is views[id(live["m"])]
    small = saved["train"]["optim"]["small"]
    assert torch.equal(small, live["small"]) and small.data_ptr() != live["small"].data_ptr(), "cloned now"
    live["small"].add_(1)
    state["train"]["optim"]["lr"].append(0.2)  # the training goes on: the save keeps what it saw
    assert saved["train"]["optim"]["lr"] == [0.1] and saved["step"] == 7 and not small.any()


class _Sharded(torch.Tensor):  # stands for a DTensor: what the route looks for is ``to_local``
    def to_local(self) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)


def test_a_dtensor_stays_for_its_layout_and_its_shard_is_written_from_the_snapshot() -> None:
    rows, other = torch.arange(4.0).as_subclass(_Sharded), torch.ones(3).as_subclass(_Sharded)
    copy = torch.full((4,), 9.0)  # the snapshot's host copy of ``rows``' shard
    state = {"train": {"model": {"rows": rows, "other": other}}, "step": 3}
    saved, shards = from_snapshot(state, lambda t: copy if t.data_ptr() == rows.data_ptr() else None)
    assert saved["train"]["model"]["rows"] is rows and saved["train"]["model"]["other"] is other, "their layouts"
    assert shards[id(rows)] is copy
    lacking = shards[id(other)]
    assert torch.equal(lacking, torch.ones(3)) and lacking.data_ptr() != other.data_ptr(), "not in it: copied now"

    # DCP's planner asks for each item's bytes by its flattened name: the copies answer for the DTensors.
    plain = torch.zeros(2)
    planner = SnapshotPlanner(shards)
    planner.set_up_planner({"train": {"model": {"rows": rows, "plain": plain}}, "step": 3}, is_coordinator=True)
    assert planner.lookup_object(MetadataIndex("train.model.rows")) is copy
    assert planner.lookup_object(MetadataIndex("train.model.plain")) is plain


def test_dcps_writer_gets_the_copy_for_each_item_the_plan_holds() -> None:
    live, kept = torch.arange(6.0), torch.ones(2)
    copy = live.clone()
    planner = SnapshotPlanner({id(live): copy})
    planner.set_up_planner({"model": {"w": live, "b": kept}}, is_coordinator=True)
    items = {item.index.fqn: item for item in planner.create_local_plan().items}
    live.add_(1)  # the training goes on
    assert planner.resolve_data(items["model.w"]) is copy and planner.resolve_data(items["model.b"]) is kept


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_an_async_saves_write_runs_on_idle_cpu_time_and_loads_back(tmp_path, monkeypatch) -> None:
    policies: list[int] = []
    write = DirectWriter.write_data

    def recorded(self, plan, planner):
        policies.append(os.sched_getscheduler(threading.get_native_id()))
        return write(self, plan, planner)

    monkeypatch.setattr(DirectWriter, "write_data", recorded)
    state = {"w": torch.arange(1000.0)}
    thread = threading.Thread(
        target=dcp.save, args=(state,), kwargs={"storage_writer": BackgroundWriter(str(tmp_path)), "no_dist": True}
    )
    thread.start()
    thread.join()
    loaded = {"w": torch.zeros(1000)}
    dcp.load(loaded, checkpoint_id=str(tmp_path), no_dist=True)
    assert policies == [os.SCHED_IDLE]
    assert torch.equal(loaded["w"], state["w"])


def test_where_sched_idle_is_refused_the_write_runs_at_nice_10(monkeypatch) -> None:
    def refuse(*_args) -> None:
        raise PermissionError("sched_setscheduler refused")

    monkeypatch.setattr(os, "sched_setscheduler", refuse, raising=False)
    seen: list[int] = []

    def lowered() -> None:
        idle_priority()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    thread = threading.Thread(target=lowered)
    thread.start()
    thread.join()
    assert seen == [BACKGROUND_NICE]
