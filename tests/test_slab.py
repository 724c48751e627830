"""SlabTier moves: eviction hands victims down, the bottom tier drops clean ones, slots are reused."""

from __future__ import annotations

import pytest
import torch

from tierstore.backends.slab import Rows, SlabTier


def _rows(keys: list[int], dirty: list[bool] | None = None, pins: list[int] | None = None) -> Rows:
    k = torch.tensor(keys, dtype=torch.int64)
    d = torch.zeros(len(keys), dtype=torch.bool) if dirty is None else torch.tensor(dirty)
    p = None if pins is None else torch.tensor(pins, dtype=torch.int32)
    return Rows(torch.zeros_like(k), k, (k.float() * 10).unsqueeze(1).repeat(1, 3), d, p)


def _payload_of(tier: SlabTier, key: int) -> torch.Tensor:
    slot = tier.lookup(torch.tensor(0), torch.tensor([key]), count=False)
    assert int(slot) >= 0, key
    return tier.read(slot)[0]


@pytest.mark.parametrize("keep_clean", [True, False])
def test_eviction_hands_down_victims_and_refills_their_slots(keep_clean):
    tier = SlabTier("t", 4, 3, "fifo")
    assert tier.insert(_rows([1, 2, 3, 4], dirty=[False, True, False, True]))[0] == 4
    k, evicted = tier.insert(_rows([5, 6, 7], dirty=[True, False, False], pins=[2, 0, 0]),
                             keep_clean=keep_clean)
    assert k == 3
    # FIFO victims 1, 2, 3: all of them, or only the dirty one, with payloads and dirty bits
    want = [1, 2, 3] if keep_clean else [2]
    assert evicted.rows.tolist() == want
    assert evicted.dirty.tolist() == [k == 2 for k in want]
    assert torch.equal(evicted.payload, (torch.tensor(want).float() * 10).unsqueeze(1).repeat(1, 3))
    assert evicted.pins is None  # victims are never pinned
    assert tier.stats.evictions == 3 and tier.stats.writebacks == 1
    assert sorted(tier.resident()[1].tolist()) == [4, 5, 6, 7]
    for key in (4, 5, 6, 7):
        assert torch.equal(_payload_of(tier, key), torch.full((3,), key * 10.0))
    slots = tier.lookup(torch.tensor(0), torch.tensor([4, 5, 6, 7]), count=False)
    assert tier.dirty[slots].tolist() == [True, True, False, False]
    assert tier.pins[slots].tolist() == [0, 2, 0, 0]
    tier.check()


def test_eviction_limited_by_pins_and_protection_uses_free_slots_too():
    tier = SlabTier("t", 5, 3, "lru")
    tier.insert(_rows([1, 2, 3], pins=[1, 0, 0]))
    protect = tier.lookup(torch.tensor(0), torch.tensor([3]), count=False)
    # 2 free slots + 1 evictable row (2): 3 of the 5 new rows fit, the rest is left to the caller
    k, evicted = tier.insert(_rows([10, 11, 12, 13, 14]), protect=protect, keep_clean=False)
    assert k == 3 and evicted is None  # the only victim (2) was clean: dropped, not copied
    assert sorted(tier.resident()[1].tolist()) == [1, 3, 10, 11, 12]
    assert tier.size == 5 and tier.stats.evictions == 1
    tier.check()
    # a tier with nothing evictable takes nothing
    tier.pin(tier.lookup(torch.tensor(0), torch.tensor([3, 10, 11, 12]), count=False), 1)
    assert tier.insert(_rows([20]))[0] == 0
    tier.check()


def test_remove_then_insert_keeps_free_list_and_generation_consistent():
    tier = SlabTier("t", 3, 3, "lru")
    tier.insert(_rows([1, 2, 3], dirty=[True, False, False], pins=[0, 3, 0]))
    gen = tier.generation
    out = tier.remove(tier.lookup(torch.tensor(0), torch.tensor([2, 1]), count=False))
    assert out.rows.tolist() == [2, 1] and out.dirty.tolist() == [False, True]
    assert out.pins.tolist() == [3, 0] and tier.size == 1 and tier.generation > gen
    tier.check()
    k, evicted = tier.insert(_rows([7, 8, 9]))  # two free slots, one victim (3)
    assert k == 3 and evicted.rows.tolist() == [3]
    assert sorted(tier.resident()[1].tolist()) == [7, 8, 9]
    assert not bool(tier.dirty.any()) and not bool(tier.pins.any())
    tier.check()


@pytest.mark.parametrize("staging", [0, 6])
def test_a_pad_row_that_expired_twice_before_the_take_leaves_once(staging):
    # a pad row unpinned to zero, pinned again by a later batch and unpinned again is queued
    # twice: it must leave (and be written back) once, and its slot return to the pad once
    tier = SlabTier("device", 8, 3, "hlfu", "cpu", staging=staging)
    if not staging:
        tier.reserve_scratch(6)
    rows = Rows(torch.zeros(4, dtype=torch.int64), torch.arange(4), torch.randn(4, 3),
                torch.ones(4, dtype=torch.bool), torch.ones(4, dtype=torch.int32))
    assert tier.insert_scratch(rows) == 4
    slots = tier.last_slots.clone()
    if staging:
        assert bool((slots >= 8).all())  # staging slots lie past the cache's capacity
    tier.pin(slots[:2], -1)  # rows 0 and 1 expire ...
    tier.pin(slots[:1], 1)  # ... row 0 is pinned again by a later batch ...
    tier.pin(slots[:1], -1)  # ... and expires again before the take
    out = tier.take_expired()
    assert sorted(out.rows.tolist()) == [0, 1]
    assert torch.equal(out.payload[torch.argsort(out.rows)], rows.payload[:2])
    assert sorted(tier._scratch.tolist()) == sorted(set(tier._scratch.tolist()))  # no repeats
    assert tier.size == 2 and tier.take_expired() is None
    tier.check()
