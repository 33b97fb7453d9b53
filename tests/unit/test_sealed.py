"""Checkpoints read as data (pliant.worker.sealed): a pickle that would run code is refused, DCP's records load."""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from pliant.worker.contract import WorkerError
from pliant.worker.sealed import DataLoadPlanner, loads


class _Payload:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.path}",)


def test_a_pickle_that_would_run_code_is_refused_and_runs_nothing(tmp_path) -> None:
    sentinel = tmp_path / "ran"
    with pytest.raises(pickle.UnpicklingError, match=r"posix\.system is not data"):
        loads(pickle.dumps(_Payload(str(sentinel))))
    assert not sentinel.exists()
    with pytest.raises(pickle.UnpicklingError, match=r"builtins\.eval is not data"):
        loads(b"cbuiltins\neval\n(S'1'\ntR.")


def test_dcp_records_and_plain_data_load() -> None:
    record = {
        "index": MetadataIndex("train.w", torch.Size([0, 0])),
        "chunk": ChunkStorageMetadata(torch.Size([2]), torch.Size([2])),
        "dtype": torch.float32,
        "layout": torch.strided,
        "error": OSError(28, "full"),
    }
    back = loads(pickle.dumps(record))
    assert back["index"] == record["index"] and back["chunk"] == record["chunk"] and back["dtype"] is torch.float32
    assert back["layout"] is torch.strided and back["error"].errno == 28


def test_a_non_tensor_item_that_is_not_data_is_refused(tmp_path) -> None:
    sentinel = tmp_path / "ran"
    planner = DataLoadPlanner()
    planner.flatten_state_dict, planner.state_dict = False, {}
    item = ReadItem(
        LoadItemType.BYTE_IO,
        MetadataIndex("extras"),
        torch.Size([0]),
        MetadataIndex("extras"),
        torch.Size([0]),
        torch.Size([0]),
    )
    forged = io.BytesIO()
    torch.save(_Payload(str(sentinel)), forged)
    forged.seek(0)
    with pytest.raises(WorkerError, match="checkpoint item extras is not data"):
        planner.load_bytes(item, forged)
    assert not sentinel.exists()
    good = io.BytesIO()
    torch.save({"step": 3, "lr": [0.1]}, good)
    good.seek(0)
    planner.load_bytes(item, good)
    assert planner.state_dict["extras"] == {"step": 3, "lr": [0.1]}
