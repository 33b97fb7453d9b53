"""The checkpoint directory's fence (pliant.fence): its ownership rule, and that only a sealed fence counts."""

from __future__ import annotations

import json

import pytest

from pliant.fence import Fence, read_fence
from pliant.seal import SealError, job_key, seal

KEY = job_key(b"r" * 32, "job")


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
