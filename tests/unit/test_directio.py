"""Checkpoint files written around the page cache (pliant.worker.directio), on this machine's disk (tmp_path): the
bytes are exactly what was written, O_DIRECT is really in use where the file system takes it, DCP's files are
byte-identical to its own writer's and load back, and a file system that refuses O_DIRECT gets a buffered file."""

from __future__ import annotations

import errno
import logging
import os
import random
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from pliant.worker import directio
from pliant.worker.directio import ALIGN, CHUNK, DirectFileSystem, DirectStream, DirectWriter

pytestmark = pytest.mark.timeout(60)


def _flags(fd: int) -> int:
    """The open flags of one of this process's descriptors, as the kernel reports them."""
    for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
        if line.startswith("flags:"):
            return int(line.split()[1], 8)
    raise AssertionError(f"no flags for descriptor {fd}")


def _pieces(seed: int) -> list[bytes]:
    rng = random.Random(seed)
    sizes = [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, 3, CHUNK - 5, 11, CHUNK, 2 * CHUNK + 7, rng.randrange(1, 10_000)]
    return [rng.randbytes(n) for n in sizes]


def test_a_stream_writes_exactly_its_bytes_through_o_direct(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    pieces = _pieces(1)
    with DirectFileSystem().create_stream(path, "wb") as stream:
        assert isinstance(stream, DirectStream)
        assert _flags(stream.fileno()) & os.O_DIRECT, "the file system of tmp_path takes O_DIRECT on this machine"
        written = 0
        for piece in pieces:
            assert stream.write(memoryview(piece)) == len(piece)
            written += len(piece)
            stream.flush()  # as DCP does after every item: nothing is lost or doubled by it
            assert stream.tell() == written
    assert path.read_bytes() == b"".join(pieces)
    assert stream.closed


def test_two_streams_open_on_one_thread_keep_their_own_bytes(tmp_path: Path) -> None:
    a, b = _pieces(2), _pieces(3)
    with (
        DirectFileSystem().create_stream(tmp_path / "a", "wb") as sa,
        DirectFileSystem().create_stream(tmp_path / "b", "wb") as sb,
    ):
        for x, y in zip(a, b, strict=True):
            sa.write(x)
            sb.write(y)
    assert (tmp_path / "a").read_bytes() == b"".join(a)
    assert (tmp_path / "b").read_bytes() == b"".join(b)


def _state() -> dict:
    torch.manual_seed(0)
    return {
        "w": torch.randn(1_000_003),
        "ids": torch.arange(7, dtype=torch.int16),
        "nested": {"m": torch.randn(100, 33), "step": 5, "name": "x"},
    }


def _save_and_load(writer: dcp.FileSystemWriter, path: Path) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP's single-process notice
        dcp.save(_state(), storage_writer=writer, no_dist=True)
        out = {
            "w": torch.zeros(1_000_003),
            "ids": torch.zeros(7, dtype=torch.int16),
            "nested": {"m": torch.zeros(100, 33), "step": 0, "name": ""},
        }
        dcp.load(out, checkpoint_id=str(path), no_dist=True)
    return out


def test_a_dcp_checkpoint_is_byte_identical_to_dcp_s_own_writer_s_and_loads_back(tmp_path: Path) -> None:
    out = _save_and_load(DirectWriter(tmp_path / "direct"), tmp_path / "direct")
    _save_and_load(dcp.FileSystemWriter(tmp_path / "plain"), tmp_path / "plain")
    data = sorted(p.name for p in (tmp_path / "plain").glob("*.distcp"))
    assert data and data == sorted(p.name for p in (tmp_path / "direct").glob("*.distcp"))
    for name in data:
        assert (tmp_path / "direct" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()
    want = _state()
    assert torch.equal(out["w"], want["w"]) and torch.equal(out["ids"], want["ids"])
    assert torch.equal(out["nested"]["m"], want["nested"]["m"])
    assert (out["nested"]["step"], out["nested"]["name"]) == (5, "x")


def test_a_file_system_that_refuses_o_direct_at_open_gets_a_buffered_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_open = os.open

    def refusing(path: str, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing)
    monkeypatch.setattr(directio, "_told", set())
    caplog.set_level(logging.INFO, logger=directio.__name__)
    out = _save_and_load(DirectWriter(tmp_path / "ckpt"), tmp_path / "ckpt")
    assert torch.equal(out["w"], _state()["w"])
    assert "written through the page cache: its file system refused O_DIRECT" in caplog.text


def test_a_refused_o_direct_write_goes_on_buffered_in_the_same_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_pwrite = os.pwrite

    def refusing(fd: int, data: memoryview, offset: int) -> int:
        if _flags(fd) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refusing)
    monkeypatch.setattr(directio, "_told", set())
    caplog.set_level(logging.INFO, logger=directio.__name__)
    pieces = _pieces(4)
    with DirectFileSystem().create_stream(tmp_path / "f.bin", "wb") as stream:
        for piece in pieces:
            stream.write(piece)
    assert (tmp_path / "f.bin").read_bytes() == b"".join(pieces)
    assert "refused an O_DIRECT write" in caplog.text


def test_a_write_error_other_than_a_refusal_is_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, data: memoryview, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with (
        pytest.raises(OSError, match="No space left"),
        DirectFileSystem().create_stream(tmp_path / "f.bin", "wb") as stream,
    ):
        stream.write(b"x" * (CHUNK + 1))
