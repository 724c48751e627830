"""The set-associative cache's Triton kernels (lookup, victim choice) under the interpreter equal
its torch ops exactly, over any sequence of lookups, inserts, locks and removals."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") in (None, "", "0") and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import: kernels on CPU tensors
triton = pytest.importorskip("triton")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.hbm_model import ops, run  # noqa: E402
from tests.profiles import examples  # noqa: E402
from tierstore.backends.hbm_cache import HbmCache  # noqa: E402
from tierstore.engine import interpreting  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="triton was imported without its interpreter")


@settings(max_examples=examples(0.3))
@given(seq=ops(), policy=st.sampled_from(["lru", "lfu"]), sets=st.integers(1, 3),
       ways=st.sampled_from([2, 4]), direct=st.booleans())
def test_triton_cache_equals_torch_cache(seq, policy, sets, ways, direct):
    if direct:  # keys 0..40 each get a line of their own
        sets = -(-41 // ways)
    ref = HbmCache(sets * ways, 2, policy=policy, ways=ways, direct=direct)
    tri = HbmCache(sets * ways, 2, policy=policy, ways=ways, kernels="triton", direct=direct)
    run(ref, seq)
    run(tri, seq)  # the model checks the kernels' victims against the rule, line by line
    for name in ("keys", "stamp", "lock", "dirty"):
        assert torch.equal(getattr(ref, name), getattr(tri, name)), name
    assert torch.equal(ref.slab, tri.slab)


def test_kernels_equal_torch_on_a_loaded_cache():
    g = torch.Generator().manual_seed(7)
    tri = HbmCache(256, 1, ways=32, kernels="triton")
    tri.insert(torch.randperm(1000, generator=g)[:230], torch.zeros(230, 1))
    tri.stamp.copy_(torch.randint(0, 5, tri.stamp.shape, generator=g))
    tri.lock.copy_((torch.rand(tri.lock.shape, generator=g) < 0.7).int() * (tri.keys >= 0))
    ids = torch.cat([torch.randint(-1, 1200, (150,), generator=g), torch.tensor([2**62, -5])])
    assert torch.equal(tri.lookup(ids), tri.lookup_torch(ids))
    absent = torch.arange(2000, 2160)
    got = tri.choose(absent)
    assert torch.equal(got, tri.choose_torch(absent))
    assert (got >= 0).any() and (got < 0).any()  # some sets ran out of unlocked lines


def test_store_on_sets_with_triton_kernels_equals_numba_on_the_slab(tmp_path):
    import tierstore as ts

    specs = [ts.TableSpec("a", 60, 4, optimizer=ts.RowWiseAdagrad(0.1)),
             ts.TableSpec("b", 40, 3, optimizer=ts.Adam(0.01))]
    final = []
    for kernels, cache in (("numba", "slab"), ("triton", "sets")):
        with ts.TierStore(tmp_path / kernels, specs, device="cpu", kernels=kernels, device_cache=cache,
                          device_capacity=32, host_capacity=20, policy="lru") as store:
            ebc = ts.TieredEmbeddingBagCollection(store, {"x": "a", "y": "b"})
            g = torch.Generator().manual_seed(5)
            for _ in range(4):
                lengths = torch.randint(0, 4, (8,), generator=g)
                n = int(lengths[:4].sum())
                values = torch.cat([torch.randint(0, 60, (n,), generator=g),
                                    torch.randint(0, 40, (int(lengths[4:].sum()),), generator=g)])
                out = ebc(["x", "y"], values, lengths)
                (out * torch.randn(out.shape, generator=g)).sum().backward()
            if cache == "sets":
                assert store.device_tier.cache.kernels == "triton"
            final.append({t: store.cascade.access(store.tables[t], torch.arange(r), None,
                                                  promote=False).clone() for t, r in (("a", 60), ("b", 40))})
    for t in ("a", "b"):
        assert torch.equal(final[0][t].view(torch.int32), final[1][t].view(torch.int32)), t


def test_a_step_half_staged_on_the_triton_engine_equals_numba_all_resident(tmp_path):
    """The CUDA engine over a step whose staging overflowed one table (that table goes the
    locked way, the other keeps the slots staging pinned): the same bits as the numba engine
    on a store that holds every row (`staged_bags_locked`, the path cache10 took on the GPU)."""
    from tests.test_sets_store import _overflow_run

    want, _ = _overflow_run(tmp_path / "resident", (10**4, 0))
    got, stats = _overflow_run(tmp_path / "sets", (32, 1000), kernels="triton")
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert stats.lock_free_bags == 0 and stats.staged_bags_locked == 5
