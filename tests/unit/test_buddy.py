"""Buddy copies' pure parts: who keeps whose shard, which snapshot step the survivors roll back to, and packing."""

from __future__ import annotations

import time

import pytest
import torch

from pliant.worker.inplace.buddy import (
    Held,
    RollbackError,
    buddies,
    choose_rollback,
    decode,
    encode,
)
from pliant.worker.inplace.packing import pack, pack_later, packed_size, unpack

pytestmark = pytest.mark.timeout(30)


def test_a_buddy_is_on_another_node_when_there_is_one() -> None:
    assert buddies([0, 0, 1, 1]) == [2, 3, 0, 1]
    assert buddies([0, 0, 0]) == [1, 2, 0]  # one node: the next rank (a worker's death is still covered)
    assert buddies([0, 0, 1]) == [2, 2, 0]  # the lone rank of node 1 keeps both of node 0's shards
    assert buddies([0, 1, 2]) == [1, 2, 0]
    for nodes in ([0, 0, 1, 1], [0, 1, 1, 1], [3, 3, 5, 5, 5, 7]):
        plan = buddies(nodes)
        assert all(nodes[b] != nodes[r] for r, b in enumerate(plan)), nodes


def test_the_survivors_roll_back_to_the_newest_step_every_shard_has() -> None:
    # Old world of 4 on two nodes; node 1 (old ranks 2, 3) died. Ranks 0 and 1 hold their own copies of steps 16 and
    # 24, and their wards' (2 and 3) of step 16 only: the step-24 exchange was still in flight.
    held = [Held(0, (24, 16), {2: (16,)}), Held(1, (24, 16), {3: (16,)}), Held(-1)]
    plan = choose_rollback(held, 4)
    assert plan.step == 16
    assert plan.holders == {0: 0, 1: 1, 2: 0, 3: 1}
    held = [Held(0, (24, 16), {2: (24, 16)}), Held(1, (24, 16), {3: (24, 16)})]
    assert choose_rollback(held, 4).step == 24


def test_an_owner_sends_its_own_shard_before_a_buddy_does() -> None:
    held = [Held(1, (8,), {0: (8,)}), Held(0, (8,), {1: (8,)})]
    assert choose_rollback(held, 2).holders == {0: 1, 1: 0}  # new ranks: old 0 is new 1, and holds its own


def test_a_shard_lost_with_its_buddy_takes_the_restart_path() -> None:
    held = [Held(0, (8,), {2: (8,)}), Held(1, (8,), {})]  # old rank 3 and its buddy's copy are gone
    with pytest.raises(RollbackError, match="ranks \\[2, 3\\] are gone"):
        choose_rollback(held, 4)
    with pytest.raises(RollbackError):
        choose_rollback([Held(-1)], 2)  # newcomers only


def test_held_copies_cross_ranks_as_one_integer_row() -> None:
    held = Held(2, (24, 16), {0: (16,), 3: (24, 16)}, generation=7)
    assert decode(encode(held, 4), 4) == held
    assert decode(encode(Held(-1), 3), 3) == Held(-1)
    kept = Held(1, (16,), {3: (16,)}, generation=7, kept=True)
    assert decode(encode(kept, 4), 4) == kept


def test_a_dead_ranks_kept_copies_complete_what_its_buddy_took_with_it() -> None:
    """The soak's case: node 1 (old ranks 2, 3) died, and old rank 1 (node 0), blocked on a send to it, gave up. Old
    rank 1's shard and old rank 3's (its ward) were in no live process; the fresh worker that replaced old rank 1
    reads them back from its node's memory (pliant.worker.inplace.kept)."""
    survivor = Held(0, (24, 16), {2: (16,)}, generation=5)
    with pytest.raises(RollbackError):
        choose_rollback([survivor, Held(-1)], 4)
    kept = Held(1, (24, 16), {3: (16,)}, generation=5, kept=True)
    plan = choose_rollback([survivor, kept], 4)
    assert (plan.step, plan.holders) == (16, {0: 0, 1: 1, 2: 0, 3: 1})


def test_kept_copies_of_another_world_do_not_count() -> None:
    """A predecessor that died in an older world (its shards were cut for another world size) holds nothing the
    survivors can use, and kept copies alone (no survivor) are no world to roll back."""
    survivor = Held(0, (24, 16), {2: (16,)}, generation=5)
    stale = Held(1, (24, 16), {3: (16,)}, generation=4, kept=True)
    with pytest.raises(RollbackError):
        choose_rollback([survivor, stale], 4)
    with pytest.raises(RollbackError):
        choose_rollback([Held(0, (8,), {1: (8,)}, generation=3, kept=True)], 2)


def test_a_shard_packs_into_one_reusable_byte_buffer() -> None:
    tensors = [torch.randn(3, 5), torch.tensor(7.0), torch.arange(9), torch.randn(2, dtype=torch.float16)]
    buffer = pack(tensors)
    assert buffer.dtype == torch.uint8 and buffer.numel() == packed_size(tensors)
    assert pack(tensors, buffer) is buffer  # the same size: reused
    out = [torch.empty_like(t) for t in tensors]
    unpack(buffer, out)
    for a, b in zip(tensors, out, strict=True):
        assert torch.equal(a, b)
    assert pack([]).numel() == 0


def test_a_packed_buffer_is_the_same_bytes_whatever_the_reused_buffer_held() -> None:
    """The alignment padding is written too, so two copies of the same tensors compare equal byte for byte."""
    tensors = [torch.randn(3), torch.arange(7)]  # 12 and 56 bytes: both padded
    dirty = torch.full((packed_size(tensors),), 104, dtype=torch.uint8)
    assert torch.equal(pack(tensors, dirty), pack(tensors, torch.zeros_like(dirty)))


def test_a_copy_in_the_background_is_whole_when_waited_for_and_then_sends() -> None:
    """A snapshot's copy runs while the next step computes: the wait returns once the buffer holds every tensor, and
    ``then`` (the send to the buddy) has run after the copy, on the copy's thread."""
    tensors = [torch.randn(1000, 100), torch.arange(7)]
    order: list[str] = []
    buffer, wait = pack_later(tensors, None, lambda sent: order.append("sent" if sent.numel() else "empty"))
    wait()
    assert order == ["sent"]
    assert torch.equal(buffer, pack(tensors))
    again, wait = pack_later(tensors, buffer)
    wait()
    assert again is buffer


def test_a_background_copy_that_failed_raises_when_waited_for() -> None:
    def refuse(_buffer: torch.Tensor) -> None:
        raise RuntimeError("Connection closed by peer")

    _buffer, wait = pack_later([torch.ones(3)], None, refuse)
    with pytest.raises(RuntimeError, match="Connection closed"):
        wait()


class _Receive:
    """A gloo receive's ``wait``: it consumes the completion, so a second call never returns (a test fails instead)."""

    def __init__(self, fails: bool = False) -> None:
        self.fails, self.waits = fails, 0

    def wait(self, *_args: object) -> bool:
        self.waits += 1
        assert self.waits == 1, "a receive waited for twice: gloo would block for good"
        if self.fails:
            raise RuntimeError("Connection closed by peer")
        return True


def test_a_slots_receives_are_waited_for_once_whoever_asks() -> None:
    """The arrival's thread waits; the next snapshot, a roll back's ward_complete and the kept-copy recorder all ask
    it, never the receives themselves."""
    from pliant.worker.inplace.buddy import _Arrival, _Slot

    receives, recorded = [_Receive(), _Receive()], []
    arrival = _Arrival(receives, lambda: recorded.append(True))
    assert arrival.wait(5.0) and arrival.wait() and arrival.failed is None
    slot = _Slot(step=8, receives=list(receives), arrival=arrival)  # type: ignore[arg-type]
    assert slot.ward_complete() and slot.ward_complete()
    assert [r.waits for r in receives] == [1, 1]
    for _ in range(100):  # ``then`` runs on the arrival's thread just after the waiters are released
        if recorded:
            break
        time.sleep(0.01)
    assert recorded == [True]

    failing = _Arrival([_Receive(fails=True)], lambda: recorded.append(False))
    assert not failing.wait(5.0) and "Connection closed" in str(failing.failed)
    assert not _Slot(step=8, arrival=failing).ward_complete()
    assert recorded == [True]  # nothing is recorded for copies that did not arrive
