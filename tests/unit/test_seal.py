"""The checkpoint directory's sealed records (pliant.seal): what a seal proves, and the fence's ownership rule."""

from __future__ import annotations

import json
import os
import stat

import pytest

from pliant.seal import Fence, SealError, job_key, load_or_create_root, read_fence, seal, unseal

KEY = job_key(b"r" * 32, "job")


def test_a_sealed_record_reads_back_and_any_change_breaks_its_seal() -> None:
    text = seal(KEY, {"kind": "commit", "step": 3, "job": "job"})
    assert unseal(KEY, text, "commit")["step"] == 3
    altered = json.loads(text)
    altered["step"] = 4
    with pytest.raises(SealError, match="wrong"):
        unseal(KEY, json.dumps(altered), "commit")
    unsealed = {"kind": "commit", "step": 3, "job": "job"}
    with pytest.raises(SealError, match="missing"):
        unseal(KEY, json.dumps(unsealed), "commit")
    with pytest.raises(SealError, match="wrong"):
        unseal(job_key(b"r" * 32, "other-job"), text, "commit")  # another job's key
    with pytest.raises(SealError, match="not a fence record"):
        unseal(KEY, text, "fence")  # a marker never stands in for a fence
    with pytest.raises(SealError, match="not a JSON record"):
        unseal(KEY, b"\x80garbage", "commit")
    assert unseal(None, json.dumps(unsealed), "commit") == unsealed  # no key: read as it is


def test_keys_differ_by_job_and_root() -> None:
    assert job_key(b"a" * 32, "job") != job_key(b"a" * 32, "job2") != job_key(b"b" * 32, "job2")
    assert len(KEY) == 32


def test_the_fence_lets_a_new_incarnation_take_over_and_fences_the_old_one() -> None:
    fence = Fence("job", "old", 7)
    assert fence.supersedes("old", 6) and not fence.supersedes("old", 7)
    assert not fence.supersedes("new", 1)  # a new incarnation (every node was lost): not fenced by generation 7
    taken = fence.opened_by("new", 1)
    assert taken == Fence("job", "new", 1, ("old",))
    assert taken.supersedes("old", 9)  # the old incarnation's worlds are fenced, whatever their generation
    assert taken.opened_by("old", 9) is None  # and never take the directory back
    assert taken.opened_by("new", 1) is None and taken.opened_by("new", 2) == Fence("job", "new", 2, ("old",))
    assert not Fence("job", "", 0).supersedes("", 5)  # outside an agent nothing is fenced
    many = Fence("job", "i0", 1)
    for i in range(1, 40):
        many = many.opened_by(f"i{i}", 1)
    assert len(many.superseded) == 16 and many.superseded[-1] == "i38"


def test_read_fence_checks_the_seal(tmp_path) -> None:
    assert read_fence(tmp_path, KEY) is None
    (tmp_path / "pliant-fence.json").write_text(seal(KEY, Fence("job", "u", 3).to_record()))
    assert read_fence(tmp_path, KEY) == Fence("job", "u", 3)
    (tmp_path / "pliant-fence.json").write_text(
        json.dumps({"kind": "fence", "job": "job", "owner": "x", "generation": 99})
    )
    with pytest.raises(SealError):
        read_fence(tmp_path, KEY)


def test_the_root_file_is_made_once_private_and_checked(tmp_path) -> None:
    path = tmp_path / "state" / "seal-root"
    root = load_or_create_root(path)
    assert len(root) == 32 and load_or_create_root(path) == root
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    os.chmod(path, 0o644)
    with pytest.raises(SealError, match="chmod 600"):
        load_or_create_root(path)
    os.chmod(path, 0o600)
    path.write_text("short")
    with pytest.raises(SealError, match="must hold 32 bytes"):
        load_or_create_root(path)
