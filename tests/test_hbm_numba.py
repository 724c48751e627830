"""The set-associative cache's numba kernels give the slots its torch ops give (`hbm_numba`)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore._kernels import HAVE_NUMBA
from tierstore.backends.hbm_cache import HbmCache
from tierstore.errors import ConfigError

pytestmark = pytest.mark.skipif(not HAVE_NUMBA, reason="numba is not installed")


def _state(cache: HbmCache, data, keyspace: int) -> None:
    """Fill the lines at random: keys (distinct, in their own sets), stamps and locks."""
    n = cache.capacity
    present = data.draw(st.lists(st.integers(0, keyspace), unique=True, max_size=n))
    keys = torch.tensor(present, dtype=torch.int64)
    if len(present):
        slots = cache.choose(keys)  # (any valid placement: the torch ops' own)
        put = slots >= 0
        cache.insert(keys[put], torch.zeros(int(put.sum()), cache.width), slots=slots[put])
    stamps = data.draw(st.lists(st.integers(-3, 6), min_size=n, max_size=n))
    locks = data.draw(st.lists(st.sampled_from([0, 0, 0, 1, 2]), min_size=n, max_size=n))
    cache.stamp.view(-1).copy_(torch.tensor(stamps, dtype=torch.int64))
    cache.lock.view(-1).copy_(torch.tensor(locks, dtype=torch.int32))


@settings(deadline=None, max_examples=150)
@given(data=st.data(), sets=st.sampled_from([1, 2, 3, 8]), ways=st.sampled_from([1, 2, 4, 8]),
       policy=st.sampled_from(["lru", "lfu"]))
def test_numba_kernels_give_the_torch_slots(data, sets, ways, policy):
    keyspace = 4 * sets * ways + 3
    ref = HbmCache(sets * ways, 2, policy=policy, ways=ways, kernels="torch")
    _state(ref, data, keyspace)
    fast = HbmCache(sets * ways, 2, policy=policy, ways=ways, kernels="numba")
    for a, b in ((fast.keys, ref.keys), (fast.stamp, ref.stamp), (fast.lock, ref.lock)):
        a.copy_(b)
    probe = torch.tensor(data.draw(st.lists(st.integers(-2, keyspace), max_size=40)),
                         dtype=torch.int64)
    assert torch.equal(fast.lookup(probe), ref.lookup_torch(probe))
    held = set(ref.keys.flatten().tolist())
    absent = torch.tensor(data.draw(st.lists(st.integers(0, keyspace).filter(lambda k: k not in held),
                                             unique=True, max_size=3 * sets * ways)),
                          dtype=torch.int64)
    assert torch.equal(fast.choose(absent), ref.choose_torch(absent))


def test_numba_kernels_on_a_large_cache_and_batch():
    gen = torch.Generator().manual_seed(3)
    ref = HbmCache(4096, 1, policy="lru", kernels="torch")
    fast = HbmCache(4096, 1, policy="lru", kernels="numba")
    keys = torch.unique(torch.randint(0, 10**9, (3000,), generator=gen))
    ref.insert(keys, torch.zeros(len(keys), 1))
    ref.stamp.view(-1).copy_(torch.randint(0, 50, (4096,), generator=gen))
    ref.lock.view(-1).copy_((torch.rand(4096, generator=gen) < 0.3).to(torch.int32))
    for a, b in ((fast.keys, ref.keys), (fast.stamp, ref.stamp), (fast.lock, ref.lock)):
        a.copy_(b)
    probe = torch.cat([keys[::3], torch.randint(0, 10**9, (500,), generator=gen)])
    assert torch.equal(fast.lookup(probe), ref.lookup_torch(probe))
    fresh = torch.unique(torch.randint(10**9, 2 * 10**9, (6000,), generator=gen))
    fresh = fresh[torch.randperm(len(fresh), generator=gen)]  # the input order sets the ranks
    got = fast.choose(fresh)
    assert torch.equal(got, ref.choose_torch(fresh))
    assert (got >= 0).any() and (got < 0).any()


def test_numba_kernels_refuse_a_cuda_device():
    with pytest.raises(ConfigError):
        HbmCache(64, 2, device="meta", kernels="numba")
    with pytest.raises(ConfigError):
        HbmCache(64, 2, kernels="cuda")
