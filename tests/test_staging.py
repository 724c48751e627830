"""The staging path's shortcuts: slots from the access path, unpins by slot, and their kernels."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tierstore as ts
from tierstore import _kernels
from tierstore.index import HashIndex, absent_from, sorted_unique


@settings(deadline=None, max_examples=60)
@given(st.lists(st.integers(-(2**62), 2**62), max_size=300), st.integers(0, 40))
def test_sorted_unique_is_torch_unique(values, spread):
    ids = torch.tensor(values, dtype=torch.int64) % (spread + 1) if spread else torch.tensor(
        values, dtype=torch.int64)
    assert torch.equal(sorted_unique(ids), torch.unique(ids))


@settings(deadline=None, max_examples=60)
@given(st.lists(st.integers(0, 15), max_size=60), st.integers(-3, 3),
       st.lists(st.integers(0, 4), min_size=16, max_size=16))
def test_add_pins_matches_index_add_then_clamp(slots, delta, start):
    if not _kernels.HAVE_NUMBA:
        return
    pins = torch.tensor(start, dtype=torch.int32)
    want = pins.clone().index_add_(0, torch.tensor(slots, dtype=torch.int64),
                                   torch.full((len(slots),), delta, dtype=torch.int32))
    if delta < 0:
        want.clamp_(min=0)
    _kernels.add_pins(pins.numpy(), np.array(slots, dtype=np.int64), delta, np.empty(0, dtype=bool),
                      np.empty(0, dtype=np.int64))
    assert torch.equal(pins, want)


@settings(deadline=None, max_examples=25)
@given(st.integers(0, 12), st.integers(0, 12),
       st.lists(st.lists(st.integers(0, 30), max_size=25), min_size=1, max_size=5))
def test_staged_slots_equal_a_fresh_lookup(tmp_path_factory, dcap, hcap, batches):
    """`StagingArea.stage_many` gives every row's device slot (-1 off the device), as a
    lookup right then would; unpinning the batches by slot leaves no pin behind."""
    path = tmp_path_factory.mktemp("s")
    spec = ts.TableSpec("a", 100, 3, optimizer=ts.SGD(0.1))
    with ts.TierStore(path, [spec], device_capacity=dcap, host_capacity=hcap, device="cpu") as store:
        store.apply("a", torch.arange(0, 31, 3), torch.ones(11, 3))  # some dirty rows cached
        tab, dev = store.tables["a"], store.device_tier
        staged = []
        with store.lock:
            for ids in batches:
                uniq = torch.unique(torch.tensor(ids, dtype=torch.int64))
                epoch = dev.pin_epoch
                host = []
                (((d, h, s), got),) = store.staging.stage_many([(tab, uniq)], host_copies=host)
                want = dev.lookup(tab.tix, uniq, count=False)
                assert torch.equal(got, want)
                assert len(host) == 1 and torch.equal(host[0], got.cpu())  # the host's copy
                assert d + h + s == uniq.numel()
                if uniq.numel() and int(got.min()) >= 0:
                    assert bool((dev.pins[got] > 0).all())
                    staged.append(("a", uniq, got, epoch))
                else:
                    staged.append(("a", uniq))
            store.staging.unpin_later(staged)
            store.staging.drain_unpins()
            assert int(dev.pins.sum()) == 0 and int(store.host_tier.pins.sum()) == 0
        store.check()


@settings(deadline=None, max_examples=25)
@given(st.integers(0, 12), st.integers(0, 12),
       st.lists(st.lists(st.lists(st.integers(0, 30), max_size=12), min_size=3, max_size=3),
                min_size=1, max_size=4))
def test_staging_all_tables_at_once_gives_each_rows_slot_and_keeps_every_value(
        tmp_path_factory, dcap, hcap, batches):
    """`StagingArea.stage_many` (one placement for a batch's tables, as the pipeline stages) returns each
    row's device slot (-1 off the device) as a lookup right then would, with the rows' sources
    counted, every staged row pinned where it is, and every row's value unchanged."""
    path = tmp_path_factory.mktemp("s")
    specs = [ts.TableSpec(n, 100, 3, optimizer=ts.SGD(0.1)) for n in ("a", "b", "c")]
    with ts.TierStore(path, specs, device_capacity=dcap, host_capacity=hcap, device="cpu") as store:
        for i, spec in enumerate(specs):  # dirty rows cached in both tiers, some already written back
            ids = torch.arange(i, 31, 3)
            store.apply(spec.name, ids, torch.full((ids.numel(), 3), i + 1.0))
        everything = torch.arange(31)
        before = {spec.name: store.read(spec.name, everything) for spec in specs}
        dev, host = store.device_tier, store.host_tier
        pinned = []
        with store.lock:
            for batch in batches:
                items = [(store.tables[spec.name], torch.unique(torch.tensor(ids, dtype=torch.int64)))
                         for spec, ids in zip(specs, batch)]
                where = [(int((dev.lookup(tab.tix, uniq, count=False) >= 0).sum()),
                          int((host.lookup(tab.tix, uniq, count=False) >= 0).sum()))
                         for tab, uniq in items]  # the exclusive caches before staging
                for (tab, uniq), ((d, h, s), got), dh in zip(items, store.staging.stage_many(items), where):
                    assert (d, h) == dh and d + h + s == uniq.numel()
                    assert torch.equal(got, dev.lookup(tab.tix, uniq, count=False))
                    pinned.append((tab.spec.name, uniq))
            keys = {(name, r) for name, uniq in pinned for r in uniq.tolist()}
            for (name, uniq) in pinned:  # staged rows stay cached, each with a pin
                tab = store.tables[name]
                dslots = dev.lookup(tab.tix, uniq, count=False)
                hslots = host.lookup(tab.tix, uniq, count=False)
                if len(keys) <= dcap + hcap:  # pinned rows never give way to unpinned victims
                    assert bool(((dslots >= 0) | (hslots >= 0)).all())
                assert bool((dev.pins[dslots[dslots >= 0]] > 0).all())
                assert bool((host.pins[hslots[hslots >= 0]] > 0).all())
            store.staging.unpin_later(pinned)
            store.staging.drain_unpins()
            assert int(dev.pins.sum()) == 0 and int(host.pins.sum()) == 0
        store.check()
        for spec in specs:
            assert torch.equal(store.read(spec.name, everything), before[spec.name])


def test_unpin_by_slot_falls_back_to_lookups_when_the_epoch_moved(tmp_path):
    spec = ts.TableSpec("a", 100, 3, optimizer=ts.SGD(0.1))
    with ts.TierStore(tmp_path / "s", [spec], device_capacity=8, host_capacity=8,
                      device="cpu") as store:
        tab, dev = store.tables["a"], store.device_tier
        with store.lock:
            uniq = torch.arange(5)
            epoch = dev.pin_epoch
            ((_, slots),) = store.staging.stage_many([(tab, uniq)])
            slots = slots.clone()
            # a pinned row leaves the device (the epoch moves): the slots no longer name the rows
            moved = dev.remove(slots[:2])
            assert dev.pin_epoch != epoch
            store.cascade.access(tab, torch.tensor([10, 11]), None)  # other rows take the freed slots
            store.cascade.place(moved, protect=slots[2:])  # back in, at other slots
            assert not torch.equal(dev.lookup(tab.tix, uniq, count=False), slots)
            store.staging.unpin_later([("a", uniq, slots, epoch)])
            store.staging.drain_unpins()
            assert int(dev.pins.sum()) == 0 and int(store.host_tier.pins.sum()) == 0
        store.check()


@settings(deadline=None, max_examples=40)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 60)), max_size=80, unique=True),
       st.lists(st.integers(0, 70), max_size=80), st.integers(0, 2))
def test_absent_from_matches_three_finds(keys, probe, tab):
    """The one-pass probe of three indexes says what three separate lookups say."""
    indexes = (HashIndex(40), HashIndex(30), HashIndex(25))
    slot = [0, 0, 0]
    for k, (t, r) in enumerate(keys):  # spread the keys over the indexes (some in none)
        which = k % 4
        if which < 3 and slot[which] < indexes[which].capacity:
            indexes[which].add(torch.tensor([t]), torch.tensor([r]), torch.tensor([slot[which]]))
            slot[which] += 1
    rows = torch.tensor(probe, dtype=torch.int64)
    want = torch.ones(len(probe), dtype=torch.bool)
    for ix in indexes:
        want &= ix.find(torch.tensor(tab), rows) < 0
    assert torch.equal(absent_from(indexes, tab, rows), want)


@settings(deadline=None, max_examples=30)
@given(st.integers(1, 40), st.data())
def test_scatter_rows_is_index_copy(n, data):
    if not _kernels.HAVE_NUMBA:
        return
    slots = torch.tensor(data.draw(st.permutations(range(50)))[:n], dtype=torch.int64)
    src = torch.randn(n, 7)
    want = torch.zeros(50, 7).index_copy_(0, slots, src)
    got = torch.zeros(50, 7)
    _kernels.scatter_rows(got.numpy(), slots.numpy(), src.numpy())
    assert torch.equal(got, want)


@settings(deadline=None, max_examples=30)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(-5, 10**12)), min_size=1, max_size=60,
                unique=True), st.data())
def test_keys_kernel_matches_the_torch_path(keys, data):
    ix = HashIndex(64)
    slots = torch.tensor(data.draw(st.permutations(range(64)))[: len(keys)], dtype=torch.int64)
    ix.add(torch.tensor([t for t, _ in keys]), torch.tensor([r for _, r in keys]), slots)
    ask = slots[torch.tensor(data.draw(st.permutations(range(len(keys)))))]
    got = ix.keys(ask)
    ix.use_kernels = False
    want = ix.keys(ask)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0].tolist() == [keys[int((slots == s).nonzero())][0] for s in ask]


@settings(deadline=None, max_examples=30)
@given(st.lists(st.integers(0, 49), max_size=40))
def test_gather_rows_is_index_select(idx):
    if not _kernels.HAVE_NUMBA:
        return
    src = torch.randn(50, 9)
    slots = torch.tensor(idx, dtype=torch.int64)
    got = _kernels.gather_rows(src.numpy(), slots.numpy())
    assert torch.equal(torch.from_numpy(got), src.index_select(0, slots))
