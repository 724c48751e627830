"""The fused placement of staged misses (`SlabTier.place_misses`) and the fused take of expired
pad rows (`take_expired` on staging slots) do what the op-by-op paths do: same slots, victims,
index, queues, pins, stacks and counters, under any sequence of batches, pins and capacities."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings

from tests.profiles import examples
from tierstore.backends.slab import Rows, SlabTier

WIDTH = 3


def _op_by_op(tier: SlabTier, tabs: np.ndarray, rows: np.ndarray, payload: torch.Tensor,
              refused: np.ndarray | None) -> tuple[np.ndarray, Rows | None]:
    """The placement as `StagingArea` does it without the kernel (the reference)."""
    m = len(rows)
    staged = np.full(m, -1, dtype=np.int64)
    moving = Rows(torch.from_numpy(tabs), torch.from_numpy(rows), payload,
                  torch.zeros(m, dtype=torch.bool), torch.ones(m, dtype=torch.int32))
    placed = np.arange(m)
    if refused is not None and refused.any():
        pad = np.flatnonzero(refused)
        kp = tier.insert_scratch(moving.take(torch.from_numpy(pad)))
        staged[pad[:kp]] = tier.last_slots[:kp].numpy()
        rest = np.ones(m, dtype=bool)
        rest[pad[:kp]] = False
        moving, placed = moving.take(torch.from_numpy(rest)), placed[rest]
    k, evicted = tier.insert(moving, keep_clean=False)
    staged[placed[:k]] = tier.last_slots[:k].numpy()
    if k < len(moving):
        kp = tier.insert_scratch(moving.take(slice(k, None)))
        staged[placed[k : k + kp]] = tier.last_slots[:kp].numpy()
    return staged, evicted


def _state(tier: SlabTier) -> dict:
    keys = tier.index.keys(torch.arange(tier.slots)[tier.index.held(torch.arange(tier.slots))])
    return {
        "keys": sorted(zip(keys[0].tolist(), keys[1].tolist())),
        "held": tier.index.held(torch.arange(tier.slots)).tolist(),
        "slab": tier.slab.clone(), "dirty": tier.dirty.tolist(), "occupied": tier.occupied.tolist(),
        "pins": tier.pins.tolist(), "transient": tier.transient.tolist(),
        "free": tier.stacks()[0].tolist(), "pad": tier.stacks()[1].tolist(),
        "policy": tier.policy.state.copy(), "since": getattr(tier.policy, "since", None),
        "live": tier.index.live,
        "stats": (tier.stats.insertions, tier.stats.evictions, tier.stats.writebacks,
                  tier.stats.scratch_rows),
    }


BATCH = st.lists(st.tuples(st.integers(0, 1), st.integers(0, 40), st.booleans()), max_size=12,
                 unique_by=lambda t: (t[0], t[1]))


@settings(max_examples=examples())
@given(batches=st.lists(st.tuples(BATCH, st.lists(st.integers(0, 63), max_size=6),
                                  st.lists(st.integers(0, 63), max_size=6)), max_size=8),
       capacity=st.integers(1, 10), staging=st.integers(1, 6),
       policy=st.sampled_from(["hlfu", "lru"]))
def test_fused_placement_matches_op_by_op(batches, capacity, staging, policy):
    """Batches of absent keys (some refused), with pins taken and dropped between them and
    some cached rows made dirty: both tiers end every batch in the same state."""
    a = SlabTier("a", capacity, WIDTH, policy, staging=staging)
    b = SlabTier("b", capacity, WIDTH, policy, staging=staging)
    b.index.use_kernels = False  # the reference: every step op by op (expiry included)
    assert a.fused_placement
    counter = 0
    for batch, dirty_some, unpin_some in batches:
        keys = [(t, r) for t, r, _ in batch]
        found = a.lookup(torch.tensor([k[0] for k in keys], dtype=torch.int64),
                         torch.tensor([k[1] for k in keys], dtype=torch.int64), count=False) \
            if keys else torch.empty(0, dtype=torch.int64)
        absent = [i for i, s in enumerate(found.tolist()) if s < 0]
        tabs = np.array([batch[i][0] for i in absent], dtype=np.int64)
        rows = np.array([batch[i][1] for i in absent], dtype=np.int64)
        refused = np.array([batch[i][2] for i in absent], dtype=bool)
        payload = torch.arange(counter, counter + len(absent) * WIDTH, dtype=torch.float32)
        payload = payload.reshape(len(absent), WIDTH)
        counter += len(absent) * WIDTH
        ref = None if not refused.any() else refused
        got_a, ev_a = a.place_misses(tabs, rows, payload.clone(), ref)
        got_b, ev_b = _op_by_op(b, tabs, rows, payload.clone(), ref)
        assert got_a.tolist() == got_b.tolist()
        if ev_b is None or len(ev_b) == 0:
            assert ev_a is None
        else:
            assert ev_a.tabs.tolist() == ev_b.tabs.tolist() and ev_a.rows.tolist() == ev_b.rows.tolist()
            assert torch.equal(ev_a.payload, ev_b.payload)
        sa, sb = _state(a), _state(b)
        for k in sa:
            if isinstance(sa[k], torch.Tensor):
                assert torch.equal(sa[k], sb[k]), k
            elif isinstance(sa[k], np.ndarray):
                assert np.array_equal(sa[k], sb[k]), k
            else:
                assert sa[k] == sb[k], k
        a.index.check()
        a.check()
        # between batches: some slots dirtied (as a step would), some pins dropped
        occ = torch.nonzero(a.occupied).flatten()
        if occ.numel():
            for tier in (a, b):
                d = occ[torch.tensor(dirty_some, dtype=torch.int64) % occ.numel()] if dirty_some else occ[:0]
                tier.mark_dirty(d)
                u = occ[torch.tensor(unpin_some, dtype=torch.int64) % occ.numel()] if unpin_some else occ[:0]
                tier.pin(torch.cat([u, u[:1]]), -1)  # a slot unpinned twice: listed twice
            ta, tb = a.take_expired(), b.take_expired()
            assert (ta is None) == (tb is None)
            if ta is not None:
                assert ta.rows.tolist() == tb.rows.tolist() and ta.tabs.tolist() == tb.tabs.tolist()
                assert torch.equal(ta.payload, tb.payload) and torch.equal(ta.dirty, tb.dirty)


def test_fused_placement_needs_a_plain_walk_and_staging_slots():
    """Policies with a walk of their own (CLOCK's second chance) and tiers without staging
    slots take the op-by-op path."""
    assert not SlabTier("c", 4, WIDTH, "clock", staging=2).fused_placement
    assert not SlabTier("n", 4, WIDTH, "hlfu").fused_placement
    assert SlabTier("h", 4, WIDTH, "hlfu", staging=2).fused_placement


@pytest.mark.parametrize("policy", ["hlfu", "lru"])
def test_fused_placement_evicts_only_unpinned_and_copies_dirty_victims(policy):
    """A full cache: pinned slots are never victims, dirty victims come back with their rows."""
    t = SlabTier("t", 4, WIDTH, policy, staging=2)
    first = np.arange(4, dtype=np.int64)
    got, ev = t.place_misses(np.zeros(4, dtype=np.int64), first, torch.ones(4, WIDTH), None)
    assert sorted(got.tolist()) == [0, 1, 2, 3] and ev is None
    t.pin(torch.from_numpy(got[:2]), -1)  # rows 0, 1 unpinned; 2, 3 stay pinned
    t.mark_dirty(torch.from_numpy(got[:1]))
    got2, ev2 = t.place_misses(np.zeros(3, dtype=np.int64), np.array([10, 11, 12]),
                               torch.full((3, WIDTH), 2.0), None)
    assert sorted(got2[:2].tolist()) == sorted(got[:2].tolist())  # the unpinned slots reused
    assert got2[2] >= 4  # the third to a staging slot
    assert ev2.rows.tolist() == [0] and torch.equal(ev2.payload, torch.ones(1, WIDTH))
