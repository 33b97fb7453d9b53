"""Who sends each rank of a new world its HSDP shards (pliant.worker.hsdp.shard_sources): a current holder keeps its
own, everyone else takes them from the lowest current holder of the same shard index, and a shard index nobody holds
fails the move."""

from __future__ import annotations

import pytest

from pliant.worker.hsdp import HSDPMoveError, shard_sources

pytestmark = pytest.mark.timeout(10)


def test_a_joining_replica_takes_each_shard_from_the_surviving_replica() -> None:
    """World 2 (one replica of 2) grows to 4: ranks 2 and 3 are newcomers, each fed by the survivor of its index."""
    sources, newest = shard_sources([True, True, False, False], [0, 1, -1, -1], [7, 7, 0, 0], 2)
    assert sources == [0, 1, 0, 1] and newest == 7


def test_survivors_renumbered_into_another_index_receive_and_behind_ones_catch_up() -> None:
    """Node 0 of three left: the survivors are ranks 0-3 now, holding indices 0, 1, 0, 1 (kept); rank 2's state is an
    update behind (a peer died during the commit), so it takes index 0's shards from rank 0."""
    sources, newest = shard_sources([True, True, True, True], [0, 1, 0, 1], [5, 5, 4, 5], 2)
    assert sources == [0, 1, 0, 3] and newest == 5


def test_a_shard_index_no_rank_holds_fails_the_move() -> None:
    with pytest.raises(HSDPMoveError, match="shard 1 of 2"):
        shard_sources([True, False, False, False], [0, -1, -1, -1], [3, 0, 0, 0], 2)
    with pytest.raises(HSDPMoveError, match="no rank of the new world holds"):
        shard_sources([False, False], [-1, -1], [0, 0], 2)


def test_a_kept_shard_of_another_index_is_not_taken_for_this_one() -> None:
    """A survivor whose node changed its ranks' order holds index 1 at a rank of index 0: it receives index 0's."""
    sources, _newest = shard_sources([True, True, False, False], [1, 0, -1, -1], [2, 2, 0, 0], 2)
    assert sources == [1, 0, 1, 0]
