"""The set-associative cache (torch ops): a dict model under any sequence, victim order, no sync."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.hbm_model import ops, run
from tests.profiles import examples
from tests.syncs import SyncCounter
from tierstore.backends.hbm_cache import HbmCache, set_of
from tierstore.errors import ConfigError


@settings(max_examples=examples(1.0))
@given(seq=ops(), policy=st.sampled_from(["lru", "lfu"]), sets=st.integers(1, 4),
       ways=st.sampled_from([1, 2, 4]))
def test_behaves_like_a_dict_and_never_evicts_a_locked_line(seq, policy, sets, ways):
    cache = HbmCache(sets * ways, 2, policy=policy, ways=ways)
    assert cache.capacity == sets * ways
    run(cache, seq)


@settings(max_examples=examples(0.5))
@given(seq=ops(max_key=47), policy=st.sampled_from(["lru", "lfu"]), ways=st.sampled_from([1, 4, 16]))
def test_a_direct_cache_holds_every_key_and_never_evicts(seq, policy, ways):
    cache = HbmCache(48, 2, policy=policy, ways=ways, direct=True)
    model = run(cache, seq)
    for op, ks in seq:  # every key ever accessed and not removed since is still there
        if op == "access":
            assert all(k in model.rows or any(o == "remove" and k in r for o, r in seq) for k in ks)
    keys, slots = cache.resident()
    assert torch.equal(keys, slots)  # each key on its own line


def test_lru_evicts_the_oldest_unlocked_line_of_the_set():
    cache = HbmCache(4, 1, ways=4)  # one set
    keys = torch.tensor([10, 11, 12, 13])
    v = cache.insert(keys, torch.zeros(4, 1))
    assert (v.keys == -1).all() and sorted(v.slots.tolist()) == [0, 1, 2, 3]
    for k in (11, 10, 13):  # 12 now the oldest
        cache.tick()
        cache.touch(cache.lookup(torch.tensor([k])))
    cache.pin(cache.lookup(torch.tensor([12])), 1)  # ... but locked: 11 goes
    cache.tick()
    v = cache.insert(torch.tensor([20]), torch.ones(1, 1), dirty=torch.tensor([True]))
    assert v.keys.tolist() == [11]
    assert int(cache.lookup(torch.tensor([20]))) == int(v.slots)
    assert bool(cache.dirty.flatten()[v.slots])


def test_lfu_evicts_the_least_used_line():
    cache = HbmCache(2, 1, policy="lfu", ways=2)
    cache.insert(torch.tensor([1, 2]), torch.zeros(2, 1))
    for _ in range(3):
        cache.touch(cache.lookup(torch.tensor([2])))
    cache.touch(cache.lookup(torch.tensor([1, 1])))  # repeats count: 1 has 3 uses, 2 has 4
    v = cache.insert(torch.tensor([3]), torch.zeros(1, 1))
    assert v.keys.tolist() == [1]


def test_a_full_locked_set_refuses_and_changes_nothing():
    cache = HbmCache(2, 1, ways=2)
    cache.insert(torch.tensor([1, 2]), torch.ones(2, 1), lock=1)
    before = cache.keys.clone()
    v = cache.insert(torch.tensor([3, 4]), torch.zeros(2, 1))
    assert v.slots.tolist() == [-1, -1] and v.keys.tolist() == [-1, -1]
    assert torch.equal(cache.keys, before)
    cache.check()


def test_sets_spread_keys_and_hash_is_deterministic():
    keys = torch.arange(100_000)
    s = set_of(keys, 1000)
    counts = torch.bincount(s, minlength=1000)
    assert counts.min() > 40 and counts.max() < 170  # ~100 each
    assert torch.equal(s, set_of(keys.clone(), 1000))
    assert set_of(torch.tensor([2**62, -1]), 7).tolist() == set_of(torch.tensor([2**62, -1]), 7).tolist()
    assert (set_of(torch.tensor([2**62 + 5, 2**40]), 7) >= 0).all()


def test_refuses_bad_configuration():
    with pytest.raises(ConfigError):
        HbmCache(8, 1, policy="s3fifo")
    with pytest.raises(ConfigError):
        HbmCache(8, 1, ways=3)
    assert HbmCache(0, 1).lookup(torch.tensor([1])).tolist() == [-1]


def test_hit_path_and_insert_make_no_syncing_call():
    cache = HbmCache(64, 3, ways=8)
    cache.insert(torch.arange(40), torch.randn(40, 3))
    ids = torch.randint(0, 80, (50,), generator=torch.Generator().manual_seed(1))
    with SyncCounter() as counter:
        slots = cache.lookup(ids)
        cache.touch(slots)
        cache.pin(slots, 1)
        cache.mark_dirty(slots)
        cache.pin(slots, -1)
        cache.tick()
        v = cache.insert(torch.arange(100, 120), torch.randn(20, 3), lock=1)
        cache.remove(v.slots)
    assert counter.calls == []
    cache.check()
