"""The one jagged-batch type (tierstore.jagged) and TorchRec-style table configs, without torchrec."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tierstore as ts
from tierstore.embedding_configs import table_spec
from tierstore.jagged import JaggedBatch


class DuckKJT:
    """A KeyedJaggedTensor look-alike that only has offsets (like a KJT built from offsets)."""

    def __init__(self, keys, values, offsets, weights=None):
        self._k, self._v, self._o, self._w = keys, values, offsets, weights

    def keys(self):
        return self._k

    def values(self):
        return self._v

    def offsets(self):
        return self._o

    def weights_or_none(self):
        return self._w


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(0, 4), min_size=2, max_size=12).filter(lambda x: len(x) % 2 == 0),
       weighted=st.booleans())
def test_every_input_form_gives_the_same_batch(lengths, weighted):
    lengths = torch.tensor(lengths, dtype=torch.int64)
    values = torch.arange(int(lengths.sum())) * 7
    weights = torch.rand(values.numel()) if weighted else None
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    forms = [JaggedBatch.of(["a", "b"], values, lengths, weights=weights),
             JaggedBatch.of(["a", "b"], values, offsets=offsets, weights=weights),
             JaggedBatch.of(DuckKJT(["a", "b"], values, offsets, weights))]
    if not weighted:
        forms.append(JaggedBatch.of((["a", "b"], values, lengths)))
    for j in forms:
        assert j.keys == ["a", "b"] and torch.equal(j.values, values) and torch.equal(j.lengths, lengths)
        assert (j.weights is None) == (not weighted)
        assert j.batch_size == len(lengths) // 2
        per = j.per_key()
        half = int(lengths[: len(lengths) // 2].sum())
        assert torch.equal(per["a"], values[:half]) and torch.equal(per["b"], values[half:])


@pytest.mark.parametrize("bad", [
    lambda: JaggedBatch.of({"a": torch.tensor([1])}),  # a dict has no bag lengths
    lambda: JaggedBatch.of(["a"], torch.tensor([1, 2]), torch.tensor([1])),  # sum != len(values)
    lambda: JaggedBatch.of(["a"], torch.tensor([1, 2])),  # neither lengths nor offsets
    lambda: JaggedBatch.of(["a"], torch.tensor([1]), torch.tensor([1.0])),  # float lengths
    lambda: JaggedBatch.of(["a", "b"], torch.tensor([1, 2, 3]), torch.tensor([3])).batch_size,
])
def test_malformed_batches_raise_shape_error(bad):
    with pytest.raises(ts.ShapeError):
        bad()


def test_collection_from_configs_matches_table_specs(tmp_path):
    tables = [ts.EmbeddingBagConfig(num_embeddings=10**9, embedding_dim=8, name="users",
                                    feature_names=["user", "friend"], optimizer=ts.RowWiseAdagrad(0.1)),
              ts.EmbeddingBagConfig(num_embeddings=100, embedding_dim=4, name="items",
                                    feature_names=["item"], weight_init_min=-0.5, weight_init_max=0.5)]
    ebc = ts.TieredEmbeddingBagCollection.from_configs(tmp_path / "s", tables, optimizer=ts.SGD(0.2),
                                                       device="cpu", device_capacity=64,
                                                       host_capacity=64)
    try:
        specs = ebc.store.table_specs
        assert specs["users"].num_rows == 10**9 and specs["users"].optimizer == ts.RowWiseAdagrad(0.1)
        assert specs["items"].optimizer == ts.SGD(0.2) and specs["items"].init == ts.UniformInit(0.5)
        assert ebc.features == {"user": "users", "friend": "users", "item": "items"}
        assert ebc.mode == "sum" and ebc.dims == [8, 8, 4]
        lengths = torch.tensor([1, 2, 0, 1, 1, 1])
        out = ebc(["user", "friend", "item"], torch.tensor([5, 6, 7, 8, 9, 3]), lengths)
        assert out.shape == (2, 20)
        rows = ebc.store.read("users", torch.tensor([5, 6, 7]))
        assert torch.equal(out[0, :8], rows[0]) and torch.equal(out[1, :8], rows[1] + rows[2])
    finally:
        ebc.store.close()
    with ts.TierStore.open(tmp_path / "s", device="cpu", host_capacity=64) as again:
        mean = ts.TieredEmbeddingBagCollection(
            again, [ts.EmbeddingBagConfig(100, 4, "items", ["item"], pooling="mean")])
        assert mean.mode == "mean" and mean.output == "tensor"


def test_config_errors(tmp_path):
    with pytest.raises(ts.ConfigError, match="different poolings"):
        ts.TieredEmbeddingBagCollection.from_configs(
            tmp_path / "a", [ts.EmbeddingBagConfig(10, 4, "x", ["f"], pooling="sum"),
                             ts.EmbeddingBagConfig(10, 4, "y", ["g"], pooling="mean")], device="cpu")
    with pytest.raises(ts.ConfigError, match="listed by tables"):
        ts.TieredEmbeddingBagCollection.from_configs(
            tmp_path / "b", [ts.EmbeddingBagConfig(10, 4, "x", ["f"]),
                             ts.EmbeddingBagConfig(10, 4, "y", ["f"])], device="cpu")
    with pytest.raises(ts.ConfigError, match="symmetric"):
        ts.TieredEmbeddingBagCollection.from_configs(
            tmp_path / "c", [ts.EmbeddingBagConfig(10, 4, "x", ["f"], weight_init_min=0.0,
                                                   weight_init_max=1.0)], device="cpu")
    # the failed constructions left no store open: the paths can be opened for writing
    with ts.TierStore(tmp_path / "a", [ts.TableSpec("x", 10, 4)], device="cpu"):
        pass


def test_keyed_output_without_torchrec_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchrec", None)  # import torchrec -> ImportError
    monkeypatch.setitem(sys.modules, "torchrec.sparse", None)
    monkeypatch.setitem(sys.modules, "torchrec.sparse.jagged_tensor", None)
    with ts.TierStore(tmp_path / "s", [ts.TableSpec("t", 10, 4)], device="cpu") as store:
        with pytest.raises(ts.ConfigError, match="install torchrec"):
            ts.TieredEmbeddingBagCollection(store, ["t"], output="keyed")
        out = ts.TieredEmbeddingBagCollection(store, ["t"], output="dict")(
            ["t"], torch.tensor([1, 2]), torch.tensor([2, 0]))
        assert set(out) == {"t"} and out["t"].shape == (2, 4)
    with pytest.raises(ts.ConfigError, match="output must be"):
        ts.TieredEmbeddingBagCollection(store, ["t"], output="list")


def test_prefetcher_is_exported():
    from tierstore.prefetch import Prefetcher

    assert ts.Prefetcher is Prefetcher


def test_tables_keyword_like_torchrec(tmp_path):
    cfgs = [ts.EmbeddingBagConfig(num_embeddings=100, embedding_dim=4, name="items",
                                  feature_names=["item", "hist"])]
    with ts.TierStore(tmp_path / "s", [table_spec(c) for c in cfgs], device="cpu",
                      device_capacity=64, host_capacity=64) as store:
        ebc = ts.TieredEmbeddingBagCollection(store, tables=cfgs, output="dict")
        assert ebc.features == {"item": "items", "hist": "items"}
        out = ebc(["item", "hist"], torch.tensor([1, 2, 3]), torch.tensor([1, 2]))
        assert set(out) == {"item", "hist"}
        assert torch.equal(out["item"][0], store.read("items", torch.tensor([1]))[0])
        with pytest.raises(ts.ConfigError, match="give features"):
            ts.TieredEmbeddingBagCollection(store)
        with pytest.raises(ts.ConfigError, match="give features"):
            ts.TieredEmbeddingBagCollection(store, ["items"], tables=cfgs)
