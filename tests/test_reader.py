"""One read interface: a writable store and a read-only handle are both RowReaders."""

from __future__ import annotations

import pytest
import torch

import tierstore as ts
from tierstore.reader import RowReader

SPECS = [ts.TableSpec("a", 500, 4), ts.TableSpec("b", 300, 6, init=ts.NormalInit(0.3))]


def _trained(path):
    store = ts.TierStore(path, SPECS, device="cpu", device_capacity=16, host_capacity=32)
    gen = torch.Generator().manual_seed(1)
    for t, n, d in (("a", 500, 4), ("b", 300, 6)):
        ids = torch.randint(0, n, (200,), generator=gen)
        store.apply(t, ids, torch.randn(200, d, generator=gen))
    store.flush()
    return store


def test_both_handles_are_row_readers_and_read_the_same_rows(tmp_path):
    with _trained(tmp_path / "s") as store:
        with ts.TierStore.open(tmp_path / "s", readonly=True, device="cpu") as ro:
            for handle in (store, ro):
                assert isinstance(handle, RowReader)
            assert (store.readonly, ro.readonly) == (False, True)
            assert store.table_specs == ro.table_specs
            ids = torch.tensor([0, 7, 299, 7, 123])
            for t in ("a", "b"):
                assert torch.equal(store.read(t, ids), ro.read(t, ids))
                for handle in (store, ro):
                    with pytest.raises(ts.InvalidIdsError):
                        handle.check_ids(handle.table_record(t), torch.tensor([-1]))
                    with pytest.raises(ts.UnknownTableError):
                        handle.table_record("nope")


def test_every_collection_runs_over_a_read_only_handle(tmp_path):
    with _trained(tmp_path / "s") as store:
        feats = {"fa": "a", "fb": "b"}
        lengths = torch.tensor([2, 0, 3, 1])
        values = torch.tensor([1, 2, 3, 4, 5, 6])
        with torch.no_grad():
            want_bags = ts.TieredEmbeddingBagCollection(store, feats)(["fa", "fb"], values, lengths)
            want_seq = ts.TieredEmbeddingCollection(store, feats)(["fa", "fb"], values, lengths)
        with ts.TierStore.open(tmp_path / "s", readonly=True, device="cpu") as ro:
            with torch.no_grad():
                got_bags = ts.TieredEmbeddingBagCollection(ro, feats)(["fa", "fb"], values, lengths)
                got_seq = ts.TieredEmbeddingCollection(ro, feats)(["fa", "fb"], values, lengths)
        assert torch.equal(got_bags, want_bags)
        for f in feats:
            assert torch.equal(got_seq[f].values(), want_seq[f].values())
            assert torch.equal(got_seq[f].offsets(), want_seq[f].offsets())
