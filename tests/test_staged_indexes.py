"""The step's indexes made at staging (the sets cache and the slab): the same integers as the host's, and
the same bits as a step that makes them itself."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tierstore as ts
import tierstore.pinned as pinned_mod
from tierstore.engine import Plan
from tierstore.gathered import Staged
from tierstore.prefetch import Prefetcher

SPECS = [ts.TableSpec("a", 5000, 8, optimizer=ts.RowWiseAdagrad(0.1)),
         ts.TableSpec("b", 300, 4, optimizer=ts.Adam(0.01, weight_decay=0.01))]
FEATS = {"x": "a", "y": "b", "z": "a"}


@settings(max_examples=40, deadline=None)
@given(pooled=st.booleans(), batch=st.integers(0, 6), weighted=st.booleans(), seed=st.integers(0, 99))
def test_device_step_builds_the_host_steps_integers(pooled, batch, weighted, seed):
    plan = Plan(SPECS, [(f, t, "sum") for f, t in FEATS.items()], pooled=pooled)
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(FEATS) * batch,), generator=g)
    per_feat = [int(x.sum()) for x in lengths.split(batch)] if batch else [0] * len(FEATS)
    n_unique = [7, 5]
    inverse = [torch.randint(0, n_unique[plan.features[f].table], (c,), generator=g)
               for f, c in enumerate(per_feat)]
    psw = torch.rand(sum(per_feat), generator=g) if weighted else None
    host = plan.step(inverse, n_unique, lengths, psw)
    starts = [0, n_unique[0], sum(n_unique)]
    dev = plan._step_on(torch.device("cpu"), inverse, starts, per_feat, lengths, psw)
    for name in ("inverse", "offsets", "bag_out", "bag_feat", "u_table"):
        assert torch.equal(getattr(host, name), getattr(dev, name)), name
    assert (host.psw is None) == (dev.psw is None)
    if host.psw is not None:
        assert torch.equal(host.psw, dev.psw)
    assert (host.u_start, host.out_rows, host.out_width) == (dev.u_start, dev.out_rows, dev.out_width)


def _batches(n, batch=8, seed=4):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        lengths = torch.randint(0, 5, (3 * batch,), generator=g)
        sizes = [int(x.sum()) for x in lengths.split(batch)]
        parts = [torch.randint(0, 300, (k,), generator=g) for k in sizes]
        yield (list(FEATS), torch.cat(parts), lengths), torch.randn(batch, 20, generator=g)


def _train(path, steps=8, cache="sets"):
    with ts.TierStore(path, SPECS, device="cpu", device_cache=cache, device_capacity=1024,
                      host_capacity=64, policy="lru") as store:
        ebc = ts.TieredEmbeddingBagCollection(store, FEATS)
        with Prefetcher(store, _batches(steps), depth=2, features=FEATS, extract=lambda b: b[0]) as pf:
            for sparse, weight in pf:
                (ebc(*sparse) * weight).sum().backward()
        return {t.name: store.read(t.name, torch.arange(t.num_rows)).clone() for t in SPECS}


@pytest.mark.parametrize("cache", ["sets", "slab"])
def test_staged_indexes_are_used_and_change_no_bit(tmp_path, monkeypatch, cache):
    used = []
    orig = pinned_mod.StagingArea.staged_indexes

    def counting(self, tab, ids):
        got = orig(self, tab, ids)
        used.append(got is not None)
        return got

    monkeypatch.setattr(pinned_mod.StagingArea, "staged_indexes", counting)
    fast = _train(tmp_path / "fast", cache=cache)
    assert used and all(used)  # every table of every step took staging's indexes
    used.clear()
    # the same run with staging keeping only the host arrays: the step makes its indexes itself
    monkeypatch.setattr(Staged, "on_device", classmethod(
        lambda cls, uniq, slots, ids, dslots, inverse=None: cls(uniq.numpy(), slots.numpy())))
    slow = _train(tmp_path / "slow", cache=cache)
    assert used and not any(used)
    for name in fast:
        assert torch.equal(fast[name], slow[name]), name


def test_other_ids_than_staged_fall_back(tmp_path):
    with ts.TierStore(tmp_path / "s", SPECS, device="cpu", device_cache="sets",
                      device_capacity=1024, host_capacity=64, policy="lru") as store:
        ids = torch.tensor([3, 1, 3, 7])
        staged = Staged.on_device(torch.tensor([1, 3, 7]), torch.tensor([0, 1, 2]), ids,
                                  torch.tensor([0, 1, 2]))
        assert torch.equal(staged.unique[staged.inverse], ids)
        store.staging.staged = (0, {"a": staged}, store.device_tier.pin_epoch)  # another thread's batch
        assert store.staging.staged_indexes(store.table_record("a"), ids) is None
        store.staging.staged = (threading.get_ident(), {"a": staged}, store.device_tier.pin_epoch)
        assert store.staging.staged_indexes(store.table_record("a"), ids) is not None
        assert store.staging.staged_indexes(store.table_record("a"), torch.tensor([3, 1, 3, 8])) is None
        store.staging.staged = (0, {}, -1)
    np.testing.assert_array_equal(staged.rows, [1, 3, 7])


def test_absent_many_is_absent_from_per_table(tmp_path):
    with ts.TierStore(tmp_path / "s", SPECS, device="cpu", device_cache="sets", device_capacity=64,
                      host_capacity=32, policy="lru") as store:
        store.read("a", torch.arange(0, 200, 3))  # some rows in each tier
        store.read("b", torch.arange(0, 90, 2))
        items = [(store.table_record("a"), torch.arange(0, 250)),
                 (store.table_record("b"), torch.arange(0, 120)),
                 (store.table_record("a"), torch.empty(0, dtype=torch.int64))]
        many = store.cascade.uncached_many(items)
        one = [store.cascade.uncached(tab, rows) for tab, rows in items]
        assert [m.tolist() for m in many] == [o.tolist() for o in one]
        assert not all(m.all() for m in many[:2]) and any(m.any() for m in many[:2])


def test_a_resident_sets_store_stages_from_its_host_mirror(tmp_path, monkeypatch):
    """A sets cache holding every declared row maps key k to slot k and mirrors which keys it
    holds on the host: staging then finds a batch's slots without a device lookup, and the
    rows train to the same bits as on the slab."""
    import tierstore.backends.set_tier as st_mod

    results = {}
    device_lookups = []
    orig = st_mod.SetIndex.find

    def counted(self, tabs, rows):
        device_lookups.append(rows.numel())
        return orig(self, tabs, rows)

    for cache in ("sets", "slab"):
        with ts.TierStore(tmp_path / cache, SPECS, device="cpu", device_cache=cache,
                          device_capacity=6000, host_capacity=0) as store:
            if cache == "sets":
                assert store.device_tier.held is not None  # direct
                monkeypatch.setattr(st_mod.SetIndex, "find", counted)
            ebc = ts.TieredEmbeddingBagCollection(store, FEATS)
            with Prefetcher(store, _batches(6), depth=2, features=FEATS,
                            extract=lambda b: b[0]) as pf:
                for sparse, weight in pf:
                    (ebc(*sparse) * weight).sum().backward()
            store.check()  # the mirror equals the cache's keys
            if cache == "sets":
                assert store.prefetch_stats.lock_free_bags == 6 * 2
                assert not device_lookups  # staging read the mirror
                monkeypatch.undo()
                slots = store.device_tier.lookup(torch.tensor(0), torch.arange(300), count=False)
                found = slots[slots >= 0]
                assert found.numel() and torch.equal(found, torch.arange(300)[slots >= 0])  # slot = key
            results[cache] = {t.name: store.read(t.name, torch.arange(t.num_rows)) for t in SPECS}
    for name in results["sets"]:
        assert torch.equal(results["sets"][name], results["slab"][name]), name


def test_a_one_table_resident_sets_store_stages_without_a_device_lookup(tmp_path, monkeypatch):
    """One table: the uncached probe of the next batch is `absent_from`, not `absent_many`; it
    answers from the direct cache's host mirror too (before, it looked the keys up on the
    device and waited for them: on CUDA, for the steps queued by then)."""
    import tierstore.backends.set_tier as st_mod

    device_lookups = []
    orig = st_mod.SetIndex.find

    def counted(self, tabs, rows):
        device_lookups.append(rows.numel())
        return orig(self, tabs, rows)

    feats = {"x": "a", "y": "a"}
    g = torch.Generator().manual_seed(6)
    batches = []
    for _ in range(6):
        lengths = torch.randint(0, 4, (2 * 5,), generator=g)
        batches.append((list(feats), torch.randint(0, 400, (int(lengths.sum()),), generator=g), lengths))
    with ts.TierStore(tmp_path / "one", SPECS[:1], device="cpu", device_cache="sets",
                      device_capacity=6000, host_capacity=0) as store:
        assert store.device_tier.held is not None  # direct
        monkeypatch.setattr(st_mod.SetIndex, "find", counted)
        ebc = ts.TieredEmbeddingBagCollection(store, feats)
        with Prefetcher(store, iter(batches), depth=2, features=feats) as pf:
            for sparse in pf:
                ebc(*sparse).sum().backward()
        assert store.prefetch_stats.lock_free_bags == 6
        assert not device_lookups  # the uncached probe and staging read the mirror
        tab = store.table_record("a")
        probe = torch.arange(0, 500, 7)
        assert torch.equal(store.cascade.uncached(tab, probe),
                           ~torch.isin(probe, torch.cat([b[1] for b in batches])))
        store.check()


def test_tables_deduplicated_in_parallel_equal_one_by_one(monkeypatch):
    from tierstore.index import sorted_unique
    from tierstore.prefetch import batch_ids

    g = torch.Generator().manual_seed(1)
    ids = {f"t{k}": torch.randint(0, 5000 * (k + 1), (20000 + 997 * k,), generator=g)
           for k in range(6)}
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)  # parallel_for's bound
    for inverse in (False, True):
        got = batch_ids.sorted_unique_each(ids, inverse=inverse)
        assert list(got) == list(ids)
        for t, i in ids.items():
            uniq, inv = got[t]
            assert torch.equal(uniq, sorted_unique(i)) and torch.equal(uniq, torch.unique(i))
            assert (inv is None) != inverse
            if inverse:
                assert torch.equal(uniq[inv], i)
