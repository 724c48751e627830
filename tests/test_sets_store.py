"""The store over the set-associative device tier (device_cache="sets") on the CPU: placement never
changes bits (against the slab tier and an all-resident store, every optimizer, the Prefetcher
staging batches), and its configuration is checked."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tierstore as ts
from tests.profiles import examples
from tests.test_prefetch import _train
from tierstore.backends.set_tier import SetTier, set_policy
from tierstore.errors import ConfigError


def test_prefetched_training_on_sets_equals_an_all_resident_store(tmp_path):
    base, _ = _train(tmp_path / "base", 0, caps=(10**5, 10**5))
    for depth in (0, 2):
        for caps, policy in (((2, 3), "lru"), ((40, 60), "lfu"), ((32, 50), "hlfu"), ((64, 0), "s3fifo")):
            got, stats = _train(tmp_path / f"s{depth}{policy}", depth, caps=caps, policy=policy,
                                device_cache="sets")
            for k in base:
                assert torch.equal(got[k], base[k]), (depth, caps, policy, k)
            assert stats["layout"]["device_cache"] == "sets"
            assert stats["layout"]["device_policy"] == set_policy(policy)
            assert stats["device"]["capacity"] % 32 == 0  # whole sets of 32 ways
            if depth and caps[0] >= 32:
                assert stats["prefetch"]["lock_free_bags"] > 0  # staged batches ran lock-free


OPTIMIZERS = [ts.SGD(0.1), ts.Adagrad(0.2), ts.RowWiseAdagrad(0.3),
              ts.Adam(0.01, weight_decay=0.01)]


def _collection_run(path, opt, dtype, device_cache, caps, steps=6):
    specs = [ts.TableSpec("u", 300, 6, optimizer=opt, dtype=dtype),
             ts.TableSpec("v", 200, 3, optimizer=ts.RowWiseAdagrad(0.1), clip=0.5)]
    gen = torch.Generator().manual_seed(11)
    with ts.TierStore(path, specs, device="cpu", device_capacity=caps[0], host_capacity=caps[1],
                      policy="lru", write_buffer=64, device_cache=device_cache) as store:
        ebc = ts.TieredEmbeddingBagCollection(store, {"a": "u", "b": "v", "c": "u"}, mode="mean")
        for _ in range(steps):
            lengths = torch.randint(0, 6, (3 * 8,), generator=gen)
            n = [int(lengths[i * 8:(i + 1) * 8].sum()) for i in range(3)]
            values = torch.cat([torch.randint(0, 300, (n[0],), generator=gen),
                                torch.randint(0, 200, (n[1],), generator=gen),
                                torch.randint(0, 300, (n[2],), generator=gen)])
            out = ebc(["a", "b", "c"], values, lengths)
            (out * torch.randn(out.shape, generator=gen)).sum().backward()
        store.check()
        return {t: store.cascade.access(store.tables[t], torch.arange(r), None, promote=False).clone()
                for t, r in (("u", 300), ("v", 200))}


@settings(max_examples=examples(0.2))
@given(opt=st.sampled_from(OPTIMIZERS), dtype=st.sampled_from(["float32", "bfloat16"]),
       caps=st.sampled_from([(32, 0), (32, 40), (64, 17), (96, 500), (600, 0)]))
def test_every_optimizer_trains_the_same_bits_on_sets_and_slab(tmp_path_factory, opt, dtype, caps):
    root = tmp_path_factory.mktemp("opt")
    resident = _collection_run(root / "slab", opt, dtype, "slab", (10**4, 0))
    small_slab = _collection_run(root / "small", opt, dtype, "slab", (7, 11))
    sets = _collection_run(root / "sets", opt, dtype, "sets", caps)
    for t in resident:  # payloads: embedding, optimizer state and stamp, bit for bit
        assert torch.equal(resident[t].view(torch.int32), sets[t].view(torch.int32)), t
        assert torch.equal(small_slab[t].view(torch.int32), sets[t].view(torch.int32)), t


def test_rows_survive_close_and_reopen_with_the_sets_tier(tmp_path):
    spec = ts.TableSpec("t", 10**6, 4, optimizer=ts.Adagrad(0.5))
    ids = torch.tensor([3, 5, 10**5, 7, 3])
    with ts.TierStore(tmp_path / "s", spec, device="cpu", device_capacity=32, host_capacity=0,
                      device_cache="sets") as store:
        assert isinstance(store.device_tier, SetTier)
        store.apply("t", ids, torch.ones(5, 4))
        store.apply("t", torch.arange(100, 200), torch.ones(100, 4))  # evicts: rows go down
        want = store.read("t", ids)
        assert store.stats()["device"]["evictions"] > 0
    with ts.TierStore(tmp_path / "s", spec, device="cpu", device_cache="slab") as again:
        assert torch.equal(again.read("t", ids), want)


def test_a_sets_tier_that_holds_every_row_maps_them_directly(tmp_path):
    specs = [ts.TableSpec("u", 300, 6), ts.TableSpec("v", 200, 3)]
    with ts.TierStore(tmp_path / "d", specs, device="cpu", device_capacity=10**4, host_capacity=0,
                      device_cache="sets") as store:
        dev = store.device_tier
        assert dev.cache.direct and dev.capacity == 512  # 500 rows in whole sets of 32
        for t, r in (("u", 300), ("v", 200)):
            store.apply(t, torch.randperm(r), torch.ones(r, 3 if t == "v" else 6))
        st_ = store.stats()["device"]
        assert st_["resident"] == 500 and st_["evictions"] == 0
        tabs, rows = dev.resident()
        assert sorted(zip(tabs.tolist(), rows.tolist())) == \
            [(0, i) for i in range(300)] + [(1, i) for i in range(200)]
        store.check()


def test_device_cache_is_checked_and_reported(tmp_path):
    spec = ts.TableSpec("t", 100, 4)
    small = {"device_capacity": 64, "host_capacity": 64}
    with pytest.raises(ConfigError, match="device_cache"):
        ts.TierStore(tmp_path / "a", spec, device="cpu", device_cache="ways")
    with pytest.raises(ConfigError, match="staging_capacity"):
        ts.TierStore(tmp_path / "b", spec, device="cpu", device_cache="sets", policy="hlfu",
                     host_capacity=0, staging_capacity=64)
    with pytest.raises(ConfigError, match="2\\*\\*48"):
        ts.TierStore(tmp_path / "c", ts.TableSpec("big", 2**50, 4), device="cpu", device_cache="sets",
                     **small)
    with ts.TierStore(tmp_path / "d", spec, device="cpu", **small) as store:  # auto: the slab on a CPU
        assert store.device_cache == "slab"
        assert store.stats()["layout"]["device_cache"] == "slab"
    with ts.TierStore(tmp_path / "e", spec, device="cpu", device_cache="sets", policy="clock",
                      **small) as store:
        layout = store.stats()["layout"]
        assert (layout["device_cache"], layout["device_policy"], layout["policy"]) == ("sets", "lru", "clock")
        assert layout["staging_rows"] == 0 and "device_cache='sets'" in layout["reasons"][-1]
        assert store.host_tier.policy.name == "clock"  # the host tier keeps the registry
    assert [set_policy(p) for p in ("lru", "lfu", "hlfu", "wtinylfu", "fifo", "lookahead")] == \
        ["lru", "lfu", "lfu", "lfu", "lru", "lru"]


def test_expiry_and_admission_run_over_the_sets_tier(tmp_path):
    specs = [ts.TableSpec("t", 10**6, 4, optimizer=ts.Adagrad(0.1)),
             ts.TableSpec("c", 500, 3, optimizer=ts.SGD(0.1), admission=ts.CountAdmission(min_count=2))]
    gen = torch.Generator().manual_seed(8)
    plan = [(torch.randint(0, 300, (20,), generator=gen) * 3001, torch.randint(0, 500, (10,), generator=gen),
             int(torch.randint(0, 3, (1,), generator=gen))) for _ in range(12)]
    got = {}
    for cache in ("slab", "sets"):
        with ts.TierStore(tmp_path / cache, specs, device="cpu", device_capacity=32, host_capacity=16,
                          policy="lru", device_cache=cache) as store:
            for ids, cids, adv in plan:
                store.apply("t", ids, torch.ones(20, 4))
                store.apply("c", cids, torch.ones(10, 3))
                store.advance(adv)
            deleted = store.expire(older_than=4)
            store.check()
            got[cache] = (deleted, store.read("t", torch.arange(300) * 3001),
                          store.read("c", torch.arange(500)))
    assert got["slab"][0] == got["sets"][0] and got["sets"][0]["t"] > 0
    assert torch.equal(got["slab"][1], got["sets"][1])
    assert torch.equal(got["slab"][2], got["sets"][2])


def _overflow_run(path, caps, steps=5, kernels="auto"):
    """Batches whose table "b" rows (4, the same each step) fit the device tier and whose
    table "a" rows (40 fresh ones) cannot: a 32-line sets tier is one set of 32 ways."""
    from tierstore.prefetch import Prefetcher

    specs = [ts.TableSpec("a", 1000, 4, optimizer=ts.Adagrad(0.1)),
             ts.TableSpec("b", 100, 3, optimizer=ts.RowWiseAdagrad(0.2))]
    feats = {"y": "b", "x": "a"}  # b first: staging places b's rows before a's

    def batches():
        g = torch.Generator().manual_seed(5)
        for s in range(steps):
            lengths = torch.tensor([1, 2, 1, 0] + [10] * 4)
            values = torch.cat([torch.tensor([0, 1, 2, 3]), torch.arange(40) + 40 * s])
            yield (list(feats), values, lengths), torch.randn(4, 7, generator=g)

    with ts.TierStore(path, specs, device="cpu", device_cache="sets", device_capacity=caps[0],
                      host_capacity=caps[1], policy="lru", kernels=kernels) as store:
        ebc = ts.TieredEmbeddingBagCollection(store, feats)
        with Prefetcher(store, batches(), depth=1, features=feats, extract=lambda b: b[0]) as pf:
            for sparse, weight in pf:
                (ebc(*sparse) * weight).sum().backward()
        store.check()
        rows = {t.name: store.read(t.name, torch.arange(t.num_rows)).clone() for t in specs}
        return rows, store.prefetch_stats


def test_a_step_whose_staging_overflowed_keeps_the_other_tables_staged(tmp_path):
    """A set full of locked lines sends a staged row down a tier: its table's step goes the
    locked way, and the step's other tables still read the slots staging pinned them in. The
    bits equal an all-resident store's."""
    want, _ = _overflow_run(tmp_path / "resident", (10**4, 0))
    got, stats = _overflow_run(tmp_path / "sets", (32, 1000))
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert stats.warm_only == 0 and stats.lock_free_bags == 0  # every step had a's overflow
    assert stats.staged_bags_locked == 5  # and kept b's staged rows, every step
