"""Buddy snapshot buffers kept in node-local files (pliant.worker.inplace.kept) and the agent's snapshot directory
(pliant.agent.snapshots): what a dead worker leaves is what its successor reads back, and nothing half-written or
foreign is ever read."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pliant import scratch
from pliant.agent import snapshots
from pliant.errors import ConfigError
from pliant.worker.inplace import kept as kept_module
from pliant.worker.inplace.kept import KeptError, KeptSlots, SlotHeader

pytestmark = pytest.mark.timeout(30)


def _header(
    own: tuple[str, int] | None, wards: dict[int, tuple[str, int]] | None = None, step: int = 16, generation: int = 5
) -> SlotHeader:
    return SlotHeader(generation, 4, 1, step, (0, 1, 2, 3, 0), own, wards or {})


def test_a_successor_reads_back_what_a_worker_kept(tmp_path: Path) -> None:
    mine = KeptSlots(str(tmp_path))
    own, ward = mine.buffer(4096), mine.buffer(1000)
    own.copy_(torch.arange(4096) % 251)
    ward.fill_(7)
    mine.record(0, _header(mine.name(own), {3: mine.name(ward)}))  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [
            mine.name(own)[0],
            mine.name(ward)[0],  # type: ignore[index]
            "slot-0.json",
        ]
    )
    successor = KeptSlots(str(tmp_path))
    [slot] = successor.load()
    assert slot.header == _header(mine.name(own), {3: mine.name(ward)})  # type: ignore[arg-type]
    assert slot.own is not None and torch.equal(slot.own, own)
    assert torch.equal(slot.wards[3], ward)
    own.fill_(1)  # the same memory: the mapping is shared
    assert torch.equal(slot.own, own)


def test_a_slot_being_rewritten_is_not_offered(tmp_path: Path) -> None:
    mine = KeptSlots(str(tmp_path))
    own = mine.buffer(4096)
    mine.record(0, _header(mine.name(own)))
    mine.record(1, _header(mine.name(own), step=24))
    mine.record(1, None)  # slot 1's buffers are about to change
    assert [s.header.step for s in KeptSlots(str(tmp_path)).load()] == [16]


def test_only_the_newest_world_is_offered(tmp_path: Path) -> None:
    mine = KeptSlots(str(tmp_path))
    own = mine.buffer(64)
    mine.record(0, _header(mine.name(own), generation=4))
    mine.record(1, _header(mine.name(own), step=24, generation=5))
    assert [(s.header.generation, s.header.step) for s in KeptSlots(str(tmp_path)).load()] == [(5, 24)]


def test_an_unreadable_header_is_skipped_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mine = KeptSlots(str(tmp_path))
    own = mine.buffer(4096)
    (tmp_path / "slot-0.json").write_text("{not json")
    (tmp_path / "slot-1.json").write_text(_header(("gone.bin", 4096)).to_json())  # its file is missing
    (tmp_path / "slot-2.json").write_text(_header((mine.name(own)[0], 8192)).to_json())  # type: ignore[index]
    with caplog.at_level(logging.WARNING):
        assert KeptSlots(str(tmp_path)).load() == []
    assert caplog.text.count("kept snapshot") == 3
    assert "has 4096 bytes, its header says 8192" in caplog.text
    for bad in (
        '{"version": 99}',
        _header(("../etc/passwd", 1)).to_json(),
        _header(("x.bin", 1)).to_json().replace('"rank": 1', '"rank": 9'),
    ):
        with pytest.raises(KeptError):
            SlotHeader.from_json(bad)


def test_a_sweep_leaves_mapped_buffers_valid(tmp_path: Path) -> None:
    mine = KeptSlots(str(tmp_path))
    own = mine.buffer(4096)
    own.fill_(3)
    mine.record(0, _header(mine.name(own)))
    mine.sweep()
    assert list(tmp_path.iterdir()) == []
    assert mine.name(own) is None and int(own.sum()) == 3 * 4096


def test_no_room_means_process_memory_and_no_headers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    mine = KeptSlots(str(tmp_path))
    first = mine.buffer(4096)
    mine.record(0, _header(mine.name(first)))
    monkeypatch.setattr(kept_module, "HEADROOM_BYTES", 1 << 60)
    with caplog.at_level(logging.WARNING):
        second = mine.buffer(4096)
    assert "kept in process memory only" in caplog.text and "needed" in caplog.text
    assert second.numel() == 4096 and mine.name(second) is None and not mine.enabled
    assert KeptSlots(str(tmp_path)).load() == []  # the old header went: its buffer's bytes will change unrecorded
    assert KeptSlots("").buffer(10).numel() == 10


def test_the_agents_directory_is_its_own_and_a_dead_agents_is_swept(tmp_path: Path) -> None:
    made = snapshots.make(str(tmp_path), "node/1")
    assert Path(made).parent == tmp_path and Path(made).name.startswith("pliant-snapshots-node_1-")
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    stale = tmp_path / "pliant-snapshots-old-x"
    stale.mkdir()
    namespace = os.stat("/proc/self/ns/pid").st_ino
    (stale / scratch.OWNER_FILE).write_text(f"{dead.stdout.strip()} {namespace} 1000.00\n")
    (stale / "local-0").mkdir()
    again = snapshots.make(str(tmp_path), "node-2")
    assert not stale.exists() and Path(made).exists() and Path(again).exists()  # a live agent's stays
    snapshots.remove(made, again, "")
    assert not Path(made).exists() and not Path(again).exists()
    assert snapshots.make("", "n") == ""


def test_a_snapshot_dir_that_is_not_a_folder_is_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--snapshot-dir .*missing.* is not a writable folder.*--snapshot-dir ''"):
        snapshots.usable(str(tmp_path / "missing"))
    assert snapshots.usable("") == ""
    assert snapshots.usable(str(tmp_path)) == str(tmp_path)
    assert snapshots.usable(None) in ("", snapshots.DEFAULT_PARENT)
    assert os.path.isdir(snapshots.usable(None) or ".")
