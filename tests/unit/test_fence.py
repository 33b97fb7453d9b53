"""The checkpoint directory's fence (pliant.fence): its ownership rule, and that only the control plane's warrants
make one count: nothing a member or a worker holds (the checkpoint key, the agent key) can forge a fence that stops a
world."""

from __future__ import annotations

import json

import pytest

from pliant.fence import NOBODY, Fence, Warranted, read_fence
from pliant.security import warrant
from pliant.security.seal import SealError, job_key, seal

ROOT = b"r" * 32
KEY = warrant.public_key(ROOT, "job")


def _world(incarnation: str, generation: int, at: float, root: bytes = ROOT) -> Warranted:
    """A world as the control plane under ``root`` warrants it."""
    signed = warrant.sign(root, warrant.World("job", incarnation, generation, at))
    return Warranted(incarnation, generation, at, signed)


def _write(directory, fence: Fence) -> None:  # type: ignore[no-untyped-def]
    (directory / "pliant-fence.json").write_text(json.dumps(fence.to_record()))


def test_the_fence_lets_a_later_incarnation_take_over_and_fences_the_old_one() -> None:
    fence = Fence("job", Warranted("old", 7, 100.0))
    assert fence.supersedes("old", 6) and not fence.supersedes("old", 7)
    assert not fence.supersedes("new", 1)  # a new incarnation (every node was lost): not fenced by generation 7
    taken = fence.opened_by(Warranted("new", 1, 200.0))
    assert taken == Fence("job", Warranted("new", 1, 200.0), (Warranted("old", 7, 100.0),))
    assert taken.supersedes("old", 9)  # the old incarnation's worlds are fenced, whatever their generation
    assert taken.opened_by(Warranted("old", 9, 300.0)) is None  # and never take the directory back
    assert taken.opened_by(Warranted("new", 1, 200.0)) is None
    assert taken.opened_by(Warranted("new", 2, 210.0)).owner == Warranted("new", 2, 210.0)  # type: ignore[union-attr]
    assert fence.opened_by(Warranted("earlier", 3, 50.0)) is None, "published before the owner: no take-over"
    assert not fence.supersedes("earlier", 3), "and not stopped either"
    assert not Fence("job", NOBODY).supersedes("", 5)  # outside an agent nothing is fenced
    many = Fence("job", Warranted("i0", 1, 0.0))
    for i in range(1, 40):
        many = many.opened_by(Warranted(f"i{i}", 1, float(i)))  # type: ignore[assignment]
    assert len(many.superseded) == 16 and many.superseded[-1].incarnation == "i38"


def test_a_fence_counts_only_with_the_control_planes_warrant(tmp_path) -> None:
    assert read_fence(tmp_path, KEY) is None
    good = Fence("job", _world("u", 3, 10.0))
    _write(tmp_path, good)
    assert read_fence(tmp_path, KEY) == good
    # What a worker holds (the checkpoint key) seals a record that is no fence at all.
    (tmp_path / "pliant-fence.json").write_text(seal(job_key(ROOT, "job"), {"kind": "fence", "job": "job"}))
    with pytest.raises(SealError):
        read_fence(tmp_path, KEY)
    # A world the control plane never published (a higher generation) with a made-up or borrowed warrant.
    for forged in (Warranted("u", 99, 10.0, "00" * 64), Warranted("u", 99, 10.0, good.owner.warrant)):
        _write(tmp_path, Fence("job", forged))
        with pytest.raises(SealError, match="warrant"):
            read_fence(tmp_path, KEY)
    # Another deployment's sealing root signs nothing this job's key accepts.
    _write(tmp_path, Fence("job", _world("u", 99, 10.0, root=b"x" * 32)))
    with pytest.raises(SealError, match="warrant"):
        read_fence(tmp_path, KEY)
    (tmp_path / "pliant-fence.json").write_bytes(b"{" * 100_000)
    with pytest.raises(SealError, match="more than a fence"):
        read_fence(tmp_path, KEY)


def test_a_listed_world_counts_only_with_its_warrant_and_when_published_before_the_owner(tmp_path) -> None:
    """A replay of real warrants cannot fence the live incarnation: listing it behind an older owner drops it."""
    live_early, old_owner = _world("live", 1, 200.0), _world("old", 5, 100.0)
    _write(tmp_path, Fence("job", old_owner, (live_early, Warranted("other", 1, 50.0, "ab" * 64))))
    fence = read_fence(tmp_path, KEY)
    assert fence is not None and fence.superseded == () and not fence.supersedes("live", 1)
    _write(tmp_path, Fence("job", _world("live", 2, 300.0), (old_owner,)))
    assert read_fence(tmp_path, KEY).supersedes("old", 9)  # type: ignore[union-attr]
