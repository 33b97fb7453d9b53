"""Sealed records (pliant.security.seal): what a seal proves, the job's key, and the sealing root's file."""

from __future__ import annotations

import json
import os
import stat

import pytest

from pliant.security.seal import SealError, job_key, load_or_create_root, seal, unseal

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
