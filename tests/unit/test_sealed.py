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


class _Huge:
    """A pickle of a few dozen bytes whose constructor call would allocate what its writer says."""

    def __init__(self, make: object, arg: object) -> None:
        self.make, self.arg = make, arg

    def __reduce__(self) -> tuple[object, tuple[object]]:
        return self.make, (self.arg,)


@pytest.mark.parametrize(
    "make, arg",
    [(bytearray, 1_500_000_000), (bytes, 1_500_000_000), (list, range(10**9)), (torch.Size, range(10**8))],
)
def test_a_small_pickle_never_builds_a_large_object(make: object, arg: object) -> None:
    """What a holder of the checkpoint key can seal is bounded by its size: a 40-byte pickle builds no 1.5 GB."""
    data = pickle.dumps(_Huge(make, arg), protocol=4)
    assert len(data) < 80
    with pytest.raises(pickle.UnpicklingError, match="goes past what this pickle may build"):
        loads(data)
    assert loads(pickle.dumps(_Huge(bytearray, 1000), protocol=4)) == bytearray(1000), "a small one loads"


def _metadata(tmp_path, offset: int, length: int, name: str = "__0_0.distcp"):  # type: ignore[no-untyped-def]
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    (tmp_path / "__0_0.distcp").write_bytes(b"x" * 100)
    meta = Metadata({}, storage_data={MetadataIndex("w"): _StorageInfo(name, offset, length)})
    (tmp_path / ".metadata").write_bytes(pickle.dumps(meta))


def test_metadata_names_only_ranges_inside_its_own_files(tmp_path) -> None:
    from pliant.worker.sealed import SealedReader

    _metadata(tmp_path, 10, 90)
    assert SealedReader(tmp_path).read_metadata().storage_data  # the whole file: read
    for offset, length, name, needle in (
        (10, 2**40, "__0_0.distcp", "which holds 100"),
        (-1, 5, "__0_0.distcp", "which holds 100"),
        (0, 5, "../../etc/passwd", "names storage file"),
        (0, 5, "missing.distcp", "which is not there"),
    ):
        _metadata(tmp_path, offset, length, name)
        with pytest.raises(WorkerError, match=needle):
            SealedReader(tmp_path).read_metadata()


def test_metadata_past_its_size_bound_is_not_read(tmp_path) -> None:
    from pliant.worker.sealed import MAX_METADATA_BYTES, SealedReader

    with open(tmp_path / ".metadata", "wb") as f:
        f.truncate(MAX_METADATA_BYTES + 1)  # sparse: nothing is written
    with pytest.raises(WorkerError, match="more than checkpoint metadata may"):
        SealedReader(tmp_path).read_metadata()
